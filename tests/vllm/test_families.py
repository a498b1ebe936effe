"""The qwen2 family inside vLLM (fused qkv with bias), on a small random checkpoint saved here: linked in vLLM
against ragcache's own engine on the same ids, and with everything recomputed against vLLM's own tokens."""

from __future__ import annotations

import pytest
import torch

from ragcache.facade import RagCache
from ragcache.integrations.vllm.spec import SPEC_KEY, link_request, transfer_config
from tests import tiny
from tests.vllm.conftest import connected_llm, run

QUESTION = "Where is the Eiffel Tower, and how tall is it?"


@pytest.fixture(scope="module")
def qwen2(tiny_qwen2, tmp_path_factory):
    """The tiny qwen2 checkpoint, and a disk store both engines share."""
    folder = tiny_qwen2
    store = f"disk:{tmp_path_factory.mktemp('qwen2-store')}"
    engine = RagCache.open(folder, store=store, dtype="float32", chunk_tokens=48)
    doc_ids = engine.compile(tiny.CORPUS[:4])
    for llm in connected_llm(model=folder, dtype="float32", enforce_eager=True, enable_prefix_caching=True,
                             max_model_len=512, max_logprobs=-1, kv_transfer_config=transfer_config(store)):
        yield engine, doc_ids, llm


@pytest.mark.parametrize("algorithm", ["focus", "cacheblend", "legolink", "naive"])
def test_qwen2_links_like_ragcaches_engine(qwen2, algorithm):
    engine, doc_ids, llm = qwen2
    request = link_request(engine, QUESTION, doc_ids[::-1], algorithm)
    ids = request["prompt_token_ids"]
    out = run(llm, request, ids, logprobs=-1)
    linked = len(ids) - request["kv_transfer_params"][SPEC_KEY]["question"]
    assert out.num_cached_tokens >= linked > 50
    reference = torch.log_softmax(engine.link(QUESTION, doc_ids[::-1], algorithm=algorithm).last_logits.double(), -1)
    theirs = torch.full_like(reference, -float("inf"))
    for token, logprob in out.outputs[0].logprobs[0].items():
        theirs[token] = logprob.logprob
    assert float((reference.exp() * (reference - theirs)).sum()) < 1e-3
    assert int(theirs.argmax()) == int(reference.argmax())


def test_qwen2_with_everything_recomputed_gives_vllms_own_tokens(qwen2):
    engine, doc_ids, llm = qwen2
    request = link_request(engine, QUESTION, doc_ids, "cacheblend", ratio=1.0, check_layer=0)
    ids = request["prompt_token_ids"]
    assert run(llm, request, ids).outputs[0].token_ids == run(llm, None, ids).outputs[0].token_ids
