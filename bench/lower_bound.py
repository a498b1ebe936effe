"""How close linking is to its floor: for the inputs of `ttft`, time the two things a link cannot avoid alone.

    python -m bench lower-bound --model smollm2-135m --docs 2,4,8 --doc-tokens 512 --runs 3 [--store disk]

Per algorithm and N:
  ttft         a query's time to first token (max_new_tokens=1), as in `ttft`
  link         rc.link alone (no decode), with its parts: fetch, rotate, recompute
  read         store.get_many of exactly the entries that link reads, and nothing else (no records, no hashing,
               no tokenizing); 0 for full and prefix, which read no chunk entries
  rows         the selected rows through every layer over the placed cache (link's recompute: attention over the
               whole prompt, rows written back, last logits)
  rows_alone   the model's plain forward over as many tokens as were recomputed, with no context at all: the
               matmul floor of recomputing that many rows (attention over the cached context left out)
  floor        read + rows;  floor / ttft says how much of the TTFT is the unavoidable work
With --store disk or redis the entries are read cold (a new engine and a freshly opened store every run).
Writes bench/results/lower-bound-<model>.json and .png.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

from . import report, squad
from ragcache.facade import QueryStats

from .common import Backings, Variant, engine, load_model


def _median(xs: list[float]) -> float:
    return round(statistics.median(xs), 6)


def entry_keys(rc, doc_ids: list[str], variant: Variant) -> list[str]:
    """The store keys rc.link reads for this algorithm (chunks in its layout, plus the system prefix)."""
    from ragcache import prompt
    from ragcache.compiler import PLAIN
    from ragcache.linker import algorithm

    if algorithm(variant.algorithm).exact:
        return []
    layout = rc.layouts[algorithm(variant.algorithm).layout]
    keys = [rc.compiler.key(ids, layout) for doc_id in doc_ids for ids in rc.document_chunks(doc_id)]
    prefix_ids = prompt.system_prefix_ids(rc.tokenizer, rc.format, None)
    if prefix_ids:
        keys.append(rc.prefix_compiler.key(prefix_ids, PLAIN))
    return keys


@torch.inference_mode()
def rows_alone_s(lm, count: int) -> float:
    """A plain forward over `count` tokens at positions 0..count-1, no cache: the matmul floor of `count` rows."""
    if count <= 0:
        return 0.0
    ids = torch.full((1, count), lm.tokenizer.eos_token_id or 0, dtype=torch.long)
    started = time.perf_counter()
    lm.model(input_ids=ids, use_cache=False)
    return time.perf_counter() - started


@contextlib.contextmanager
def _engine(rc, lm, spec: str, chunk_tokens: int, cold: bool):
    """The warm engine, or (cold) a new one over a freshly opened store, connected before timing starts."""
    if not cold:
        yield rc
        return
    fresh = engine(lm, spec, chunk_tokens, rc.kv_codec)
    fresh.store.ping()
    try:
        yield fresh
    finally:
        fresh.store.close()


def _one_run(rc, lm, spec: str, chunk_tokens: int, cold: bool, query_q: str, link_q: str, doc_ids: list[str],
             v: Variant) -> dict:
    """One round for one algorithm: a query (TTFT), a link (its parts), the bare store read, the bare rows."""
    with _engine(rc, lm, spec, chunk_tokens, cold) as e:
        answer = e.query(query_q, doc_ids, max_new_tokens=1, **v.kwargs)
    with _engine(rc, lm, spec, chunk_tokens, cold) as e:
        started = time.perf_counter()
        linked = e.link(link_q, doc_ids, _stats=(stats := QueryStats()), **v.kwargs)
        link_s = time.perf_counter() - started
    keys = entry_keys(rc, doc_ids, v)
    got, read_s = [], 0.0
    if keys:
        with _engine(rc, lm, spec, chunk_tokens, cold) as e:
            started = time.perf_counter()
            got = e.store.get_many(keys)
            read_s = time.perf_counter() - started
    if any(g is None for g in got):
        print(f"warning: {sum(g is None for g in got)} entries missing for {v.label}", file=sys.stderr)
    return dict(ttft_s=answer.stats.ttft_s, link_s=link_s, fetch_s=stats.fetch_s, rotate_s=linked.rotate_s,
                rows_s=linked.recompute_s, read_s=read_s, rows_alone_s=rows_alone_s(lm, linked.recomputed_tokens),
                prompt_tokens=answer.stats.prompt_tokens, recomputed_tokens=linked.recomputed_tokens,
                entries=len(keys), entry_bytes=sum(g.nbytes for g in got if g is not None))


def run(model: str, docs: list[int], doc_tokens: int, runs: int, variants: list[Variant], store: str,
        redis_url: str | None = None, out_dir: Path | None = None, tag: str = "", kv_codec: str = "auto") -> dict:
    params = dict(model=model, docs=docs, doc_tokens=doc_tokens, runs=runs, algorithms=[v.label for v in variants],
                  store=store, tag=tag, kv_codec=kv_codec)
    bench = report.Run("lower-bound", params, out_dir)
    lm = load_model(model)
    texts = squad.timing_documents(lm.tokenizer, max(docs), doc_tokens)
    questions = squad.timing_questions(2 * runs + 1)  # a query and a link per run, never the same question
    cold = store != "memory"
    results = []
    with Backings([store], redis_url) as backings:
        if not backings.names:
            raise SystemExit(f"store {store} is not available: {'; '.join(backings.notes)}")
        spec = backings.spec(store)
        chunk_tokens = max(doc_tokens, 16)
        rc = engine(lm, spec, chunk_tokens, kv_codec)
        rc.warmup()
        ids = rc.compile(texts)
        label = f"{backings.describe(store)} ({'cold' if cold else 'warm'})"
        for n in docs:
            if n * doc_tokens + 64 > rc.context_length:
                print(f"skip N={n}: beyond the context length {rc.context_length}", file=sys.stderr)
                continue
            doc_ids = ids[:n]
            for v in variants:
                rc.query(questions[-1], doc_ids, max_new_tokens=1, **v.kwargs)  # untimed: sink entries, prefix cache
            samples: dict[str, dict[str, list[float]]] = {v.label: {} for v in variants}
            for r in range(runs):
                for v in variants:
                    one = _one_run(rc, lm, spec, chunk_tokens, cold, questions[2 * r], questions[2 * r + 1], doc_ids, v)
                    for name, value in one.items():
                        samples[v.label].setdefault(name, []).append(value)
            for v in variants:
                s = samples[v.label]
                row = dict(store=label, kv_codec=rc.kv_codec, algorithm=v.algorithm, label=v.label, **v.params,
                           n_docs=n, runs=runs,
                           **{k: s[k][-1] for k in ("prompt_tokens", "recomputed_tokens", "entries", "entry_bytes")},
                           **{k: _median(s[k]) for k in ("ttft_s", "link_s", "fetch_s", "rotate_s", "rows_s", "read_s",
                                                         "rows_alone_s")})
                row["floor_s"] = round(row["read_s"] + row["rows_s"], 6)
                row["floor_over_ttft"] = round(row["floor_s"] / row["ttft_s"], 3) if row["ttft_s"] else None
                row["read_gb_per_s"] = round(row["entry_bytes"] / row["read_s"] / 1e9, 3) if row["read_s"] else None
                row["read_over_ttft"] = round(row["read_s"] / row["ttft_s"], 3) if row["ttft_s"] else None
                results.append(row)
            print(f"N={n} done", file=sys.stderr, flush=True)
        rc.store.close()
    _print(results, bench.machine)
    paths = bench.finish(results, plot=lambda p: plot(results, bench.machine, p, model))
    return dict(results=results, paths=paths)


def _print(results: list[dict], machine: dict) -> None:
    headers = ["store", "algorithm", "N", "recomputed", "TTFT ms", "link", "fetch", "read", "rotate", "rows",
               "rows alone", "floor", "floor/TTFT"]
    rows = [[r["store"], r["label"], r["n_docs"], r["recomputed_tokens"], report.ms(r["ttft_s"]),
             report.ms(r["link_s"]),
             report.ms(r["fetch_s"]), report.ms(r["read_s"]), report.ms(r["rotate_s"]), report.ms(r["rows_s"]),
             report.ms(r["rows_alone_s"]), report.ms(r["floor_s"]),
             "" if r["floor_over_ttft"] is None else f"{r['floor_over_ttft']:.2f}"] for r in results]
    report.print_table("Link vs its floor (medians, ms)", headers, rows, caption=report.subtitle(machine))


def plot(results: list[dict], machine: dict, path: Path, model: str) -> None:
    """Stacked bars per (algorithm, N): read | rows | the rest of the TTFT."""
    plt = report.pyplot()
    labels = [f"{r['label']}\nN={r['n_docs']}" for r in results]
    read = [r["read_s"] * 1e3 for r in results]
    rows = [r["rows_s"] * 1e3 for r in results]
    rest = [max(r["ttft_s"] * 1e3 - a - b, 0.0) for r, a, b in zip(results, read, rows)]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(results) + 2), 4.8))
    x = range(len(results))
    ax.bar(x, read, label="store read (floor)")
    ax.bar(x, rows, bottom=read, label="selected rows (floor)")
    ax.bar(x, rest, bottom=[a + b for a, b in zip(read, rows)], label="rest of TTFT (placing, bookkeeping, "
                                                                      "first token)", color="lightgray")
    ax.set_xticks(list(x), labels, rotation=90, fontsize=7)
    ax.set_ylabel("ms (median)")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.legend(fontsize=8)
    store = results[0]["store"] if results else ""
    ax.set_title(f"TTFT vs its floor, {model}, {store} — {report.subtitle(machine)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(data: dict) -> str:
    headers = ["store", "algorithm", "N", "recomputed", "TTFT ms", "link", "fetch", "read", "rotate", "rows",
               "rows alone", "floor", "floor/TTFT"]
    rows = [[r["store"], r["label"], r["n_docs"], r["recomputed_tokens"], report.ms(r["ttft_s"]),
             report.ms(r["link_s"]), report.ms(r["fetch_s"]), report.ms(r["read_s"]), report.ms(r["rotate_s"]),
             report.ms(r["rows_s"]), report.ms(r["rows_alone_s"]), report.ms(r["floor_s"]),
             "" if r["floor_over_ttft"] is None else f"{r['floor_over_ttft']:.2f}"] for r in data["results"]]
    return report.header_line(data) + "\n\n" + report.markdown_table(headers, rows)
