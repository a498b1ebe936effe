"""llama-index plugin: compile nodes into the ragcache store, warm their caches at retrieval, answer by linking them.

    pipeline = IngestionPipeline(transformations=[SentenceSplitter(), RagCacheCompiler(rc=rc)])
    nodes = pipeline.run(documents=documents)                    # each node's text compiled into rc.store
    retriever = RagCacheRetriever(BM25Retriever.from_defaults(nodes=nodes), rc=rc)   # compiles misses, prefetches
    engine = RagCacheQueryEngine(rc=rc, retriever=retriever)  # focus at the calibrated ratio
    response = engine.query("...")    # Response: .response, .source_nodes, .metadata (QueryStats.as_dict() + ...)
    llm = RagCacheLLM(rc=rc)          # plain completions from the same engine

Needs the optional extra: pip install -e '.[llama-index]' in a ragcache checkout.
"""

try:
    import llama_index.core  # noqa: F401 - only whether the extra is installed
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "ragcache.integrations.llama_index needs llama-index-core: pip install -e '.[llama-index]' in a ragcache checkout"
    ) from exc

from .compiler import RagCacheCompiler
from .llm import RagCacheLLM
from .nodes import DOC_ID_KEY
from .query_engine import RagCacheQueryEngine
from .retriever import RagCacheRetriever, WarmReport

__all__ = ["DOC_ID_KEY", "RagCacheCompiler", "RagCacheLLM", "RagCacheQueryEngine", "RagCacheRetriever", "WarmReport"]
