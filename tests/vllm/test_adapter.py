"""A link adapter on the vLLM engine (`RagCache.open(engine="vllm", adapter=...)`): vLLM runs it as a LoRA on the
rows it computes, the connector adds it on the rows a link recomputes, and compiling never runs it. On the tiny
qwen2 checkpoint with a random LoRA, every answer is checked against ragcache's own engine with the same adapter."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ragcache import models
from ragcache.engine import RagCache
from ragcache.errors import BadAdapter
from tests import tiny

QUESTION = "Where is the Eiffel Tower, and how tall is it?"
TOKENS = 6
ALGORITHMS = ["focus", "legolink", "cacheblend", "naive", "full"]


@pytest.fixture(scope="module")
def adapter(tiny_qwen2, tmp_path_factory):
    from bench.adapter import random_adapter

    torch.manual_seed(0)
    return random_adapter(models.load(tiny_qwen2, dtype="float32"), tmp_path_factory.mktemp("adapter"), rank=4)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return f"disk:{tmp_path_factory.mktemp('adapter-store')}"


@pytest.fixture(scope="module")
def rc(tiny_qwen2, store, adapter):
    engine = RagCache.open(tiny_qwen2, store, engine="vllm", dtype="float32", chunk_tokens=48, max_model_len=512,
                           kv_cache_gib=0.25, enforce_eager=True, adapter=adapter)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def adapted(tiny_qwen2, adapter, tmp_path_factory):
    """ragcache's own engine with the same adapter, beside the weights as vLLM runs it, over entries it compiled
    itself: a store of its own."""
    return RagCache.open(tiny_qwen2, f"disk:{tmp_path_factory.mktemp('own-store')}", dtype="float32", chunk_tokens=48,
                         adapter=adapter, merge_adapter=False)


@pytest.fixture(scope="module")
def base(tiny_qwen2, store):
    return RagCache.open(tiny_qwen2, store, dtype="float32", chunk_tokens=48, adapter=None)


@pytest.fixture(scope="module")
def doc_ids(rc, adapted) -> list[str]:
    ids = rc.compile_documents(tiny.CORPUS[:4]).ids
    assert adapted.compile_documents(tiny.CORPUS[:4]).ids == ids
    return ids


def test_entries_vllm_compiles_with_an_adapter_are_the_base_models(rc, base, adapted, doc_ids):
    assert base.warm(doc_ids, prefetch=False) == (0, 0)  # under the base model's keys: compiling ran no adapter
    assert rc.lm.fingerprint == adapted.lm.fingerprint != base.lm.fingerprint  # its profiles are the adapted model's
    assert rc.lm.adapter.sha256 == adapted.lm.adapter.sha256 and not rc.lm.adapter.merged  # vLLM's LoRA, beside


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_adapted_answers_are_ragcaches_own(rc, adapted, doc_ids, algorithm):
    answer = rc.query(QUESTION, doc_ids[::-1], algorithm=algorithm, max_new_tokens=TOKENS)
    expected = adapted.query(QUESTION, doc_ids[::-1], algorithm=algorithm, max_new_tokens=TOKENS)
    assert answer.token_ids == expected.token_ids
    if algorithm != "full":
        assert answer.stats.cached_tokens > 100  # linked by the connector, not prefilled by vLLM


def test_the_adapter_changes_the_answers(rc, base, doc_ids):
    """Without this, the test above would also pass with an adapter that vLLM and the connector both ignored."""
    changed = [a for a in ALGORITHMS
               if rc.query(QUESTION, doc_ids[::-1], algorithm=a, max_new_tokens=TOKENS).token_ids
               != base.query(QUESTION, doc_ids[::-1], algorithm=a, max_new_tokens=TOKENS).token_ids]
    assert len(changed) >= 3, changed


def test_an_adapter_the_connector_cannot_compute_is_refused_before_vllm_starts(tiny_qwen2, adapter, tmp_path):
    shutil.copytree(adapter, tmp_path / "dora")
    config = json.loads((tmp_path / "dora" / "adapter_config.json").read_text())
    (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(BadAdapter, match="DoRA"):
        RagCache.open(tiny_qwen2, f"disk:{tmp_path / 's'}", engine="vllm", adapter=tmp_path / "dora")
    shutil.copytree(adapter, tmp_path / "mlp")
    tensors = load_file(tmp_path / "mlp" / "adapter_model.safetensors")
    tensors["base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"] = torch.zeros(4, 128)
    save_file(tensors, tmp_path / "mlp" / "adapter_model.safetensors")
    with pytest.raises(BadAdapter, match="not a LoRA weight of an attention projection"):
        RagCache.open(tiny_qwen2, f"disk:{tmp_path / 's'}", engine="vllm", adapter=tmp_path / "mlp")


def test_a_miss_compiled_inside_an_adapted_link_is_the_base_models(rc, adapted, base, doc_ids):
    text = tiny.CORPUS[4] + " Compiled at the link."
    new = rc.catalog.add(text)  # stored as text only: the adapted query's link compiles it inside vLLM
    answer = rc.query(QUESTION, [new, *doc_ids[:1]], algorithm="naive", max_new_tokens=TOKENS)
    assert base.warm([new], prefetch=False) == (0, 0)  # stored under the base model's keys
    assert adapted.compile_documents([text]).ids == [new]  # the same chunk, compiled by ragcache with base weights
    assert answer.token_ids == adapted.query(QUESTION, [new, *doc_ids[:1]], algorithm="naive",
                                             max_new_tokens=TOKENS).token_ids
