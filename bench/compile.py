"""Compile throughput: `RagCache.compile_documents` against transformers' own forward over the same chunks, the
store's write rate, and how long a decoding stream waits while a compile runs beside it.

    python -m bench compile --model smollm2-135m --docs 32 --doc-tokens 512 --runs 3
    python -m bench compile --docs 12 --doc-tokens 2000 --chunk-tokens 512   # a corpus as the chunker cuts it

- ours: a fresh engine and store per run, warmed by one other document, then `compile_documents` of every document
  (each chunk a compile sequence the scheduler packs into its steps, entries encoded in the engine's codec and
  written by the writer thread).
- transformers: the same chunks' ids (the layout's BOS included), `model(ids, logits_to_keep=1)` in the same dtype,
  one chunk per call (B=1) and batched (chunks of one length stacked, B up to --peer-batch); the faster of the two is
  the peer. It runs on a thread that ends with it, after the engine's model thread has ended: neither side runs
  while the other's idle OpenMP team lives (ragcache.engine.threads). It runs on a copy of the model loaded for it
  alone: an engine wraps its own model's Linears (batch invariance's row tiles; bf16's row buckets), which would
  slow the peer down. It computes K/V as a compile does, without the encode, the copy to host memory or the write.
- writes: the compiled entries `put_many` into a fresh store of each kind (memory, disk), bytes per second.
- beside a decode: one stream decodes while a compile of --docs documents runs; the longest gap between its tokens
  against the longest step with rows of the decoding stream (StepStats), the budgeted step the scheduler promises.
Tokens/s counts compiled chunk tokens (the layout's BOS included). Writes bench/results/compile-<model>.json.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from . import report, squad
from .common import load_model

PEER_BATCH = 8


def run(model: str, docs: int, doc_tokens: int, runs: int, dtype: str, peer_batch: int, beside: bool,
        out_dir: Path | None = None, tag: str = "", batch_invariant: bool | None = None,
        row_budget: int | None = None, chunk_tokens: int | None = None) -> dict:
    from ragcache.engine import on_a_passing_thread
    from ragcache.facade import RagCache
    from ragcache.settings import EngineConfig
    from ragcache.store import open_store

    params = dict(model=model, docs=docs, doc_tokens=doc_tokens, runs=runs, dtype=dtype, peer_batch=peer_batch,
                  tag=tag, batch_invariant=batch_invariant, row_budget=row_budget,
                  chunk_tokens=chunk_tokens)
    bench = report.Run("compile", params, out_dir)
    lm = load_model(model, dtype)
    peer = load_model(model, dtype)  # its own copy: an engine wraps its model's Linears (batch invariance, buckets)
    *texts, warm = squad.timing_documents(lm.tokenizer, docs + 1, doc_tokens)
    config = EngineConfig(chunk_tokens=chunk_tokens or doc_tokens, batch_invariant=batch_invariant,
                          row_budget=row_budget)
    ours, peer_single, peer_batched, chunks = [], [], [], None
    for _ in range(runs):  # interleaved: a load change on a shared box falls on both
        rc = RagCache(lm, open_store("memory:"), config)
        rc.compile_documents([warm])  # warm, as the peer is: a document not among the timed ones
        started = time.perf_counter()
        compiled = rc.compile_documents(texts)
        ours.append(time.perf_counter() - started)
        if chunks is None:
            lead = list(rc.layouts["default"].lead_ids)
            chunks = [lead + ids for doc_id in compiled.ids for ids in rc.document_chunks(doc_id)]
            entries = {key: rc.store.get_many([key])[0] for key in rc.store.keys()}
            invariance, budgets = rc.batch_invariance, rc.row_budgets
        rc.close()
        # the peer on a thread of its own that ends with it, as ours runs on the engine's model thread, which
        # rc.close() ended: neither pays for the other's idle OpenMP team (ragcache.engine.threads)
        peer_single.append(on_a_passing_thread(_transformers, peer, chunks, 1))
        peer_batched.append(on_a_passing_thread(_transformers, peer, chunks, peer_batch))
    tokens = sum(map(len, chunks))
    ours_s, single_s, batched_s = (statistics.median(t) for t in (ours, peer_single, peer_batched))
    peer_s = min(single_s, batched_s)
    row = dict(chunks=len(chunks), tokens=tokens, ours_s=round(ours_s, 4), ours_tok_s=round(tokens / ours_s, 1),
               transformers_b1_s=round(single_s, 4), transformers_batched_s=round(batched_s, 4),
               peer=f"transformers B={1 if single_s <= batched_s else peer_batch}",
               peer_tok_s=round(tokens / peer_s, 1), ratio=round(peer_s / ours_s, 3),
               ours_all_s=[round(t, 4) for t in ours], batch_invariance=invariance, row_budgets=list(budgets),
               entry_bytes=sum(e.nbytes for e in entries.values()))
    writes = _writes(entries)
    waits = _beside_a_decode(lm, config, texts) if beside else None
    _print(row, writes, waits)
    bench.finish([row], extra=dict(writes=writes, beside_a_decode=waits))
    return dict(row=row, writes=writes, beside_a_decode=waits)


@torch.inference_mode()
def _transformers(lm, chunks: list[list[int]], batch: int) -> float:
    """Seconds for transformers' forward over every chunk alone, `batch` chunks of one length per call."""
    device = next(lm.model.parameters()).device
    by_length: dict[int, list[list[int]]] = {}
    for ids in chunks:
        by_length.setdefault(len(ids), []).append(ids)
    calls = [group[i:i + batch] for group in by_length.values() for i in range(0, len(group), batch)]
    lm.model(torch.tensor(calls[0][:1], device=device), logits_to_keep=1)  # warm
    started = time.perf_counter()
    for call in calls:
        lm.model(torch.tensor(call, device=device), logits_to_keep=1)
    return time.perf_counter() - started


def _writes(entries: dict) -> list[dict]:
    from ragcache.store import open_store

    nbytes = sum(e.nbytes for e in entries.values())
    rows = []
    with tempfile.TemporaryDirectory(prefix="ragcache-bench-compile-") as folder:
        for name, url in (("memory", "memory:"), ("disk", f"disk:{folder}")):
            store = open_store(url)
            started = time.perf_counter()
            store.put_many(entries)
            seconds = time.perf_counter() - started
            store.close()
            rows.append(dict(store=name, entries=len(entries), bytes=nbytes, seconds=round(seconds, 4),
                             mb_s=round(nbytes / seconds / 1e6, 1)))
    return rows


def _beside_a_decode(lm, config, texts: list[str]) -> dict:
    """One stream decodes while the documents compile: its longest gap between tokens, and the longest step it
    waited for (StepStats.longest_decode_step_s), with the compile running beside it."""
    from ragcache.facade import RagCache
    from ragcache.store import open_store

    rc = RagCache(lm, open_store("memory:"), config)
    doc = rc.compile(texts[:1])
    stamps: list[float] = []
    room = rc.context_length - len(rc.document_chunks(doc[0])[0]) - 64  # as long as the context lets it
    question = "Tell me everything about it, in detail."
    stream = rc.stream(question, doc, max_new_tokens=room, temperature=1.0, seed=0, algorithm="naive")
    decoding = threading.Thread(target=lambda: [stamps.append(time.perf_counter()) for _ in stream], daemon=True)
    decoding.start()
    while len(stamps) < 3:
        if not decoding.is_alive():  # EOS (stop ids are kept) or a failure before three tokens: no stream to time
            raise RuntimeError(f"the decoding stream ended after {len(stamps)} token(s), before the compile began")
        time.sleep(0.01)
    rc.step_stats(reset=True)
    started = len(stamps)
    compiled = rc.compile_documents(texts[1:])
    during = rc.step_stats()
    ended, decoding_alive = len(stamps), decoding.is_alive()  # False: it ended first, and so did the sample
    stream.cancel()
    decoding.join(60)
    rc.close()
    gaps = [b - a for a, b in zip(stamps[started:ended], stamps[started + 1:ended])]
    return dict(documents=compiled.documents, stream_outlived_compile=decoding_alive, compiled_chunks=compiled.compiled_chunks, tokens_during=len(gaps),
                longest_gap_s=round(max(gaps), 4) if gaps else None,
                median_gap_s=round(statistics.median(gaps), 4) if gaps else None,
                longest_decode_step_s=round(during.longest_decode_step_s, 4), steps=during.steps,
                link_rows=during.link_rows, row_budget=rc.row_budgets[0])


def _print(row: dict, writes: list[dict], waits: dict | None) -> None:
    print(f"compile: {row['chunks']} chunks, {row['tokens']} tokens: ours {row['ours_tok_s']:,.0f} tok/s, "
          f"{row['peer']} {row['peer_tok_s']:,.0f} tok/s: {row['ratio']:.2f}x the peer "
          f"(batch invariance: {row['batch_invariance']})")
    for w in writes:
        print(f"  write {w['store']}: {w['mb_s']:,.1f} MB/s ({w['bytes'] / 1e6:,.1f} MB)")
    if waits:
        print(f"  beside a decode: longest gap {waits['longest_gap_s']} s, median {waits['median_gap_s']} s, "
              f"longest step with its row {waits['longest_decode_step_s']} s over {waits['tokens_during']} tokens")
