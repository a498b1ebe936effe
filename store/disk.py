"""Disk tier (the embedded default): one file per entry, an SQLite index, LRU eviction under a byte budget.

Crash safety: an entry is written to a temp file in the same directory, fsynced and renamed, so a reader
sees the old file or the new one, never half of one. Several processes may share a directory: renames are
atomic and the index is SQLite in WAL mode. The index is a cache of what is on disk; if it is missing it
is rebuilt from the files.
"""

from __future__ import annotations

import errno
import json
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from ragcache.errors import StoreError

from .base import BlobStore, log

DEFAULT_DISK_BUDGET = 20 << 30
SUFFIX = ".kv"


class DiskStore(BlobStore):
    name = "disk"

    def __init__(self, root: str | os.PathLike, budget_bytes: int = DEFAULT_DISK_BUDGET):
        super().__init__()
        self.root = Path(root)
        self.budget_bytes = budget_bytes
        self.entries_dir = self.root / "entries"
        self.records_dir = self.root / "records"
        for d in (self.entries_dir, self.records_dir):
            d.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        index_path = self.root / "index.sqlite"
        fresh = not index_path.exists()
        with self._db() as db:
            db.execute(
                "CREATE TABLE IF NOT EXISTS entries (key TEXT PRIMARY KEY, size INTEGER, last_access REAL, hits INTEGER DEFAULT 0)"
            )
        if fresh:
            self.rebuild_index()

    # -- index --------------------------------------------------------------------------------------
    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.root / "index.sqlite", timeout=30, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            self._local.db = db
        return db

    def rebuild_index(self) -> int:
        rows = []
        for path in self.entries_dir.glob(f"*/*{SUFFIX}"):
            stat = path.stat()
            rows.append((path.stem, stat.st_size, stat.st_mtime))
        db = self._db()
        db.execute("BEGIN IMMEDIATE")
        db.execute("DELETE FROM entries")
        db.executemany("INSERT INTO entries (key, size, last_access) VALUES (?, ?, ?)", rows)
        db.execute("COMMIT")
        if rows:
            log.info("disk tier %s: index rebuilt from %d files", self.root, len(rows))
        return len(rows)

    def _path(self, key: str) -> Path:
        return self.entries_dir / key[:2] / f"{key}{SUFFIX}"

    # -- blobs --------------------------------------------------------------------------------------
    def read_blobs(self, keys: list[str]) -> list[bytes | None]:
        out, found = [], []
        for key in keys:
            try:
                out.append(self._path(key).read_bytes())
                found.append(key)
            except FileNotFoundError:
                out.append(None)
        if found:
            now = time.time()
            self._db().executemany(
                "UPDATE entries SET last_access = ?, hits = hits + 1 WHERE key = ?", [(now, k) for k in found]
            )
        return out

    def write_blobs(self, blobs: dict[str, bytes]) -> None:
        rows = []
        for key, blob in blobs.items():
            path = self._path(key)
            path.parent.mkdir(exist_ok=True)
            tmp = path.with_name(f".{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
            try:
                with open(tmp, "wb") as fh:
                    fh.write(blob)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, path)
            except OSError as exc:
                tmp.unlink(missing_ok=True)
                hint = "disk full" if exc.errno == errno.ENOSPC else exc.strerror
                raise StoreError(f"disk tier {self.root}: cannot write entry {key[:12]} ({hint})") from exc
            rows.append((key, len(blob), time.time()))
        self._db().executemany(
            "INSERT INTO entries (key, size, last_access) VALUES (?, ?, ?) "
            "ON CONFLICT(key) DO UPDATE SET size = excluded.size, last_access = excluded.last_access",
            rows,
        )
        self.evict()

    def evict(self) -> int:
        """Drop least recently used entries until the directory fits its budget."""
        db = self._db()
        (total,) = db.execute("SELECT COALESCE(SUM(size), 0) FROM entries").fetchone()
        removed = 0
        if total <= self.budget_bytes:
            return 0
        for key, size in db.execute("SELECT key, size FROM entries ORDER BY last_access ASC").fetchall():
            if total <= self.budget_bytes:
                break
            self.delete(key)
            total -= size
            removed += 1
        return removed

    def contains_many(self, keys: list[str]) -> list[bool]:
        return [self._path(k).exists() for k in keys]

    def delete(self, key: str) -> bool:
        existed = self._path(key).exists()
        self._path(key).unlink(missing_ok=True)
        self._db().execute("DELETE FROM entries WHERE key = ?", (key,))
        return existed

    def keys(self) -> Iterator[str]:
        return (p.stem for p in self.entries_dir.glob(f"*/*{SUFFIX}"))

    # -- records ------------------------------------------------------------------------------------
    def _record_path(self, name: str) -> Path:
        return self.records_dir / (name.replace("/", "__") + ".json")

    def get_record(self, name: str) -> dict | None:
        try:
            return json.loads(self._record_path(name).read_text())
        except FileNotFoundError:
            return None
        except json.JSONDecodeError:
            log.warning("disk tier: record %s is unreadable; ignoring it", name)
            return None

    def put_record(self, name: str, record: dict) -> None:
        path = self._record_path(name)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            tmp.write_text(json.dumps(record))
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise StoreError(f"disk tier {self.root}: cannot write record {name} ({exc.strerror})") from exc

    def delete_record(self, name: str) -> bool:
        path = self._record_path(name)
        existed = path.exists()
        path.unlink(missing_ok=True)
        return existed

    def record_names(self, prefix: str = "") -> list[str]:
        names = (p.name[: -len(".json")].replace("__", "/") for p in self.records_dir.glob("*.json"))
        return sorted(n for n in names if n.startswith(prefix))

    def stats(self) -> dict:
        count, total, hits = self._db().execute(
            "SELECT COUNT(*), COALESCE(SUM(size), 0), COALESCE(SUM(hits), 0) FROM entries"
        ).fetchone()
        return {**super().stats(), "path": str(self.root), "entries": count, "bytes": total,
                "budget_bytes": self.budget_bytes, "index_hits": hits}
