"""Disk tier (the embedded default): one file per entry, an SQLite index, LRU eviction under a byte budget.

Crash safety: an entry is written to a temp file in the same directory, fsynced and renamed, so a reader
sees the old file or the new one, never half of one. Several processes may share a directory: renames are
atomic and the index is SQLite in WAL mode. The index is a cache of what is on disk (sizes and last access,
for eviction and stats): reads go to the files, a file the index lacks is added when it is read, a missing or
unreadable index is rebuilt from the files, and `gc()` reconciles the two.
"""

from __future__ import annotations

import errno
import json
import os
import sqlite3
import stat
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

from . import durable
from .base import DEFAULT_DISK_BUDGET, SIZE_FORMS, BlobStore, TierUnavailable, UnreadableRecord, log, parse_size
from .durable import TMP_SUFFIX, sync_folder
from .entry import MAX_ENTRY_BYTES, PROBE, describe_head, head_length
from .errors import BrokenStore, CorruptEntry, StoreError, UnknownStore

SUFFIX = ".kv"
INDEX_COLUMNS = ("key", "size", "last_access", "hits")
RECONCILE_EVERY_S = 60.0  # at most this often, a write over budget first re-reads the real file sizes
STALE_TEMP_S = 600.0  # a temp file untouched this long is a killed writer's (no write of an entry takes minutes)
EVICT_BATCH = 256  # least recently used rows read at a time while claiming


# SQLite's errors that tell of the moment (another process's lock, permissions, a full disk), not of the index: an
# index that fails with them may be sound and open in other processes, never to be deleted under them
_NOT_THE_FILE = tuple(
    "SQLITE_BUSY SQLITE_LOCKED SQLITE_CANTOPEN SQLITE_IOERR SQLITE_FULL SQLITE_READONLY SQLITE_PERM SQLITE_NOMEM "
    "SQLITE_PROTOCOL".split()
)


def _says_nothing_of_the_file(exc: sqlite3.Error) -> bool:
    return (getattr(exc, "sqlite_errorname", None) or "").startswith(_NOT_THE_FILE)


class DiskStore(BlobStore):
    name = "disk"

    def __init__(self, root: str | os.PathLike, budget_bytes: int = DEFAULT_DISK_BUDGET):
        super().__init__()
        self.root = Path(root)
        self.budget_bytes = budget_bytes
        self.entries_dir = self.root / "entries"
        self.records_dir = self.root / "records"
        self.index_path = self.root / "index.sqlite"
        try:
            for d in (self.entries_dir, self.records_dir):
                d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"disk tier {self.root}: cannot create the store directory ({exc.strerror})") from exc
        self._local = threading.local()
        self._reconciled_at = -float("inf")
        fresh = not self.index_path.exists()
        try:
            self._create_index()
            self._check_index()
        except sqlite3.DatabaseError as exc:  # not a database, malformed, or not ours: it is only a cache
            self._drop_connection()
            if _says_nothing_of_the_file(exc):
                raise StoreError(f"disk tier {self.root}: cannot open its index {self.index_path} ({exc})") from exc
            log.warning("disk tier %s: index unusable (%s); rebuilding it from the files", self.root, exc)
            try:
                for suffix in ("", "-wal", "-shm"):
                    Path(f"{self.index_path}{suffix}").unlink(missing_ok=True)
                self._create_index()
            except (OSError, sqlite3.Error) as again:
                raise StoreError(
                    f"disk tier {self.root}: cannot rebuild its index {self.index_path} ({again})"
                ) from again
            fresh = True
        if fresh and (added := self._reconcile_index()["index_rows_added"]):
            log.info("disk tier %s: index rebuilt from %d files", self.root, added)

    @classmethod
    def from_url(cls, spec: str, connect: bool = True, device=None) -> DiskStore:
        return cls(*cls.url_parts(spec))

    @staticmethod
    def url_parts(spec: str) -> tuple[str, int]:
        """`disk:PATH[?size=SIZE]` -> (PATH, its budget in bytes): an empty PATH is ./.ragcache, no size the
        default budget (past it the least recently used entries are evicted)."""
        path, _, query = spec[len("disk:") :].partition("?")
        path = os.path.expanduser(path)  # no shell expands a ~ after "disk:": left alone, it made a folder named ~
        if not query:
            return path or "./.ragcache", DEFAULT_DISK_BUDGET
        options = urllib.parse.parse_qs(query, keep_blank_values=True)
        sizes = options.pop("size", [])
        budget = parse_size(sizes[0]) if len(sizes) == 1 else None
        if options or budget is None:
            raise UnknownStore(f"store tier {spec!r}: a disk tier's one option is ?size=SIZE, {SIZE_FORMS}")
        return path or "./.ragcache", budget

    # -- index --------------------------------------------------------------------------------------
    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.index_path, timeout=30, isolation_level=None)
            try:
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=NORMAL")
            except sqlite3.Error:
                db.close()
                raise
            self._local.db = db
        return db

    def _drop_connection(self) -> None:
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None

    def _create_index(self) -> None:
        db = self._db()
        db.execute(
            "CREATE TABLE IF NOT EXISTS entries (key TEXT PRIMARY KEY, size INTEGER, last_access REAL, hits INTEGER DEFAULT 0)"
        )
        # eviction reads the least recently used first, on every write past the budget
        db.execute("CREATE INDEX IF NOT EXISTS entries_by_access ON entries (last_access)")

    def _check_index(self) -> None:
        """An index with another schema, or with sizes no entry file can have, would steer eviction wrong (one
        huge row evicts everything): refuse it, and the caller rebuilds it from the files."""
        columns = [row[1] for row in self._db().execute("PRAGMA table_info(entries)")]
        if columns != list(INDEX_COLUMNS):
            raise sqlite3.DatabaseError(f"entries table has columns {columns}, expected {list(INDEX_COLUMNS)}")
        (bad,) = (
            self._db()
            .execute(
                "SELECT COUNT(*) FROM entries WHERE typeof(size) != 'integer' OR size < 0 OR size > ? "
                "OR typeof(last_access) NOT IN ('real', 'integer')",
                (MAX_ENTRY_BYTES,),
            )
            .fetchone()
        )
        if bad:
            raise sqlite3.DatabaseError(f"{bad} index row(s) with impossible sizes or times")

    def _files(self) -> dict[str, tuple[int, float]]:
        """key -> (size, mtime) of every entry file (a file removed while listing is skipped)."""
        out = {}
        for path in self.entries_dir.glob(f"*/*{SUFFIX}"):
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue
            out[path.stem] = (stat.st_size, stat.st_mtime)
        return out

    def entry_path(self, key: str) -> Path:
        return self.entries_dir / key[:2] / f"{key}{SUFFIX}"

    # -- blobs --------------------------------------------------------------------------------------
    def _reads(self, keys: list[str]) -> Iterator[tuple[str, bytearray | OSError | None]]:
        """Per key, its bytes, None where it is absent, or the OSError that stopped the read."""
        for key in keys:
            try:
                yield key, _read(self.entry_path(key))
            except FileNotFoundError:
                yield key, None
            except OSError as exc:
                yield key, exc

    def read_blobs(self, keys: list[str]) -> list[bytes | bytearray | None]:
        out: list[bytes | bytearray | None] = []
        for key, blob in self._reads(keys):
            if isinstance(blob, OSError) and _damaged(blob):
                if not isinstance(blob, NotAnEntryFile):  # those are named where the empty bytes are refused
                    log.warning("disk tier %s: entry %s is unreadable (%s)", self.root, key[:12], blob.strerror)
                blob = bytearray()  # decode rejects empty bytes as corrupt: a miss, dropped, recompiled
            elif isinstance(blob, OSError):
                raise self._fault(f"cannot read entry {key[:12]}", blob) from blob
            out.append(blob)
        if found := [(key, len(blob)) for key, blob in zip(keys, out) if blob is not None]:
            self._touch(found)
        return out

    def _touch(self, found: list[tuple[str, int]]) -> None:
        """LRU bookkeeping for entries just read; adds a file the index lacks (a writer killed before indexing it).
        Best effort: a full disk or a locked index must not fail a read."""
        now = time.time()
        try:
            self._db().executemany(
                "INSERT INTO entries (key, size, last_access, hits) VALUES (?, ?, ?, 1) "
                "ON CONFLICT(key) DO UPDATE SET last_access = excluded.last_access, hits = hits + 1",
                [(key, size, now) for key, size in found],
            )
        except sqlite3.Error as exc:
            log.debug("disk tier %s: index not updated after a read (%s)", self.root, exc)

    def touch(self, keys: list[str]) -> None:
        now = time.time()
        try:
            self._db().executemany("UPDATE entries SET last_access = ? WHERE key = ?", [(now, key) for key in keys])
        except sqlite3.Error as exc:
            log.debug("disk tier %s: index not updated for entries read elsewhere (%s)", self.root, exc)

    def read_raw(self, keys: list[str]) -> list[bytes | bytearray | str | None]:
        """As read_blobs reads: a file that is damaged (`_damaged`) is a problem of its entry, said in a str; any
        other failure (an I/O error, a folder that cannot be read) is the tier's, TierUnavailable, so that `verify
        --fix` lists the tier as not verified instead of deleting sound entries during a passing fault."""
        out: list[bytes | bytearray | str | None] = []
        for key, blob in self._reads(keys):
            if isinstance(blob, OSError) and not _damaged(blob):
                raise TierUnavailable(f"disk tier {self.root}: cannot read entry {key[:12]} ({blob.strerror})")
            if isinstance(blob, OSError):
                kind = "not an entry file" if isinstance(blob, NotAnEntryFile) else "unreadable file"
                out.append(f"{kind}: {blob.strerror}")
            else:
                out.append(blob)
        return out

    def write_blobs(self, blobs: dict[str, bytes]) -> None:
        # an entry over the budget would evict every other and then itself
        kept = {key: blob for key, blob in blobs.items() if len(blob) <= self.budget_bytes}
        self._unkept(len(blobs) - len(kept))
        rows = []
        try:
            for key, blob in kept.items():
                self._replace_making_room(self.entry_path(key), blob, f"entry {key[:12]}")
                rows.append((key, len(blob), time.time()))
        finally:  # index what reached its place even when a later entry failed
            if rows:
                self._index(rows)
        self.evict()

    def _replace_making_room(self, path: Path, data: bytes, what: str, lasting: bool = False) -> None:
        """`_replace`, and on a full disk (the budget is more than the disk has) once more after evicting least
        recently used entries of the write's size: entries are a cache, and a document's record or a new entry
        must not fail while they fill the disk."""
        try:
            self._replace(path, data, what, lasting)
        except DiskFull:
            if not self._evict_lru(len(data)):
                raise
            self._replace(path, data, what, lasting)

    def _replace(self, path: Path, data: bytes, what: str, lasting: bool = False) -> None:
        """Write `data` to `path` whole or not at all: synced to a temp file, then renamed over it, so a crash
        leaves the old file or the new one, never an empty or torn one. `lasting` (records, which are acknowledged
        to the user): the folder is synced too, so the rename itself survives a power loss."""
        try:
            path.parent.mkdir(exist_ok=True)
            durable.write_file(path, data, lasting)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFull(f"disk tier {self.root}: cannot write {what} (disk full)") from exc
            raise self._fault(f"cannot write {what}", exc) from exc

    def _fault(self, what: str, exc: OSError) -> StoreError:
        if exc.errno == errno.ELOOP:  # only a symlink we never made can loop: the same call fails the same way again
            return BrokenStore(
                f"disk tier {self.root}: {what} (a symbolic link loop on its path, {exc.filename}; a "
                "retry cannot fix it: remove the link)"
            )
        return StoreError(f"disk tier {self.root}: {what} ({exc.strerror})")

    def _index(self, rows: list[tuple[str, int, float]]) -> None:
        try:
            self._db().executemany(
                "INSERT INTO entries (key, size, last_access) VALUES (?, ?, ?) "
                "ON CONFLICT(key) DO UPDATE SET size = excluded.size, last_access = excluded.last_access",
                rows,
            )
        except sqlite3.Error as exc:  # the files are in place and readable; the next read or gc() indexes them
            log.warning("disk tier %s: index not updated after a write (%s)", self.root, exc)

    def evict(self) -> int:
        """Drop least recently used entries until the directory fits its budget."""
        try:
            db = self._db()
            indexed_bytes = "SELECT COALESCE(SUM(size), 0) FROM entries"
            if db.execute(indexed_bytes).fetchone()[0] <= self.budget_bytes:
                return 0
            if time.monotonic() - self._reconciled_at > RECONCILE_EVERY_S:
                # Before deleting anything, trust the files over the index: a stale or planted row must not
                # make us evict entries the budget still has room for. Killed writers' temp files go first: no
                # index counts them, and a server killed now and then would fill the disk past its budget with them
                self._remove_temps(STALE_TEMP_S)
                self._reconcile_index()
        except (sqlite3.Error, StoreError) as exc:
            log.warning("disk tier %s: eviction skipped (%s)", self.root, exc)
            return 0
        removed = self._evict_lru(budget=self.budget_bytes)
        if removed:
            log.info("disk tier %s: evicted %d entries to stay under %d bytes", self.root, removed, self.budget_bytes)
        return removed

    def _evict_lru(self, nbytes: int = 0, budget: int | None = None) -> int:
        """Delete least recently used entries until `nbytes` of them are deleted, or while the index holds more than
        `budget`; the entries deleted. Rows are claimed (`_claim`) before their files are deleted, so writers
        evicting at once (threads, processes sharing the folder) share the overage instead of each freeing all of
        it, and none counts a file another deleted. A row without its file frees nothing but the index's count of
        it; a file that cannot be deleted (another user's) loses its row, so that eviction does not stop at it every
        time, and stays counted against the budget: the next round claims as much again."""
        removed, limit = 0, budget
        try:
            while nbytes > 0 or limit is not None:
                claimed = self._claim(nbytes, limit)
                if not claimed:
                    break
                for key, size in claimed:
                    try:
                        existed = self._unlink(key)
                    except StoreError as exc:
                        log.warning("disk tier %s: could not evict %s (%s)", self.root, key[:12], exc)
                        limit = None if limit is None else limit - size
                        continue
                    if existed:
                        nbytes -= size
                        removed += 1
                if limit is not None and limit == budget:  # every claimed file deleted: the index is within it
                    break
        except sqlite3.Error as exc:
            log.warning("disk tier %s: eviction stopped (%s)", self.root, exc)
        self.metrics.add(evicted=removed)
        return removed

    def _claim(self, nbytes: int, limit: int | None) -> list[tuple[str, int]]:
        """Least recently used rows taken out of the index, as many as make `nbytes`, or as bring it within `limit`:
        read and deleted under one write lock (BEGIN IMMEDIATE), the index's total read once."""
        db = self._db()
        db.execute("BEGIN IMMEDIATE")
        try:
            (over,) = db.execute("SELECT COALESCE(SUM(size), 0) FROM entries").fetchone()
            over = nbytes if limit is None else over - limit
            claimed: list[tuple[str, int]] = []
            while over > 0:
                rows = db.execute(
                    "SELECT key, size FROM entries ORDER BY last_access ASC LIMIT ?", (EVICT_BATCH,)
                ).fetchall()
                taken = []
                for key, size in rows:
                    if over <= 0:
                        break
                    taken.append((key, size))
                    over -= size
                if not taken:
                    break
                db.executemany("DELETE FROM entries WHERE key = ?", [(key,) for key, _ in taken])
                claimed += taken
            db.execute("COMMIT")
            return claimed
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise

    def contains_many(self, keys: list[str]) -> list[bool]:
        try:  # exists() raises for what is not a missing file (EACCES, EIO)
            return [self.entry_path(k).exists() for k in keys]
        except OSError as exc:
            raise self._fault("cannot look up entries", exc) from exc

    def delete(self, key: str) -> bool:
        existed = self._unlink(key)
        try:
            self._db().execute("DELETE FROM entries WHERE key = ?", (key,))
        except sqlite3.Error as exc:  # a stale row only skews sizes until gc()
            log.debug("disk tier %s: index row of %s not removed (%s)", self.root, key[:12], exc)
        return existed

    def _unlink(self, key: str) -> bool:
        """Its entry file removed; whether there was one."""
        path = self.entry_path(key)
        try:
            path.unlink()
            return True
        except FileNotFoundError:
            return False
        except IsADirectoryError:  # never ours: leave it for an operator, but do not fail the read that found it
            log.warning("disk tier %s: %s is a directory, not an entry; ignoring it", self.root, path)
            return False
        except OSError as exc:
            raise self._fault(f"cannot delete entry {key[:12]}", exc) from exc

    def keys(self) -> Iterator[str]:
        try:
            for path in self.entries_dir.glob(f"*/*{SUFFIX}"):
                yield path.stem
        except OSError as exc:
            raise self._fault("cannot list entries", exc) from exc

    def describe_many(self, keys: list[str]) -> list[dict | None]:
        out: list[dict | None] = []
        for key in keys:
            try:
                with _open_regular(self.entry_path(key)) as fh:
                    info = os.fstat(fh.fileno())
                    out.append({**describe_head(_head(fh)), "size": info.st_size, "written": info.st_mtime})
            except FileNotFoundError:
                out.append(None)
            except Exception as exc:  # noqa: BLE001 - unreadable header: report it rather than fail a listing
                out.append({"error": str(exc), "size": self._size(key)})
        return out

    def _size(self, key: str) -> int:
        try:
            return self.entry_path(key).stat().st_size
        except OSError:
            return 0

    # -- maintenance --------------------------------------------------------------------------------
    def gc(self, tmp_age_s: float = STALE_TEMP_S) -> dict:
        """Delete temp files older than tmp_age_s (left by killed writers), reconcile the index with the files
        (rows without a file dropped, files without a row added, sizes fixed), then evict to the budget."""
        tmp_removed = self._remove_temps(tmp_age_s)
        return {"tmp_files_removed": tmp_removed, **self._reconcile_index(), "evicted": self.evict()}

    def _remove_temps(self, age_s: float) -> int:
        """Delete temp files older than `age_s`; how many."""
        now, removed = time.time(), 0
        for path in [*self.entries_dir.glob(f"*/.*{TMP_SUFFIX}"), *self.records_dir.glob(f".*{TMP_SUFFIX}")]:
            try:
                if now - path.stat().st_mtime >= age_s:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:  # removed meanwhile
                continue
            except OSError as exc:  # another user's, say: the rest goes on
                log.warning("disk tier %s: cannot remove temp file %s (%s)", self.root, path, exc.strerror)
        return removed

    def _reconcile_index(self) -> dict:
        """Make the index say what the files say: rows without a file dropped, files without a row added, sizes fixed.
        StoreError when the files cannot be listed or the index written (read-only, full, locked past its timeout)."""
        try:
            files = self._files()
            db = self._db()
            db.execute("BEGIN IMMEDIATE")
        except (OSError, sqlite3.Error) as exc:
            raise StoreError(f"disk tier {self.root}: cannot reconcile its index with the files ({exc})") from exc
        try:
            indexed = dict(db.execute("SELECT key, size FROM entries").fetchall())
            # the files were listed before the index was locked: a writer may have written and indexed one since
            # (its row is no stale row), or an eviction deleted one (no row to add back); looked at again, now
            gone = [k for k in indexed if k not in files and not _there(self.entry_path(k))]
            added = [(k, size, mtime) for k, (size, mtime) in files.items() if k not in indexed]
            added = [row for row in added if _there(self.entry_path(row[0]))]
            resized = [(size, k) for k, (size, _) in files.items() if k in indexed and indexed[k] != size]
            db.executemany("DELETE FROM entries WHERE key = ?", [(k,) for k in gone])
            db.executemany("INSERT INTO entries (key, size, last_access) VALUES (?, ?, ?)", added)
            db.executemany("UPDATE entries SET size = ? WHERE key = ?", resized)
            db.execute("COMMIT")
        except sqlite3.Error as exc:
            if db.in_transaction:  # SQLite may have rolled back itself (a full disk, an I/O error)
                db.execute("ROLLBACK")
            raise StoreError(f"disk tier {self.root}: cannot reconcile its index with the files ({exc})") from exc
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        self._reconciled_at = time.monotonic()
        return {"index_rows_dropped": len(gone), "index_rows_added": len(added), "index_sizes_fixed": len(resized)}

    # -- records ------------------------------------------------------------------------------------
    def _record_path(self, name: str) -> Path:
        return self.records_dir / (name.replace("/", "__") + ".json")

    def get_record(self, name: str) -> dict | UnreadableRecord | None:
        try:
            with _open_regular(self._record_path(name)) as fh:
                # read(n) allocates n bytes first: the file's size, not the bound (a GiB per record read), and a
                # byte more to see a file that grew past it since
                size = os.fstat(fh.fileno()).st_size
                raw = fh.read(min(size, MAX_RECORD_BYTES) + 1)
            if len(raw) > MAX_RECORD_BYTES:
                raise NotAnEntryFile(errno.EFBIG, f"over {MAX_RECORD_BYTES} bytes")
            return json.loads(raw.decode("utf-8"))
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
            log.warning("disk tier: record %s is unreadable (%s)", name, exc)
            return UnreadableRecord(f"disk tier: {exc}")
        except OSError as exc:
            if not _damaged(exc):
                raise self._fault(f"cannot read record {name}", exc) from exc
            log.warning("disk tier: record %s is unreadable (%s)", name, exc)
            return UnreadableRecord(f"disk tier: {exc.strerror or type(exc).__name__}")  # a client reads it: no path

    def put_record(self, name: str, record: dict) -> None:
        data = json.dumps(record).encode("utf-8")
        self._replace_making_room(self._record_path(name), data, f"record {name}", lasting=True)

    def delete_record(self, name: str) -> bool:
        try:
            path = self._record_path(name)
            path.unlink()
            sync_folder(path.parent)  # a deleted document does not come back after a power loss
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise self._fault(f"cannot delete record {name}", exc) from exc

    def record_names(self, prefix: str = "") -> list[str]:
        try:
            names = [p.name[: -len(".json")].replace("__", "/") for p in self.records_dir.glob("*.json")]
        except OSError as exc:
            raise self._fault("cannot list records", exc) from exc
        return sorted(n for n in names if n.startswith(prefix))

    def stats(self) -> dict:
        try:
            count, total, hits = (
                self._db()
                .execute("SELECT COUNT(*), COALESCE(SUM(size), 0), COALESCE(SUM(hits), 0) FROM entries")
                .fetchone()
            )
        except sqlite3.Error as exc:
            raise StoreError(f"disk tier {self.root}: index unreadable ({exc})") from exc
        return {
            **super().stats(),
            "path": str(self.root),
            "entries": count,
            "bytes": total,
            "budget_bytes": self.budget_bytes,
            "index_hits": hits,
        }

    def close(self) -> None:
        self._drop_connection()


def _there(path: Path) -> bool:
    """Whether a file is there, as far as can be told: one that cannot be looked at (a folder of another user's) is
    taken as there, so that its row is neither dropped nor its entry counted gone."""
    try:
        return path.exists()
    except OSError:
        return True


def holds_store(root: str | os.PathLike) -> bool:
    """Whether a disk tier was opened in this folder: it holds any of what opening one makes."""
    root = Path(root)
    return any((root / name).exists() for name in ("entries", "records", "index.sqlite"))


class DiskFull(StoreError):
    """A write the file system had no room for (ENOSPC, EDQUOT)."""

    public = "the document store's disk is full"


class NotAnEntryFile(OSError):
    """The path holds something no writer of ours makes: a FIFO, a device, a directory, an absurd size."""


def _damaged(exc: OSError) -> bool:
    """What failed is this one file (another user's, not ours to read), not the tier: the same read fails again while
    the tier's other files read fine, so it is damage to report, not an outage to retry. A folder we cannot read, or
    an I/O error (what a network filesystem gives while its server is away), is the tier's."""
    if isinstance(exc, NotAnEntryFile):
        return True
    if exc.errno not in (errno.EACCES, errno.EPERM) or not exc.filename:
        return False
    return os.access(Path(exc.filename).parent, os.R_OK | os.X_OK)


MAX_RECORD_BYTES = 1 << 30  # far above any real chunk; a bigger header is a planted or sparse file


def _open_regular(path: Path):
    """Open for reading without ever blocking: O_NONBLOCK keeps a FIFO from hanging the open, and anything that
    is not a regular file is refused before a byte is read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        if exc.errno == errno.ELOOP and path.is_symlink():  # O_NOFOLLOW refuses the file itself being a link
            raise NotAnEntryFile(errno.ELOOP, "a symbolic link, which ragcache never writes") from exc
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotAnEntryFile(errno.EINVAL, "not a regular file")
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def _head(fh) -> bytes:
    """An entry file's leading bytes, as many as `describe_head` needs."""
    probe = fh.read(PROBE)
    return probe + fh.read(max(0, head_length(probe) - len(probe)))


def _declared_size(fh) -> int:
    """The entry's size as its own header declares it (magic, digest, safetensors header, tensor data)."""
    try:
        head = _head(fh)
        size = head_length(head) + describe_head(head)["nbytes"]
    except CorruptEntry as exc:
        raise NotAnEntryFile(errno.EINVAL, f"not an entry ({exc})") from exc
    if size > MAX_ENTRY_BYTES:
        raise NotAnEntryFile(errno.EFBIG, f"header declares {size} bytes")
    return size


def _read(path: Path) -> bytearray:
    """The entry's bytes into a bytearray (decode hands out tensors that are views of it, with no further copy).

    Reads no further than the size the header declares, so a sparse or padded file cannot exhaust memory; a file
    shorter than that comes back short, and the checksum rejects it."""
    with _open_regular(path) as fh:
        size = min(_declared_size(fh), os.fstat(fh.fileno()).st_size)
        fh.seek(0)
        blob = bytearray(size)
        view, done = memoryview(blob), 0
        while done < size:
            n = fh.readinto(view[done:])
            if not n:
                break
            done += n
    return blob if done == size else blob[:done]
