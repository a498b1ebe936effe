"""RagCacheRetriever: any llama-index retriever, with the caches of what it returns made ready before linking."""

from __future__ import annotations

import asyncio
from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.callbacks import CallbackManager
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle

from ragcache.front import Front
from ragcache.integrations.warming import WarmReport, default_prefetch, warm
from ragcache.request import blank

from .nodes import DOC_ID_KEY, mark, node_text, record_meta


class RagCacheRetriever(BaseRetriever):
    """Returns exactly what the wrapped retriever returns (same NodeWithScores, same order); on the way it compiles
    any node whose cache is missing (and records "ragcache_doc_id" in its metadata) and prefetches the entries of
    every chunk, so that linking finds them in the store's fastest tier.

    layout: "default" for every algorithm but legolink0, "sink" for legolink0 (its chunks are compiled behind
    dropped sink tokens; missing ones are compiled here). prefetch: None (default) reads the entries only when the
    store is tiered, where a read fills the faster tiers; True always; False never."""

    def __init__(
        self,
        retriever: BaseRetriever,
        rc: Front,
        *,
        layout: str = "default",
        prefetch: bool | None = None,
        metadata_mode: MetadataMode = MetadataMode.NONE,
        callback_manager: CallbackManager | None = None,
        verbose: bool = False,
    ) -> None:
        rc.check_layout(layout)
        super().__init__(
            callback_manager=callback_manager or getattr(retriever, "callback_manager", None), verbose=verbose
        )
        self.retriever = retriever
        self.rc = rc
        self.layout = layout
        self.prefetch = default_prefetch(rc, prefetch)
        self.metadata_mode = metadata_mode
        self.last_report: WarmReport | None = None  # the latest retrieval to end: calls at once overwrite it

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        nodes = self.retriever.retrieve(query_bundle)
        self.last_report = self.warm(nodes)
        return nodes

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        nodes = await self.retriever.aretrieve(query_bundle)
        self.last_report = await asyncio.to_thread(self.warm, nodes)
        return nodes

    def warm(self, nodes: list[NodeWithScore]) -> WarmReport:
        """Compile the nodes' missing chunks and prefetch their entries (in the chosen layout)."""
        todo = [(n.node, text) for n in nodes if not blank(text := node_text(n.node, self.metadata_mode))]
        ids, report = warm(
            self.rc, [text for _, text in todo], [record_meta(node) for node, _ in todo], self.layout, self.prefetch
        )
        for (node, _), doc_id in zip(todo, ids):
            if node.metadata.get(DOC_ID_KEY) != doc_id:
                mark(node, doc_id)
        return report

    def _get_prompt_modules(self) -> dict[str, Any]:
        return {"retriever": self.retriever}
