"""What the plugin's parts share about nodes: which text is compiled, and where its document id is recorded.

A node's ragcache document is its text (`get_content(metadata_mode)`, metadata left out by default), so its
document id is the content hash of that text: the id recorded in metadata is a label, the text is the truth.
"""

from __future__ import annotations

from llama_index.core.schema import BaseNode, MetadataMode

from ragcache.documents import labels

DOC_ID_KEY = "ragcache_doc_id"


def node_text(node: BaseNode, metadata_mode: MetadataMode = MetadataMode.NONE) -> str:
    """The node's text in `metadata_mode`, never with the document id `mark` recorded: MetadataMode.ALL shows every
    key, and a text holding its own id would hash to another id each time it is marked."""
    if DOC_ID_KEY not in node.metadata:
        return node.get_content(metadata_mode=metadata_mode)
    unmarked = {key: value for key, value in node.metadata.items() if key != DOC_ID_KEY}
    return node.model_copy(update={"metadata": unmarked}).get_content(metadata_mode=metadata_mode)


def mark(node: BaseNode, doc_id: str) -> None:
    """Record the document id in the node's metadata, hidden from the LLM and the embedding model."""
    node.metadata[DOC_ID_KEY] = doc_id
    for excluded in (node.excluded_llm_metadata_keys, node.excluded_embed_metadata_keys):
        if DOC_ID_KEY not in excluded:
            excluded.append(DOC_ID_KEY)


def record_meta(node: BaseNode) -> dict:
    """The node's ids and scalar metadata for the store's document record, as labels (documents.labels): an id made
    from a file name (`filename_as_id`) may hold its undecodable bytes as lone surrogates too."""
    ids = labels({"node_id": node.node_id, "ref_doc_id": node.ref_doc_id}, skip=DOC_ID_KEY)
    return {"source": "llama_index", **ids, **labels(node.metadata, skip=DOC_ID_KEY)}
