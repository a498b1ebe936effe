"""What the soak breaks while it runs: Redis killed and restarted, and entries and records tampered with in the disk
tier under a running `ragcache serve`.

- `RedisChaos`: every `every_s` the store's redis-server is killed with SIGKILL (a crash: no shutdown, its data
  gone) and started again, empty, on the same port `down_s` later.
- `Tamperer`: every `every_s` one kind of damage (TAMPERS, in turn) is written into the disk tier's files of a
  victim document, the victim is asked its question, and the outcome is classified: the clean answer (the
  serial baseline's), a typed error naming the damage (`corrupt_*`), or a failure (a wrong answer, any other
  error). Then its text is added again (what repairs a damaged record) and it is asked again: that answer must be
  the clean one. The victims are documents of their own, so the load's figures stay the load's.

The forger knows the store's formats but not the server's RAGCACHE_STORE_KEY: a forged entry or chunk record
carries a plain sha256, which a server with a store key refuses.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ragcache.documents import chunks_checksum, chunks_name_parts, doc_name

from .common import LocalRedis

MAGIC_AND_SUM = 8 + 32  # an entry file: magic, sha256 of the payload, safetensors payload (ragcache.store.entry)
OUTCOMES = ("clean", "typed", "wrong", "untyped")
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


class Background:
    """Runs `_run` on a daemon thread from `start` until `stop`, which answers `report()`; `_run` waits on
    `_stop` between its acts."""

    name = "background"

    def __init__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)

    def start(self):
        self._thread.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return self.report()

    def report(self) -> dict:
        raise NotImplementedError

    def _run(self) -> None:
        raise NotImplementedError


class RedisChaos(Background):
    """Kills the store's redis-server every `every_s` and starts it again `down_s` later, on a thread."""

    name = "redis"

    def __init__(self, redis: LocalRedis, every_s: float, down_s: float):
        self.redis, self.every_s, self.down_s = redis, every_s, down_s
        self.kills = self.restarts = 0
        self.down_total_s = 0.0
        super().__init__()

    def report(self) -> dict:
        return dict(kills=self.kills, restarts=self.restarts, every_s=self.every_s, down_s=self.down_s,
                    down_total_s=round(self.down_total_s, 1))

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.redis.kill()
            self.kills += 1
            killed = time.monotonic()
            self._stop.wait(self.down_s)  # when the soak ends mid-outage, Redis comes back all the same
            self.redis.start()
            self.restarts += 1
            self.down_total_s += time.monotonic() - killed


# -- the damage ------------------------------------------------------------------------------------------------------
@dataclass
class Victim:
    """A document of the tamperer's own: its text, id, entry files in the disk tier, the request it is asked and
    that request's clean answer."""

    text: str
    id: str
    entries: list[Path]
    body: dict
    clean: str = ""


def _write(path: Path, data: bytes) -> None:
    """Replace a file whole, as another writer of the store would (a reader sees the old file or the new one)."""
    tmp = path.with_name(path.name + ".tamper")
    tmp.write_bytes(data)
    tmp.replace(path)


def flip_entry_bytes(store: Path, victim: Victim, other: Victim) -> None:
    """A disk's damage: one byte of each entry's K/V flipped, the checksum left as it was."""
    for path in victim.entries:
        blob = bytearray(path.read_bytes())
        blob[len(blob) // 2] ^= 0x40
        _write(path, bytes(blob))


def foreign_entry(store: Path, victim: Victim, other: Victim) -> None:
    """Another document's sound entry under each of this document's keys."""
    blob = other.entries[0].read_bytes()
    for path in victim.entries:
        _write(path, blob)


def forged_entry(store: Path, victim: Victim, other: Victim) -> None:
    """Each entry's V scaled by 2 with the checksum recomputed as a plain sha256: sound to anyone without the
    store key."""
    for path in victim.entries:
        _write(path, scaled_values(path.read_bytes(), 2.0))


def scaled_values(blob: bytes, factor: float) -> bytes:
    """An entry's blob with V scaled by `factor` and a plain sha256: float V scaled in place, int8 V through its
    (scale, zero) pairs (V ~= code * scale + zero)."""
    payload = bytearray(blob[MAGIC_AND_SUM:])
    header_len = int.from_bytes(payload[:8], "little")
    header = json.loads(payload[8:8 + header_len])
    spec = header["value_scales"] if "value_scales" in header else header["values"]
    start, end = (8 + header_len + offset for offset in spec["data_offsets"])
    dtype = _DTYPES[spec["dtype"]]
    torch.frombuffer(payload, dtype=dtype, offset=start, count=(end - start) // dtype.itemsize).mul_(factor)
    return blob[:8] + hashlib.sha256(payload).digest() + bytes(payload)


def record_not_json(store: Path, victim: Victim, other: Victim) -> None:
    """The document record cut short: not JSON."""
    _write(_record_path(store, doc_name(victim.id)), b'{"id": "')


def record_budget(store: Path, victim: Victim, other: Victim) -> None:
    """The document record's chunk budget edited (16, or 8 where it was 16)."""
    path = _record_path(store, doc_name(victim.id))
    record = json.loads(path.read_bytes())
    _write(path, json.dumps(dict(record, chunk_tokens=8 if record["chunk_tokens"] == 16 else 16)).encode())


def forged_chunks(store: Path, victim: Victim, other: Victim) -> None:
    """The chunk record's ids replaced by one outside the vocabulary, its checksum recomputed as a plain sha256."""
    for path in store.glob(f"records/chunks__{victim.id}__*.json"):  # chunks/<id>/<tokenizer>-<budget>-v<version>
        record = json.loads(path.read_bytes())
        _, _, budget, version = chunks_name_parts(path.stem.replace("__", "/"))
        chunks = [[10**9]]
        forged = dict(record, chunks=chunks, tokens=1, checksum=chunks_checksum(
            victim.id, record["tokenizer"], budget, record["vocab"], chunks, version))
        _write(path, json.dumps(forged).encode())


def _record_path(store: Path, name: str) -> Path:
    return store / "records" / (name.replace("/", "__") + ".json")  # the disk tier's record files


TAMPERS = {"entry-bytes": flip_entry_bytes, "entry-foreign": foreign_entry, "entry-forged": forged_entry,
           "record-not-json": record_not_json, "record-budget": record_budget, "chunks-forged": forged_chunks}


# -- the tamperer ----------------------------------------------------------------------------------------------------
def entry_files(store: Path) -> set[Path]:
    return set((store / "entries").glob("*/*.kv"))


def add_victims(client, store: Path, texts: list[str], body_for) -> list[Victim]:
    """Upload each text alone (before anything else compiles) and note which entry files it added."""
    victims = []
    for text in texts:
        before = entry_files(store)
        r = client.post("/v1/documents", json={"documents": [{"text": text}]})
        r.raise_for_status()
        (doc_id,) = r.json()["ids"]
        victims.append(Victim(text, doc_id, sorted(entry_files(store) - before), body_for(doc_id)))
    if len({v.id for v in victims}) < len(victims) or not all(v.entries for v in victims):
        raise RuntimeError("every victim must be a document of its own whose upload adds entry files")
    return victims


def outcome(response, clean: str) -> str:
    """clean | typed (an error that names the damage) | wrong | untyped; for a response to a tampered victim. A
    damaged copy while Redis, which may hold a sound one, is down is a 503 (retry) that names the damage too."""
    if response.status_code == 200:
        return "clean" if response.json()["answer"] == clean else "wrong"
    try:
        error = response.json()["error"]
        kind, message = error["type"], error["message"]
    except (ValueError, KeyError, TypeError):
        return "untyped"
    named = kind.startswith("corrupt_") or (kind == "tier_unavailable" and "damaged" in message)
    return "typed" if named else "untyped"


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)
    repaired: int = 0
    not_repaired: int = 0
    samples: list[str] = field(default_factory=list)  # the first few errors, as the client saw them

    def as_dict(self) -> dict:
        return dict({o: self.outcomes[o] for o in OUTCOMES}, repaired=self.repaired, not_repaired=self.not_repaired,
                    samples=self.samples)


class Tamperer(Background):
    """Every `every_s`, the next kind of damage to a random victim, the victim asked, repaired and asked again."""

    name = "tampering"

    def __init__(self, url: str, store: Path, victims: list[Victim], every_s: float, seed: int = 0):
        if len(victims) < 2:
            raise ValueError("the tamperer needs two victims at least (a foreign entry is another's)")
        self.url, self.store, self.victims, self.every_s = url, store, victims, every_s
        self.rng = random.Random(seed)
        self.tallies = {kind: Tally() for kind in TAMPERS}
        super().__init__()

    def report(self) -> dict:
        return {kind: tally.as_dict() for kind, tally in self.tallies.items()}

    def _run(self) -> None:
        import httpx

        kinds = itertools.cycle(TAMPERS)
        with httpx.Client(base_url=self.url, timeout=900) as client:
            while not self._stop.wait(self.every_s):
                victim, other = self.rng.sample(self.victims, 2)
                self.tamper_once(client, next(kinds), victim, other)

    def tamper_once(self, client, kind: str, victim: Victim, other: Victim) -> None:
        import httpx

        tally = self.tallies[kind]
        TAMPERS[kind](self.store, victim, other)
        try:
            r = client.post("/v1/query", json=victim.body)
            got = outcome(r, victim.clean)
            if got != "clean" and len(tally.samples) < 3:
                tally.samples.append(f"{r.status_code} {r.text[:300]}")
            client.post("/v1/documents", json={"documents": [{"text": victim.text}]})
            again = client.post("/v1/query", json=victim.body)
            fixed = outcome(again, victim.clean) == "clean"
        except httpx.HTTPError as exc:
            got, fixed = "untyped", False
            if len(tally.samples) < 3:
                tally.samples.append(f"{type(exc).__name__}: {exc}")
        tally.outcomes[got] += 1
        if fixed:
            tally.repaired += 1
        else:
            tally.not_repaired += 1
