"""A LangChain RAG chain answered by ragcache: focus over cached documents vs a plain `full` prefill.

    folder of documents -> InMemoryVectorStore (word-count embeddings) -> RagCacheRetriever (compiles, prefetches)
        -> ChatPromptTemplate | ChatRagCache (links the retrieved documents' caches: focus | full)

    python examples/langchain_rag.py                           # quick: 6 questions (a few minutes on 2 cores)
    python examples/langchain_rag.py --all                     # every question
    python examples/langchain_rag.py --n-questions 4 --algorithm cacheblend --store memory:

Needs the extra: pip install -e '.[langchain]' in a ragcache checkout. Questions come from a JSONL file with one
{"question", "answer", "doc"} per line; those whose doc is not in the folder are skipped.
"""

from __future__ import annotations

import argparse
import json
import re
import zlib
from pathlib import Path
from statistics import mean

from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.vectorstores import InMemoryVectorStore
from rich.console import Console
from rich.progress import track
from rich.table import Table

from ragcache import ALGORITHMS, RagCache
from ragcache.integrations.langchain import DOC_ID_KEY, ChatRagCache, RagCacheRetriever
from ragcache.settings import DATA_DIR

DATA = DATA_DIR
QUICK_QUESTIONS = 6


class WordCounts(Embeddings):
    """A stand-in for an embedding model that needs no download: hashed counts of a text's longer words."""

    dims = 512

    def embed_query(self, text: str) -> list[float]:
        vector = [0.0] * self.dims
        for word in re.findall(r"[a-z0-9]+", text.lower()):
            if len(word) > 3 or word.isdigit():
                vector[zlib.crc32(word.encode()) % self.dims] += 1.0
        return vector

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return [self.embed_query(text) for text in texts]


def main() -> None:
    args = parse_args()
    console = Console()
    rc = RagCache.open(args.model, args.store)

    # 1. index the folder, and compile every document into the store (what is already there is skipped)
    documents = [Document(page_content=path.read_text(), metadata={"source": path.name})
                 for path in sorted(args.docs.iterdir()) if path.suffix in (".txt", ".md")]
    store = InMemoryVectorStore.from_documents(documents, WordCounts())
    retriever = RagCacheRetriever(retriever=store.as_retriever(search_kwargs={"k": args.top_k}), rc=rc,
                                  layout="sink" if args.algorithm == "legolink0" else "default")
    report = retriever.warm(documents)
    console.print(f"{len(documents)} documents; compiled {report.compiled_chunks} new chunks into {rc.store.name} "
                  f"in {report.seconds:.1f}s")
    names = {document.metadata[DOC_ID_KEY]: document.metadata["source"] for document in documents}

    # 2. one chain per algorithm; the chat model retrieves for the question and links what it gets
    prompt = ChatPromptTemplate.from_messages([("human", "{question}")])
    chains = {name: prompt | ChatRagCache(rc=rc, retriever=retriever, algorithm=name, k=args.k,
                                          max_new_tokens=args.max_new_tokens, stop=["\n\n"])
              for name in dict.fromkeys([args.algorithm, args.baseline])}

    # 3. ask, with both algorithms (the retriever returns the same documents to both)
    present = {p.name for p in args.docs.iterdir()}
    questions = [q for q in map(json.loads, filter(str.strip, args.questions.read_text().splitlines()))
                 if q.get("doc") in present][: None if args.all else args.n_questions]
    rc.warmup()
    rows = []
    for q in track(questions, description=f"{len(questions)} questions x {len(chains)} algorithms", console=console,
                   transient=True):
        row = {"question": q["question"], "expected": q["answer"]}
        for name, chain in chains.items():
            message = chain.invoke({"question": q["question"]})
            sources = [names.get(doc_id) for doc_id in message.response_metadata["doc_ids"]]
            row[name] = {"answer": message.content.strip(), "retrieved": q["doc"] in sources, "sources": sources,
                         **message.response_metadata}
        rows.append(row)

    print_table(console, rows, list(chains), rc.lm.name, args.top_k)
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
    p.add_argument("--top-k", type=int, default=3, help="documents retrieved (and linked) per question")
    p.add_argument("--k", type=int, default=16, help="LegoLink: tokens recomputed at the start of every chunk")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    return p.parse_args()


def print_table(console: Console, rows: list[dict], names: list[str], model: str, top_k: int) -> None:
    table = Table("question", "algorithm", "answer", "TTFT ms", "recomputed", "cached",
                  title=f"LangChain + ragcache ({model}, top {top_k}, same documents for every algorithm)")
    for row in rows:
        for i, name in enumerate(names):
            r = row[name]
            table.add_row(row["question"] if i == 0 else "", name, short(r["answer"]), f"{r['ttft_s'] * 1000:.0f}",
                          str(r["recomputed_tokens"]), str(r["cached_tokens"]), end_section=i == len(names) - 1)
    console.print(table)
    if not rows:
        return
    for name in names:
        got = [row[name] for row in rows]
        console.print(f"{name}: mean TTFT {mean(r['ttft_s'] for r in got) * 1000:.0f} ms, "
                      f"{sum(r['retrieved'] for r in got)}/{len(got)} retrievals found the right document")
    if len(names) == 2:
        same = sum(row[names[0]]["answer"] == row[names[1]]["answer"] for row in rows)
        fast, slow = (mean(row[name]["ttft_s"] for row in rows) for name in names)
        console.print(f"{names[0]} gave {names[1]}'s answer word for word on {same}/{len(rows)} questions; "
                      f"mean TTFT, {names[1]} / {names[0]}: {slow / fast:.2f}x")


def short(text: str, limit: int = 60) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


if __name__ == "__main__":
    main()
