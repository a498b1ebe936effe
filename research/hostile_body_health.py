"""Issue 50's goal for hostile bodies: while one body up to the size limit is in flight, /health from another
client answers in under 100 ms at the 99th percentile, and the server's RSS stays within 2x of idle.

`ragcache serve` (smollm2-135m, memory store) in a subprocess. For each kind of body, one at a time: a thread posts
it (in 1 MiB pieces: see pieces()) while another polls GET /health every 20 ms on a keep-alive connection and a
third samples the server's RSS every 50 ms. The /health latencies counted are those while the body was in flight.

    python research/hostile_body_health.py [--out research/results]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.soak import rss_mib  # noqa: E402 - the repo root goes on the path first
from bench.throughput import Server  # noqa: E402
from ragcache.settings import Settings  # noqa: E402


def bodies(limit: int) -> dict[str, bytes]:
    """Each kind of hostile body, just under `limit` bytes."""
    def fill(head: str, item: str, tail: str) -> bytes:
        parts, size, i = [], len(head) + len(tail) + 1024, 0
        while size + len(text := item.format(i)) + 1 <= limit:
            parts.append(text)
            size += len(text) + 1
            i += 1
        return (head + ",".join(parts) + tail).encode()

    return {
        "unknown keys": fill('{"question": "q", ', '"k{:010d}": 1', "}"),
        "tiny documents": fill('{"question": "q", "documents": [', '{{"text": "d{}"}}', "]}"),
        "one long string": ('{"question": "' + "a" * (limit - 1024) + '"}').encode(),
        "a long array of numbers": fill('{"question": "q", "documents": [', "{}", "]}"),
    }


def pieces(body: bytes, size: int = 1 << 20) -> Iterator[bytes]:
    """The body in 1 MiB pieces. Given whole, httpcore sends it with `buffer = buffer[sent:]`, copying the rest of
    the body after every partial send while holding this process's GIL: tens of milliseconds at a time during which
    the /health poller here, not the server, is stalled."""
    view = memoryview(body)
    for start in range(0, len(body), size):
        yield bytes(view[start : start + size])


def idle_health_ms(url: str, calls: int = 100) -> dict:
    """/health on the idle server, polled as during the bodies (every 20 ms, one keep-alive connection)."""
    seconds = []
    with httpx.Client(base_url=url, timeout=30) as client:
        for _ in range(calls):
            started = time.perf_counter()
            client.get("/health")
            seconds.append(time.perf_counter() - started)
            time.sleep(0.02)
    seconds.sort()
    p99 = seconds[min(calls - 1, int(0.99 * calls))]
    return dict(n=calls, p50_ms=1e3 * statistics.median(seconds), p99_ms=1e3 * p99)


def run(out: Path) -> dict:
    settings = Settings()
    limit = settings.max_documents * settings.max_document_chars * 6 + (1 << 20)  # api/app.py's max_body
    server = Server("smollm2-135m", "memory")
    rows = []
    try:
        idle = rss_mib(server.proc.pid)
        idle_health = idle_health_ms(server.url)
        print(f"idle /health n={idle_health['n']} p50 {idle_health['p50_ms']:.1f} ms p99 {idle_health['p99_ms']:.1f} ms",
              flush=True)
        for kind, body in bodies(limit).items():
            done = threading.Event()
            health: list[float] = []
            rss: list[float] = []
            result: dict = {}

            def poll() -> None:
                with httpx.Client(base_url=server.url, timeout=30) as client:
                    while not done.is_set():
                        started = time.perf_counter()
                        client.get("/health")
                        health.append(time.perf_counter() - started)
                        time.sleep(0.02)

            def sample() -> None:
                while not done.is_set():
                    rss.append(rss_mib(server.proc.pid))
                    time.sleep(0.05)

            watchers = [threading.Thread(target=poll), threading.Thread(target=sample)]
            for thread in watchers:
                thread.start()
            time.sleep(0.5)
            before = len(health)
            started = time.perf_counter()
            r = httpx.post(f"{server.url}/v1/query", content=pieces(body), timeout=300,
                           headers={"content-type": "application/json", "content-length": str(len(body))})
            result.update(status=r.status_code, answer_bytes=len(r.content), seconds=time.perf_counter() - started)
            in_flight = sorted(health[before:])
            done.set()
            for thread in watchers:
                thread.join()
            row = dict(kind=kind, body_mib=len(body) / 2**20, **result, health_n=len(in_flight),
                       health_p50_ms=1e3 * statistics.median(in_flight) if in_flight else None,
                       health_p99_ms=1e3 * in_flight[min(len(in_flight) - 1, int(0.99 * len(in_flight)))]
                       if in_flight else None, health_max_ms=1e3 * in_flight[-1] if in_flight else None,
                       rss_idle_mib=idle, rss_peak_mib=max(rss), rss_peak_over_idle=max(rss) / idle,
                       rss_after_mib=rss_mib(server.proc.pid))
            rows.append(row)
            print(f"{kind:24s} {row['body_mib']:5.1f} MiB -> {row['status']} in {row['seconds']:.2f} s "
                  f"({row['answer_bytes']} B); /health n={row['health_n']} p50 {row['health_p50_ms']:.1f} ms "
                  f"p99 {row['health_p99_ms']:.1f} ms max {row['health_max_ms']:.1f} ms; RSS idle {idle:.0f}, "
                  f"peak {row['rss_peak_mib']:.0f} ({row['rss_peak_over_idle']:.2f}x), after "
                  f"{row['rss_after_mib']:.0f} MiB", flush=True)
    finally:
        server.stop()
    result = dict(research="hostile bodies against /health", created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  body_limit_bytes=limit, health_idle=idle_health, rows=rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hostile-body-health.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("research/results"))
    run(ap.parse_args().out)
