"""Tiers joined fastest first (memory + disk + redis): reads fall through and fill the faster tiers, writes go to all.

A tier that fails (Redis down, an unreadable disk) is marked down with one warning and skipped. A tier whose ping
tells (Redis) is pinged by a thread of the store's while it is down, on a short bounded backoff (probe_s doubling up
to max_probe_s), and taken back as soon as it answers, without any request waiting on it meanwhile; any other is
tried again by a call after a backoff (retry_after seconds, doubling up to max_retry_after while it keeps failing).
Once a tier answers it is announced back with one more line, and the records written while it was down are written
into it. A write that a tier refuses for its own reasons (disk full, Redis out of memory)
fails on that tier only, with one warning per streak; the write fails with StoreError only when no tier took it.
Entries that only a tier in this process's memory took, every lasting tier being down or refusing writes, are written
into the lasting tiers by a thread of the store's once they take writes again, from the tier that still holds them: a
disk that was full does not leave a compile's entries in memory, where a re-run compile finds them held and a restart
loses them.
"""

from __future__ import annotations

import itertools
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from . import crossing
from .base import (
    DEFAULT_MAX_PROBE_S,
    DEFAULT_MAX_RETRY_AFTER_S,
    DEFAULT_PROBE_S,
    DEFAULT_RETRY_AFTER_S,
    Backoff,
    RecordCheck,
    Store,
    TierUnavailable,
    UnreadableRecord,
    log,
)
from .entry import ChunkKV
from .errors import StoreError

try:  # redis errors escaping a tier (RedisStore wraps its own; this covers anything else built on redis-py)
    from redis.exceptions import RedisClusterException, RedisError

    _REDIS_FAULTS: tuple[type[BaseException], ...] = (RedisError, RedisClusterException)
except ImportError:  # pragma: no cover - redis is a dependency
    _REDIS_FAULTS = ()

FAULTS: tuple[type[BaseException], ...] = (StoreError, OSError, sqlite3.Error, *_REDIS_FAULTS)
# the most record text (documents' texts and chunk records) a memory tier keeps in front of lasting tiers
RECORD_CACHE_BYTES = 64 << 20
# entry keys noted per lasting tier that missed them; past it, the others are compiled again when a link needs them
ENTRIES_BEHIND_MAX = 1 << 16
CLOSE_WAIT_S = 10.0  # at close, for the write-behind to write what waits for a lasting tier
CLOSE_BATCH_WAIT_S = 5.0  # then for the batch under way to end
ENTRIES_BEHIND_BATCH = 16  # entries read from the tier holding them and written into the lagging one at a time
# an entry a faster tier served refreshes its place in the slower tiers' eviction order at most this often, and this
# many such entries are remembered: a hot entry costs the disk index a write a minute, not one a query
TOUCH_EVERY_S = 60.0
TOUCHED_MAX = 1 << 16


@dataclass
class TierState:
    backoff: Backoff
    reason: str = ""
    write_failing: bool = False
    write_retry_at: float = 0.0  # when a tier refusing writes is tried again with the entries it missed
    failures: int = 0  # calls that failed as the tier being unreachable, ever (Store.outages)

    @property
    def down(self) -> bool:
        return self.backoff.failing


def said(error: StoreError) -> StoreError:
    """`error` with its message for the client too: one made here of tier kinds, record names and what is damaged
    in the copies read (what a client retries for, or repairs by adding a text again), no tier's own words."""
    error.public = None
    return error


class TieredStore(Store):
    takes_device_entries = True  # each tier gets them as it takes them (put_many)

    def __init__(
        self,
        tiers: list[Store],
        retry_after: float = DEFAULT_RETRY_AFTER_S,
        max_retry_after: float = DEFAULT_MAX_RETRY_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
        probe_s: float = DEFAULT_PROBE_S,
        max_probe_s: float = DEFAULT_MAX_PROBE_S,
    ):
        super().__init__()
        if not tiers:
            raise StoreError("a tiered store needs at least one tier")
        self.tiers = list(tiers)
        self.name = "+".join(t.name for t in self.tiers)
        self.lasting = any(t.lasting for t in self.tiers)
        for tier in self.tiers:
            if self.lasting and tier.records_in_memory and tier.record_budget_bytes is None:
                tier.record_budget_bytes = RECORD_CACHE_BYTES  # a cache of the lasting tiers' records: bounded
        self.retry_after = retry_after
        self.max_retry_after = max(max_retry_after, retry_after)
        self.clock = clock
        self.probe_s, self.max_probe_s = probe_s, max(max_probe_s, probe_s)
        self.states = [TierState(Backoff(self.retry_after, self.max_retry_after)) for _ in self.tiers]
        self._lock = threading.Lock()
        self._prober: threading.Thread | None = None  # runs while a probed tier is down
        self._closed = threading.Event()
        # lasting tier -> records written while it was down: written there when it is back, so a store that others
        # read too (a shared Redis) does not miss documents uploaded during its outage. Kept in memory: after a
        # restart the other lasting tier still holds them, and only that tier stays behind.
        self._behind: dict[int, set[str]] = {}
        # records' writes and deletes, and a catch-up's read and write of one, one at a time (`_record_op`); a tier
        # that comes back during one is caught up after it (`_catch_ups`), not inside it: a delete's catch-up would
        # copy the record into the tier it just answered for from a tier the delete had not reached yet
        self._record_writes = threading.RLock()
        self._in_record_op = threading.local()
        self._catch_ups: set[int] = set()
        # entry deletes and the write-behind's batches, one at a time: a batch read before a delete is not written after
        self._entry_writes = threading.Lock()
        # lasting tier -> entry keys it missed while a faster tier took them (in order); `_write_behind` empties it
        self._entries_behind: dict[int, dict[str, None]] = {}
        self._behind_full_warned: set[int] = set()
        self._writing_behind: threading.Thread | None = None
        self._touched: OrderedDict[str, float] = OrderedDict()  # entry key -> when the slower tiers were last touched
        self._touches: dict[int, dict[str, None]] = {}  # tier an entry was read from -> keys to touch behind it
        self._touching: threading.Thread | None = None

    # -- fault handling -----------------------------------------------------------------------------
    def _usable(self, i: int) -> bool:
        state = self.states[i]
        return not state.down or (not self.tiers[i].probed and self.clock() >= state.backoff.until)

    def _call(self, i: int, fn, *args, write: bool = False):
        """(result, True) or (None, False) when tier i failed (and is now marked down or its write refused)."""
        started = self.clock()
        try:
            result = fn(*args)
        except FAULTS as exc:
            self._failed(i, exc, write, started)
            return None, False
        self._answered(i, write)
        return result, True

    def _answered(self, i: int, write: bool) -> None:
        state = self.states[i]
        if state.down or (write and state.write_failing):
            with self._lock:
                back = state.down
                if state.down:
                    log.warning("store tier %s is back", self.tiers[i].name)
                    state.backoff.answered()
                    state.reason = ""
                if write and state.write_failing:
                    log.warning("store tier %s accepts writes again", self.tiers[i].name)
                    state.write_failing, state.reason = False, ""
            if back or write:  # back, or taking writes again: what it missed meanwhile
                with self._lock:
                    self._catch_ups.add(i)
                    # and the tiers whose catch-up could not read what it missed from this one, while it was down
                    self._catch_ups.update(j for j, names in self._behind.items() if names and not self.states[j].down)
                self._run_catch_ups()
            self._start_write_behind()

    @contextmanager
    def _record_op(self) -> Iterator[None]:
        """A record's write, delete or catch-up, alone; the catch-ups of tiers it found back run after it."""
        depth = getattr(self._in_record_op, "depth", 0)
        try:
            with self._record_writes:
                self._in_record_op.depth = depth + 1
                try:
                    yield
                finally:
                    self._in_record_op.depth = depth
        finally:  # an op that raised (a tier failing) may be what noted a catch-up
            if not depth:
                self._run_catch_ups()

    def _run_catch_ups(self) -> None:
        if getattr(self._in_record_op, "depth", 0):
            return  # inside a record's write or delete: once it is over
        while True:
            with self._lock:
                if not self._catch_ups:
                    return
                i = self._catch_ups.pop()
            self._catch_up(i)

    def _catch_up(self, i: int) -> None:
        """Write into tier i the records that were written while it missed them (down, or refusing writes), from the
        other lasting tiers: this process's memory may hold a copy another worker has since replaced or deleted."""
        with self._lock:
            names = sorted(self._behind.pop(i, ()))
        for n, name in enumerate(names):
            with self._record_op():  # a delete or an upload of it meanwhile is not undone by an older copy
                record, answered = self._lasting_record(name, but=i)
                if record is None and answered:  # deleted since, everywhere else too
                    continue
                if record is None or not self._call(i, self.tiers[i].put_record, name, record, write=True)[1]:
                    with self._lock:  # a tier that could not be read, or i failing again: tried at i's next recovery
                        self._behind.setdefault(i, set()).update(names[n:])
                    log.warning("store tier %s could not catch up yet; it retries when it is back", self.tiers[i].name)
                    return
        if names:
            log.info(
                "store tier %s caught up with %d record(s) written while it was down", self.tiers[i].name, len(names)
            )

    def _lasting_record(self, name: str, but: int) -> tuple[dict | None, bool]:
        """A record from the first lasting tier other than `but` that holds it, and whether every one asked answered."""
        answered = True
        for j, tier in enumerate(self.tiers):
            if j == but or not tier.lasting:
                continue
            got, ok = self._call(j, tier.get_records, [name]) if self._usable(j) else (None, False)
            record = got[0] if ok and got else None
            if isinstance(record, dict):
                return record, True
            answered = answered and ok
        return None, answered

    def _failed(self, i: int, exc: BaseException, write: bool, started: float | None = None) -> None:
        """Tier i failed a call `started` then (None: now). Calls that were under way when another one marked the
        tier down fail with it: only a retry, a call made once the tier's retry time had come, doubles the wait."""
        state, name = self.states[i], self.tiers[i].name
        with self._lock:
            if write and isinstance(exc, StoreError) and not isinstance(exc, TierUnavailable):
                state.write_retry_at, state.reason = self.clock() + self.retry_after, str(exc)
                if not state.write_failing:  # the tier is up but refused this write (full): keep reading from it
                    log.warning("store tier %s refused a write: %s", name, exc)
                    state.write_failing = True
                return
            state.failures += 1
            was_down = state.down
            if not state.backoff.failed(self.clock(), started):
                return  # under way when the tier went down: no retry of it
            if was_down:  # a retry that failed again
                log.debug("store tier %s still down (%s); next try in %.1f s", name, exc, state.backoff.wait)
            else:
                again = "probing it" if self.tiers[i].probed else f"retrying in {state.backoff.wait:.1f} s"
                log.warning("store tier %s is down (%s); skipping it, %s", name, exc, again)
            state.reason = str(exc)
            if self.tiers[i].probed and self._prober is None and not self._closed.is_set():
                self._prober = threading.Thread(target=self._probe, name="ragcache-store-probe", daemon=True)
                self._prober.start()

    def _probe(self) -> None:
        """While a probed tier is down, ping it (probe_s after the outage began, the wait doubling up to
        max_probe_s) and take it back once it answers. The thread ends when no probed tier is down; the next outage
        starts another (both under the lock, so none is left unprobed)."""
        wait = self.probe_s
        while not self._closed.wait(wait):
            with self._lock:
                down = [i for i, s in enumerate(self.states) if s.down and self.tiers[i].probed]
                if not down:
                    self._prober = None
                    return
            for i in down:
                try:
                    if self._answers(i):
                        self._answered(i, write=False)
                except Exception:  # noqa: BLE001 - a catch-up's own bug: the prober goes on probing the others
                    log.exception("store tier %s: taking it back failed", self.tiers[i].name)
            wait = min(wait * 2, self.max_probe_s)
        with self._lock:
            self._prober = None

    def _answers(self, i: int) -> bool:
        try:
            return bool(self.tiers[i].ping())
        except Exception as exc:  # noqa: BLE001 - a ping that fails in any way is a tier still down
            log.debug("store tier %s: probe failed (%s)", self.tiers[i].name, exc)
            return False

    def _each(self, fn_name: str, *args, write: bool = False) -> list[tuple[int, Any]]:
        """Call a method on every usable tier; [(tier index, result)] for those that answered."""
        calls = [
            (i, self._call(i, getattr(tier, fn_name), *args, write=write))
            for i, tier in enumerate(self.tiers)
            if self._usable(i)
        ]
        return [(i, result) for i, (result, ok) in calls if ok]

    def _written(self, answers: list, what: str) -> None:
        if not answers:
            raise StoreError(f"no store tier could {what} ({self._reasons(self.tiers)})")

    def _reasons(self, tiers) -> str:
        """Why each of these tiers is not taking writes, as they last said."""
        return "; ".join(f"{t.name}: {s.reason or 'refused'}" for t, s in zip(self.tiers, self.states) if t in tiers)

    # -- entries ------------------------------------------------------------------------------------
    def _first(self, method: str, keys: list[str], fill: bool = False) -> list:
        """Per key, the first answer that is not empty, asking the tiers fastest first for the keys still missing;
        with `fill` (entries), what a slower tier had goes into the faster ones, and the answer is the fastest one's
        copy (`_filled`)."""
        out: list = [None] * len(keys)
        missing = list(range(len(keys)))
        for i, tier in enumerate(self.tiers):
            if not missing or not self._usable(i):
                continue
            got, ok = self._call(i, getattr(tier, method), [keys[j] for j in missing])
            if ok:
                found = {keys[j]: answer for j, answer in zip(missing, got) if answer}
                if found and fill:
                    self._touch_behind(i, list(found))
                    found = self._filled(i, found)
                for j in missing:
                    out[j] = found.get(keys[j], out[j])
                missing = [j for j in missing if keys[j] not in found]
        return out

    def get_many(self, keys: list[str]) -> list[ChunkKV | None]:
        self._start_write_behind()  # a server that only reads still writes what memory alone holds
        started = time.perf_counter()
        out = self._first("get_many", keys, fill=True)
        found = [e for e in out if e is not None]
        self.metrics.read(started, len(found), len(keys) - len(found), sum(e.nbytes for e in found))
        return out

    def _touch_behind(self, found_in: int, keys: list[str]) -> None:
        """Entries tier `found_in` served, made recent in the tiers behind it (Store.touch) by a thread of its own:
        each tier's LRU would otherwise see only the reads that reached it, and a slower tier would evict the most
        read entries first, the ones a faster tier always answers for, to be compiled again after a restart. Off the
        reader's thread: a hit in memory does not wait on the disk's index or on Redis."""
        if found_in == len(self.tiers) - 1:
            return
        now = self.clock()
        with self._lock:
            due = [key for key in keys if now - self._touched.get(key, -TOUCH_EVERY_S) >= TOUCH_EVERY_S]
            for key in due:
                self._touched[key] = now
                self._touched.move_to_end(key)
            while len(self._touched) > TOUCHED_MAX:
                self._touched.popitem(last=False)
            if not due or sum(map(len, self._touches.values())) >= TOUCHED_MAX or self._closed.is_set():
                return  # nothing due, or a tier behind so slow that touches pile up: these are let go
            self._touches.setdefault(found_in, {}).update(dict.fromkeys(due))
            if self._touching is None:
                self._touching = threading.Thread(target=self._touch, name="ragcache-store-touch", daemon=True)
                self._touching.start()

    def _touch(self) -> None:
        while True:
            with self._lock:
                if not self._touches or self._closed.is_set():
                    self._touching = None
                    return
                touches, self._touches = self._touches, {}
            for found_in, keys in touches.items():
                for i in range(found_in + 1, len(self.tiers)):
                    if self._usable(i) and not self.states[i].down:
                        self._call(i, self.tiers[i].touch, list(keys))  # a tier unreachable is marked down

    def _filled(self, found_in: int, entries: dict[str, ChunkKV]) -> dict[str, ChunkKV]:
        """What a slower tier had, put into the faster ones (best effort: a failure there only logs), nearest first:
        each takes the copy the tier behind it kept, so a GPU tier fills from the pinned memory tier at PCIe speed, not
        from a disk read's pageable buffer. The entries handed back are the fastest tier's copies (GPU memory, or a
        pinned arena that a link's copies and prefetch read asynchronously); where no tier kept one, the read's own."""
        for i in reversed(range(found_in)):
            tier = self.tiers[i]
            if not self._takes_writes(i) or not self._call(i, tier.put_many, entries, write=True)[1]:
                continue
            if tier.hands_out_copies:
                kept = tier.peek(list(entries))
                entries = {key: entry if k is None else k for (key, entry), k in zip(entries.items(), kept)}
        return entries

    def put_many(self, items: dict[str, ChunkKV]) -> None:
        """Into every tier that is up, fastest first, each in the form it keeps (`crossing.for_tier`: an entry still on
        a GPU crosses to host memory once). StoreError when none took them, and when a store with lasting tiers kept
        them only in memory: a reader in this process has them, but they end with it (a compile has lost its work)."""
        if not items:
            return
        started = time.perf_counter()
        took, host = [], dict[str, ChunkKV]()  # the tiers that took them; entries in host memory, by key
        for i, tier in enumerate(self.tiers):
            if not self._takes_writes(i):
                continue
            _, ok = self._call(i, tier.put_many, crossing.for_tier(tier.takes_device_entries, items, host), write=True)
            if ok:
                took.append(tier)
                if tier.hands_out_copies:  # the host copies a tier kept: what the slower tiers behind it take
                    kept = zip(items, tier.peek(list(items)))
                    host.update({key: k for key, k in kept if k is not None and not crossing.on_device(k)})
        self._written(took, f"store {len(items)} entries")
        self.metrics.wrote(started, sum(e.nbytes for e in items.values()))
        lasting = [tier for tier in self.tiers if tier.lasting]
        if lasting and not any(tier.lasting for tier in took):
            self._note_behind(list(items), [i for i, tier in enumerate(self.tiers) if tier.lasting])
            behind = StoreError(
                f"{len(items)} entries are kept only in this process's memory for now: no lasting tier took them "
                f"({self._reasons(lasting)}); they are written there once it takes writes again"
            )
            behind.public = (
                f"{len(items)} entries are kept only in the server's memory for now: no lasting tier of the document "
                "store took them; they are written there once it takes writes again"
            )
            raise behind

    def _note_behind(self, keys: list[str], missed: list[int]) -> None:
        """Entries only a tier in this process's memory took: `_write_behind` writes them into the lasting tiers that
        `missed` them. (Entries one lasting tier took and another missed are not: a copy that lasts exists, and a
        tier back from an outage is not flooded with the outage's entries.)"""
        for i in missed:
            with self._lock:
                behind = self._entries_behind.setdefault(i, {})
                room = max(ENTRIES_BEHIND_MAX - len(behind), 0)
                behind.update(dict.fromkeys(keys[:room]))
                over = len(keys) > room and i not in self._behind_full_warned
                self._behind_full_warned.update([i] if over else [])
            if over:
                log.warning(
                    "store tier %s has missed over %d entries; those past them are not written there later "
                    "(compiled again where a link needs them)",
                    self.tiers[i].name,
                    ENTRIES_BEHIND_MAX,
                )

    def _takes_writes(self, i: int) -> bool:
        """Whether tier i may be written now: up (or due a retry), and taking writes or due a try (a full disk is not
        sent every fill's and compile's entries, each encoded and evicted for, until its retry)."""
        state, now = self.states[i], self.clock()
        return self._usable(i) and (not state.write_failing or now >= state.write_retry_at)

    def _start_write_behind(self) -> None:
        with self._lock:
            if self._writing_behind is not None or self._closed.is_set():
                return
            if not any(keys and self._takes_writes(i) for i, keys in self._entries_behind.items()):
                return
            self._writing_behind = threading.Thread(
                target=self._write_behind, name="ragcache-store-write-behind", daemon=True
            )
            self._writing_behind.start()

    def _write_behind(self) -> None:
        """Write the entries the lasting tiers missed, a few at a time, from the tiers that still hold them (one no
        tier holds any more is dropped: compiled again where needed); ends when none is left to write, or when a
        write fails again (the tier's next recovery, or the next read after its retry time, starts it again)."""
        written: dict[int, int] = {}
        try:
            while not self._closed.is_set():
                with self._entry_writes:  # a delete of one of the batch waits for its write, and then deletes it
                    with self._lock:
                        ready = [i for i, keys in self._entries_behind.items() if keys and self._takes_writes(i)]
                        if not ready:  # ended in the block that decides it: a tier ready from now on starts another
                            self._writing_behind = None
                            return
                        i = ready[0]
                        batch = list(itertools.islice(self._entries_behind[i], ENTRIES_BEHIND_BATCH))
                    tier = self.tiers[i]
                    try:
                        entries = self._held_elsewhere(i, batch)
                        write = crossing.for_tier(tier.takes_device_entries, entries, {}) if entries else {}
                    except Exception as exc:  # noqa: BLE001 - not a tier's fault (a host copy): the next retry
                        log.exception("store tier %s: reading the entries it missed failed", tier.name)
                        self._failed(i, StoreError(f"writing the entries it missed failed: {exc}"), write=True)
                        return
                    if write:
                        if not self._call(i, tier.put_many, write, write=True)[1]:
                            return
                        written[i] = written.get(i, 0) + len(write)
                    with self._lock:
                        for key in batch:
                            self._entries_behind[i].pop(key, None)
        finally:
            with self._lock:
                if self._writing_behind is threading.current_thread():
                    self._writing_behind = None
            for i, n in written.items():
                log.info("store tier %s took %d entries it had missed", self.tiers[i].name, n)

    def _held_elsewhere(self, i: int, keys: list[str]) -> dict[str, ChunkKV]:
        """The entries of `keys` that tiers other than i hold, from the fastest that has each."""
        found: dict[str, ChunkKV] = {}
        for j, tier in enumerate(self.tiers):
            missing = [key for key in keys if key not in found]
            if j == i or not missing or not self._usable(j):
                continue
            read = tier.peek if tier.hands_out_copies else tier.get_many  # no hit counted, no LRU touch where it can
            got, ok = self._call(j, read, missing)
            found.update({key: entry for key, entry in zip(missing, got or ()) if ok and entry is not None})
        return found

    def entries_behind(self, wait_s: float = 0.0) -> int:
        """Entries a lasting tier still misses, after waiting up to wait_s for the write-behind under way."""
        thread = self._writing_behind
        if thread is not None and wait_s > 0:
            thread.join(wait_s)
        with self._lock:
            return sum(len(keys) for keys in self._entries_behind.values())

    def contains_many(self, keys: list[str]) -> list[bool]:
        """Held in any tier. A key only a faster tier holds, missed by a lasting tier that refused writes, is held
        too: asking is when the write-behind is tried again (a re-run compile finds it held and compiles nothing)."""
        self._start_write_behind()
        return [bool(there) for there in self._first("contains_many", keys)]

    def delete(self, key: str) -> bool:
        with self._entry_writes:
            with self._lock:
                for keys in self._entries_behind.values():
                    keys.pop(key, None)
            return any(bool(r) for _, r in self._each("delete", key, write=True))

    def keys(self) -> Iterator[str]:
        seen = set()
        for i, tier in enumerate(self.tiers):
            if not self._usable(i):
                continue
            names, ok = self._call(i, lambda t=tier: list(t.keys()))
            for key in names if ok else ():
                if key not in seen:
                    seen.add(key)
                    yield key

    def describe_many(self, keys: list[str]) -> list[dict | None]:
        return self._first("describe_many", keys)

    def check_many(self, keys: list[str]) -> list[str | None]:
        """Sound if every tier holding the entry holds it intact; else the first problem, named by tier."""
        out: list[str | None] = ["missing"] * len(keys)
        for i, got in self._each("check_many", keys):
            for j, problem in enumerate(got):
                if problem == "missing":
                    continue
                if problem is not None:
                    out[j] = f"{self.tiers[i].name}: {problem}" if out[j] in (None, "missing") else out[j]
                elif out[j] == "missing":
                    out[j] = None
        return out

    # -- records ------------------------------------------------------------------------------------
    def get_record(self, name: str) -> dict | UnreadableRecord | None:
        return self.get_records([name])[0]

    def get_records(self, names: list[str], problem: RecordCheck | None = None) -> list[dict | UnreadableRecord | None]:
        """Each record from the fastest lasting tier that has it (one batched read per tier, for what is still
        missing); None only where every lasting tier answered that it has none. Lasting tiers are asked first because
        they are what every worker shares: a copy in this process's memory may be of a document another worker has
        since deleted or replaced, so memory answers only for what the lasting tiers could not give: records while a
        tier that may hold them is down, and sound copies of records they hold damaged. Where a tier that may hold a
        record is down and no copy is found, the record is not "unknown" but "unavailable": TierUnavailable. A damaged
        copy (not a JSON object, or one that fails `problem`, the reader's checks) is read past, so a sound copy
        elsewhere replaces it; it is given back only where no tier holds a sound one."""
        out: list = [None] * len(names)
        damaged: dict[int, tuple[object, str]] = {}  # the first damaged copy read, and what is wrong with it
        todo = list(range(len(names)))
        unanswered: list[str] = []
        lasting = [i for i, tier in enumerate(self.tiers) if tier.lasting]
        others = [i for i, tier in enumerate(self.tiers) if not tier.lasting]
        for i in lasting + others:
            asked = todo if (unanswered or not lasting or i in lasting) else [j for j in todo if j in damaged]
            if not asked:
                continue
            tier = self.tiers[i]
            got, ok = self._call(i, tier.get_records, [names[j] for j in asked]) if self._usable(i) else ([], False)
            if not ok:
                unanswered.append(tier.name)
                continue
            for j, record in zip(asked, got):
                hurt = None if record is None else self._problem(names[j], record, problem)
                if hurt is not None:
                    damaged.setdefault(j, (record, hurt))
                elif record is not None:
                    out[j] = record
                    self._fill_record(i, names[j], record)
            todo = [j for j in todo if out[j] is None]
        if todo and unanswered:
            hurts = [f"{names[j]} ({damaged[j][1]})" for j in todo if j in damaged]
            raise said(
                TierUnavailable(
                    f"record(s) {', '.join(names[j] for j in todo[:3])} may be in store tier(s) "
                    f"{', '.join(unanswered)}, which are down"
                    + (f"; the copies read are damaged: {', '.join(hurts[:3])}" if hurts else "")
                )
            )
        for j in todo if lasting else ():  # in no lasting tier: a copy kept here would be another worker's past
            if j not in damaged:
                for i in others:
                    self._call(i, self.tiers[i].delete_record, names[j], write=True)
        for j, (record, _) in damaged.items():
            out[j] = record if out[j] is None else out[j]
        return out

    @staticmethod
    def _problem(name: str, record, problem: RecordCheck | None) -> str | None:
        if isinstance(record, UnreadableRecord):
            return record.reason
        if not isinstance(record, dict):
            return "not a JSON object"
        try:
            return None if problem is None else problem(name, record)
        except Exception as exc:  # noqa: BLE001 - a check that cannot read a record has found it damaged
            return f"unreadable by its reader ({type(exc).__name__}: {exc})"

    def _fill_record(self, found_in: int, name: str, record: dict) -> None:
        """A record a slower tier had goes into the faster ones; a memory tier, which only answers while the lasting
        tiers cannot, takes it only when it has none (serializing a long text again on every read costs more)."""
        for i in range(found_in):
            tier = self.tiers[i]
            if self._usable(i) and not (tier.records_in_memory and tier.has_record(name)):
                self._call(i, tier.put_record, name, record, write=True)

    def put_record(self, name: str, record: dict) -> None:
        """Records are the documents themselves, not a cache: when the store has a lasting tier (disk, Redis), one of
        them must take the record, or a restart would lose a document whose upload was acknowledged."""
        with self._record_op():
            self._put_record(name, record)

    def _put_record(self, name: str, record: dict) -> None:
        answers = self._each("put_record", name, record, write=True)
        lasting = [(i, r) for i, r in answers if self.tiers[i].lasting]
        if answers and not lasting and any(tier.lasting for tier in self.tiers):
            for i, _ in answers:  # not kept in memory either: it would seem stored until the restart
                self._call(i, self.tiers[i].delete_record, name, write=True)
            answers = []
        self._written(answers, f"store record {name}")
        answered = {i for i, _ in answers}
        missed = [i for i, tier in enumerate(self.tiers) if tier.lasting and i not in answered]
        while missed:
            # decided under the lock the probe takes the tier back with: a tier still down is noted for its
            # catch-up; one the probe took back since its write failed (its catch-up may have run already) is
            # written now, and noted in turn if that write fails too
            with self._lock:
                for i in missed:
                    if self.states[i].down or self.states[i].write_failing:
                        self._behind.setdefault(i, set()).add(name)
                missed = [i for i in missed if not self.states[i].down and not self.states[i].write_failing]
            missed = [i for i in missed if not self._call(i, self.tiers[i].put_record, name, record, write=True)[1]]

    def delete_record(self, name: str) -> bool:
        """Deleted from every tier, or TierUnavailable: a tier that is down keeps its copy, and would bring the
        record back into the others on a later read."""
        with self._record_op():
            answers = self._each("delete_record", name, write=True)
        missed = [self.tiers[i].name for i in range(len(self.tiers)) if i not in {j for j, _ in answers}]
        if missed:
            raise said(
                TierUnavailable(
                    f"record {name} may still be in store tier(s) {', '.join(missed)}, which did not answer; "
                    "delete it again when they are back"
                )
            )
        return any(bool(r) for _, r in answers)

    def record_names(self, prefix: str = "") -> list[str]:
        """The lasting tiers' names when they all answer (memory may still hold what another worker deleted), else
        every tier's that answered."""
        answers = self._each("record_names", prefix)
        lasting = [i for i, tier in enumerate(self.tiers) if tier.lasting]
        if lasting and set(lasting) <= {i for i, _ in answers}:
            answers = [(i, got) for i, got in answers if self.tiers[i].lasting]
        return sorted({name for _, got in answers for name in got})

    # -- operator view ------------------------------------------------------------------------------
    def stats(self) -> dict:
        tiers: list[dict] = []
        for i, (tier, state) in enumerate(zip(self.tiers, self.states)):
            try:
                info = tier.stats()
            except FAULTS as exc:
                info = {"tier": tier.name, "error": str(exc)}
            with self._lock:
                behind = len(self._entries_behind.get(i, ()))
            tiers.append({**info, "up": not state.down, "write_failing": state.write_failing, "entries_behind": behind})
        return {**super().stats(), "tiers": tiers}

    def ping(self) -> bool:
        return any(t.ping() for t in self.tiers)

    def close(self) -> None:
        """Write what the lasting tiers missed while they take writes (for up to CLOSE_WAIT_S), then close the tiers;
        what is left unwritten is said in the log, entries and records both."""
        deadline = time.monotonic() + CLOSE_WAIT_S
        self._start_write_behind()
        self._join(self._writing_behind, deadline)  # it ends by itself once nothing is left that a tier takes
        self._closed.set()
        # its batch under way ends before the tiers close under it, with time of its own past a drain that used all
        self._join(self._writing_behind, max(deadline, time.monotonic() + CLOSE_BATCH_WAIT_S))
        self._join(self._prober, deadline)  # a catch-up under way, writing into a tier about to close
        self._join(self._touching, deadline)
        left = self.entries_behind()
        if left:
            log.warning("%d entries only this process's memory held were not written into a lasting tier", left)
        with self._lock:
            records = {self.tiers[i].name: len(names) for i, names in self._behind.items() if names}
        for name, count in records.items():
            log.warning(
                "store tier %s misses %d document record(s) written while it was down: a process that reads only it "
                "does not see those documents until they are added again",
                name,
                count,
            )
        for tier in self.tiers:
            tier.close()

    @staticmethod
    def _join(thread: threading.Thread | None, deadline: float) -> None:
        if thread is not None and thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))

    def up(self) -> list[bool]:
        return [not s.down for s in self.states]

    def tier_states(self) -> list[tuple[str, bool]]:
        return [(tier.name, not state.down) for tier, state in zip(self.tiers, self.states)]

    def outages(self) -> int:
        return sum(state.failures for state in self.states)
