"""Time to first token of every algorithm, for N documents of ~D tokens and a ~32-token question.

    python -m bench ttft --model smollm2-135m --docs 2,4,8,16 --doc-tokens 512 --runs 3 [--redis URL]

Stores and states:
  memory (warm)  entries in the engine's memory tier (also what a memory+disk or memory+redis store gives once
                 an entry has been read), the prefix cache holding earlier prompts over the same documents
  disk (cold)    entries only in a disk store (OS page cache not dropped): a new engine for every query
  redis (cold)   entries only in Redis (the URL given by --redis, else a local redis-server): a new engine per query
A new engine also has an empty prefix cache, so `prefix` is a full prefill when cold. Each run asks a different
question; the algorithms take turns within a run. Before timing: rc.warmup(), every document compiled, and one
untimed query per algorithm (this compiles legolink0's sink-layout entries and primes the prefix cache).

TTFT parts (QueryStats): fetch (store reads, records, tokenizing), rotate (placing chunks: gather + RoPE),
recompute (the selected rows through every layer, and the last row's logits), first (the rest: allocating the
joined cache, choosing the first token). Writes bench/results/ttft-<model>.json and .png.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from . import report, squad
from .common import Backings, Variant, engine, load_model

PARTS = ("ttft_s", "fetch_s", "rotate_s", "recompute_s", "first_s")


def timed_query(rc, question: str, doc_ids: list[str], variant: Variant) -> dict:
    answer = rc.query(question, doc_ids, max_new_tokens=1, **variant.kwargs)
    st = answer.stats
    first = st.ttft_s - st.fetch_s - st.rotate_s - st.recompute_s
    return dict(ttft_s=st.ttft_s, fetch_s=st.fetch_s, rotate_s=st.rotate_s, recompute_s=st.recompute_s,
                first_s=first, prompt_tokens=st.prompt_tokens, recomputed_tokens=st.recomputed_tokens,
                cached_tokens=st.cached_tokens, store_hits=st.store_hits, store_misses=st.store_misses,
                compiled_chunks=st.compiled_chunks)


def summarize(samples: list[dict]) -> dict:
    out = {f"{p}": round(statistics.median(s[p] for s in samples), 6) for p in PARTS}
    for key in ("prompt_tokens", "recomputed_tokens", "cached_tokens"):
        out[key] = samples[-1][key]
    out["store_misses"] = sum(s["store_misses"] for s in samples)
    out["compiled_chunks"] = sum(s["compiled_chunks"] for s in samples)
    out["ttft_all_s"] = [round(s["ttft_s"], 6) for s in samples]
    return out


def run(model: str, docs: list[int], doc_tokens: int, runs: int, variants: list[Variant], stores: list[str],
        redis_url: str | None = None, out_dir: Path | None = None, tag: str = "") -> dict:
    params = dict(model=model, docs=docs, doc_tokens=doc_tokens, runs=runs, algorithms=[v.label for v in variants],
                  stores=stores, tag=tag, max_new_tokens=1)
    bench = report.Run("ttft", params, out_dir)
    lm = load_model(model)
    n_max = max(docs)
    texts = squad.timing_documents(lm.tokenizer, n_max, doc_tokens)
    questions = squad.timing_questions(runs + 1)
    question_tokens = [len(lm.tokenizer(q, add_special_tokens=False)["input_ids"]) for q in questions]
    results: list[dict] = []
    skipped: list[dict] = []
    with Backings(stores, redis_url) as backings:
        for store in backings.names:
            states = ["warm"] if store == "memory" else ["cold"]
            for state in states:
                results += _measure_store(lm, backings, store, state, texts, questions, docs, doc_tokens, runs,
                                          variants, skipped)
        notes = backings.notes
    _speedups(results)
    _print(results, bench.machine)
    extra = dict(question_tokens=question_tokens, doc_token_counts=[len(lm.tokenizer(t, add_special_tokens=False)
                                                                        ["input_ids"]) for t in texts],
                 skipped=skipped, notes=notes)
    paths = bench.finish(results, extra, plot=lambda p: plot(results, bench.machine, p, model))
    return dict(results=results, paths=paths)


def _measure_store(lm, backings: Backings, store: str, state: str, texts, questions, docs, doc_tokens, runs,
                   variants, skipped) -> list[dict]:
    label = f"{backings.describe(store)} ({state})"
    spec = backings.spec(store)
    chunk_tokens = max(doc_tokens, 16)
    rc = engine(lm, spec, chunk_tokens)
    rc.warmup()
    ids = rc.compile(texts)
    rows = []
    for n in docs:
        context = n * doc_tokens
        if context + 64 > rc.context_length:
            skipped.append(dict(store=label, n_docs=n, reason=f"about {context} tokens of documents do not fit the "
                                                             f"model's context of {rc.context_length}"))
            print(f"skip {label} N={n}: beyond the context length {rc.context_length}", file=sys.stderr)
            continue
        doc_ids = ids[:n]
        for v in variants:  # untimed: compile sink entries (legolink0), prime the prefix cache
            rc.query(questions[-1], doc_ids, max_new_tokens=1, **v.kwargs)
        samples: dict[str, list[dict]] = {v.label: [] for v in variants}
        for r in range(runs):
            for v in variants:
                if state == "warm":
                    samples[v.label].append(timed_query(rc, questions[r], doc_ids, v))
                else:
                    cold = engine(lm, spec, chunk_tokens)
                    cold.store.ping()  # connect outside the timed query
                    samples[v.label].append(timed_query(cold, questions[r], doc_ids, v))
                    cold.close()  # its model thread (and OpenMP team) gone before the next engine is timed
        for v in variants:
            rows.append(dict(store=label, state=state, algorithm=v.algorithm, label=v.label, **v.params, n_docs=n,
                             runs=runs, **summarize(samples[v.label])))
        print(f"{label} N={n}: " + ", ".join(f"{v.label} {report.ms(rows[-len(variants) + i]['ttft_s'])} ms"
                                              for i, v in enumerate(variants)), file=sys.stderr, flush=True)
    rc.close()
    return rows


def _speedups(results: list[dict]) -> None:
    """Each TTFT as a share of `full`'s on the same store and documents: what the reuse leaves of our own full
    prefill, not a speedup (those are against the fastest peer: `python -m bench peers`)."""
    full = {(r["store"], r["n_docs"]): r["ttft_s"] for r in results if r["label"] == "full"}
    for r in results:
        base = full.get((r["store"], r["n_docs"]))
        r["ttft_over_full"] = round(r["ttft_s"] / base, 3) if base and r["ttft_s"] else None


def _print(results: list[dict], machine: dict) -> None:
    headers = ["store", "algorithm", "N", "prompt tok", "recomputed", "TTFT ms", "fetch", "rotate", "recompute",
               "first", "/ full"]
    rows = [[r["store"], r["label"], r["n_docs"], r["prompt_tokens"], r["recomputed_tokens"], report.ms(r["ttft_s"]),
             report.ms(r["fetch_s"]), report.ms(r["rotate_s"]), report.ms(r["recompute_s"]), report.ms(r["first_s"]),
             "" if r["ttft_over_full"] is None else f"{r['ttft_over_full']:.2f}"] for r in results]
    report.print_table("TTFT (median; parts in ms)", headers, rows, caption=report.subtitle(machine))


def plot(results: list[dict], machine: dict, path: Path, model: str) -> None:
    plt = report.pyplot()
    stores = list(dict.fromkeys(r["store"] for r in results))
    fig, axes = plt.subplots(1, max(len(stores), 1), figsize=(5.5 * max(len(stores), 1), 4.5), squeeze=False,
                             sharey=True)
    for ax, store in zip(axes[0], stores):
        mine = [r for r in results if r["store"] == store]
        for label in dict.fromkeys(r["label"] for r in mine):
            pts = sorted((r["prompt_tokens"], r["ttft_s"] * 1e3) for r in mine if r["label"] == label)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_title(store)
        ax.set_xlabel("prompt tokens")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("TTFT (ms, median)")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"TTFT vs context, {model} — {report.subtitle(machine)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(data: dict) -> str:
    headers = ["store", "algorithm", "N", "prompt tokens", "recomputed", "TTFT ms", "fetch", "rotate", "recompute",
               "first", "/ full"]
    rows = [[r["store"], r["label"], r["n_docs"], r["prompt_tokens"], r["recomputed_tokens"], report.ms(r["ttft_s"]),
             report.ms(r["fetch_s"]), report.ms(r["rotate_s"]), report.ms(r["recompute_s"]), report.ms(r["first_s"]),
             "" if r["ttft_over_full"] is None else f"{r['ttft_over_full']:.2f}"] for r in data["results"]]
    return report.header_line(data) + "\n\n" + report.markdown_table(headers, rows)
