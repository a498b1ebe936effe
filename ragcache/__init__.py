"""ragcache: reuse document KV caches in RAG. Compile documents offline, link their caches at query time.

Names are imported lazily so that `ragcache.store` and the operator CLI do not pay for torch/transformers."""

from importlib import import_module

__version__ = "0.1.0"
__all__ = ["ALGORITHMS", "Answer", "CompileReport", "QueryStats", "RagCache", "RagCacheError", "Sequence"]

_HOMES = {
    "ALGORITHMS": "linker",
    "Answer": "engine",
    "CompileReport": "front",
    "QueryStats": "engine",
    "RagCacheError": "errors",
    "Sequence": "engine",
}


def __getattr__(name: str):
    if name in __all__:
        return getattr(import_module(f".{_HOMES.get(name, 'facade')}", __name__), name)
    raise AttributeError(f"module 'ragcache' has no attribute {name!r}")
