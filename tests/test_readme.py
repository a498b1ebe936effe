"""The README's code runs as written: a new user copies these blocks first."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
pytestmark = pytest.mark.real_model


def python_blocks() -> dict[str, str]:
    """Each ```python block of the README, named by the section heading it sits under."""
    blocks, heading = {}, ""
    for part in re.split(r"(^#+ [^\n]*$|```python\n.*?```)", README.read_text(), flags=re.M | re.S):
        if part.startswith("#"):
            heading = part.lstrip("#").strip()
        elif part.startswith("```python"):
            blocks[heading] = part.removeprefix("```python\n").removesuffix("```")
    return blocks


def run_block(code: str, cwd: Path) -> dict:
    namespace: dict = {}
    previous = Path.cwd()
    try:
        import os

        os.chdir(cwd)  # the blocks use ./.ragcache, as a user in their project folder would
        exec(compile(code, str(README), "exec"), namespace)
    finally:
        os.chdir(previous)
    return namespace


# The "Infilling (EFIM)" block needs qwen2.5-coder-0.5b (a 491 MB download) and is not run here; the same calls run
# on tiny FIM models in tests/test_infill.py.
def test_the_readme_has_the_blocks_these_tests_run():
    # "On vLLM" runs in vLLM's environment: tests/vllm/test_readme_vllm.py
    assert {"Python API", "REST API", "llama-index", "LangChain", "Infilling (EFIM)", "On vLLM"} <= set(python_blocks())


def test_python_api_block_runs(tmp_path, smollm2, capsys):
    names = run_block(python_blocks()["Python API"], tmp_path)
    assert names["ans"].text and names["ans"].stats.ttft_s > 0 and names["logits"].ndim == 1
    assert (tmp_path / ".ragcache").is_dir()


def test_rest_api_block_runs_against_a_live_server(tmp_path, smollm2):
    from ragcache.facade import RagCache
    from ragcache.store import open_store
    from tests.test_api import serve

    # answers of a few tokens: a chat naming no max_tokens would decode to the end of the context (1,024 tokens)
    with serve(RagCache(smollm2, open_store("memory:")), max_new_tokens=8, chat_max_new_tokens=8) as server:
        code = python_blocks()["REST API"].replace("http://127.0.0.1:8000", server.url)
        names = run_block(code, tmp_path)
    assert names["r"].status_code == 200 and names["r"].json()["answer"]


def test_llama_index_block_runs(tmp_path, smollm2, capsys):
    pytest.importorskip("llama_index.retrievers.bm25")
    names = run_block(python_blocks()["llama-index"], tmp_path)
    assert names["response"].response and len(names["response"].metadata["doc_ids"]) == 2


def test_langchain_block_runs(tmp_path, smollm2, capsys):
    pytest.importorskip("langchain_core")
    names = run_block(python_blocks()["LangChain"], tmp_path)
    message = names["message"]
    assert message.content and len(message.response_metadata["doc_ids"]) == 2
    assert message.usage_metadata["input_token_details"]["cache_read"] > 0
    assert names["chunk"].chunk_position == "last" and capsys.readouterr().out.strip()
