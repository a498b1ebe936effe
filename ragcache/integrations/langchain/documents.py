"""What the plugin's parts share about LangChain documents: a document's ragcache text is its `page_content`, so its
document id is the content hash of that text; the id recorded in its metadata is a label."""

from __future__ import annotations

from langchain_core.documents import Document

from ragcache.documents import labels

DOC_ID_KEY = "ragcache_doc_id"


def document_text(document: Document | str) -> str:
    return document if isinstance(document, str) else document.page_content


def record_meta(document: Document) -> dict:
    """The document's id and scalar metadata for the store's document record, as labels (documents.labels): an id
    made from a file name may hold its undecodable bytes as lone surrogates too."""
    ids = labels({"langchain_id": document.id or None}, skip=DOC_ID_KEY)
    return {"source": "langchain", **ids, **labels(document.metadata, skip=DOC_ID_KEY)}
