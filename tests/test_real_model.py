"""The built-in default model (SmolLM2-135M-Instruct, fetched once from PyPI): invariants 1 and 2, and a
4-chunk RAG example where naive and legolink both answer with the right statistics."""

import pytest
import torch

from ragcache import models, prompt
from ragcache.facade import RagCache
from ragcache.settings import EngineConfig
from ragcache.store.memory import MemoryStore

pytestmark = pytest.mark.real_model

DOCS = [
    "The Harrow Point lighthouse stands on a granite headland at the northern end of Kessel Bay. It was built "
    "in 1871 by the engineer Martha Linde. The tower is 41 metres tall.",
    "The Amber Line is a narrow-gauge railway that climbs from the town of Orsk to the mountain village of Tiel. "
    "The line is 27 kilometres long and has 14 tunnels.",
    "The Pell Street Library was the first public library in the city of Marrow. It opened in 1889 with 3,000 "
    "books donated by the printer Edith Pell.",
    "Honey bees in a healthy hive can number 50,000 in summer. The queen lays up to 1,500 eggs a day.",
]
QUESTION = "How long is the Amber Line railway?"


@pytest.fixture(scope="module")
def rc(smollm2):
    return RagCache(smollm2, MemoryStore(), EngineConfig(chunk_tokens=48))


@pytest.fixture(scope="module")
def reference():
    lm = models.load("smollm2-135m", dtype="float32")
    lm.model.set_attn_implementation("eager")
    return lm


def test_full_equals_model_forward_and_greedy_text(rc, reference):
    ids = rc.compile(DOCS)
    linked = rc.link(QUESTION, ids, algorithm="full")
    with torch.inference_mode():
        expected = reference.model(linked.token_ids[None]).logits[0, -1].float()
        generated = reference.model.generate(linked.token_ids[None], max_new_tokens=16, do_sample=False)
    torch.testing.assert_close(linked.last_logits, expected, atol=2e-3, rtol=1e-4)
    answer = rc.query(QUESTION, ids, algorithm="full", max_new_tokens=16)
    expected_text = reference.tokenizer.decode(generated[0, linked.token_ids.numel():], skip_special_tokens=True)
    assert answer.text == expected_text


def test_full_recompute_settings_equal_full(rc):
    ids = rc.compile(DOCS)
    full = rc.link(QUESTION, ids, algorithm="full").last_logits
    for algorithm, params in [("legolink", {"k": 10_000}), ("cacheblend", {"ratio": 1.0})]:
        linked = rc.link(QUESTION, ids, algorithm=algorithm, **params).last_logits
        torch.testing.assert_close(linked, full, atol=2e-3, rtol=1e-4)


def test_four_chunk_example_naive_and_legolink(rc):
    ids = rc.compile(DOCS)
    chunks = [c for i in ids for c in rc.document_chunks(i)]
    assert len(chunks) == 4
    prefix = prompt.system_prefix_ids(rc.tokenizer, rc.format, None)
    question = prompt.question_ids(rc.tokenizer, rc.format, QUESTION, with_docs=True)
    assert prefix  # the chat template's header: an exact prefix, cached, never recomputed
    for algorithm, recomputed_chunk_rows in [("naive", 0), ("legolink", sum(min(16, len(c)) for c in chunks))]:
        answer = rc.query(QUESTION, ids, algorithm=algorithm, k=16, max_new_tokens=16)
        st = answer.stats
        assert st.prompt_tokens == len(prefix) + sum(map(len, chunks)) + len(question)
        assert st.recomputed_tokens == recomputed_chunk_rows + len(question)
        assert st.cached_tokens == st.prompt_tokens - st.recomputed_tokens
        assert st.store_hits == 5 and st.store_misses == 0  # 4 chunks + the system prefix
        assert st.ttft_s > 0 and st.completion_tokens >= 1
        assert answer.text.strip()
