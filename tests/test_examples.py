"""Every example script runs as a user would run it (a subprocess), with small settings."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ragcache import RagCache, models
from ragcache.settings import DATA_DIR
from ragcache.store import open_store

pytestmark = pytest.mark.real_model

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
DATA = DATA_DIR


def run(args: list[str], cwd: Path) -> str:
    done = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_data_has_a_question_per_document():
    docs = sorted(p.name for p in (DATA / "docs").glob("*.txt"))
    questions = [json.loads(line) for line in (DATA / "questions.jsonl").read_text().splitlines() if line.strip()]
    assert len(docs) >= 24 and sorted(q["doc"] for q in questions) == docs
    for q in questions:
        assert set(q) == {"question", "answer", "doc"}
        text = (DATA / "docs" / q["doc"]).read_text()
        assert 60 <= len(text.split()) <= 150
        assert q["answer"].removeprefix("the ").removeprefix("about ").removeprefix("up to ") in text


def test_quickstart(tmp_path):
    out = run([str(EXAMPLES / "quickstart.py"), "memory:"], cwd=tmp_path)
    *answer, stats = out.strip().splitlines()
    assert "".join(answer).strip()
    assert stats.startswith("TTFT ") and "cached" in stats and "recomputed" in stats


def test_llamaindex_rag(tmp_path, smollm2):
    pytest.importorskip("llama_index.retrievers.bm25")
    docs = tmp_path / "docs"
    docs.mkdir()
    for name in ("lighthouse.txt", "railway.txt", "bridge.txt"):  # a small folder keeps the compile short
        shutil.copy(DATA / "docs" / name, docs / name)
    store = f"disk:{tmp_path / 'store'}"
    rows_path = tmp_path / "rows.json"
    out = run([str(EXAMPLES / "llamaindex_rag.py"), "--docs", str(docs), "--n-questions", "2", "--store", store,
               "--max-new-tokens", "6", "--top-k", "2", "--chunk-size", "256", "--json", str(rows_path)], cwd=tmp_path)
    assert "3 documents -> 3 nodes; compiled 3 new chunks" in " ".join(out.split())
    assert "mean TTFT" in out
    rows = json.loads(rows_path.read_text())
    assert [r["question"] for r in rows] == ["How tall is the Harrow Point lighthouse?",
                                             "How long is the Amber Line railway?"]
    for row in rows:
        linked, full = row["focus"], row["full"]
        assert linked["sources"] == full["sources"] and len(full["sources"]) == 2 and full["retrieved"]
        assert full["cached_tokens"] == 0 and full["recomputed_tokens"] == full["prompt_tokens"]
        assert 0 < linked["recomputed_tokens"] < full["recomputed_tokens"] and linked["cached_tokens"] > 0
        assert linked["ttft_s"] > 0 and full["ttft_s"] > 0
    assert rows[1]["focus"]["compiled_chunks"] == 0 and rows[1]["focus"]["store_hits"] > 0  # compiled before

    # the disk store kept what the pipeline compiled: a second run would compile nothing. The example ran in the
    # default dtype (the fixture is fp32), and the dtype is part of the chunk key
    rc = RagCache(models.load("smollm2-135m"), open_store(store))
    assert len(rc.document_ids()) == 3
    for doc_id in rc.document_ids():
        assert all(rc.store.contains_many([rc.compiler.key(ids, rc.layouts["default"]) for ids in rc.document_chunks(doc_id)]))


def test_langchain_rag(tmp_path, smollm2):
    pytest.importorskip("langchain_core")
    docs = tmp_path / "docs"
    docs.mkdir()
    for name in ("lighthouse.txt", "railway.txt", "bridge.txt"):  # a small folder keeps the compile short
        shutil.copy(DATA / "docs" / name, docs / name)
    store = f"disk:{tmp_path / 'store'}"
    rows_path = tmp_path / "rows.json"
    out = run([str(EXAMPLES / "langchain_rag.py"), "--docs", str(docs), "--n-questions", "2", "--store", store,
               "--max-new-tokens", "6", "--top-k", "2", "--json", str(rows_path)], cwd=tmp_path)
    assert "3 documents; compiled 3 new chunks" in " ".join(out.split())
    assert "mean TTFT" in out and "word for word on" in " ".join(out.split())
    rows = json.loads(rows_path.read_text())
    assert [r["question"] for r in rows] == ["How tall is the Harrow Point lighthouse?",
                                             "How long is the Amber Line railway?"]
    for row, expected in zip(rows, ("lighthouse.txt", "railway.txt")):
        linked, full = row["focus"], row["full"]
        assert linked["sources"] == full["sources"] and len(full["sources"]) == 2 and full["sources"][0] == expected
        assert linked["doc_ids"] == full["doc_ids"] and full["retrieved"]
        assert full["cached_tokens"] == 0 and full["recomputed_tokens"] == full["prompt_tokens"]
        assert 0 < linked["recomputed_tokens"] < full["recomputed_tokens"] and linked["cached_tokens"] > 0
        assert linked["prompt_tokens"] == full["prompt_tokens"] and linked["ttft_s"] > 0 and full["ttft_s"] > 0
        assert linked["answer"] and full["answer"]
        assert linked["compiled_chunks"] == 0 and linked["store_hits"] > 0  # compiled before the questions

    # the disk store kept what the example compiled: its next run would compile nothing
    rc = RagCache(models.load("smollm2-135m"), open_store(store))
    assert len(rc.document_ids()) == 3
    for doc_id in rc.document_ids():
        assert rc.document(doc_id)["meta"]["source"] in ("lighthouse.txt", "railway.txt", "bridge.txt")
        keys = [rc.compiler.key(ids, rc.layouts["default"]) for ids in rc.document_chunks(doc_id)]
        assert all(rc.store.contains_many(keys))
