"""The connector's worker side: link one request with vLLM's own modules and write it into vLLM's paged cache."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections import Counter, OrderedDict

import numpy as np
import torch

from ragcache import linker, loaded, models
from ragcache.catalog import Catalog
from ragcache.compiler import PLAIN, Compiler, default_layout, sink_layout
from ragcache.engine import JoinedCache
from ragcache.errors import BadAdapter, StoreError
from ragcache.settings import DEFAULT_STORE
from ragcache.store import open_store
from ragcache.store.codec import native as native_kv_codec

from . import plugin
from .layers import VllmRunner
from .lora import LinkLora
from .spec import BadLinkSpec, Load

log = logging.getLogger("ragcache.vllm")

TAILS_KEPT = 256  # linked tails (under one block each) kept for exact repeats
LORAS_KEPT = 8


class LinkWorker:
    """What ragcache's engine holds for linking (runner, compilers, layouts, store), over vLLM's loaded model.

    Options (`kv_connector_extra_config`): `store` (a ragcache store URL), `kv_codec` (as `ragcache compile` used),
    `model_fingerprint` (else computed from the checkpoint with transformers, and kept in the model cache for
    its files: models.checkpoint_fingerprint; entries' keys name the model),
    `merged_adapter` (the link adapter folded into the served weights, lora.py)."""

    def __init__(self, vllm_config, options: dict):
        from transformers import AutoTokenizer

        config = vllm_config.model_config
        model = plugin.loaded_model(vllm_config)
        self.runner = VllmRunner(model, config.hf_config, config.dtype)
        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
        fingerprint = options.get("model_fingerprint") or models.checkpoint_fingerprint(config.model, config.dtype)
        lm = loaded.LoadedModel(config.model, model, tokenizer, fingerprint, loaded.tokenizer_fingerprint(tokenizer))
        # a tensor-parallel rank reads and writes its own heads' shards (whole entries serve it sliced)
        heads = self.runner.heads
        self.compiler = Compiler(lm, self.runner, options.get("kv_codec", "auto"), heads)
        self.prefix_compiler = Compiler(lm, self.runner, native_kv_codec(config.dtype), heads)
        self.agree = agree_across_ranks if self.runner.ranks > 1 else None
        # what this rank read from the store since the connector last took it (`take_read`), and its link's rows and times
        self.read: Counter[str] = Counter()
        self.timed: dict[str, float] = {}
        self.layouts = {"default": default_layout(tokenizer), "sink": sink_layout(tokenizer)}
        self.store_url, self.lm = options.get("store", DEFAULT_STORE), lm
        self._catalog: Catalog | None = None
        try:
            self.catalog  # noqa: B018 - opened now where it can be; a store down at start is opened at a link
        except StoreError as exc:
            log.warning("ragcache's store is not reachable yet (%s); linking retries it at each request", exc)
        # on CUDA the link runs on a stream of its own, beside vLLM's steps, and is complete when `load` returns
        self.stream = torch.cuda.Stream(self.runner.device) if self.runner.device.type == "cuda" else None
        self.tails: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        # the link adapters requests came with, by directory (or why one cannot be used: a message, not the
        # exception, whose traceback would keep the request that first raised it alive)
        self.loras: OrderedDict[str, LinkLora | str] = OrderedDict()
        # vLLM serves weights a link adapter was merged into: compiling takes its term back out
        merged = options.get("merged_adapter")
        if merged and self.runner.ranks > 1:
            raise ValueError(
                f"merged_adapter ({merged}) under tensor parallelism: a link adapter's terms are not split across "
                "ranks, merged or not; serve it at tensor_parallel_size 1"
            )
        self.unmerge = (
            LinkLora(
                merged,
                self.runner.layer_range,
                config.hf_config.num_hidden_layers,
                self.runner.shape.dtype,
                self.runner.device,
                sign=-1,
            )
            if merged
            else None
        )

    @property
    def catalog(self) -> Catalog:
        """The store's catalog, opened at the first call that finds the store up (StoreError until then), so a store
        that is down costs each link one connection attempt, not the worker rebuilt."""
        if self._catalog is None:
            store = open_store(self.store_url, device=self.runner.device)  # ragcache's tiers: gpu, pinned memory
            self._catalog = Catalog(store, self.lm.tokenizer, self.lm.tokenizer_fingerprint, 1)
        return self._catalog

    def close(self) -> None:
        """The store, closed (a tiered one says which entries reached no lasting tier; its connections and threads
        end), once vLLM shuts the connector down."""
        if self._catalog is not None:
            self._catalog.store.close()

    def load(self, load: Load, kv_caches: dict[str, torch.Tensor], block_size: int, queued=None) -> None:
        """`queued`: a CUDA event recorded on vLLM's stream when the link was handed over (async_load); else the
        link runs on vLLM's thread and waits for that thread's stream. Either way no kernel vLLM queued before can
        still be writing the blocks the link writes (vLLM schedules a step while the last one runs)."""
        if self.stream is not None:
            if queued is not None:
                self.stream.wait_event(queued)
            else:
                self.stream.wait_stream(torch.cuda.current_stream(self.runner.device))
        try:
            with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                self._load(load, kv_caches, block_size)
        finally:  # a link that raised may have queued writes to blocks vLLM recomputes next: they land first
            if self.stream is not None:
                self.stream.synchronize()

    @torch.inference_mode()
    def _load(self, load: Load, kv_caches: dict[str, torch.Tensor], block_size: int) -> None:
        """Write the request's linked positions [load.start, linked) into its blocks. vLLM's prefix cache keeps only
        whole blocks, so an exact repeat of a linked request asks for the linked part's last, partial block alone:
        that tail is kept from the first link and written again, instead of linking everything once more."""
        end = load.spec.linked
        tail_start = end // block_size * block_size
        name = (
            load.spec.salt,
            hashlib.sha256(np.asarray(load.token_ids[:end], dtype="<i8").tobytes()).hexdigest(),
            load.adapter,
        )
        tail = self.tails.get(name)
        if load.start >= tail_start and tail is not None:
            self.tails.move_to_end(name)
            keys, values = (t[:, :, load.start - tail_start :].to(self.runner.device) for t in tail)
            self.write(keys, values, load.start, load.block_ids, kv_caches, block_size)
            return
        cache = self.link(load)
        self.write(
            cache.keys[:, :, load.start : end],
            cache.values[:, :, load.start : end],
            load.start,
            load.block_ids,
            kv_caches,
            block_size,
        )
        if load.spec.nonce:  # a compile's, salted to be read once: kept, it would push users' tails out
            return
        # in host memory: on a GPU, vLLM sized its KV cache to the memory it saw, and up to TAILS_KEPT blocks of every
        # layer (half a GiB at an 8B shape) would come out of what it counted on
        self.tails[name] = (
            cache.keys[:, :, tail_start:end].to("cpu", copy=True),
            cache.values[:, :, tail_start:end].to("cpu", copy=True),
        )
        while len(self.tails) > TAILS_KEPT:
            self.tails.popitem(last=False)

    def link(self, load: Load) -> JoinedCache:
        """The request's joined cache with every position before the question linked (the question is vLLM's)."""
        spec = load.spec
        parts = spec.parts(load.token_ids)
        params = spec.params()
        algorithm = linker.algorithm(params.algorithm)
        layout = self.layouts[algorithm.layout]
        lead = list(layout.lead_ids)
        if any(ids[: len(lead)] != lead for ids in parts.chunk_ids):
            raise BadLinkSpec(f"every chunk must start with the layout's ids {lead}, as ragcache tokenizes them")
        chunks = [ids[len(lead) :] for ids in parts.chunk_ids]
        started = time.perf_counter()
        with self.runner.adapted(self.unmerge):  # compiling: the base model's entries
            parts.chunk_entries = self.ensure(chunks, self.compiler, layout, store=not load.relink)
            if parts.prefix_ids:
                parts.prefix_entry = self.ensure([parts.prefix_ids], self.prefix_compiler, PLAIN)[0]
        fetched = time.perf_counter()
        with self.runner.adapted(self.lora(load.adapter)):
            plan = linker.plan(self.runner, parts, params)
            rows = plan.rows[plan.rows < spec.linked]
            narrow = plan.narrow
            if narrow is not None:
                narrow.question_rows = narrow.question_rows[:0]
            if rows.numel():
                rows = linker.recompute(self.runner, plan.token_ids, rows, plan.cache, narrow)[1]  # those kept
        # every layer placed before vLLM's blocks read the cache whole: on CUDA an entry in host memory crosses on a
        # copy stream, and a link that recomputes no row (naive) never waited for it
        plan.cache.settle()
        # what the request's output reports (connector.LinkStats): vLLM computes the question itself
        self.timed = dict(
            recomputed=int(rows.numel()),
            fetch_s=fetched - started,
            rotate_s=plan.rotate_s,
            recompute_s=time.perf_counter() - fetched - plan.rotate_s,
        )
        return plan.cache

    def ensure(self, chunks: list[list[int]], compiler: Compiler, layout, store: bool = True) -> list:
        """The chunks' entries (this rank's heads), compiling what any rank misses, on every rank together; stored
        unless `store` is False."""
        try:
            catalog = self.catalog
        except StoreError:
            if self.agree is not None:  # the other ranks wait to hear whether this one read the store
                self.agree([True] * len(chunks), True)
            raise
        entries, report = catalog.ensure(chunks, compiler, layout, agree=self.agree, store=store)
        self.read.update(
            store_bytes=report.read_bytes,
            sliced=report.sliced,
            joined=report.joined,
            hits=report.hits,
            misses=len(chunks) - report.hits,
            compiled=report.compiled,
        )
        return entries

    def take_read(self) -> dict[str, float]:
        read, self.read, self.timed = {**self.read, **self.timed}, Counter(), {}
        return read

    def lora(self, path: str | None) -> LinkLora | None:
        """The request's LoRA as the connector computes it (BadAdapter: one it cannot compute, such as a task LoRA
        on the MLP; vLLM then prefills the request with it). Read once a directory, as vLLM reads a LoRA once while
        it keeps it: an adapter replaced in place is read again only by a new server."""
        if path is None:
            return None
        if self.runner.ranks > 1:  # the same on every rank: they all fall back together
            raise BadAdapter("a link adapter under tensor parallelism: its terms are not split across ranks")
        from vllm.lora.utils import get_adapter_absolute_path

        path = get_adapter_absolute_path(path)  # as vLLM resolves it: ~, relative paths, hub ids
        if path not in self.loras:
            try:
                self.loras[path] = LinkLora(
                    path,
                    self.runner.layer_range,
                    self.runner.config.num_hidden_layers,
                    self.runner.shape.dtype,
                    self.runner.device,
                )
            except BadAdapter as exc:
                self.loras[path] = str(exc)
            while len(self.loras) > LORAS_KEPT:
                self.loras.popitem(last=False)
        self.loras.move_to_end(path)
        found = self.loras[path]
        if isinstance(found, str):
            raise BadAdapter(found)
        return found

    def write(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        start: int,
        block_ids: list[int],
        kv_caches: dict[str, torch.Tensor],
        block_size: int,
    ) -> None:
        """K/V [layers, kv_heads, n, d] of positions start.. into the request's blocks, through each layer's own
        attention backend (so the paged layout, CPU or CUDA, is the backend's business)."""
        positions = torch.arange(start, start + keys.shape[2])
        blocks = torch.tensor(block_ids, dtype=torch.long)[positions // block_size]
        slots = (blocks * block_size + positions % block_size).to(self.runner.device)
        for index, layer in enumerate(self.runner.layers):
            attention = layer.self_attn.attn
            by_token = keys[index].transpose(0, 1).contiguous(), values[index].transpose(0, 1).contiguous()
            attention.impl.do_kv_cache_update(attention, *by_token, kv_caches[attention.layer_name], slots)


def agree_across_ranks(missing: list[bool], failed: bool) -> tuple[list[bool], bool]:
    """Catalog.ensure's `agree` for tensor-parallel ranks: a chunk missing on any rank, and a read failed on any."""
    import torch.distributed as dist
    from vllm.distributed import get_tp_group

    flags = torch.tensor([*missing, failed], dtype=torch.int32)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=get_tp_group().cpu_group)
    return [bool(f) for f in flags[:-1]], bool(flags[-1])
