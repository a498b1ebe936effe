"""LangChain plugin: warm the caches of what a retriever returns, answer by linking them.

    retriever = RagCacheRetriever(retriever=vectorstore.as_retriever(), rc=rc)    # compiles misses, prefetches
    chat = ChatRagCache(rc=rc, retriever=retriever)     # links the retrieved documents' caches (focus by default)
    message = chat.invoke("How tall is the lighthouse?")  # AIMessage: .response_metadata (QueryStats + doc_ids)
    for chunk in chat.stream("..."): ...                  # closing the stream (or cancelling its task) stops decoding
    chat.invoke("...", documents=[Document(page_content="...")])   # or the documents of one call

Needs the optional extra: pip install -e '.[langchain]' in a ragcache checkout.
"""

try:
    import langchain_core  # noqa: F401 - only whether the extra is installed
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "ragcache.integrations.langchain needs langchain-core: pip install -e '.[langchain]' in a ragcache checkout"
    ) from exc

from ragcache.integrations.warming import WarmReport

from .chat_model import ChatRagCache
from .documents import DOC_ID_KEY
from .retriever import RagCacheRetriever

__all__ = ["DOC_ID_KEY", "ChatRagCache", "RagCacheRetriever", "WarmReport"]
