"""What a linked request carries to vLLM, built and read without vLLM installed: `LinkSpec` (how ragcache's prompt
ids split into parts, and how to link them), the request fields that carry it, and the connector's config."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from ragcache import linker
from ragcache.errors import RagCacheError
from ragcache.linker import LinkInput, LinkParams
from ragcache.settings import DEFAULT_ALGORITHM

SPEC_KEY = "ragcache"
# what the connector did for a linked request, in its finished output's kv_transfer_params: its store lookups
# (chunk and prefix entries: hits, misses, compiled), the rows it recomputed, and its time fetching (the store reads
# and any compile), placing, and recomputing and writing into vLLM's cache
LINK_KEY = "ragcache_link"
LINK_FIELDS = ("hits", "misses", "compiled", "recomputed", "fetch_s", "rotate_s", "recompute_s")
SALT_PREFIX = "ragcache-link:"
NAME = "RagcacheConnector"
# vLLM's ways of splitting one replica's model across devices that a link cannot follow. Tensor parallelism it can:
# each rank links its own KV heads with its shard of the model (layers.VllmRunner), reading its shards of the entries.
# A pipeline rank holds some of the layers, and a link's recompute carries hidden states through every layer in one
# pass on one rank; context parallelism splits a sequence's positions, which a link places and recomputes whole
SPLITS = (
    "pipeline_parallel_size",
    "prefill_context_parallel_size",
    "decode_context_parallel_size",
)


def split_problem(sizes: dict[str, int]) -> str | None:
    """Why the connector cannot run with these parallel sizes (vLLM's ParallelConfig fields), or None."""
    split = {name: size for name, size in sizes.items() if name in SPLITS and size is not None and size > 1}
    if not split:
        return None
    named = ", ".join(f"{name}={size}" for name, size in split.items())
    return (
        f"{NAME} links on a model split by heads (tensor parallelism) or not at all, got {named}: a link's "
        "recompute runs every layer over the request's whole sequence on one rank (docs/DESIGN.md, 'Past one "
        "machine'). Use --tensor-parallel-size instead, or serve more GPUs as replicas on one store"
    )


MODULE = "ragcache.integrations.vllm.connector"


class BadLinkSpec(RagCacheError):
    pass


@dataclass(frozen=True)
class LinkSpec:
    """How one prompt splits into ragcache's parts, and how to link them. Lengths are in prompt ids."""

    prefix: int
    chunks: tuple[int, ...]
    question: int
    link: LinkParams = dataclasses.field(default_factory=LinkParams)  # on the wire: its knobs beside the lengths
    nonce: str = ""  # a request that must read the store (compiling through vLLM) gets a salt of its own
    # an algorithm that ranks its rows across every chunk and the question (focus, cacheblend) links another cache
    # of a chunk for another prompt: the prompt's digest enters the salt, so vLLM's prefix cache never serves one
    # prompt's link to another (blocks of the same chunk at the same place, other chunks or question after them)
    prompt_sha: str = ""

    @classmethod
    def of_parts(cls, parts: LinkInput, params: LinkParams) -> LinkSpec:
        across = linker.algorithm(params.algorithm).ranks_across
        return cls(
            len(parts.prefix_ids),
            tuple(map(len, parts.chunk_ids)),
            len(parts.question_ids),
            params,
            prompt_sha=prompt_sha(parts.token_ids.tolist()) if across else "",
        )

    def prompt_problem(self, token_ids: list[int]) -> str | None:
        """Why the spec's prompt digest does not fit the prompt (None: it does)."""
        wanted = prompt_sha(token_ids) if linker.algorithm(self.link.algorithm).ranks_across else ""
        return (
            None
            if self.prompt_sha == wanted
            else (
                f"{self.link.algorithm} ranks its rows across the whole prompt: prompt_sha must be the sha256 of its "
                "ids (LinkSpec.of_parts)"
                if wanted
                else f"{self.link.algorithm} takes no prompt_sha"
            )
        )

    @classmethod
    def parse(cls, raw: Any, prompt_tokens: int, num_layers: int | None = None) -> LinkSpec:
        """The spec a request sent, checked whole (its link's knobs as `LinkParams.validate` checks them, against the
        model's `num_layers` where known): BadLinkSpec or ParameterOutOfRange before any worker sees it, as a knob
        a worker met first would fail its step, and with tensor parallelism the engine."""
        if not isinstance(raw, dict):
            raise BadLinkSpec(f"kv_transfer_params[{SPEC_KEY!r}] must be an object, got {type(raw).__name__}")
        knobs = {f.name for f in dataclasses.fields(LinkParams)}
        unknown = set(raw) - knobs - {f.name for f in dataclasses.fields(cls)} | ({"link"} & set(raw))
        if unknown:
            raise BadLinkSpec(f"unknown fields {sorted(unknown)}")
        own = {name: value for name, value in raw.items() if name not in knobs}
        try:
            link = LinkParams(**{name: value for name, value in raw.items() if name in knobs})
            spec = cls(**{**own, "chunks": tuple(raw.get("chunks", ())), "link": link})
        except TypeError as exc:
            raise BadLinkSpec(str(exc)) from None
        try:
            link.validate(num_layers if num_layers is not None else max(int(link.check_layer), 0) + 1)
        except (TypeError, ValueError) as exc:  # a knob of the wrong type (a ratio "x")
            raise BadLinkSpec(f"its link's knobs: {exc}") from None
        lengths = (spec.prefix, *spec.chunks, spec.question)
        if not isinstance(spec.nonce, str) or not isinstance(spec.prompt_sha, str):
            raise BadLinkSpec("nonce and prompt_sha must be strings")
        if not all(type(n) is int and n >= 0 for n in lengths):
            raise BadLinkSpec(f"part lengths must be integers >= 0, got {list(lengths)}")
        if not all(spec.chunks):  # nothing to compile or place: a worker's prefill of no ids would fail its step
            raise BadLinkSpec(f"every chunk needs at least one id, got lengths {list(spec.chunks)}")
        if spec.question < 1 or sum(lengths) != prompt_tokens:
            raise BadLinkSpec(
                f"parts of {sum(lengths)} ids (question {spec.question}) do not cover the prompt's "
                f"{prompt_tokens}; the question needs at least one id"
            )
        if linker.algorithm(spec.link.algorithm).reuses != "chunks":
            raise BadLinkSpec(
                f"{spec.link.algorithm!r} reuses no chunks: send it to vLLM without {SPEC_KEY!r} params "
                "(full is vLLM's prefill, prefix its prefix cache)"
            )
        return spec

    @property
    def linked(self) -> int:
        """The prompt ids the link provides: everything before the question."""
        return self.prefix + sum(self.chunks)

    @property
    def salt(self) -> str:
        """What files the linked blocks in vLLM's prefix cache. A link that ranks no rows across the prompt (naive,
        legolink) gives the linked part the same K/V whatever the question: the question's length stays out, so
        questions over the same documents share those blocks."""
        wire = self.as_dict()
        if not linker.algorithm(self.link.algorithm).ranks_across:
            del wire["question"]
        return SALT_PREFIX + hashlib.sha256(json.dumps(wire, sort_keys=True).encode()).hexdigest()[:32]

    def as_dict(self) -> dict:
        """The wire form: the lengths, the link's knobs (LinkParams') and the salt's parts, one flat object."""
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "link"}
        return {**own, **dataclasses.asdict(self.link), "chunks": list(self.chunks)}

    def params(self) -> LinkParams:
        return self.link

    def parts(self, token_ids: list[int]) -> LinkInput:
        chunks, position = [], self.prefix
        for length in self.chunks:
            chunks.append(list(token_ids[position : position + length]))
            position += length
        return LinkInput(list(token_ids[: self.prefix]), chunks, list(token_ids[position:]))

    def request(self, token_ids: list[int]) -> dict:
        """What to send vLLM (`LLM.generate` prompt fields, or the OpenAI server's extra body)."""
        return {
            "prompt_token_ids": list(token_ids),
            "cache_salt": self.salt,
            "kv_transfer_params": {SPEC_KEY: self.as_dict()},
        }


def prompt_sha(ids) -> str:
    return hashlib.sha256(json.dumps([int(i) for i in ids]).encode()).hexdigest()[:32]


@dataclass
class Load:
    """One request's link, as the worker needs it."""

    request_id: str
    token_ids: list[int]
    spec: LinkSpec
    block_ids: list[int]
    start: int  # first position to write: vLLM's own prefix hit ends there
    adapter: str | None = None  # the directory of the request's LoRA (its LoRARequest), a link adapter
    # linked before: vLLM preempted the request and gave its blocks away. Its client released the documents at its
    # first token, so a delete may have come since: what is missing is compiled for this link and not stored (it
    # would be entries no document refers to)
    relink: bool = False

    def written_blocks(self, block_size: int) -> list[int]:
        """The blocks the link writes: from the one where vLLM's prefix hit ends to the linked part's last."""
        return self.block_ids[self.start // block_size : -(-self.spec.linked // block_size)]


def transfer_config(store: str, **options) -> dict:
    """The `kv_transfer_config` that loads this connector (`vllm serve --kv-transfer-config`, `LLM(...)`)."""
    return {
        "kv_connector": NAME,
        "kv_connector_module_path": MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": store, **options},
    }


def link_request(
    rc, question: str, doc_ids: list[str], algorithm: str = DEFAULT_ALGORITHM, system: str | None = None, **params
) -> dict:
    """The vLLM request fields (`prompt_token_ids`, `cache_salt`, `kv_transfer_params`) that link `doc_ids` for
    `question` inside vLLM exactly as the ragcache engine `rc` would link them itself."""
    parts = rc.prompt_parts(question, doc_ids, system, algorithm)
    spec = LinkSpec.of_parts(parts, rc.params(algorithm, **params))
    return spec.request(parts.token_ids.tolist())
