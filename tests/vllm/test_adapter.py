"""A link adapter on the vLLM engine (`RagCache.open(engine="vllm", adapter=...)`): vLLM runs it as a LoRA on the
rows it computes, the connector adds it on the rows a link recomputes, and compiling never runs it. On the tiny
qwen2 checkpoint with a random LoRA, every answer is checked against ragcache's own engine with the same adapter."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from ragcache import adapters, models
from ragcache.facade import RagCache
from ragcache.errors import BadAdapter, ParameterOutOfRange
from ragcache.integrations.vllm.engine import lora_engine_args
from ragcache.integrations.vllm.lora import LinkLora
from ragcache.integrations.vllm.spec import transfer_config
from ragcache.integrations.vllm.worker import LinkWorker
from ragcache.engine.sampling import Sampling
from tests import tiny

QUESTION = "Where is the Eiffel Tower, and how tall is it?"
TOKENS = 6
ALGORITHMS = ["focus", "legolink", "cacheblend", "naive", "full"]
RECOMPUTING = ["focus", "legolink", "cacheblend"]


def edited(adapter, folder, **config):
    """A copy of the adapter in folder, with these adapter_config.json fields changed."""
    shutil.copytree(adapter, folder)
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return folder


def mlp_adapter(adapter, folder):
    """The adapter with a LoRA on an MLP projection too: a task LoRA, which the connector cannot compute."""
    copy = edited(adapter, folder / "mlp")
    tensors = load_file(copy / "adapter_model.safetensors")
    tensors["base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"] = torch.zeros(4, 128)
    save_file(tensors, copy / "adapter_model.safetensors")
    return copy


@pytest.fixture(scope="module")
def adapter(tiny_qwen2, tmp_path_factory):
    from bench.adapter import random_adapter

    torch.manual_seed(0)
    path = random_adapter(models.load(tiny_qwen2, dtype="float32"), tmp_path_factory.mktemp("adapter"), rank=4)
    tensors = load_file(path / "adapter_model.safetensors")  # stronger, so that its term on the rows a link
    save_file({k: 4 * t if "lora_B" in k else t for k, t in tensors.items()}, path / "adapter_model.safetensors")
    return path  # recomputes shows in greedy tokens


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return f"disk:{tmp_path_factory.mktemp('adapter-store')}"


@pytest.fixture(scope="module", params=["merged", "lora"])
def rc(request, tiny_qwen2, store, adapter):
    """Merged: vLLM serves a checkpoint with the adapter folded in, and the connector takes it back out to compile.
    LoRA: vLLM runs it as its own LoRA, and the connector adds it on the rows a link recomputes."""
    engine = RagCache.open(tiny_qwen2, store, engine="vllm", dtype="float32", chunk_tokens=48, max_model_len=512,
                           kv_cache_gib=0.25, enforce_eager=True, adapter=adapter,
                           merge_adapter=request.param == "merged")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def own_store(tmp_path_factory) -> str:
    return f"disk:{tmp_path_factory.mktemp('own-store')}"


@pytest.fixture(scope="module")
def adapted(tiny_qwen2, adapter, own_store):
    """ragcache's own engine with the same adapter, beside the weights as vLLM runs it, over entries it compiled
    itself: a store of its own."""
    return RagCache.open(tiny_qwen2, own_store, dtype="float32", chunk_tokens=48, adapter=adapter,
                         merge_adapter=False)


@pytest.fixture(scope="module")
def base(tiny_qwen2, store):
    return RagCache.open(tiny_qwen2, store, dtype="float32", chunk_tokens=48, adapter=None)


@pytest.fixture(scope="module")
def doc_ids(rc, adapted) -> list[str]:
    ids = rc.compile_documents(tiny.CORPUS[:4]).ids
    assert adapted.compile_documents(tiny.CORPUS[:4]).ids == ids
    return ids


def test_entries_vllm_compiles_with_an_adapter_are_the_base_models(rc, base, adapted, doc_ids):
    assert base.warm(doc_ids, prefetch=False) == (0, 0)  # under the base model's keys (their content: below)
    assert rc.lm.fingerprint == adapted.lm.fingerprint != base.lm.fingerprint  # its profiles are the adapted model's
    assert rc.lm.adapter.sha256 == adapted.lm.adapter.sha256
    merged = rc.lm.adapter.merged
    assert (rc.lora is None) == merged  # merged: vLLM serves the folded checkpoint, and no request carries a LoRA
    assert merged == (Path(rc.llm.model_config.model).parent == adapters.merged_dir())


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_adapted_answers_are_ragcaches_own(rc, adapted, doc_ids, algorithm):
    answer = rc.query(QUESTION, doc_ids[::-1], algorithm=algorithm, max_new_tokens=TOKENS)
    expected = adapted.query(QUESTION, doc_ids[::-1], algorithm=algorithm, max_new_tokens=TOKENS)
    assert answer.token_ids == expected.token_ids
    if algorithm != "full":
        # linked by the connector, not prefilled by vLLM, over the rows ragcache's engine recomputes
        assert answer.stats.store_hits > 0 and answer.stats.recomputed_tokens == expected.stats.recomputed_tokens


def test_the_adapter_changes_the_answers(rc, base, doc_ids):
    """Without this, the test above would also pass with an adapter that vLLM and the connector both ignored."""
    changed = [a for a in ALGORITHMS
               if rc.query(QUESTION, doc_ids[::-1], algorithm=a, max_new_tokens=TOKENS).token_ids
               != base.query(QUESTION, doc_ids[::-1], algorithm=a, max_new_tokens=TOKENS).token_ids]
    assert len(changed) >= 3, changed


def test_the_connectors_own_lora_term_matters(tiny_qwen2, adapter, adapted, own_store, monkeypatch):
    """... and this, with one that the connector ignored on the rows it recomputes while vLLM ran it on the question:
    vLLM's `LLM` in this process (ragcache's engine runs vLLM's core in a process of its own), over the reference
    engine's store, and no prefix cache, so that the same prompt is linked again."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.lora.request import LoRARequest

    from ragcache.integrations.vllm.spec import link_request
    from tests.vllm.conftest import connected_llm

    llm_args = dict(model=tiny_qwen2, dtype="float32", enforce_eager=True, enable_prefix_caching=False,
                    max_model_len=512, kv_transfer_config=transfer_config(own_store),
                    **lora_engine_args(adapter))
    doc_ids = adapted.compile_documents(tiny.CORPUS[:4]).ids
    lora = LoRARequest("link", 1, str(adapter))

    def answers(llm) -> list[list[int]]:
        got = []
        for algorithm in RECOMPUTING:
            request = link_request(adapted, QUESTION, doc_ids[::-1], algorithm)
            prompt = {"prompt_token_ids": request["prompt_token_ids"], "cache_salt": request["cache_salt"]}
            params = SamplingParams(max_tokens=TOKENS, temperature=0.0,
                                    extra_args={"kv_transfer_params": request["kv_transfer_params"]})
            out = llm.generate(prompt, params, use_tqdm=False, lora_request=lora)[0]
            assert out.num_cached_tokens >= len(request["prompt_token_ids"]) - 40  # linked (all but the question)
            got.append(list(out.outputs[0].token_ids))
        return got

    expected = [adapted.query(QUESTION, doc_ids[::-1], algorithm=a, max_new_tokens=TOKENS).token_ids
                for a in RECOMPUTING]
    with contextlib.closing(connected_llm(**llm_args)) as engines:
        llm = next(engines)
        assert answers(llm) == expected
        monkeypatch.setattr(LinkLora, "add", lambda *args: None)
        get_kv_transfer_group()._worker_().tails.clear()  # what serves an exact repeat's last block
        assert answers(llm) != expected


def test_the_worker_resolves_keeps_and_refuses_loras_as_requests_name_them(adapter, tmp_path, monkeypatch):
    runner = SimpleNamespace(layer_range=range(4), config=SimpleNamespace(num_hidden_layers=4),
                             shape=SimpleNamespace(dtype=torch.float32), device=torch.device("cpu"), ranks=1)
    worker = SimpleNamespace(runner=runner, loras=OrderedDict())
    monkeypatch.chdir(adapter.parent)
    found = LinkWorker.lora(worker, adapter.name)  # a relative path, resolved as vLLM resolves it
    assert found is LinkWorker.lora(worker, str(adapter)) and isinstance(found, LinkLora)
    mlp = mlp_adapter(adapter, tmp_path)
    with pytest.raises(BadAdapter) as first:
        LinkWorker.lora(worker, str(mlp))
    (mlp / "adapter_model.safetensors").unlink()  # read once: a request with it falls back without reading it again
    with pytest.raises(BadAdapter) as again:
        LinkWorker.lora(worker, str(mlp))
    # the same refusal, raised anew: the first exception's traceback (and the request it holds) is not kept
    assert str(again.value) == str(first.value) and again.value is not first.value
    assert not any(isinstance(kept, BaseException) for kept in worker.loras.values())
    runner.ranks = 2  # a tensor-parallel rank holds part of each projection: the adapter's terms are whole
    with pytest.raises(BadAdapter, match="tensor parallelism"):
        LinkWorker.lora(worker, str(adapter))


def test_an_adapter_the_connector_cannot_compute_is_refused_before_vllm_starts(tiny_qwen2, adapter, tmp_path):
    with pytest.raises(BadAdapter, match="DoRA"):
        RagCache.open(tiny_qwen2, f"disk:{tmp_path / 's'}", engine="vllm",
                      adapter=edited(adapter, tmp_path / "dora", use_dora=True))
    with pytest.raises(BadAdapter, match="not a LoRA weight of an attention projection"):
        RagCache.open(tiny_qwen2, f"disk:{tmp_path / 's'}", engine="vllm", adapter=mlp_adapter(adapter, tmp_path))
    with pytest.raises(BadAdapter, match="vLLM cannot load"):  # it changed the base weights when it was made
        RagCache.open(tiny_qwen2, f"disk:{tmp_path / 's'}", engine="vllm",
                      adapter=edited(adapter, tmp_path / "pissa", init_lora_weights="pissa"))
    for merged in (True, False):  # the connector's ranks would prefill every request themselves, unlinked
        with pytest.raises(BadAdapter, match="tensor parallelism"):
            RagCache.open(tiny_qwen2, f"disk:{tmp_path / 's'}", engine="vllm", adapter=adapter, merge_adapter=merged,
                          tensor_parallel_size=2)


def test_the_guard_measures_against_the_base_models_full_or_is_refused_when_merged(rc, adapted, doc_ids):
    """vLLM's LoRA: the guard's full runs without it, as on ragcache's engine. Merged, vLLM holds no base weights to
    run the base model's full with: the guard is refused when it is set up, not at each check."""
    from ragcache.guard import BackgroundGuard

    if rc.lm.adapter.merged:
        with pytest.raises(ParameterOutOfRange, match="merge_adapter=False"):
            BackgroundGuard(rc, 1.0)
        return
    query = rc.validate(QUESTION, doc_ids, link=rc.params("naive"), sampling=Sampling(TOKENS))
    check, expected = rc.compare_with_full(query), adapted.check(QUESTION, doc_ids, algorithm="naive")
    assert check.top1_agrees == expected.top1_agrees
    assert check.kl == pytest.approx(expected.kl, rel=0.02, abs=1e-4), (check, expected)


def test_a_model_split_by_layers_is_refused_before_anything_loads(tiny_qwen2, tmp_path):
    with pytest.raises(ParameterOutOfRange, match="pipeline_parallel_size=2"):
        RagCache.open(tiny_qwen2, f"disk:{tmp_path}", engine="vllm", pipeline_parallel_size=2)


def test_a_miss_compiled_inside_an_adapted_link_is_the_base_models(rc, adapted, base, doc_ids):
    text = tiny.CORPUS[4] + f" Compiled at the link, merged {rc.lm.adapter.merged}."
    new = rc.catalog.add(text)  # stored as text only: the adapted query's link compiles it inside vLLM
    answer = rc.query(QUESTION, [new, *doc_ids[:1]], algorithm="naive", max_new_tokens=TOKENS)
    assert base.warm([new], prefetch=False) == (0, 0)  # stored under the base model's keys
    assert adapted.compile_documents([text]).ids == [new]  # the same chunk, compiled by ragcache with base weights
    assert answer.token_ids == adapted.query(QUESTION, [new, *doc_ids[:1]], algorithm="naive",
                                             max_new_tokens=TOKENS).token_ids
