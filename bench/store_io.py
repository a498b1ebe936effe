"""Store read/write throughput per tier for entries shaped like the default model's.

SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, fp32 -> one 512-token chunk is 23.6 MB of K+V. A "query" reads
8 such documents in one get_many (what the engine does); a "compile" writes them in one put_many. GB/s counts
tensor bytes (K, V, token ids), 1 GB = 1e9 bytes. Starts its own redis-server on a free loopback port.

    .venv/bin/python bench/store_io.py [--docs 8] [--tokens 512] [--repeat 5]

Rows: memory (tensors kept as they are: no copy), disk with the page cache warm and cold (files dropped from the
page cache with posix_fadvise before each read), redis (loopback), memory+disk warm (answered by memory) and cold
(memory empty: disk reads plus the fill into memory), and the codec alone (encode/decode with checksum, no I/O),
which bounds every byte tier. Writes: the median of --repeat put_many calls of all entries (fresh keys each time).
Writes JSON (and a PNG when matplotlib is there) to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ragcache.store import open_store  # noqa: E402
from ragcache.store.disk import DiskStore  # noqa: E402
from ragcache.store.base import decode_all  # noqa: E402
from ragcache.store.entry import ChunkKV, encode  # noqa: E402
from ragcache.store.keys import entry_key, entry_meta  # noqa: E402
from ragcache.store.memory import MemoryStore  # noqa: E402
from ragcache.store.redis_tier import RedisStore  # noqa: E402
from ragcache.store.tiered import TieredStore  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64


def make_entries(docs: int, tokens: int, salt: int) -> dict[str, ChunkKV]:
    g = torch.Generator().manual_seed(salt)
    out = {}
    for d in range(docs):
        ids = torch.randint(0, 49152, (tokens,), generator=g, dtype=torch.int32)
        k = torch.randn(LAYERS, KV_HEADS, tokens, HEAD_DIM, generator=g)
        v = torch.randn(LAYERS, KV_HEADS, tokens, HEAD_DIM, generator=g)
        meta = entry_meta(f"bench-{salt}", "bench", "float32", "bos:1:", "fp32", "bench")  # fresh keys per salt
        out[entry_key(meta, "fp32", ids.tolist())] = ChunkKV(ids, k, v, meta)
    return out


def drop_page_cache(store: DiskStore, keys) -> None:
    for key in keys:
        path = store.entry_path(key)
        if path.exists():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def measure(name: str, store, args, before_read=None) -> dict:
    nbytes = None
    writes, reads = [], []
    kept = None
    for r in range(args.repeat):
        items = make_entries(args.docs, args.tokens, salt=1000 * (zlib.crc32(name.encode()) % 1000) + r)
        nbytes = sum(e.nbytes for e in items.values())
        writes.append(timed(lambda: store.put_many(items)))
        kept = items
    keys = list(kept)
    for _ in range(args.repeat):
        if before_read:
            before_read(keys)
        got = []
        reads.append(timed(lambda: got.extend(store.get_many(keys))))
        assert all(g is not None and g.equal(kept[k]) for g, k in zip(got, keys)), f"{name}: read back differs"
    return row(name, nbytes, writes, reads)


def row(name: str, nbytes: int, writes: list[float], reads: list[float]) -> dict:
    def gbps(times):
        return {"median": nbytes / statistics.median(times) / 1e9, "best": nbytes / min(times) / 1e9} if times else None

    return {"tier": name, "bytes": nbytes, "write_gbps": gbps(writes), "read_gbps": gbps(reads),
            "write_s": writes, "read_s": reads}


def codec(args) -> dict:
    """encode, and the read side as the byte tiers run it: checksum + in-place decode of bytearrays, in parallel."""
    items = make_entries(args.docs, args.tokens, salt=7)
    nbytes = sum(e.nbytes for e in items.values())
    keys = list(items)
    writes, reads = [], []
    for _ in range(args.repeat):
        blobs = {}
        writes.append(timed(lambda: blobs.update({k: encode(k, e) for k, e in items.items()})))
        buffers = [bytearray(blobs[k]) for k in keys]
        got = []
        reads.append(timed(lambda: got.extend(decode_all(keys, buffers))))
        assert all(g.equal(items[k]) for g, k in zip(got, keys))
    return row("codec (encode / checksum+decode)", nbytes, writes, reads)


def machine(redis_version: str) -> dict:
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = 0
    try:
        mem = int(next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                       if line.startswith("MemTotal"))) * 1024
    except (OSError, StopIteration):
        pass
    import redis

    try:
        import hiredis

        hiredis_version = hiredis.__version__
    except ImportError:
        hiredis_version = None
    return {"platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem,
            "python": platform.python_version(), "torch": torch.__version__, "redis_py": redis.__version__,
            "hiredis": hiredis_version, "redis_server": redis_version}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "store_io.json")
    args = parser.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    load_before = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="ragcache-bench-"))
    redis_version = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.strip()
    rows = []
    try:
        (tmp / "redis").mkdir()
        with RedisServer(tmp / "redis") as server:
            rows.append(codec(args))
            rows.append(measure("memory", MemoryStore(), args))
            disk = DiskStore(tmp / "disk")
            rows.append(measure("disk (page cache warm)", disk, args))
            cold_disk = DiskStore(tmp / "disk-cold")
            rows.append(measure("disk (page cache dropped)", cold_disk, args,
                                before_read=lambda keys: drop_page_cache(cold_disk, keys)))
            rows.append(measure("redis (loopback)", RedisStore(server.url), args))
            rows.append(measure("memory+disk (warm: from memory)", open_store(f"memory+disk:{tmp / 'tiered'}"), args))
            cold = TieredStore([MemoryStore(), DiskStore(tmp / "tiered-cold")])

            def empty_memory(keys):
                cold.tiers[0] = MemoryStore()

            rows.append(measure("memory+disk (cold: disk + fill)", cold, args, before_read=empty_memory))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    mb = rows[0]["bytes"] / 1e6
    print(f"\nstore I/O: {args.docs} documents x {args.tokens} tokens, {LAYERS} layers x {KV_HEADS} KV heads x "
          f"{HEAD_DIM} fp32 = {mb:.0f} MB per get_many/put_many; median (best) of {args.repeat}\n")
    print(f"{'tier':<34} {'write GB/s':>18} {'read GB/s':>18}")
    for r in rows:
        w, rd = r["write_gbps"], r["read_gbps"]
        print(f"{r['tier']:<34} {w['median']:>9.2f} ({w['best']:5.2f}) {rd['median']:>9.2f} ({rd['best']:5.2f})")
    info = machine(redis_version)
    info["loadavg_before"], info["loadavg_after"] = list(load_before), list(os.getloadavg())
    result = {"benchmark": "store_io", "shape": {"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                                                 "dtype": "float32", "tokens": args.tokens, "documents": args.docs},
              "repeat": args.repeat, "rows": rows, "machine": info,
              "when": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print("memory keeps references to the tensors (no copy, no checksum): its rows are a ceiling, not I/O")
    print(f"\nmachine: {info['cpu']}, {info['cores']} cores; {info['redis_server']}; load average "
          f"{info['loadavg_before'][0]:.1f} before, {info['loadavg_after'][0]:.1f} after (other work on the machine "
          "slows every row)")
    print(f"wrote {args.out}")
    plot(rows, args.out.with_suffix(".png"))


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = [r["tier"] for r in rows]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ys = range(len(rows))
    ax.barh([y - 0.2 for y in ys], [r["write_gbps"]["median"] for r in rows], height=0.4, label="write")
    ax.barh([y + 0.2 for y in ys], [r["read_gbps"]["median"] for r in rows], height=0.4, label="read")
    ax.set_yticks(list(ys), names)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("GB/s (tensor bytes, median)")
    ax.set_title("ragcache store I/O, SmolLM2-135M-shaped entries")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
