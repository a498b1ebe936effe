"""Redis tier: an entry is split into parts of about 2 MiB plus a small manifest written last (the commit marker).

Layout under a prefix (default "ragcache"; `?prefix=NAME` in the URL picks another):

  {prefix}:entry:{KEY}             manifest, JSON: v, gen, size, parts, part_bytes, sha256 (the payload digest the
                                   entry carries in its header), tokens, nbytes, dtype, shape, meta, created
  {prefix}:part:{KEY}:GEN:I        the I-th slice of the encoded entry, as written by one put (generation GEN)
  {prefix}:rec:NAME                a record (document text, chunk ids), JSON

The braces around KEY are a Redis Cluster hash tag: an entry's manifest and parts live in one slot (on a single
server they are just characters).

Write: the parts of every entry in one non-transactional pipeline, then the manifests (SET ... GET) in a second;
when a manifest replaced one of an older generation, the old parts are deleted. Parts of a new generation never
overwrite the parts a reader may be fetching, so a reader sees the old entry or the new one.
Read: one pipeline for the manifests, one for all their parts. An entry counts only if every part is there, the
sizes add up and the header digest is the manifest's (Redis under allkeys-lru evicts parts independently); else it
is a miss and its remains are deleted. The payload checksum itself is verified by `decode`, as for every tier.
A writer killed between parts and manifest leaves orphan parts: invisible, reclaimed by eviction or `gc()`.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import parse_qsl, urlencode

import redis
import redis.cluster
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from .base import DEFAULT_PREFIX, BlobStore, RecordCheck, TierUnavailable, UnreadableRecord, batched, log
from .entry import HEADER, MAGIC, MAX_ENTRY_BYTES, describe_head
from .errors import StoreError
from .tiers import redact_url

PART_BYTES = 2 << 20
MAX_PARTS = 1 << 16  # 128 GiB at PART_BYTES; a manifest claiming more is planted (every read names each part)
MANIFEST_VERSION = 1
SOCKET_TIMEOUT_S = 2.0  # per socket read: a 2 MiB part arrives in milliseconds on a live server
CONNECT_TIMEOUT_S = 2.0
ORPHAN_AGE_S = 600.0
# what a manifest keeps of describe_head's summary
SUMMARY = ("sha256", "tokens", "nbytes", "dtype", "codec", "shape", "meta")

_UNAVAILABLE = (RedisConnectionError, RedisTimeoutError, RedisClusterException, OSError)

# Delete a manifest only if it still is the one we read: a writer may have committed a new generation since.
_DELETE_IF_SAME = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class RedisStore(BlobStore):
    name = "redis"
    probed = True

    def __init__(
        self,
        url: str,
        *,
        prefix: str | None = None,
        part_bytes: int = PART_BYTES,
        socket_timeout: float = SOCKET_TIMEOUT_S,
        connect_timeout: float = CONNECT_TIMEOUT_S,
        connect: bool = True,
    ):
        """connect=False defers the first connection to the first call (a tiered store must open while Redis is
        down); with connect=True an unreachable server fails here with a StoreError."""
        super().__init__()
        url, options = _take_options(url, ("prefix",))
        self.prefix = prefix or options.get("prefix") or DEFAULT_PREFIX
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.prefix):
            raise StoreError(f"redis tier: prefix {self.prefix!r} must be letters, digits, '_', '.' or '-'")
        if part_bytes < 1:
            raise StoreError(f"redis tier: part_bytes must be >= 1, got {part_bytes}")
        self._url = url
        self.url = redact_url(url)
        self.part_bytes = part_bytes
        self._client_options = dict(
            socket_timeout=socket_timeout,
            socket_connect_timeout=connect_timeout,
            # one quick reconnect after a dropped connection (a server restart); never
            # after a timeout: a frozen server would cost every call twice the timeout
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        )
        self._client: redis.Redis | redis.cluster.RedisCluster | None = None
        self._connect_lock = threading.Lock()
        self.cluster = False
        if connect:
            self._redis()

    @classmethod
    def from_url(cls, spec: str, connect: bool = True, device=None) -> RedisStore:
        return cls(spec, connect=connect)

    # -- connection ---------------------------------------------------------------------------------
    def _redis(self):
        if self._client is not None:
            return self._client
        with self._connect_lock, self._errors("connect"):
            if self._client is None:
                try:
                    client = redis.Redis.from_url(self._url, **self._client_options)
                except ValueError as exc:
                    raise StoreError(f"redis tier: bad URL {self.url}: {exc}") from exc
                try:
                    cluster = int(client.info("cluster").get("cluster_enabled", 0)) == 1
                except ResponseError:  # INFO renamed away (some managed services): assume a single server
                    client.ping()
                    cluster = False
                if cluster:
                    client.close()
                    client = redis.cluster.RedisCluster.from_url(self._url, **self._client_options)
                self.cluster = cluster
                _warn_if_evicting(client, self.url)
                self._delete_if_same = client.register_script(_DELETE_IF_SAME)
                self._client = client  # last: other threads use it as soon as it is set
        return self._client

    @contextmanager
    def _errors(self, what: str):
        try:
            yield
        except StoreError:
            raise
        except _UNAVAILABLE as exc:
            raise TierUnavailable(f"redis tier {self.url}: {what} failed, server unreachable ({exc})") from exc
        except RedisError as exc:
            raise StoreError(f"redis tier {self.url}: {what} failed ({exc})") from exc

    def ping(self) -> bool:
        try:
            with self._errors("ping"):
                return bool(self._redis().ping())
        except StoreError:
            return False

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    # -- names --------------------------------------------------------------------------------------
    def _manifest_name(self, key: str) -> str:
        return f"{self.prefix}:entry:{{{key}}}"

    def _part_name(self, key: str, gen: str, i: int) -> str:
        return f"{self.prefix}:part:{{{key}}}:{gen}:{i}"

    def _record_name(self, name: str) -> str:
        return f"{self.prefix}:rec:{name}"

    def _part_names(self, key: str, manifest: dict) -> list[str]:
        return [self._part_name(key, manifest["gen"], i) for i in range(manifest["parts"])]

    # -- blobs --------------------------------------------------------------------------------------
    def _manifests(self, keys: list[str]) -> list[tuple[bytes | None, dict | None]]:
        """(raw manifest, parsed manifest or None when unusable) per key; one pipeline."""
        pipe = self._redis().pipeline(transaction=False)
        for key in keys:
            pipe.get(self._manifest_name(key))
        return [(raw, None if raw is None else _parse_manifest(raw)) for raw in pipe.execute()]

    def _fetch(self, keys: list[str]) -> list[tuple[bytearray | None, str | None, bytes | None, dict | None]]:
        """Per key: (blob or None, problem or None, raw manifest, manifest). An entry found incomplete is read once
        more: a writer that replaced it between the manifest's read and its parts' deleted the parts read for (a
        reader sees the old entry or the new one, not a miss)."""
        fetched = self._fetch_once(keys)
        torn = [i for i, (_, problem, _, _) in enumerate(fetched) if problem is not None]
        if torn:
            for i, again in zip(torn, self._fetch_once([keys[i] for i in torn])):
                if again[2] != fetched[i][2]:  # another manifest: the entry was rewritten
                    fetched[i] = again
        return fetched

    def _fetch_once(self, keys: list[str]) -> list[tuple[bytearray | None, str | None, bytes | None, dict | None]]:
        """`_fetch`'s one read: two pipelines in all."""
        manifests = self._manifests(keys)
        pipe = self._redis().pipeline(transaction=False)
        for key, (_, manifest) in zip(keys, manifests):
            for name in self._part_names(key, manifest) if manifest else ():
                pipe.get(name)
        parts = iter(pipe.execute(raise_on_error=False)) if len(pipe) else iter(())
        return [
            (None, None, None, None) if raw is None else (*_assembled(manifest, parts), raw, manifest)
            for raw, manifest in manifests
        ]

    def touch(self, keys: list[str]) -> None:
        """TOUCH refreshes what an allkeys-lru Redis evicts by: an entry's manifest and every one of its parts. A
        server that cannot be reached raises TierUnavailable, as a read would."""
        with self._errors("touch"):
            manifests = self._manifests(keys)
            pipe = self._redis().pipeline(transaction=False)
            for key, (_, manifest) in zip(keys, manifests):
                if manifest is not None:  # one slot per entry: one command each
                    pipe.touch(self._manifest_name(key), *self._part_names(key, manifest))
            if len(pipe):
                pipe.execute()

    def read_blobs(self, keys: list[str]) -> list[bytes | bytearray | None]:
        with self._errors("read"):
            fetched = self._fetch(keys)
            for key, (_, problem, raw, manifest) in zip(keys, fetched):
                if problem is not None:
                    assert raw is not None  # a problem is found only in an entry whose manifest was read
                    self.metrics.add(incomplete=1)
                    log.warning(
                        "redis tier: entry %s is incomplete (%s); dropping it (it will be recompiled)",
                        key[:12],
                        problem,
                    )
                    self._drop_remains(key, raw, manifest)
            return [blob for blob, *_ in fetched]

    def read_raw(self, keys: list[str]) -> list[bytes | bytearray | str | None]:
        with self._errors("read"):
            return [problem if problem is not None else blob for blob, problem, _, _ in self._fetch(keys)]

    def _drop_remains(self, key: str, raw: bytes, manifest: dict | None) -> None:
        """Best effort: a cleanup refused (a read-only replica, an ACL without DEL) must not fail the read whose
        other entries were fetched, nor mark the tier down."""
        try:
            if manifest is not None:
                self._redis().delete(*self._part_names(key, manifest))  # one slot: one command
            self._delete_if_same(keys=[self._manifest_name(key)], args=[raw])
        except RedisError as exc:
            log.warning("redis tier: could not drop the remains of entry %s: %s", key[:12], exc)

    def write_blobs(self, blobs: dict[str, bytes]) -> None:
        if not blobs:
            return
        with self._errors("write"):
            client = self._redis()
            gen = f"{int(time.time()):08x}{secrets.token_hex(3)}"  # time first: gc() can tell old orphans
            plans = {key: self._plan(key, gen, blob) for key, blob in blobs.items()}
            pipe = client.pipeline(transaction=False)
            for key, (_manifest, slices) in plans.items():
                for i, piece in enumerate(slices):
                    pipe.set(self._part_name(key, gen, i), piece)
            results = iter(pipe.execute(raise_on_error=False))
            failed: dict[str, Exception] = {}
            for key, (_manifest, slices) in plans.items():
                errors = [r for r in (next(results) for _ in slices) if isinstance(r, Exception)]
                if errors:
                    failed[key] = errors[0]
            for key in failed:  # leave nothing half written behind
                self._delete_quietly(self._part_names(key, plans[key][0]))
            pipe = client.pipeline(transaction=False)
            committed = [key for key in plans if key not in failed]
            for key in committed:
                pipe.set(self._manifest_name(key), json.dumps(plans[key][0]), get=True)
            stale = []
            for key, old in zip(committed, pipe.execute(raise_on_error=False)):
                if isinstance(old, Exception):
                    failed[key] = old
                    self._delete_quietly(self._part_names(key, plans[key][0]))
                    continue
                previous = _parse_manifest(old) if old is not None else None
                if previous is not None and previous["gen"] != gen:
                    stale.extend(self._part_names(key, previous))
            if stale:
                self._delete_quietly(stale)
            if failed:
                key, exc = next(iter(failed.items()))
                if isinstance(exc, _UNAVAILABLE):
                    raise exc
                raise StoreError(
                    f"redis tier {self.url}: cannot write {len(failed)} of {len(blobs)} entries "
                    f"(first: {key[:12]}: {exc})"
                ) from exc

    def _plan(self, key: str, gen: str, blob: bytes) -> tuple[dict, list[memoryview]]:
        view = memoryview(blob)
        if (parts := part_count(len(blob), self.part_bytes)) > MAX_PARTS:  # its readers would refuse its manifest
            raise StoreError(
                f"redis tier: an entry of {len(blob)} bytes would take {parts} parts of part_bytes "
                f"{self.part_bytes}, more than {MAX_PARTS}: raise part_bytes"
            )
        slices = [view[i * self.part_bytes : (i + 1) * self.part_bytes] for i in range(parts)]
        info = describe_head(view)
        return {
            "v": MANIFEST_VERSION,
            "gen": gen,
            "size": len(blob),
            "parts": len(slices),
            "part_bytes": self.part_bytes,
            **{field: info[field] for field in SUMMARY},
            "created": time.time(),
        }, slices

    def _delete_quietly(self, names: list[str]) -> None:
        """Best-effort cleanup, one command per slot group (cluster DEL must stay within a slot)."""
        try:
            pipe = self._redis().pipeline(transaction=False)
            for name in names:
                pipe.delete(name)
            pipe.execute(raise_on_error=False)
        except (RedisError, RedisClusterException, OSError) as exc:
            log.debug("redis tier: cleanup of %d keys failed (%s)", len(names), exc)

    def contains_many(self, keys: list[str]) -> list[bool]:
        """Present = a manifest and every one of its parts (not the bytes: that is a read)."""
        with self._errors("lookup"):
            return [whole for _, _, whole in self._presence(keys)]

    def _presence(self, keys: list[str]) -> list[tuple[bytes | None, dict | None, bool]]:
        """Per key: (raw manifest, manifest, whether every part of that manifest is there). Whole or not is said of
        the manifest read here: a writer may have replaced it since, and only that one's parts are its to judge."""
        manifests = self._manifests(keys)
        pipe = self._redis().pipeline(transaction=False)
        for key, (_, manifest) in zip(keys, manifests):
            if manifest:
                pipe.exists(*self._part_names(key, manifest))
        counts = iter(pipe.execute()) if len(pipe) else iter(())
        return [
            (raw, manifest, next(counts) == manifest["parts"] if manifest else False) for raw, manifest in manifests
        ]

    def delete(self, key: str) -> bool:
        with self._errors("delete"):
            ((raw, manifest),) = self._manifests([key])
            if raw is None:
                return False
            names = [self._manifest_name(key), *(self._part_names(key, manifest) if manifest else [])]
            return self._redis().delete(*names) > 0

    def _scan(self, match: str) -> Iterator[bytes]:
        with self._errors("scan"):
            yield from self._redis().scan_iter(match=match, count=1000)

    def _names(self, match: str) -> Iterator[str]:
        """The names `match` finds, as text; one that is not UTF-8 was not written by ragcache (which writes text
        names) and is passed over, or one stray key would fail every listing, delete and gc."""
        for name in self._scan(match):
            try:
                yield name.decode()
            except UnicodeDecodeError:
                log.warning("redis tier: passing over key %r, which is not UTF-8 (not ragcache's)", name[:80])

    def keys(self) -> Iterator[str]:
        start = len(self.prefix) + len(":entry:{")
        return (name[start:-1] for name in self._names(f"{self.prefix}:entry:*"))

    def describe_many(self, keys: list[str]) -> list[dict | None]:
        with self._errors("lookup"):
            out: list[dict | None] = []
            for raw, manifest in self._manifests(keys):
                if raw is None:
                    out.append(None)
                elif manifest is None:
                    out.append({"error": "unreadable manifest", "size": 0})
                else:
                    out.append(
                        {
                            # .get: manifests written before a field was summarized lack it (summary_codec)
                            **{field: manifest.get(field) for field in (*SUMMARY, "size", "parts")},
                            "written": manifest.get("created"),
                        }
                    )  # the writer's clock
            return out

    # -- maintenance --------------------------------------------------------------------------------
    def gc(self, orphan_age_s: float = ORPHAN_AGE_S) -> dict:
        """Delete parts no manifest points to (a writer killed before its commit, an overwrite's leftovers) once
        older than orphan_age_s, and manifests that cannot be read or whose parts are gone."""
        live: dict[str, str] = {}  # key -> gen of its manifest
        broken = 0
        # a part's age is taken against the time before the keys are listed: one whose entry was written after the
        # listing (not in `live`) is younger than that, however long the manifest pass takes
        now = time.time()
        for batch in batched(list(self.keys()), 500):
            with self._errors("gc"):
                # one manifest read per key, judged and dropped alike: an entry written again between two reads
                # had its fresh parts deleted for the old manifest's missing ones
                for key, (raw, manifest, whole) in zip(batch, self._presence(batch)):
                    if whole and manifest is not None:
                        live[key] = manifest["gen"]
                    elif raw is not None:
                        self._drop_remains(key, raw, manifest)
                        broken += 1
        orphans = []
        part_re = re.compile(rf"{re.escape(self.prefix)}:part:\{{(?P<key>[^}}]*)\}}:(?P<gen>[0-9a-f]+):\d+")
        for name in self._scan(f"{self.prefix}:part:*"):
            m = part_re.fullmatch(name.decode(errors="replace"))  # a generation begins with its write's time
            if m and live.get(m["key"]) != m["gen"] and now - int(m["gen"][:8], 16) >= orphan_age_s:
                orphans.append(name)
        with self._errors("gc"):
            for names in batched(orphans, 1000):
                pipe = self._redis().pipeline(transaction=False)
                for name in names:
                    pipe.delete(name)
                pipe.execute()
        return {"broken_entries_removed": broken, "orphan_parts_removed": len(orphans)}

    # -- records ------------------------------------------------------------------------------------
    def get_record(self, name: str) -> dict | UnreadableRecord | None:
        return self.get_records([name])[0]

    def get_records(self, names: list[str], problem: RecordCheck | None = None) -> list[dict | UnreadableRecord | None]:
        if not names:
            return []
        with self._errors("read records"):
            pipe = self._redis().pipeline(transaction=False)  # one round trip; a cluster splits it per slot
            for name in names:
                pipe.get(self._record_name(name))
            raws = pipe.execute()
        return [_parse_record(name, raw) for name, raw in zip(names, raws)]

    def put_record(self, name: str, record: dict) -> None:
        with self._errors("write record"):
            self._redis().set(self._record_name(name), json.dumps(record))

    def delete_record(self, name: str) -> bool:
        with self._errors("delete record"):
            return self._redis().delete(self._record_name(name)) > 0

    def record_names(self, prefix: str = "") -> list[str]:
        start = len(self._record_name(""))
        pattern = self._record_name(re.sub(r"([*?\[\]\\])", r"\\\1", prefix)) + "*"  # glob characters escaped
        return sorted({name[start:] for name in self._names(pattern)})

    # -- operator view ------------------------------------------------------------------------------
    def stats(self) -> dict:
        with self._errors("stats"):
            client = self._redis()
            nodes = {"target_nodes": redis.cluster.RedisCluster.PRIMARIES} if self.cluster else {}
            memory, stats = _info(client, "memory", nodes), _info(client, "stats", nodes)
            keys = client.dbsize(**nodes)
        return {
            **super().stats(),
            "url": self.url,
            "prefix": self.prefix,
            "cluster": self.cluster,
            "server_keys": keys,
            "used_memory": memory.get("used_memory", 0),
            "maxmemory": memory.get("maxmemory", 0),
            "maxmemory_policy": memory.get("maxmemory_policy", ""),
            "server_hits": stats.get("keyspace_hits", 0),
            "server_misses": stats.get("keyspace_misses", 0),
            "server_evicted_keys": stats.get("evicted_keys", 0),
        }


def part_count(size: int, part_bytes: int) -> int:
    """The parts an entry of `size` bytes is written in: an empty one is one empty part."""
    return max(-(-size // part_bytes), 1)


_GENERATION = re.compile(r"[0-9a-f]{8}[0-9a-f]{6}", re.ASCII)  # a writer's time, then its random part (write_blobs)


def _text(s: str) -> bool:
    """Whether `s` is Unicode text (no lone surrogate, which JSON escapes can carry and UTF-8 cannot)."""
    try:
        s.encode()
    except UnicodeEncodeError:
        return False
    return True


def _parse_manifest(raw: bytes) -> dict | None:
    """A manifest, or None when it is unusable: its part count is the one its size and part size give, and at most
    MAX_PARTS (a manifest another writer of the Redis planted with a billion parts would have every read build a
    billion part names)."""
    try:
        manifest = json.loads(raw)
        size, part_bytes, parts = manifest.get("size"), manifest.get("part_bytes"), manifest.get("parts")
        if (
            manifest.get("v") != MANIFEST_VERSION
            or not isinstance(manifest.get("gen"), str)
            or not _GENERATION.fullmatch(manifest["gen"])
            or not all(isinstance(n, int) for n in (size, part_bytes, parts))
            or not 0 <= size <= MAX_ENTRY_BYTES
            or part_bytes < 1
            or parts != part_count(size, part_bytes)
            or parts > MAX_PARTS
            or not isinstance(manifest.get("sha256"), str)
            # what readers build names of, or fold into forms and keys (maintenance): text, or the manifest's
            # writer was not ragcache
            or not isinstance(meta := manifest.get("meta", {}), dict)
            or not all(isinstance(k, str) and isinstance(v, str) and _text(k + v) for k, v in meta.items())
        ):
            return None
        return manifest
    except (ValueError, UnicodeDecodeError, AttributeError, RecursionError):
        return None


def _assembled(manifest: dict | None, parts: Iterator) -> tuple[bytearray | None, str | None]:
    """An entry's bytes joined from its parts (the next ones of `parts`), or why they are unusable."""
    if manifest is None:
        return None, "unreadable manifest"
    got = [next(parts) for _ in range(manifest["parts"])]
    if missing := sum(not isinstance(p, bytes) for p in got):  # absent, or not a string (an error reply)
        return None, f"{missing} of {manifest['parts']} parts missing (evicted?)"
    blob = bytearray().join(got)  # a bytearray: decode's tensors are views of it
    if len(blob) != manifest["size"]:
        return None, f"parts hold {len(blob)} bytes, manifest says {manifest['size']}"
    if blob[len(MAGIC) : HEADER].hex() != manifest["sha256"]:
        return None, "parts do not match the manifest digest"
    return blob, None


def _info(client, section: str, nodes: dict) -> dict:
    """INFO section; a cluster answers per node: numbers are summed, the rest taken from one node."""
    info = client.info(section, **nodes)
    if info and all(isinstance(v, dict) for v in info.values()):
        merged: dict = {}
        for node in info.values():
            for k, v in node.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    merged[k] = merged.get(k, 0) + v
                else:
                    merged.setdefault(k, v)
        return merged
    return info


def _take_options(url: str, names: tuple[str, ...]) -> tuple[str, dict[str, str]]:
    """Remove ragcache's own query options from a Redis URL (redis-py would reject them)."""
    base, _, query_text = url.partition("?")  # not urlunsplit: it would turn unix:///path into unix:/path
    query = parse_qsl(query_text, keep_blank_values=True)
    ours = {k: v for k, v in query if k in names}
    rest = [(k, v) for k, v in query if k not in names]
    return base + (f"?{urlencode(rest)}" if rest else ""), ours


def _parse_record(name: str, raw: bytes | None) -> dict | UnreadableRecord | None:
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        log.warning("redis tier: record %s is unreadable (%s)", name, exc)
        return UnreadableRecord(f"redis tier: {exc}")


def _warn_if_evicting(client, url: str) -> None:
    """Document records (the texts) live in the same keyspace as entries and carry no TTL: under an allkeys-*
    policy Redis may evict them, and those documents are then gone. Entries are only a cache; records are not."""
    try:
        policy = client.config_get("maxmemory-policy").get("maxmemory-policy", "")
    except RedisError:  # CONFIG refused (managed services): nothing to check
        return
    if str(policy).startswith("allkeys"):
        log.warning(
            "redis tier %s: maxmemory-policy is %s, which may evict document records as well as cached entries; "
            "those documents would be lost. Use noeviction (writes fail when full, nothing is lost) or keep a "
            "disk tier beside Redis (memory+disk+redis) so records survive.",
            url,
            policy,
        )
