"""The kinds of store tier, each declared once: the URL schemes that name it, how it opens, whether it lives in this
process. A store URL is read here alone (`tier_urls`, `per_process`, `open_tier`); a new tier is its Store class in a
file of its own, with a `from_url`, and one `register` below."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from .errors import StoreError, UnknownStore

if TYPE_CHECKING:
    from .base import Store

# (the tier's URL, connect, the engine's device or None) -> the open tier; connect=False: one tier of several, opened
# while its server may be down (a tiered store retries it, as it does a tier that goes down later)
Opener = Callable[[str, bool, Any], "Store"]


@dataclass(frozen=True)
class TierKind:
    # what its URLs start with, and what starts a new tier after a '+': "disk:", "redis://"; a bare word ("memory")
    # names the tier alone or before a colon ("memory:16GiB")
    schemes: tuple[str, ...]
    form: str  # its URL as the unknown-store message shows it
    opens: Opener
    per_process: bool = False  # lives in this process's memory: nothing it holds outlives the process or is shared
    # reads a URL's options (a size) without opening anything: UnknownStore for one it cannot read
    checks: Callable[[str], Any] | None = None

    def names(self, spec: str) -> bool:
        """`spec` (one tier's URL) is a tier of this kind."""
        return any(spec == s or spec.startswith(s if s.endswith((":", "/")) else s + ":") for s in self.schemes)


KINDS: list[TierKind] = []


def register(kind: TierKind) -> TierKind:
    taken = [s for other in KINDS for s in other.schemes if s in kind.schemes]
    if taken:
        raise StoreError(f"store scheme(s) {', '.join(taken)} already name a tier kind")
    KINDS.append(kind)
    return kind


def lazy(module: str, name: str) -> Opener:
    """Opens with `name.from_url` from `module` (relative to this package), imported only when a tier of the kind
    opens: a memory store does not import redis, nor `import ragcache.store` any tier."""

    def opens(spec: str, connect: bool, device: Any) -> Store:
        return getattr(importlib.import_module(module, __package__), name).from_url(spec, connect, device)

    return opens


def reads(module: str, path: str, **options) -> Callable[[str], Any]:
    """A check of a kind's URL: the function at dotted `path` in `module`, imported when a URL is checked."""

    def check(spec: str) -> Any:
        fn: Any = importlib.import_module(module, __package__)
        for name in path.split("."):
            fn = getattr(fn, name)
        return fn(spec, **options)

    return check


register(TierKind(("memory",), "memory:[SIZE]", lazy(".memory", "MemoryStore"), True, reads(".memory", "url_budget")))
register(
    TierKind(
        ("gpu",),
        "gpu:[SIZE|N%] (on CUDA)",
        lazy(".device", "DeviceStore"),
        True,
        reads(".memory", "url_budget", share=True),
    )
)
register(
    TierKind(
        ("disk:",), "disk:PATH[?size=SIZE]", lazy(".disk", "DiskStore"), checks=reads(".disk", "DiskStore.url_parts")
    )
)
register(TierKind(("redis://", "rediss://", "unix://"), "redis://HOST:PORT/DB", lazy(".redis_tier", "RedisStore")))


def kind_of(spec: str) -> TierKind | None:
    return next((kind for kind in KINDS if kind.names(spec)), None)


def tier_urls(url: str) -> list[str]:
    """'memory+disk:./x+redis://h' -> ['memory', 'disk:./x', 'redis://h'] (a '+' starts a tier only before a tier's
    URL: 'disk:/data/run+gpu_cache' is one path)."""
    parts: list[str] = []
    for piece in (p.strip() for p in url.split("+")):
        if parts and kind_of(piece) is None:
            parts[-1] += "+" + piece
        else:
            parts.append(piece)
    return parts


def redact_url(url: str) -> str:
    """The URL as logs, errors and stats show it: a password, in the netloc (a host's or a socket's, `unix://:pw@/x`)
    or in the query (`?password=`), as ***."""
    parts = urlsplit(url)
    if parts.password is not None:
        user, _, host = parts.netloc.rpartition("@")
        parts = parts._replace(netloc=f"{user.partition(':')[0]}:***@{host}")
    query = parse_qsl(parts.query, keep_blank_values=True)
    if any(name == "password" for name, _ in query):
        hidden = [(name, "***" if name == "password" else value) for name, value in query]
        parts = parts._replace(query=urlencode(hidden, safe="*"))
    return urlunsplit(parts)


def shown(url: str) -> str:
    """A store URL as the CLI and logs show it: each tier's password (`redact_url`) as ***."""
    return "+".join(redact_url(tier) if "://" in tier else tier for tier in tier_urls(url))


def per_process(url: str) -> bool:
    """Every tier of the URL lives in this process (memory, gpu): nothing it holds outlives it or is shared."""
    return all((kind := kind_of(tier)) is not None and kind.per_process for tier in tier_urls(url))


def check_url(url: str) -> None:
    """UnknownStore for a tier of no known kind, or with options it cannot read (a size of `20GB`): before a model
    loads for minutes, not after."""
    for spec in tier_urls(url):
        kind = _known_kind(spec)
        if kind.checks is not None:
            kind.checks(spec)


def _known_kind(spec: str) -> TierKind:
    kind = kind_of(spec)
    if kind is None:
        forms = ", ".join(k.form for k in KINDS)
        raise UnknownStore(f"unknown store {spec!r}: use {forms}, or tiers joined by '+'")
    return kind


def open_tier(spec: str, connect: bool = True, device=None) -> Store:
    return _known_kind(spec).opens(spec, connect, device)
