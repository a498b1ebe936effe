"""A llama-index RAG pipeline answered by ragcache: focus over cached documents vs a plain `full` prefill.

    folder of documents -> IngestionPipeline [(SentenceSplitter), RagCacheCompiler] -> BM25 retriever
        -> RagCacheRetriever (compiles misses, prefetches) -> RagCacheQueryEngine (focus | full)

    python examples/llamaindex_rag.py                          # quick: 6 questions (a few minutes on 2 cores)
    python examples/llamaindex_rag.py --all                    # every question (about half an hour on 2 cores)
    python examples/llamaindex_rag.py --n-questions 4 --algorithm cacheblend --store memory: --chunk-size 256

Needs the extra: pip install -e '.[llama-index]' in a ragcache checkout. Questions come from a JSONL file with one
{"question", "answer", "doc"} per line; those whose doc is not in the folder are skipped.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from statistics import mean

from llama_index.core import SimpleDirectoryReader
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.node_parser import SentenceSplitter
from llama_index.retrievers.bm25 import BM25Retriever
from rich.console import Console
from rich.progress import track
from rich.table import Table

from ragcache import ALGORITHMS, RagCache
from ragcache.settings import DATA_DIR
from ragcache.integrations.llama_index import RagCacheCompiler, RagCacheQueryEngine, RagCacheRetriever

DATA = DATA_DIR
QUICK_QUESTIONS = 6


def main() -> None:
    args = parse_args()
    console = Console()
    rc = RagCache.open(args.model, args.store)

    # 1. ingest: (split,) then compile every node into the store (what is already there is skipped)
    documents = SimpleDirectoryReader(str(args.docs), required_exts=[".txt", ".md"]).load_data()
    compiler = RagCacheCompiler(rc=rc)
    steps = ([SentenceSplitter(chunk_size=args.chunk_size, chunk_overlap=0)] if args.chunk_size else []) + [compiler]
    nodes = IngestionPipeline(transformations=steps).run(documents=documents)
    report = compiler.last_report
    console.print(f"{len(documents)} documents -> {len(nodes)} nodes; compiled {report.compiled_chunks} new chunks "
                  f"into {rc.store.name} in {report.seconds:.1f}s ({report.skipped} nodes already compiled)")

    # 2. retrieve with BM25; the ragcache wrapper makes sure the retrieved nodes' caches are ready
    retriever = RagCacheRetriever(BM25Retriever.from_defaults(nodes=nodes, similarity_top_k=args.top_k), rc=rc,
                                  layout="sink" if args.algorithm == "legolink0" else "default")
    engines = {name: RagCacheQueryEngine(rc=rc, retriever=retriever, algorithm=name, k=args.k,
                                         max_new_tokens=args.max_new_tokens, stop=["\n\n"])
               for name in dict.fromkeys([args.algorithm, args.baseline])}

    # 3. ask, with both algorithms, on the same retrieved nodes
    present = {p.name for p in args.docs.iterdir()}
    questions = [q for q in map(json.loads, filter(str.strip, args.questions.read_text().splitlines()))
                 if q.get("doc") in present][: None if args.all else args.n_questions]
    rc.warmup()
    rows = []
    for q in track(questions, description=f"{len(questions)} questions x {len(engines)} algorithms", console=console,
                   transient=True):
        row = {"question": q["question"], "expected": q["answer"]}
        for name, engine in engines.items():
            response = engine.query(q["question"])
            sources = [n.node.metadata.get("file_name") for n in response.source_nodes]
            row[name] = {"answer": response.response.strip(), "correct": has_answer(q["answer"], response.response),
                         "retrieved": q["doc"] in sources, "sources": sources, **response.metadata}
        rows.append(row)

    print_table(console, rows, list(engines), rc.lm.name, args.top_k)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
        console.print(f"rows written to {args.json}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=Path, default=DATA / "docs", help="folder of .txt/.md documents")
    p.add_argument("--questions", type=Path, default=DATA / "questions.jsonl")
    p.add_argument("--algorithm", default="focus", choices=ALGORITHMS)
    p.add_argument("--baseline", default="full", choices=ALGORITHMS, help="what the algorithm is compared with")
    p.add_argument("--n-questions", type=int, default=QUICK_QUESTIONS, help="ask the first N questions")
    p.add_argument("--all", action="store_true", help="ask every question (overrides --n-questions)")
    p.add_argument("--store", default="disk:./.ragcache", help="memory:, disk:PATH, redis://..., or tiers joined by +")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--top-k", type=int, default=3, help="nodes retrieved (and linked) per question")
    p.add_argument("--k", type=int, default=16, help="LegoLink: tokens recomputed at the start of every chunk")
    p.add_argument("--chunk-size", type=int, default=0,
                   help="split documents with a SentenceSplitter of this many tokens (e.g. 512 for long documents); "
                        "0 (default): one node per document, whose caches `make demo` already compiled")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    return p.parse_args()


def print_table(console: Console, rows: list[dict], names: list[str], model: str, top_k: int) -> None:
    table = Table("question", "algorithm", "answer", "ok", "TTFT ms", "recomputed", "cached",
                  title=f"llama-index + ragcache ({model}, BM25 top {top_k}, same nodes for every algorithm)")
    for row in rows:
        for i, name in enumerate(names):
            r = row[name]
            table.add_row(row["question"] if i == 0 else "", name, short(r["answer"]), "yes" if r["correct"] else "no",
                          f"{r['ttft_s'] * 1000:.0f}", str(r["recomputed_tokens"]), str(r["cached_tokens"]),
                          end_section=i == len(names) - 1)
    console.print(table)
    if not rows:
        return
    for name in names:
        got = [row[name] for row in rows]
        console.print(f"{name}: {sum(r['correct'] for r in got)}/{len(got)} answers contain the expected answer, "
                      f"mean TTFT {mean(r['ttft_s'] for r in got) * 1000:.0f} ms, "
                      f"{sum(r['retrieved'] for r in got)}/{len(got)} retrievals found the right document")
    if len(names) == 2:
        fast, slow = (mean(row[name]["ttft_s"] for row in rows) for name in names)
        console.print(f"mean TTFT, {names[1]} / {names[0]}: {slow / fast:.2f}x")


NUMBER_WORDS = {w: str(i) for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen".split())}
FILLER = {"the", "a", "an", "of", "about", "up", "to", "and"}


def tokens(text: str) -> list[str]:
    """Lower-case words, singular, one spelling of metre, numbers as digits without separators."""
    words = re.findall(r"\d[\d,.]*\d|\d|[a-z]+", text.lower().replace("metre", "meter"))
    words = [w[:-1] if len(w) > 3 and w.endswith("s") else w for w in words]
    return [NUMBER_WORDS.get(w, w.replace(",", "")) for w in words]


def has_answer(expected: str, answer: str) -> bool:
    """Every meaningful word of the expected answer appears in the answer (numbers compared as digits)."""
    said = set(tokens(answer))
    return all(w in said for w in tokens(expected) if w not in FILLER)


def short(text: str, limit: int = 60) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


if __name__ == "__main__":
    main()
