"""The store interface every tier implements, and the shared get/put bookkeeping (integrity, metrics)."""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from itertools import islice

from .entry import ChunkKV, decode, describe, encode
from .errors import CorruptEntry, StoreError

log = logging.getLogger("ragcache.store")

# the store's defaults (ragcache.settings re-exports them with every other default)
DEFAULT_MEMORY_BUDGET = 2 << 30
DEFAULT_DISK_BUDGET = 20 << 30
DEFAULT_PREFIX = "ragcache"  # of a Redis tier's keys
DEFAULT_RETRY_AFTER_S = 5.0  # a tiered store skips an unavailable tier this long, doubling up to the max
DEFAULT_MAX_RETRY_AFTER_S = 60.0
# a tier whose ping tells (Store.probed) is pinged while it is down instead: first this soon, then at most this
# often, so it is used again within about the max of answering, and no request waits on it meanwhile
DEFAULT_PROBE_S = 0.25
DEFAULT_MAX_PROBE_S = 2.0


@dataclass
class Backoff:
    """How long a failing store is left alone: `first` seconds once it fails, doubling up to `most` while each retry
    fails. Pure state: the caller passes its clock's time."""

    first: float = DEFAULT_RETRY_AFTER_S
    most: float = DEFAULT_MAX_RETRY_AFTER_S
    failing: bool = False  # from a failure until the store answers
    wait: float = 0.0  # the current wait
    until: float = 0.0  # no retry before it

    def failed(self, now: float, started: float | None = None) -> bool:
        """A call made at `started` (None: now) failed. False for a call under way when another one began the wait
        (calls failing together are one failure: only a retry lengthens the wait)."""
        if self.failing and (now if started is None else started) < self.until:
            return False
        self.wait = min(2 * self.wait, self.most) if self.failing else self.first
        self.failing, self.until = True, now + self.wait
        return True

    def answered(self) -> None:
        """The store answered: its next failure waits `first` again. A wait under way is kept (an answer to a call
        made before the failure does not end it)."""
        self.failing, self.wait = False, 0.0


SIZE_FORMS = "a size such as 512MiB or 16GiB (units B, KiB, MiB, GiB, TiB: binary, so GiB, not GB)"
_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"(\d{1,9}(?:\.\d{1,9})?)\s*([kmgt]ib|b)?", re.ASCII | re.IGNORECASE)


def parse_size(text: str) -> int | None:
    """A tier's budget as its URL writes it ("16GiB", "512MiB", "1.5TiB", a number of bytes): bytes, or None when
    the text is no such size (the caller's error names its tier and SIZE_FORMS)."""
    if (size := _SIZE.fullmatch(text.strip())) is None:
        return None
    return int(float(size.group(1)) * _UNITS[(size.group(2) or "").lower()]) or None


class TierUnavailable(StoreError):
    """A tier cannot be reached at all (Redis down, connection refused, timeout): a tiered store skips it for a while.

    A plain StoreError on a write (disk full, Redis out of memory) fails that write only."""

    public = "a tier of the document store cannot be reached; retry shortly"


@dataclass(frozen=True)
class UnreadableRecord:
    """What a tier gives for a record that is there but is not a JSON object (damaged, or planted): not absent, so
    the reader can say it is corrupt, and not a record, so nothing reads a field of it."""

    reason: str


RecordCheck = Callable[[str, dict], "str | None"]


@dataclass
class TierMetrics:
    hits: int = 0
    misses: int = 0
    corrupt: int = 0  # entries that failed their checksum / belonged to another key: dropped
    incomplete: int = 0  # entries with a part missing (Redis evicts parts independently): dropped
    unkept: int = 0  # entries a put could not keep (over the tier's budget, or no free span in its arena)
    evicted: int = 0  # entries dropped to stay within the tier's budget, the least recently used first
    bytes_read: int = 0
    bytes_written: int = 0
    gets: int = 0
    puts: int = 0
    get_seconds: float = 0.0
    put_seconds: float = 0.0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()  # tiers count from many threads at once (not a field: stats() copies those)

    def add(self, **counts: float) -> None:
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def read(self, started: float, hits: int, misses: int, nbytes: int) -> None:
        """One get_many that began at `started` (time.perf_counter)."""
        self.add(hits=hits, misses=misses, bytes_read=nbytes, gets=1, get_seconds=time.perf_counter() - started)

    def wrote(self, started: float, nbytes: int) -> None:
        self.add(puts=1, bytes_written=nbytes, put_seconds=time.perf_counter() - started)


class Store(ABC):
    """Chunk entries by key, plus small JSON records (documents). Every method takes batches."""

    name = "store"
    lasting = True  # keeps what it holds across a restart of the process
    # What a tiered store asks of its tiers, each declared by the tier's class (these defaults are disk's and Redis's):
    hands_out_copies = False  # keeps entries as the tensors a read may be handed (`peek`), in place of a slower tier's
    # keeps records in this process's memory, at most `record_budget_bytes` of text (None: all); in front of a lasting
    # tier they are a cache of its records, bounded, and filled only with what it lacks (`has_record`)
    records_in_memory = False
    record_budget_bytes: int | None = None
    # ping() says whether the tier answers (Redis): a tiered store pings it while it is down, and no call of a request
    # tries it meanwhile; a tier whose ping cannot tell (disk) is tried again by a call once its backoff has run
    probed = False
    # takes an entry still on a GPU (a compile's) and keeps or copies it itself (store/crossing.py); others are
    # handed it in host memory
    takes_device_entries = False

    budget_bytes = 0  # what a bounded tier (memory, GPU, disk) keeps at most, set by it

    def __init__(self) -> None:
        self.metrics = TierMetrics()

    @classmethod
    def from_url(cls, spec: str, connect: bool = True, device=None) -> Store:
        """The tier a store URL's piece names (store/tiers.py registers which class opens which scheme); `connect`
        False: one of several tiers, opened while its server may be down; `device`: the engine's, or None."""
        raise NotImplementedError(f"{cls.__name__} does not open from a store URL")

    # -- entries ------------------------------------------------------------------------------------
    @abstractmethod
    def get_many(self, keys: list[str]) -> list[ChunkKV | None]: ...

    @abstractmethod
    def put_many(self, items: dict[str, ChunkKV]) -> None: ...

    @abstractmethod
    def contains_many(self, keys: list[str]) -> list[bool]: ...

    @abstractmethod
    def delete(self, key: str) -> bool: ...

    @abstractmethod
    def keys(self) -> Iterator[str]: ...

    def __iter__(self) -> Iterator[str]:
        return self.keys()

    def get(self, key: str) -> ChunkKV | None:
        return self.get_many([key])[0]

    def put(self, key: str, entry: ChunkKV) -> None:
        self.put_many({key: entry})

    # -- records (document -> chunk keys, texts) ----------------------------------------------------------
    @abstractmethod
    def get_record(self, name: str) -> dict | UnreadableRecord | None: ...

    def get_records(self, names: list[str], problem: RecordCheck | None = None) -> list[dict | UnreadableRecord | None]:
        """Several records in one round trip where the tier can (Redis overrides this). `problem(name, record)` (what
        is wrong with a record, None if sound) lets a store of several tiers read past a copy that fails the reader's
        checks; one tier has no other copy to give, so it gives what it holds."""
        return [self.get_record(name) for name in names]

    def has_record(self, name: str) -> bool:
        return self.get_record(name) is not None

    @abstractmethod
    def put_record(self, name: str, record: dict) -> None: ...

    @abstractmethod
    def delete_record(self, name: str) -> bool: ...

    @abstractmethod
    def record_names(self, prefix: str = "") -> list[str]: ...

    # -- operator view ------------------------------------------------------------------------------
    def describe_many(self, keys: list[str]) -> list[dict | None]:
        """A summary per entry (tokens, tensor bytes, dtype, shape, meta, stored size, and `written`: when it was
        stored, in unix seconds, where the tier knows) without loading tensors where the tier can; None where the key
        is absent. Tiers override this with something cheaper than a full read."""
        return [None if e is None else {**describe(e), "size": e.nbytes} for e in self.get_many(keys)]

    def touch(self, keys: list[str]) -> None:  # noqa: B027 - a tier that evicts nothing has no order to refresh
        """Entries a faster tier in front of this one served: their place in this tier's eviction order refreshed as
        a read here would refresh it, so that what is read most is not what this tier evicts first. Absent keys are
        passed over; a tier that cannot be reached raises as a read would (the tiered store marks it down)."""

    def peek(self, keys: list[str]) -> list[ChunkKV | None]:
        """The entries as this tier keeps them, with no side effect (no LRU touch): a tier that `hands_out_copies`."""
        raise NotImplementedError(f"{self.name} tier keeps no copies to hand out")

    def check_many(self, keys: list[str]) -> list[str | None]:
        """Full integrity check with no side effect (nothing deleted, no LRU touch): None where the entry is sound,
        else what is wrong with it ("missing" where it is absent)."""
        raise NotImplementedError(f"{self.name} tier has no integrity check")

    def stats(self) -> dict:
        return {"tier": self.name, **asdict(self.metrics)}

    def _unkept(self, count: int) -> None:
        """Entries this tier could not keep reach their links from a slower tier: counted, and said once."""
        if count and not self.metrics.unkept:
            log.warning(
                "store tier %s (a budget of %.0f MiB) could not keep an entry: a link reads such entries from a "
                "slower tier; give it a larger budget in the store URL, each tier named (e.g. %s:%dGiB)",
                self.name,
                self.budget_bytes / (1 << 20),
                self.name,
                max(16, 2 * -(-self.budget_bytes >> 30)),
            )
        self.metrics.add(unkept=count)

    def ping(self) -> bool:
        return True

    def tier_states(self) -> list[tuple[str, bool]]:
        """(tier name, taken as up) for each tier, fastest first: a tiered store's view of its tiers (/health)."""
        return [(self.name, True)]

    def outages(self) -> int:
        """How many times one of its tiers has failed so far: a tiered store goes on without a tier that fails (and
        takes it back once it answers), so a pass that must have seen every tier compares this before and after.
        A single tier raises instead: none."""
        return 0

    def close(self) -> None:  # noqa: B027 - optional: a store that holds nothing open need not override it
        pass


class BlobStore(Store):
    """A tier that holds entries as bytes (disk, Redis): decoding, checksum and metrics live here once."""

    @abstractmethod
    def read_blobs(self, keys: list[str]) -> list[bytes | bytearray | None]:
        """The stored bytes per key (None where absent); a bytearray lets decode hand out tensors without a copy."""

    @abstractmethod
    def write_blobs(self, blobs: dict[str, bytes]) -> None: ...

    @abstractmethod
    def read_raw(self, keys: list[str]) -> list[bytes | bytearray | str | None]:
        """Like read_blobs but with no side effect: bytes, None (absent), or a str saying why the stored bytes are
        unusable (a tier-level problem such as a missing Redis part)."""

    def check_many(self, keys: list[str]) -> list[str | None]:
        out: list[str | None] = []
        for key in keys:  # one at a time: a verify pass over a big store must not hold it all in memory
            (blob,) = self.read_raw([key])
            if blob is None or isinstance(blob, str):
                out.append(blob or "missing")
                continue
            try:
                decode(key, blob)
                out.append(None)
            except CorruptEntry as exc:
                out.append(str(exc))
        return out

    def get_many(self, keys: list[str]) -> list[ChunkKV | None]:
        started = time.perf_counter()
        blobs = self.read_blobs(keys)
        out: list[ChunkKV | None] = []
        for key, entry in zip(keys, decode_all(keys, blobs)):
            if isinstance(entry, CorruptEntry):
                self.metrics.add(corrupt=1)
                log.warning("%s tier: %s; dropping it (it will be recompiled)", self.name, entry)
                try:
                    self.delete(key)
                except StoreError as exc:  # still a miss; the batch's other entries are good
                    log.warning("%s tier: the corrupt entry %s stays (%s)", self.name, key[:12], exc)
                entry = None
            out.append(entry)
        hits = sum(e is not None for e in out)
        self.metrics.read(started, hits, len(keys) - hits, sum(len(b) for b in blobs if b is not None))
        return out

    def put_many(self, items: dict[str, ChunkKV]) -> None:
        started = time.perf_counter()
        blobs = {key: encode(key, entry) for key, entry in items.items()}
        self.write_blobs(blobs)
        self.metrics.wrote(started, sum(len(b) for b in blobs.values()))


PARALLEL_DECODE_BYTES = 16 << 20


def decode_all(keys: list[str], blobs: list) -> list[ChunkKV | CorruptEntry | None]:
    """Decode (checksum first) every blob; several big ones on several threads: hashlib and the copies release the
    GIL, so a query's chunks verify in parallel. A pool per call: nothing left behind for a fork to inherit."""

    def one(i: int) -> ChunkKV | CorruptEntry | None:
        if blobs[i] is None:
            return None
        try:
            return decode(keys[i], blobs[i])
        except CorruptEntry as exc:
            return exc

    present = [i for i, b in enumerate(blobs) if b is not None]
    workers = min(len(present), os.cpu_count() or 1)
    if workers < 2 or sum(len(blobs[i]) for i in present) < PARALLEL_DECODE_BYTES:
        return [one(i) for i in range(len(blobs))]
    with ThreadPoolExecutor(workers, thread_name_prefix="ragcache-decode") as pool:
        return list(pool.map(one, range(len(blobs))))


def batched(items, size: int = 256):
    """Lists of up to `size` items (itertools.batched arrives with Python 3.12)."""
    rest = iter(items)
    while batch := list(islice(rest, size)):
        yield batch
