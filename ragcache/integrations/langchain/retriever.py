"""RagCacheRetriever: any LangChain retriever, with the caches of what it returns made ready before linking."""

from __future__ import annotations

import asyncio
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForRetrieverRun, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from pydantic import ConfigDict, Field

from ragcache.front import Front
from ragcache.integrations.warming import WarmReport, default_prefetch, warm
from ragcache.request import blank

from .documents import DOC_ID_KEY, document_text, record_meta


class RagCacheRetriever(BaseRetriever):
    """Returns exactly what the wrapped retriever returns (the same Documents, in the same order); on the way it
    compiles any document whose cache is missing, records its ragcache document id in its metadata under
    "ragcache_doc_id", and prefetches the entries of every chunk, so that linking finds them in the store's fastest
    tier. The wrapped retriever runs as a child of this one (callbacks and tracing see it).

    layout: "default" for every algorithm but legolink0, "sink" for legolink0 (its chunks are compiled behind
    dropped sink tokens; missing ones are compiled here). prefetch: None (default) reads the entries only when the
    store is tiered, where a read fills the faster tiers; True always; False never."""

    model_config = ConfigDict(extra="forbid")  # a misspelt field is an error, not ignored

    retriever: BaseRetriever = Field(description="the retriever whose documents are warmed")
    rc: Front = Field(exclude=True, description="the engine whose store holds the caches")
    layout: str = "default"
    prefetch: bool | None = None
    # of the latest retrieval to end: calls run at once (batch, threads) overwrite each other's
    last_report: WarmReport | None = Field(default=None, exclude=True, description="the latest retrieval's report")

    def model_post_init(self, context: Any) -> None:
        super().model_post_init(context)
        self.rc.check_layout(self.layout)
        self.prefetch = default_prefetch(self.rc, self.prefetch)

    # `kwargs`: the call's own search arguments (a vector store's `filter`, `k`), the wrapped retriever's to read:
    # dropped, a tenant's filter would let other tenants' documents into its answers
    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        documents = self.retriever.invoke(query, config={"callbacks": run_manager.get_child()}, **kwargs)
        self.last_report = self.warm(documents)
        return documents

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        documents = await self.retriever.ainvoke(query, config={"callbacks": run_manager.get_child()}, **kwargs)
        self.last_report = await asyncio.to_thread(self.warm, documents)
        return documents

    def warm(self, documents: list[Document]) -> WarmReport:
        """Compile the documents' missing chunks and prefetch their entries (in the chosen layout); empty documents
        are left as they are."""
        todo = [document for document in documents if not blank(document_text(document))]
        ids, report = warm(
            self.rc, [d.page_content for d in todo], [record_meta(d) for d in todo], self.layout, self.prefetch
        )
        for document, doc_id in zip(todo, ids):
            document.metadata[DOC_ID_KEY] = doc_id
        return report
