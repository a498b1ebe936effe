"""ragcache: reuse document KV caches in RAG. Compile documents offline, link their caches at query time."""

from .engine import Answer, CompileReport, QueryStats, RagCache, Stream
from .errors import RagCacheError
from .linker import ALGORITHMS

__all__ = ["ALGORITHMS", "Answer", "CompileReport", "QueryStats", "RagCache", "RagCacheError", "Stream"]
__version__ = "0.1.0"
