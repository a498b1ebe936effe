"""Serving: REST requests/s and latency under concurrency, and decode speed of the batched scheduler.

    python -m bench serve --model smollm2-135m [--clients 1,4,16] [--requests 16] [--decode-tokens 32]

1. REST, closed loop (bench/throughput.py's server and clients): `ragcache serve` in a subprocess; for full and
   legolink-16 and each C, C client threads take request numbers 0..requests-1; request i is the same question
   over the same documents in every cell. Latency is client-side (send to full JSON answer).
2. Decode, in this process, on one prompt (3 documents, legolink-16), EOS ignored so every run decodes the same
   number of tokens:
   - transformers' own cached decode loop (model(prompt, use_cache=True), then one token at a time, argmax), on a
     model loaded apart from ragcache's (the runner rewrites the Linears and attention of the model it runs);
   - ragcache, one stream: decode tokens/s from the answer's own timings;
   - ragcache, C streams at once (the same prompt with C different questions): `tokens_per_s` is rows / seconds
     of the scheduler's decode-only steps (steps that carried a link piece are left out, rows and time: the rate
     of the decode step, not what clients received); `wall_tokens_per_s` is what they received, every stream's
     tokens after its first over the time from the first stream's first token to the last stream's last;
   - the bound on that: one runner step of 1 row and of C rows over caches of the prompt's length, and of C rows
     over 1-position caches (what the projections and MLPs alone cost), median of 5 interleaved runs.
Writes bench/results/serve-<model>[-tag].json.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import report, squad, throughput
from .common import Variant

DECODE_DOCS = 3
STEP_RUNS = 5


def run(model: str, clients: list[int], requests: int, pool_size: int, doc_tokens: int, docs: tuple[int, int],
        max_tokens: int, variants: list[Variant], decode_tokens: int, decode_streams: list[int],
        out_dir: Path | None = None, tag: str = "", dtype: str = "auto", repeats: int = 1,
        batch_invariant: bool = True) -> dict:
    params = dict(model=model, clients=clients, requests=requests, pool=pool_size, doc_tokens=doc_tokens,
                  docs_per_query=list(docs), max_tokens=max_tokens, algorithms=[v.label for v in variants],
                  decode_tokens=decode_tokens, decode_streams=decode_streams, tag=tag, dtype=dtype,
                  decode_repeats=repeats, batch_invariant=batch_invariant,
                  server_threads=throughput.server_threads() if clients else None)
    bench = report.Run("serve", params, out_dir)
    rest = rest_cells(model, clients, requests, pool_size, doc_tokens, docs, max_tokens, variants) if clients else []
    decode = (decode_cells(model, doc_tokens, decode_tokens, decode_streams, dtype, repeats, batch_invariant)
              if decode_tokens else [])
    _print(rest, decode, bench.machine)
    paths = bench.finish(rest + decode)
    return dict(results=rest + decode, paths=paths)


def rest_cells(model: str, clients: list[int], requests: int, pool_size: int, doc_tokens: int,
               docs: tuple[int, int], max_tokens: int, variants: list[Variant]) -> list[dict]:
    import httpx
    from transformers import AutoTokenizer

    from ragcache import models

    tokenizer = AutoTokenizer.from_pretrained(models.resolve(model))
    texts = squad.timing_documents(tokenizer, pool_size, doc_tokens)
    questions = squad.timing_questions(64)
    server = throughput.Server(model, "memory:", max_queue=max(64, 2 * max(clients)))
    rows = []
    try:
        with httpx.Client(base_url=server.url, timeout=900) as client:
            pool = throughput.upload(client, texts)
            for v in variants:
                def body(i: int, v=v) -> dict:
                    return dict(question=questions[i % len(questions)], documents=throughput.draw(pool, i, docs),
                                max_tokens=max_tokens, **v.kwargs)

                client.post("/v1/query", json=dict(body(0), max_tokens=1)).raise_for_status()  # untimed warm-up
                for c in clients:
                    wall, records = throughput.closed_loop(server.url, c, requests, body)
                    rows.append(dict(kind="rest", **throughput._row(v, c, wall, records)))
                    r = rows[-1]
                    print(f"{v.label} C={c}: {r['requests_per_s']:.3f} req/s, p50 {report.ms(r['p50_s'])} ms, "
                          f"p99 {report.ms(r['p99_s'])} ms", file=sys.stderr, flush=True)
    finally:
        server.stop()
    return rows


def decode_cells(model: str, doc_tokens: int, tokens: int, streams: list[int], dtype: str = "auto",
                 repeats: int = 1, batch_invariant: bool = True) -> list[dict]:
    """Each cell `repeats` times, interleaved (transformers, then each C in turn, then again), median: a load spike
    on a shared machine then lands on every cell alike instead of on one. Then each of the most streams' requests
    alone: how many of its answers the batch left unchanged (`identical_to_alone`)."""
    import statistics

    from transformers import AutoTokenizer

    from ragcache import models
    from ragcache.facade import RagCache
    from ragcache.settings import EngineConfig
    from ragcache.store import open_store

    # transformers' loop gets a model of its own: building the runner rewrites lm.model (each Linear pads its rows
    # on CPU, the attention is routed through ragcache's), and the peer must run transformers' code unmodified.
    plain = models.load(model, dtype=dtype).model
    lm = models.load(model, dtype=dtype)
    rc = RagCache(lm, open_store("memory:"), EngineConfig(batch_invariant=batch_invariant))
    texts = squad.timing_documents(AutoTokenizer.from_pretrained(models.resolve(model)), DECODE_DOCS, doc_tokens)
    ids = rc.compile(texts)
    questions = squad.timing_questions(max(streams))
    rc.stop_ids = set()  # ignore EOS: every run decodes exactly `tokens` tokens
    kwargs = dict(algorithm="legolink", k=16, max_new_tokens=tokens)
    rc.query(questions[0], ids, **dict(kwargs, max_new_tokens=2))  # warm-up
    prompt = rc.link(questions[0], ids, algorithm="full").token_ids
    peer: list[float] = []  # transformers' loop, tok/s per repeat
    # (decode-only steps' rows/s, per stream, wall-clock tokens after the first / first to last token)
    runs: dict[int, list[tuple[float, float | None, float]]] = {c: [] for c in streams}
    steps: dict[int, list[int]] = {c: [] for c in streams}  # decode-only steps per repeat (0: its rate is NaN)
    packed: dict[int, list] = {}  # C -> the token ids of its last repeat's answers
    for _ in range(repeats):
        peer.append(transformers_loop(plain, prompt, tokens))
        for c in streams:
            before = _decode_counters(rc)
            with ThreadPoolExecutor(c) as pool:
                done = list(pool.map(lambda q: _ended(rc.query, q, ids, **kwargs), questions[:c]))
            answers = [a for a, _ in done]
            rows_done, seconds, decode_steps = (a - b for a, b in zip(_decode_counters(rc), before))
            steps[c].append(decode_steps)
            packed[c] = [a.token_ids for a in answers]
            per_stream = [(a.stats.completion_tokens - 1) / a.stats.decode_s for a in answers if a.stats.decode_s]
            runs[c].append((rows_done / seconds if seconds else float("nan"),
                            sum(per_stream) / len(per_stream) if per_stream else None, wall_rate(done)))
            print(f"decode C={c}: {runs[c][-1][0]:.2f} tok/s over decode-only steps, {runs[c][-1][2]:.2f} tok/s "
                  "wall-clock", file=sys.stderr, flush=True)
    cell = dict(kind="decode", prompt_tokens=prompt.numel())
    rows = [dict(cell, engine="transformers cached loop", streams=1, tokens_per_s=round(statistics.median(peer), 2),
                 runs_tokens_per_s=[round(t, 2) for t in peer], dtype=str(plain.dtype).removeprefix("torch."))]
    for c, got in runs.items():
        row = dict(cell, engine="ragcache scheduler", streams=c,
                   tokens_per_s=round(statistics.median(t for t, _, _ in got), 2),
                   runs_tokens_per_s=[round(t, 2) for t, _, _ in got],
                   per_stream_tokens_per_s=round(statistics.median(p for _, p, _ in got if p is not None), 2),
                   wall_tokens_per_s=round(statistics.median(w for _, _, w in got), 2),
                   runs_wall_tokens_per_s=[round(w, 2) for _, _, w in got], runs_decode_only_steps=steps[c])
        if c > 1 and 1 in runs:  # paired per repeat: the two cells ran back to back
            ratios = [t / one for (t, _, _), (one, _, _) in zip(got, runs[1])]
            row.update(vs_one_stream=round(statistics.median(ratios), 2),
                       runs_vs_one_stream=[round(r, 2) for r in ratios])
        rows.append(row)
    if streams:
        most = max(streams)
        alone = [rc.query(q, ids, **kwargs).token_ids for q in questions[:most]]
        row = rows[1 + streams.index(most)]
        row["identical_to_alone"] = sum(a == b for a, b in zip(alone, packed[most]))
        print(f"decode C={most}: {row['identical_to_alone']} of {most} answers identical to the request alone",
              file=sys.stderr, flush=True)
        rows += rc.with_runner(step_cells, prompt.numel(), max(streams))
    return rows


def decode_step(runner, caches: list) -> float:
    """Seconds of one runner step: a decode row at each cache's next position (then taken back, so every run sees
    the same lengths)."""
    import torch

    parts = [(cache, torch.tensor([cache.length])) for cache in caches]
    for cache in caches:
        cache.length += 1
    started = time.perf_counter()
    with torch.inference_mode():
        runner.logits(runner.forward(torch.ones(len(caches), dtype=torch.long), parts)[0])
    seconds = time.perf_counter() - started
    for cache in caches:
        cache.length -= 1
    return seconds


def step_cells(runner, positions: int, streams: int, runs: int = STEP_RUNS) -> list[dict]:
    """What bounds C-stream decode: one runner step of 1 row and of C rows over caches of the prompt's length
    (C rows pooled: one attention call per layer), and of C rows over 1-position caches (attention almost free:
    the projections and MLPs alone). Interleaved, median of `runs`."""
    import statistics

    def caches(count: int, length: int, pooled: bool) -> list:
        made = []
        for _ in range(count):
            cache = runner.new_cache(length + 1)
            cache.keys.normal_(), cache.values.normal_()
            cache.length = length
            if pooled:
                runner.adopt(cache)
            made.append(cache)
        return made

    cells = [(1, positions, False), (streams, positions, runner.decode != "per-segment"), (streams, 1, False)]
    groups = [caches(n, length, pooled) for n, length, pooled in cells]
    times: list[list[float]] = [[] for _ in cells]
    for _ in range(runs):
        for group, seconds in zip(groups, times):
            seconds.append(decode_step(runner, group))
    for group in groups:
        for cache in group:
            runner.release(cache)
    one = statistics.median(times[0])
    rows = []
    for (n, length, pooled), seconds in zip(cells, times):
        ms = statistics.median(seconds)
        rows.append(dict(kind="step", rows=n, cache_positions=length, pooled=pooled, step_ms=round(1000 * ms, 1),
                         tokens_per_s=round(n / ms, 2), vs_one_row=round(n * one / ms, 2),
                         runs_ms=[round(1000 * t, 1) for t in seconds]))
        print(f"step {n} rows over {length} positions: {rows[-1]['step_ms']} ms, {rows[-1]['vs_one_row']}x one row",
              file=sys.stderr, flush=True)
    return rows


def _ended(query, *args, **kwargs):
    """(the answer, when it came back): with its decode_s, when its first token came."""
    answer = query(*args, **kwargs)
    return answer, time.perf_counter()


def wall_rate(done: list) -> float:
    """Tokens after the first, summed over streams, per second from the earliest first token to the latest last
    one: what the clients received together, link pieces and idle steps included."""
    firsts = [ended - answer.stats.decode_s for answer, ended in done]
    span = max(ended for _, ended in done) - min(firsts)
    tokens = sum(answer.stats.completion_tokens - 1 for answer, _ in done)
    return tokens / span if span > 0 else float("nan")


def _decode_counters(rc) -> tuple[int, float, int]:
    stats = rc.step_stats()
    return stats.decode_only_rows, stats.decode_only_s, stats.decode_only_steps


def transformers_loop(model, prompt, tokens: int) -> float:
    """Tokens/s of transformers' own cached greedy decode over `prompt` (after its prefill), on `model` as
    transformers loaded it (no runner built on it)."""
    import torch
    from transformers import DynamicCache

    from ragcache.engine import cache_argument

    cache = {cache_argument(model): DynamicCache(config=model.config)}
    with torch.inference_mode():
        token = model(prompt[None], use_cache=True, **cache).logits[0, -1].argmax()
        started = time.perf_counter()
        for _ in range(tokens - 1):
            token = model(token.view(1, 1), use_cache=True, **cache).logits[0, -1].argmax()
            int(token)  # the host needs the token, as a server does
        return (tokens - 1) / (time.perf_counter() - started)


def _print(rest: list[dict], decode: list[dict], machine: dict) -> None:
    headers = ["algorithm", "C", "requests", "req/s", "p50 ms", "p99 ms", "server TTFT p50", "errors"]
    rows = [[r["label"], r["clients"], r["requests"], f"{r['requests_per_s']:.3f}", report.ms(r["p50_s"]),
             report.ms(r["p99_s"]), report.ms(r["ttft_p50_s"]), r["errors"]] for r in rest]
    if rows:
        report.print_table("REST, closed loop (latency client-side)", headers, rows, caption=report.subtitle(machine))
    streams = [r for r in decode if r["kind"] == "decode"]
    if streams:
        report.print_table("Decode tokens/s (EOS ignored)", ["engine", "streams", "tok/s, decode-only steps",
                                                              "tok/s, wall-clock", "tok/s per stream"],
                           [[r["engine"], r["streams"], r["tokens_per_s"], r.get("wall_tokens_per_s", ""),
                             r.get("per_stream_tokens_per_s", "")] for r in streams], caption=report.subtitle(machine))
    steps = [r for r in decode if r["kind"] == "step"]
    if steps:
        report.print_table("One runner step (median)", ["rows", "cache positions", "pooled", "ms", "tok/s",
                                                         "vs one row"],
                           [[r["rows"], r["cache_positions"], r["pooled"], r["step_ms"], r["tokens_per_s"],
                             r["vs_one_row"]] for r in steps], caption=report.subtitle(machine))
