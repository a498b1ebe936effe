"""What every framework's retriever wrapper does with the texts it returns: compile the missing chunks and prefetch
the rest, so that linking them finds their entries in the store's fastest tier."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ragcache.errors import BadRequest
from ragcache.front import Front
from ragcache.linker import algorithm


@dataclass
class WarmReport:
    documents: int = 0
    compiled_chunks: int = 0  # chunks that were missing from the store and compiled
    prefetched_chunks: int = 0  # chunk entries read so that a tiered store holds them in its fastest tier
    seconds: float = 0.0


def default_prefetch(rc: Front, prefetch: bool | None) -> bool:
    """None: prefetch only from a tiered store, where a read fills the faster tiers."""
    return hasattr(rc.store, "tiers") if prefetch is None else prefetch


def check_layout(rc: Front, warmed: str | None, knobs: dict) -> None:
    """BadRequest where a retriever warms entries in a layout (`warmed`; None: it warms none) the engine's links, with
    these knobs, never read: each query would compile its documents again, inside its time to first token."""
    read = algorithm(rc.params(**knobs).algorithm)
    if warmed is not None and read.reuses == "chunks" and read.layout != warmed:
        raise BadRequest(
            f"the retriever warms the {warmed!r} layout and {read.name} links read the {read.layout!r} one: give the "
            f"retriever layout={read.layout!r}"
        )


def warm(
    rc: Front, texts: list[str], metadata: list[dict], layout: str, prefetch: bool
) -> tuple[list[str], WarmReport]:
    """Compile the texts' missing chunks in `layout` (the one their links read) and, with prefetch, read the present
    ones. Returns the texts' document ids and the report."""
    started = time.perf_counter()
    report = WarmReport(documents=len(texts))
    compiled = rc.compile_documents(texts, metadata, layout=layout)
    report.compiled_chunks = compiled.compiled_chunks
    if prefetch:
        more, found = rc.warm(compiled.ids, layout=layout, prefetch=True)
        report.compiled_chunks += more
        report.prefetched_chunks = found
    report.seconds = time.perf_counter() - started
    return compiled.ids, report
