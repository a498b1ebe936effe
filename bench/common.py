"""What the benchmarks share: the algorithm variants, option parsing, and the stores they time against
(a temporary disk store, a redis-server started on a free loopback port when none is given)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass(frozen=True)
class Variant:
    """An algorithm with its parameters, under the label tables and plots use."""

    label: str
    algorithm: str
    params: dict = field(default_factory=dict)

    @property
    def kwargs(self) -> dict:
        return dict(algorithm=self.algorithm, **self.params)


VARIANTS = {
    v.label: v
    for v in (
        Variant("full", "full"),
        Variant("prefix", "prefix"),
        Variant("naive", "naive"),
        Variant("cacheblend", "cacheblend", {"ratio": 0.15}),
        Variant("legolink-16", "legolink", {"k": 16}),
        Variant("legolink-32", "legolink", {"k": 32}),
        Variant("legolink0", "legolink0"),
        Variant("focus", "focus", {"ratio": 0.25}),
    )
}
ALIASES = {"legolink": "legolink-16"}


def parse_variants(text: str) -> list[Variant]:
    """'full,legolink-16,cacheblend' (also 'legolink' = legolink-16, 'legolink-8' for any k, 'cacheblend-0.3',
    'focus-0.25'); any of them '+repair-N' repairs N stale rows a decode step ('focus+repair-32')."""
    out = []
    for name in (p.strip() for p in text.split(",") if p.strip()):
        base, _, repair = name.partition("+repair-")
        if repair:
            if not repair.isdigit():
                raise ValueError(f"{name!r}: +repair- takes a row count, as in focus+repair-32")
            (variant,) = parse_variants(base)
            out.append(Variant(name, variant.algorithm, {**variant.params, "repair": int(repair)}))
            continue
        name = ALIASES.get(name, name)
        if name in VARIANTS:
            out.append(VARIANTS[name])
        elif name.startswith("legolink-") and name[9:].isdigit():
            out.append(Variant(name, "legolink", {"k": int(name[9:])}))
        elif name.startswith("cacheblend-"):
            out.append(Variant(name, "cacheblend", {"ratio": float(name[11:])}))
        elif name.startswith("focus-"):
            out.append(Variant(name, "focus", {"ratio": float(name[6:])}))
        else:
            raise ValueError(f"unknown algorithm {name!r}; choose from {', '.join(VARIANTS)} (or legolink-K, "
                             "cacheblend-R, focus-R)")
    return out


def parse_ints(text: str) -> list[int]:
    return [int(p) for p in text.split(",") if p.strip()]


def load_model(name: str, dtype: str = "auto"):
    from ragcache import models

    return models.load(name, dtype=dtype)


def engine(lm, store, chunk_tokens: int, kv_codec: str = "auto"):
    """A RagCache over an already loaded model (several engines share one model: no reload per store)."""
    from ragcache.facade import RagCache
    from ragcache.settings import EngineConfig
    from ragcache.store import open_store

    return RagCache(lm, open_store(store), EngineConfig(chunk_tokens=chunk_tokens, kv_codec=kv_codec))


def _empty(spec: str) -> None:
    from ragcache.store import open_store

    try:
        store = open_store(spec)
        for key in list(store.keys()):
            store.delete(key)
        for name in store.record_names():
            store.delete_record(name)
        store.close()
    except Exception as exc:  # noqa: BLE001 - cleanup is best effort
        print(f"note: could not empty {spec}: {exc}", file=sys.stderr)


# -- stores ------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    """Linux: the server gets SIGKILL when the benchmark dies, even without running its cleanup."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class LocalRedis:
    """A throwaway redis-server on a free loopback port (no persistence), killed by close()."""

    def __init__(self):
        self.binary = shutil.which("redis-server")
        self.dir = tempfile.mkdtemp(prefix="ragcache-bench-redis-")
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "LocalRedis":
        if self.binary is None:
            raise FileNotFoundError("redis-server is not on PATH")
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir, "--save", "",
             "--appendonly", "no", "--daemonize", "no", "--maxmemory", "0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        self.close()
        raise RuntimeError("redis-server did not answer PING")

    def kill(self) -> None:
        """SIGKILL, like a crash (no shutdown, its data gone); start() brings it back, empty, on the same port."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class Backings:
    """The stores a benchmark reads from besides memory: a temporary disk directory and, when asked, Redis
    (the URL given, or a local redis-server started here). Each spec gets a fresh namespace."""

    def __init__(self, names: list[str], redis_url: str | None = None):
        self.names = list(names)
        self.tmp = Path(tempfile.mkdtemp(prefix="ragcache-bench-"))
        self.local_redis: LocalRedis | None = None
        self.redis_url = redis_url
        self.notes: list[str] = []
        self.redis_specs: list[str] = []
        if "redis" in self.names and not self.redis_url:
            try:
                self.local_redis = LocalRedis().start()
                self.redis_url = self.local_redis.url
            except (OSError, RuntimeError) as exc:
                self.names.remove("redis")
                self.notes.append(f"redis left out: {exc}")
                print(f"note: redis left out ({exc}); pass --redis URL", file=sys.stderr)

    def spec(self, name: str) -> str:
        """A fresh, empty store of that kind."""
        tag = uuid.uuid4().hex[:8]
        if name == "memory":
            return "memory:"
        if name == "disk":
            return f"disk:{self.tmp / tag}"
        if name == "redis":
            sep = "&" if "?" in self.redis_url else "?"
            self.redis_specs.append(spec := f"{self.redis_url}{sep}prefix=ragcache-bench-{tag}")
            return spec
        raise ValueError(f"unknown store {name!r}: memory, disk or redis")

    def describe(self, name: str) -> str:
        if name == "redis":
            return "redis (local redis-server)" if self.local_redis else "redis (--redis)"
        return name

    def close(self) -> None:
        if self.local_redis is not None:
            self.local_redis.close()
        else:  # a Redis we were given: remove what the benchmark wrote under its prefixes
            for spec in self.redis_specs:
                _empty(spec)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> "Backings":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
