"""Every default, and one settings model for the CLI and the server: flags > environment (RAGCACHE_*) > config
file > defaults.

The config file is TOML: `./ragcache.toml`, or the path in RAGCACHE_CONFIG. The store's own defaults stay in
ragcache/store (it imports nothing from ragcache) and are re-exported here."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import reprlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from ragcache.errors import BadRequest, ParameterOutOfRange
from ragcache.store.base import (  # noqa: F401 - re-exported: the defaults are read from settings
    DEFAULT_DISK_BUDGET,
    DEFAULT_MAX_RETRY_AFTER_S,
    DEFAULT_MEMORY_BUDGET,
    DEFAULT_PREFIX,
    DEFAULT_RETRY_AFTER_S,
)
from ragcache.store.codec import CODECS

DEFAULT_MODEL = "smollm2-135m"
INSTALLED = "installed"  # the model's installed adapter, where its calibration vouches for it (ragcache/adapters.py)
DEFAULT_STORE = "disk:./.ragcache"
DEFAULT_CHUNK_TOKENS = 512
DEFAULT_PREFIX_BUDGET = 256 << 20  # bytes per prefix cache (the `prefix` baseline, infilling)
DEFAULT_ROW_BUDGET = 512  # rows per step: long prefills go in pieces, so decoding streams never stall for long
# By device: (rows per step while a stream decodes or a link has ended in the step, while nothing waits on it). A
# GPU step costs its kernel launches more than its rows until thousands of rows: on an H100 at a Llama-3-8B shape
# `full` at 32k took 2.4x transformers' forward in 512-row steps and 1.02x in one step. 8192 rows keep a decoding
# stream's wait at about one 8k-token forward (0.26 s there). While no stream decodes and no link has ended in the
# step, nothing waits on its length: on an H200 at the llama3-8b shape `full` at 32,546 tokens took 1.49 s in
# 8192-row steps, 1.46 s in 16,384 and 1.35 s in one step, against 1.34 s for transformers' forward
# (bench/results/gpu-link-routed-NVIDIA-H200.json). bench/gpu.py measures both.
DEVICE_ROW_BUDGETS = {"cpu": (DEFAULT_ROW_BUDGET, DEFAULT_ROW_BUDGET), "cuda": (8192, 32768)}


AUTO_DEVICE = "auto"


def check_device(device: str, here: bool = True) -> None:
    """auto, cpu, or cuda[:N], and with `here`, a CUDA device this machine has: anything else would fail only once
    the model is loaded. ParameterOutOfRange otherwise."""
    found = re.fullmatch(r"cuda(?::(\d+))?", device)
    if device in (AUTO_DEVICE, "cpu"):
        return
    if found is None:
        raise ParameterOutOfRange(
            f"device {device!r}: must be auto, cpu or cuda (another GPU than the first: CUDA_VISIBLE_DEVICES)"
        )
    if not here:
        return
    if not torch.cuda.is_available():
        raise ParameterOutOfRange(
            f"device {device}: torch sees no CUDA device on this machine; use --device cpu (or auto)"
        )
    if found.group(1) is not None and int(found.group(1)) >= torch.cuda.device_count():
        raise ParameterOutOfRange(
            f"device {device}: this machine has {torch.cuda.device_count()} CUDA device(s), numbered from 0"
        )


def refuse_another_gpu(device) -> None:
    """ParameterOutOfRange for a GPU other than the process's first: CUDA's current device is each thread's, 0 in
    every thread ragcache's engine starts (its model thread, store writers, finalizers), so Triton's launches, the
    decode graphs' streams and the copies' events would be on the first GPU with the engine's tensors on another."""
    device = torch.device(device)
    if device.type == "cuda" and (device.index or 0) != 0:
        visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        gpu = visible[device.index] if device.index < len(visible) else str(device.index)  # as CUDA numbers it
        raise ParameterOutOfRange(
            f"device {device}: ragcache's engine runs on the first GPU the process sees; choose this one with "
            f"CUDA_VISIBLE_DEVICES={gpu} and --device cuda"
        )


def resolve_device(device: str | None, here: bool = True) -> tuple[str, str]:
    """The device an engine runs on, and why: "auto" (the default) is CUDA where torch sees a GPU, else the CPU; any
    other name is checked (`check_device`: with `here`, this machine must have it) and taken as given."""
    if device not in (None, "", AUTO_DEVICE):
        check_device(str(device), here)
        return str(device), "configured"
    if torch.cuda.is_available():
        return "cuda", f"auto: torch sees {torch.cuda.device_count()} CUDA device(s)"
    return "cpu", "auto: " + (
        "this torch is a CPU build" if torch.version.cuda is None else "torch sees no CUDA device"
    )


def row_budgets_for(device) -> tuple[int, int]:
    """The step's row budgets on a device (torch.device or its name): while a stream decodes, while none does."""
    return DEVICE_ROW_BUDGETS.get(str(device).split(":")[0], (DEFAULT_ROW_BUDGET, DEFAULT_ROW_BUDGET))


def store_for(store: object, device) -> object:
    """The store an engine on `device` opens: on CUDA the default store has a GPU tier and a pinned memory tier in
    front of it (a link from those copies at PCIe speed or not at all, README: On a GPU); any other as given."""
    if store == DEFAULT_STORE and str(device).split(":")[0] == "cuda":
        return "gpu+memory+" + DEFAULT_STORE
    return store


DEFAULT_ALGORITHM = "focus"  # legolink-16 is no better than naive on the capable reader; focus is (docs/ACCURACY.md)
DEFAULT_TRAIN_ALGORITHM = "naive"  # what `ragcache train link` fits unless told: the cheapest link has the most to win
TRAIN_READ_KNOBS = {"legolink": ("k",), "focus": ("ratio",)}  # what shapes each fitted link besides its algorithm
DEFAULT_K = 16
DEFAULT_RATIO = 0.15  # cacheblend's
DEFAULT_FOCUS_RATIO = 0.25  # keeps full's F1 on the 1.5B reader (n = 1000) and agrees on 0.90 of first tokens
DEFAULT_CHECK_LAYER = 1
DEVIATIONS = ("key", "value")  # what CacheBlend compares at its check layer


REPAIR_ON_VLLM = (  # why the vllm engine refuses `repair`: vLLM's scheduler owns its decode steps
    "repair (recomputing a link's stale rows during decode) runs on ragcache's engine only; leave it out, or serve "
    "with --engine ragcache"
)
REPAIR_OF_ONE = (  # what `repair` must be: each decode step also adds a row decoded over the stale cache
    "0 (off) or at least 2: a repair of 1 row a decode step never catches up"
)


def whole(value):
    """A float with no fraction as the int it is, for the integer fields of request bodies (a `before` validator):
    JSON Schema's integer is any number without one (1.0 is 1), while strict ints still refuse true and "3"."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


class LinkKnobs(BaseModel):
    """Every knob a caller may set on a link, declared once. The doors take it whole or derive from it: the REST
    schemas (api/schemas.LinkOptions), Settings, `Front.stream`/`Front.params`, the CLI (`cli.link_options`),
    llama-index's and LangChain's models; the linker's `LinkParams` holds the same names resolved. None leaves a knob
    to the next default: the server's settings, then the model's calibrated profile (k, the focus ratio), then the
    linker's (DEFAULT_ALGORITHM, DEFAULT_K, ...). Numbers are strict: a JSON true or "3" is no number."""

    algorithm: str | None = Field(
        default=None, description=f"link algorithm (README: Algorithms; default: {DEFAULT_ALGORITHM})"
    )
    k: int | None = Field(
        default=None,
        ge=0,
        le=1 << 20,
        strict=True,
        description=f"legolink: tokens recomputed at each chunk start (default: the model's calibrated k, else {DEFAULT_K})",
    )
    ratio: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        allow_inf_nan=False,
        strict=True,
        description="focus, cacheblend: share of chunk tokens recomputed (default: focus the model's calibrated "
        f"ratio, else {DEFAULT_FOCUS_RATIO}; cacheblend {DEFAULT_RATIO})",
    )
    check_layer: int | None = Field(
        default=None,
        ge=0,
        strict=True,
        description=f"cacheblend: the layer whose deviation picks the rows (default: {DEFAULT_CHECK_LAYER})",
    )
    deviation: Literal[DEVIATIONS] | None = Field(  # type: ignore[valid-type]
        default=None, description="cacheblend: rank rows by K (key, the default) or V (value) deviation"
    )
    repair: int | None = Field(
        default=None,
        ge=0,
        le=1 << 16,
        strict=True,
        description="rows of the link's stale cache recomputed with each decode step once the first token is out, "
        "in causal order, until the cache is full's (0 or at least 2: a step also decodes a row over the stale "
        "cache); past the prompt's length (e.g. 4096) it is full's from the second token on, and on CPU so is the answer "
        "wherever its first token is (README: Repair during decode; default 0: off)",
    )

    _whole_knobs = field_validator("k", "check_layer", "repair", mode="before")(whole)

    @field_validator("repair")
    @classmethod
    def _repair_catches_up(cls, value: int | None) -> int | None:
        if value == 1:
            raise ValueError(REPAIR_OF_ONE)
        return value

    @classmethod
    def of(cls, **named) -> LinkKnobs:
        """From keywords, as the Python API takes them: an unknown name or a value out of range is a typed error
        (ParameterOutOfRange, a 422 at the API) that names the knob."""
        unknown = set(named) - set(cls.model_fields)
        if unknown:
            raise ParameterOutOfRange(
                f"unknown link knob(s) {sorted(unknown)}; the knobs: {', '.join(cls.model_fields)}"
            )
        try:
            return cls(**named)
        except ValidationError as exc:
            problem = exc.errors()[0]
            name, why = problem["loc"][0], problem["msg"].removeprefix("Input should be ").removeprefix("Value error, ")
            raise ParameterOutOfRange(f"{name} must be {why}, got {problem['input']!r}") from None

    def knobs(self) -> dict:
        """Every knob by name, None where unset (on a model that inherits these fields among others too)."""
        return {name: getattr(self, name) for name in LinkKnobs.model_fields}

    def given(self) -> dict:
        """The knobs set (not None), by name."""
        return {name: value for name, value in self.knobs().items() if value is not None}


DEFAULT_TARGET = 0.95  # first-token agreement with full that calibration aims for and the guard warns below
DEFAULT_WINDOW = 200  # guard checks per (model, algorithm) in the sliding agreement fraction
DEFAULT_KS = (0, 4, 8, 16, 32, 64, 128, 256)  # what calibration tries
DEFAULT_RATIOS = (0.05, 0.15, 0.3, 0.5)
DEFAULT_FOCUS_RATIOS = (0.05, 0.1, 0.25, 0.4, 0.5, 0.75)  # qwen2.5-coder-0.5b reaches 0.95 near 0.75 (docs/ACCURACY.md)
DEFAULT_LR = {True: 2e-4, False: 2e-5}  # infill training, by lora

DATA_DIR = Path(__file__).resolve().parent / "data"  # the demo's and calibration's documents and questions


def parse_adapter(value: str | Path | None) -> str | Path | None:
    """A CLI or settings value: "none" is the base model, "installed" the installed default, else a directory."""
    if value is None or str(value).lower() in ("", "none"):
        return None
    return INSTALLED if str(value).lower() == INSTALLED else Path(value)


# what only ragcache's own engine reads: the vllm engine refuses them rather than ignore them
RAGCACHE_ENGINE_ONLY = (
    "row_budget",
    "link_row_budget",
    "batch_invariant",
    "decode_graphs",
    "decode_compile",
    "decode_eager",
    "prefetch_bytes",
)


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is opened with, in one object from `Settings.engine_config()` (or by hand) to the
    engine's parts: `RagCache.from_config` loads the model and opens the store; the facade hands each part its knobs.
    `adapter`: a directory `ragcache train link` wrote, None (the base model), or INSTALLED: the model's installed
    adapter where its calibration vouches for it (ragcache/adapters.py), else the base model."""

    model: str = DEFAULT_MODEL
    store: object = DEFAULT_STORE  # a URL, or an open ragcache.store.Store
    engine: str = "ragcache"  # or "vllm": the same front doors on vLLM's engine
    device: str = AUTO_DEVICE  # resolved when the config is made (`resolve_device`), the reason kept beside it
    dtype: str = "auto"
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    kv_codec: str = "auto"  # how chunk K/V are stored (store/codec.py): auto is int8 on CPU and CUDA
    prefix_cache_bytes: int = DEFAULT_PREFIX_BUDGET
    row_budget: int | None = None  # rows per step while a stream decodes; None: the device's (row_budgets_for)
    # rows per step while none decodes and no link has ended in it; None: row_budget where that is given, else the
    # device's (row_budgets_for)
    link_row_budget: int | None = None
    batch_invariant: bool | None = None  # None: on on CPU, off on CUDA until measured there (Runner)
    decode_graphs: bool | None = None  # None: on on CUDA where the decode is pooled (ragcache.engine.graphs)
    decode_compile: bool = False  # torch.compile the decode graphs' step before its capture (ragcache.engine.graphs)
    # run the decode graphs' fixed-shape step eagerly, never captured: the captured step's reference (bench/gpu.py)
    decode_eager: bool = False
    prefetch_bytes: int | None = None  # device memory for entries crossing ahead of their link (ragcache.engine.copies)
    adapter: str | Path | None = INSTALLED
    merge_adapter: bool = True  # fold the adapter into the weights, or run it beside them
    vllm_args: dict = dataclasses.field(default_factory=dict)  # the vllm engine's: max_model_len, kv_cache_gib, ...
    device_reason: str = dataclasses.field(default="", compare=False)  # why `device` is what it is (/health, the log)

    def __post_init__(self) -> None:
        if self.device in (None, "", AUTO_DEVICE) or not self.device_reason:
            device, reason = resolve_device(self.device)
            object.__setattr__(self, "device", device)
            object.__setattr__(self, "device_reason", reason)

    def vllm_problem(self) -> str | None:
        """Why the vllm engine cannot take this config: options only ragcache's engine reads, which it would ignore."""
        own = [name for name in RAGCACHE_ENGINE_ONLY if getattr(self, name) not in (None, False)]
        if self.engine != "vllm" or not own:
            return None
        return (
            f"{', '.join(own)}: options of ragcache's engine; vLLM plans its own steps (its max_num_batched_tokens, "
            "its CUDA graphs): leave them out with engine=vllm"
        )

    @classmethod
    def of(cls, model: str = DEFAULT_MODEL, store: object = DEFAULT_STORE, **options) -> EngineConfig:
        """From keywords, as `RagCache.open` takes them: EngineConfig's fields, and any other name an argument of
        the vllm engine (refused on ragcache's)."""
        names = {f.name for f in dataclasses.fields(cls)}
        known = {k: v for k, v in options.items() if k in names}
        vllm_args = {**known.pop("vllm_args", {}), **{k: v for k, v in options.items() if k not in names}}
        return cls(model, store, **known, vllm_args=vllm_args)


def config_path() -> Path:
    return Path(os.environ.get("RAGCACHE_CONFIG") or "ragcache.toml")  # an empty RAGCACHE_CONFIG: the default


class Settings(BaseSettings, LinkKnobs):  # the link knobs (RAGCACHE_ALGORITHM, ...): the server's defaults
    model_config = SettingsConfigDict(env_prefix="RAGCACHE_", extra="ignore")

    model: str = Field(DEFAULT_MODEL, description="built-in name, transformers directory or hub id")
    store: str = Field(
        DEFAULT_STORE,
        description="memory:[SIZE], gpu:[SIZE|N%] (CUDA), disk:PATH, redis://..., or tiers joined by '+'",
    )
    prefix_cache_mib: int = Field(
        DEFAULT_PREFIX_BUDGET >> 20,
        ge=0,
        description="MiB of exact-prefix KV kept for "
        "the `prefix` baseline, and as much for infilling sessions (least recently used "
        "first out)",
    )
    chunk_tokens: int = Field(DEFAULT_CHUNK_TOKENS, ge=16, le=8192, description="chunk budget in tokens")
    dtype: str = Field(
        "auto",
        pattern="^(auto|float32|float16|bfloat16)$",
        description="auto: bfloat16 on CUDA from Ampere on (float16 on older GPUs) and on CPUs with bf16 "
        "instructions (AVX512-BF16, AMX), else float32 (see README: dtype)",
    )
    device: str = Field(
        AUTO_DEVICE,
        description="auto: CUDA where torch sees a GPU, else the CPU; or cpu, cuda, cuda:N (ragcache's engine runs on "
        "cuda:0: choose its GPU with CUDA_VISIBLE_DEVICES)",
    )
    engine: str = Field(
        "ragcache",
        pattern="^(ragcache|vllm)$",
        description="ragcache: this package's engine; vllm: vLLM's async engine with ragcache's "
        "connector (README: On vLLM; needs vLLM installed and a disk: or redis:// store)",
    )
    max_model_len: int | None = Field(
        None, ge=16, description="vllm engine: longest prompt + answer in tokens (default: the model's own)"
    )
    kv_cache_gib: float | None = Field(
        None,
        gt=0,
        description="vllm engine: GiB of vLLM's paged KV cache (default: 4 on a CPU, vLLM's own choice on a GPU)",
    )
    tensor_parallel_size: int | None = Field(
        None,
        ge=1,
        description="vllm engine: devices the model's heads are split across; each rank links its own heads, "
        "reading its shards of the entries (`ragcache compile --shards N`; whole entries are sliced)",
    )
    adapter: str | None = Field(
        INSTALLED,
        description="a read-side LoRA directory `ragcache train link` wrote, "
        "`none` for the base model, or `installed`: the model's installed adapter where its "
        "calibration reached the target, else the base model (README: Installed adapters)",
    )
    merge_adapter: bool = Field(
        True,
        description="fold the link adapter into the weights (faster; on the vllm engine a "
        "merged copy of the model in the model cache) or run it beside them (on vllm: vLLM's "
        "LoRA, which the accuracy guard needs there)",
    )
    batch_invariant: bool | None = Field(
        None,
        description="a request's greedy answer does not depend on what else "
        "is in its batch (default: on on CPU, off on CUDA until its cost is measured "
        "there); false: the library's own GEMMs and one attention call per layer for "
        "all decode rows, faster at many streams (README: Batch invariance)",
    )
    decode_graphs: bool | None = Field(
        None,
        description="decode-only steps replayed from CUDA graphs, one per "
        "allocation of the pool of decoding caches (default: on on CUDA where "
        "batch_invariant is off; elsewhere the same fixed-shape step runs eagerly "
        "when asked for)",
    )
    decode_compile: bool = Field(
        False,
        description="torch.compile the decode graphs' step before it is captured, so that each layer's norms, RoPE "
        "and elementwise ops run fused (off by default until measured on a GPU; compiling takes a while at start "
        "and once more when the pool first grows)",
    )
    row_budget: int | None = Field(
        None,
        ge=1,
        description="rows per engine step while a stream decodes: each waits for a step, so this bounds the wait "
        "(default: the device's, 8192 on CUDA, 512 on CPU)",
    )
    link_row_budget: int | None = Field(
        None,
        ge=1,
        description="rows per engine step while no stream decodes (no more past row_budget once a link has ended "
        "in the step): a long link in fewer, larger steps (default: "
        "row_budget where that is set, else the device's, 32768 on CUDA, 512 on CPU)",
    )
    prefetch_mib: int | None = Field(
        None,
        ge=0,
        description="on CUDA, device memory for chunk entries that start crossing from host memory as soon as a "
        "request has fetched them, while other requests' steps run (default: 10% of what is free once the "
        "model and the store are in; 0: off, entries cross at their link); ignored on CPU",
    )
    kv_codec: str = Field(
        "auto",
        pattern=f"^(auto|{'|'.join(CODECS)})$",
        description="how chunk K/V are stored: auto (int8 on CPU and CUDA, the compute dtype elsewhere), "
        f"{', '.join(CODECS)} (see README: KV codecs)",
    )
    max_new_tokens: int = Field(
        64,
        ge=1,
        description="tokens an answer may have when its request names no max_tokens, cut to the context its "
        "prompt leaves (an OpenAI chat request naming none goes on to max_new_tokens_limit instead, as OpenAI's "
        "goes on to the context's end)",
    )
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    # an empty key (a secret a template failed to fill in) is refused, not read as "no key": that opened the API
    api_key: str | None = Field(None, min_length=1, description="bearer token required by the API when set")
    allowed_hosts: list[str] | None = Field(
        None,
        description="Host names the API answers besides loopback ones (['*']: any); default: with no api_key on a "
        "loopback address, "
        "loopback names only (a web page pointing its own name at 127.0.0.1 is refused), else any. Behind a proxy "
        "that passes its Host, name the proxy's (RAGCACHE_ALLOWED_HOSTS='[\"rag.example.com\"]')",
    )
    public_paths: list[str] = Field(
        ["/health"],
        description="paths open without the token when api_key is set "
        '(RAGCACHE_PUBLIC_PATHS=\'["/health", "/metrics"]\')',
    )
    guard_rate: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="fraction of linked answers also linked with full "
        "after answering, to measure agreement (on ragcache's engine only in steps no user "
        "request needs; on vllm two one-token requests beside the users'); 0 = off",
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="seconds a client may take to send a request's line "
        "and headers, from connecting (or from the first byte of its next request on a "
        "kept-alive connection); then the connection is closed",
    )
    body_timeout_s: float = Field(
        30.0,
        gt=0,
        description="seconds a whole request body may take to arrive, from "
        "the end of its headers; then a 408 and the connection is closed",
    )
    max_bodies_mib: int = Field(
        2048,
        ge=1,
        description="MiB of request bodies a server process holds at once, counted as they arrive; past it a request "
        "is a 503 with Retry-After (at once where its declared length does not fit), the rest of its body not read: "
        "every client sending a largest body at once would otherwise hold max_connections times about 190 MiB",
    )
    keep_alive_s: float = Field(5.0, gt=0, description="seconds an idle connection stays open between requests")
    max_connections: int | None = Field(
        None,
        ge=1,
        description="open client connections per server process "
        "(default: the open-file limit less fd_reserve); at the cap a new one "
        "replaces the one waiting longest without a request, or is closed if "
        "every one has a request in flight",
    )
    fd_reserve: int = Field(
        256,
        ge=0,
        description="file descriptors per server process kept from client "
        "connections, for the store, model files, logs and threads",
    )
    max_queue: int = Field(32, ge=1, description="requests waiting for the engine before 429")
    max_per_client: int | None = Field(
        None,
        ge=1,
        description="requests one client (its address; behind a proxy the X-Forwarded-For it sets, see uvicorn's "
        "forwarded_allow_ips) may have waiting for or using the engine; past it that client alone gets 429 "
        "(default: a quarter of max_queue, at least 1: four busy clients fill the queue, a single one never does, "
        "and each may still stream several answers at once)",
    )
    max_tokenizing: int = Field(
        2,
        ge=1,
        description="queries whose raw texts are measured against the context at once, before admission (each "
        "takes a CPU core while it runs); up to max_queue more wait their turn, the next is a 429",
    )
    max_question_chars: int = Field(8_000, ge=1)
    max_document_chars: int = Field(200_000, ge=1)
    max_documents: int = Field(
        64,
        ge=1,
        description="documents in one request (POST /v1/documents, raw texts and "
        "ids of a query); more is a 413 before any is validated",
    )
    # the shape of every JSON body (documents, query, infill, completions, chat), checked before validation so that
    # no body costs more than bounded work, nor pydantic more than a bounded number of errors (api/shape.py)
    max_body_values: int = Field(
        200_000,
        ge=1,
        description="JSON values (objects, arrays, strings, numbers) in one "
        "request body, metadata included; the read stops at the first past it, a 413",
    )
    max_body_keys: int = Field(
        1_024, ge=1, description="keys in one JSON object of a request body (metadata included); more is a 413"
    )
    max_body_items: int = Field(
        10_000,
        ge=1,
        description="items in one JSON array of a request body (metadata "
        "included; `documents` is bounded by max_documents); more is a 413",
    )
    max_body_depth: int = Field(
        64, ge=2, le=256, description="objects and arrays nested in one another in a request body; deeper is a 422"
    )
    max_new_tokens_limit: int = Field(1024, ge=1)
    chat_max_new_tokens: int | None = Field(
        None,
        ge=1,
        description="tokens an OpenAI chat answer may have when its request names no max_tokens, cut to the "
        "context its prompt leaves (OpenAI's goes on to the context's end); default max_new_tokens_limit. Each such "
        "request reserves that many rows of KV cache on ragcache's engine: lower it to serve more at once",
    )

    @field_validator(*LinkKnobs.model_fields, mode="before")
    @classmethod
    def _knob_from_text(cls, value):
        """The environment and the config file give text; the knobs' numbers are strict (for JSON's sake)."""
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                number = json.loads(value)
                if isinstance(number, int | float) and not isinstance(number, bool):
                    return number
        return value

    @model_validator(mode="after")
    def _engine_options(self) -> Settings:
        if self.engine != "vllm" and (self.max_model_len or self.kv_cache_gib or self.tensor_parallel_size):
            raise ValueError(
                "max_model_len, kv_cache_gib and tensor_parallel_size are options of the vllm engine (engine=vllm)"
            )
        # (only on vllm: an engine config checks the device, which settings a plan reads need not have)
        if self.engine == "vllm" and (problem := self.engine_config().vllm_problem()):
            raise ValueError(problem)
        if self.engine == "vllm" and self.repair:  # every request would be refused for it
            raise ValueError(f"repair: {REPAIR_ON_VLLM}")
        if self.max_per_client is not None and self.max_per_client > self.max_queue:
            raise ValueError(
                f"max_per_client ({self.max_per_client}) is above max_queue ({self.max_queue}): one client "
                "could still take the whole queue"
            )
        # every request that leaves max_tokens out would be refused for a number it never named
        for name in ("max_new_tokens", "chat_max_new_tokens"):
            if (value := getattr(self, name)) is not None and value > self.max_new_tokens_limit:
                raise ValueError(f"{name} ({value}) is above max_new_tokens_limit ({self.max_new_tokens_limit})")
        named = self.adapter is not None and self.adapter.lower() not in ("none", INSTALLED)
        if self.engine == "vllm" and self.guard_rate and named and self.merge_adapter:
            raise ValueError(
                "the accuracy guard on the vllm engine needs the adapter unmerged (merge_adapter=false, "
                "--no-merge-adapter): a merged one leaves vLLM no base weights for the base model's full"
            )
        return self

    @property
    def client_limit(self) -> int:
        """max_per_client, or its default (see its description)."""
        return self.max_per_client or max(1, self.max_queue // 4)

    def engine_config(self) -> EngineConfig:
        vllm_args = {
            "max_model_len": self.max_model_len,
            "kv_cache_gib": self.kv_cache_gib,
            "tensor_parallel_size": self.tensor_parallel_size,
        }
        return EngineConfig(
            model=self.model,
            store=self.store,
            engine=self.engine,
            device=self.device,
            dtype=self.dtype,
            chunk_tokens=self.chunk_tokens,
            kv_codec=self.kv_codec,
            prefix_cache_bytes=self.prefix_cache_mib << 20,
            batch_invariant=self.batch_invariant,
            decode_graphs=self.decode_graphs,
            decode_compile=self.decode_compile,
            row_budget=self.row_budget,
            link_row_budget=self.link_row_budget,
            prefetch_bytes=None if self.prefetch_mib is None else self.prefetch_mib << 20,
            adapter=parse_adapter(self.adapter),
            merge_adapter=self.merge_adapter,
            vllm_args={k: v for k, v in vllm_args.items() if v is not None},
        )

    @classmethod
    def settings_customise_sources(
        cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, Toml(settings_cls, toml_file=config_path())


class Toml(TomlConfigSettingsSource):
    """ragcache.toml, whose keys must be settings: a misspelled one (`kv_codc`) would be read past, its value never
    used, with nothing said. (RAGCACHE_* variables that are no setting stay allowed: the environment is shared.)
    A file that is no TOML or cannot be read, or a RAGCACHE_CONFIG naming none, is a BadRequest naming it."""

    def __init__(self, settings_cls, toml_file: Path):
        try:
            if os.environ.get("RAGCACHE_CONFIG") and not toml_file.is_file():
                raise BadRequest(f"RAGCACHE_CONFIG={str(toml_file)!r}: no such file")
            super().__init__(settings_cls, toml_file=toml_file)
        except (ValueError, OSError) as exc:  # tomllib's TOMLDecodeError is a ValueError
            raise BadRequest(f"{toml_file}: {exc}") from None

    def __call__(self) -> dict:
        unknown = sorted(set(self.toml_data) - set(self.settings_cls.model_fields))
        if unknown:
            raise BadRequest(
                f"{self.toml_file_path}: {', '.join(map(repr, unknown))} is no setting; `ragcache config` lists them"
            )
        return super().__call__()


SECRET_SETTINGS = ("api_key", "store")  # values a settings error does not echo


def load_settings(**overrides) -> Settings:
    """The settings with these overrides (None: not given); BadRequest for a bad value, wherever it came from (a flag,
    RAGCACHE_*, ragcache.toml): pydantic's message names the field."""
    try:
        settings = Settings(**{k: v for k, v in overrides.items() if v is not None})
    except SettingsError as exc:
        # a RAGCACHE_* list or dict that is no JSON (its value is not echoed: it may be secret)
        raise BadRequest(
            f"{exc}: a list or table in RAGCACHE_* is JSON, as RAGCACHE_ALLOWED_HOSTS='[\"a.example\"]'"
        ) from None
    except ValidationError as exc:
        problem = exc.errors()[0]
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        if not problem["loc"]:  # a check across fields: its input is every setting, the API key among them
            raise BadRequest(f"{problem['msg'].removeprefix('Value error, ')}{more}") from None
        field = ".".join(map(str, problem["loc"]))
        # a secret (the API key, a store URL's password) is not echoed into a service's log
        got = "" if problem["loc"][0] in SECRET_SETTINGS else f", got {reprlib.repr(problem.get('input'))}"
        raise BadRequest(
            f"{field}: {problem['msg']}{got}{more} (from a flag, RAGCACHE_{field.upper()} or ragcache.toml)"
        ) from None
    return settings
