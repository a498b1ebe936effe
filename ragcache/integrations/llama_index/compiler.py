"""RagCacheCompiler: an IngestionPipeline step that compiles each node's text into the ragcache store."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from llama_index.core.bridge.pydantic import ConfigDict, Field
from llama_index.core.schema import BaseNode, MetadataMode, TransformComponent

from ragcache.front import CompileReport, Front
from ragcache.request import blank

from .nodes import mark, node_text, record_meta


class RagCacheCompiler(TransformComponent):
    """Compiles every node's text (skipping what the store already holds) and records its document id in the
    node's metadata under "ragcache_doc_id" (excluded from LLM and embedding metadata). Nodes come back as they
    went in, so the step can sit anywhere after the splitter (with a metadata_mode other than NONE, after every
    step that changes the metadata it reads too: what the retriever links must be the text compiled); empty nodes
    are passed through unmarked.

    `target` (the model fingerprint and the store) is part of the step's ingestion-cache hash, so a pipeline cache
    filled against one model or store does not skip compiling into another. A skipped compile is never fatal:
    RagCacheRetriever and RagCacheQueryEngine compile whatever is missing."""

    model_config = ConfigDict(extra="forbid")  # a misspelt field is an error, not ignored

    rc: Front = Field(exclude=True, description="the engine whose store receives the caches")
    metadata_mode: MetadataMode = Field(
        default=MetadataMode.NONE, description="which node content is compiled (NONE: the text alone)"
    )
    target: str = Field(default="", description="model fingerprint @ store, set from rc")
    last_report: CompileReport | None = Field(default=None, exclude=True, description="the latest call's report")

    def __init__(self, rc: Front, **kwargs: Any) -> None:
        kwargs.setdefault("target", f"{rc.lm.name}:{rc.lm.fingerprint[:16]}@{_store_label(rc.store)}")
        super().__init__(rc=rc, **kwargs)

    @classmethod
    def class_name(cls) -> str:
        return "RagCacheCompiler"

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        todo = [(node, text) for node in nodes if not blank(text := node_text(node, self.metadata_mode))]
        bar = _bar(len(todo)) if kwargs.get("show_progress") else None

        def progress(so_far: CompileReport) -> None:  # documents whose chunks are all compiled (or were)
            assert bar is not None
            bar.set_postfix(compiled_tokens=so_far.compiled_tokens, refresh=False)
            bar.update(so_far.ready - bar.n)

        try:
            report = self.rc.compile_documents(
                [text for _, text in todo], [record_meta(node) for node, _ in todo], progress=progress if bar else None
            )
        finally:
            if bar:
                bar.close()
        for (node, _), doc_id in zip(todo, report.ids):
            mark(node, doc_id)
        self.last_report = report
        return nodes

    async def acall(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        return await asyncio.to_thread(self.__call__, nodes, **kwargs)


def _store_label(store) -> str:
    return "+".join(f"{tier.name}:{getattr(tier, 'root', '')}" for tier in getattr(store, "tiers", [store]))


def _bar(documents: int):
    from tqdm.auto import tqdm

    return tqdm(total=documents, desc="ragcache compile", unit="doc")
