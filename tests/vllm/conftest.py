"""The vLLM tests run in vLLM's own environment (`make setup-vllm`, `.venv-vllm`), which `make test` runs them in.
One vLLM engine, in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), fp32, prefix caching on, ragcache's connector
over a disk store that a fp32 ragcache engine fills: the two engines share the store, as `ragcache compile` and
`vllm serve` would."""

from __future__ import annotations

import os

import pytest

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the connector and the model are then in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

DOCS = ["aquarium", "beekeeping", "bridge", "canal"]


@pytest.fixture(scope="session")
def store_url(tmp_path_factory) -> str:
    return f"disk:{tmp_path_factory.mktemp('store')}"


@pytest.fixture(scope="session")
def engine(store_url):
    from ragcache.engine import RagCache

    return RagCache.open("smollm2-135m", store=store_url, dtype="float32")


@pytest.fixture(scope="session")
def doc_ids(engine) -> list[str]:
    from ragcache.settings import DATA_DIR

    texts = [(DATA_DIR / "docs" / f"{name}.txt").read_text()[:1200] for name in DOCS]
    return engine.compile(texts)


@pytest.fixture(scope="session")
def llm(store_url, engine):
    from vllm import LLM

    from ragcache import models
    from ragcache.integrations.vllm.spec import transfer_config

    return LLM(model=models.resolve("smollm2-135m"), dtype="float32", enforce_eager=True, enable_prefix_caching=True,
               max_model_len=2048, max_logprobs=-1, seed=0,
               kv_transfer_config=transfer_config(store_url))
