"""Queries refused for length beside a small one, against `ragcache serve` (issue 64's first goal).

    python -m bench refusals [--model smollm2-135m] [--clients 4] [--each 2] [--texts 64] [--chars 200000]

`ragcache serve` starts in a subprocess with the store memory:. Each of --rounds rounds times a small query (a
question, one short raw text, a few tokens) alone --alone times. Then --clients processes each post --each queries
of --texts raw texts of --chars characters (12.8 MB a body at the defaults), which the server must refuse with 413
for length, one after another on their own connection; each body is built before the attack starts, so that what
the clients spend while it runs is sending. Meanwhile this process asks the small query back to back until every
refusal has come, and samples the server's RSS every 20 ms. Reported per round: each refusal's status and seconds,
the small query alone and during the attack (medians, and their ratio), the server's RSS idle and at its peak, and
its CPU seconds; then the rounds against the goals (the median and the largest ratio).
Writes bench/results/refusals-<model>[-tag].json.

Clients and server share this machine's cores: on 2 cores the clients' sending competes with the server's reading,
as it would not across a network."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import statistics
import string
import threading
import time
from http.client import HTTPConnection
from pathlib import Path

from . import report
from .slow_clients import LimitedServer
from .soak import rss_mib

SMALL_QUESTION = "What colour is the door of the lighthouse keeper's house?"
SMALL_TEXT = "The lighthouse keeper's house stands by the pier. Its door is painted a deep green every spring."
RSS_EVERY_S = 0.02
TIMEOUT_S = 300.0
OPEN_FILES = 4096


def hostile_body(texts: int, chars: int, seed: int) -> bytes:
    """A query whose raw texts are far past any context: `texts` words-like texts of `chars` characters each, each
    body distinct (its seed), so that nothing the server keeps from one refusal applies to the next."""
    rng = random.Random(seed)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(512)]
    docs = []
    for _ in range(texts):
        text = " ".join(rng.choices(words, k=chars // 5 + 1))[:chars]
        docs.append({"text": text})
    return json.dumps({"question": "What do these say?", "documents": docs, "max_tokens": 4}).encode()


def _post(host: str, port: int, body: bytes) -> tuple[int, float]:
    """(status, seconds) of one POST /v1/query on a new connection; http.client sends the body with sendall."""
    start = time.perf_counter()
    conn = HTTPConnection(host, port, timeout=TIMEOUT_S)
    try:
        conn.request("POST", "/v1/query", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        return response.status, time.perf_counter() - start
    finally:
        conn.close()


def _client(port: int, bodies: list[bytes], go, out) -> None:
    go.wait()
    for body in bodies:
        try:
            out.put(_post("127.0.0.1", port, body))
        except OSError as exc:  # a refused connection or a reset is a result too
            out.put((f"{type(exc).__name__}: {exc}", 0.0))


def _sample_rss(pid: int, stop: threading.Event, into: list[float]) -> None:
    while not stop.is_set():
        try:
            into.append(rss_mib(pid))
        except OSError:
            return
        stop.wait(RSS_EVERY_S)


def cpu_s(pid: int) -> float:
    """CPU seconds (user and system) a process has used, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def small_query(port: int, max_tokens: int) -> float:
    body = json.dumps({"question": SMALL_QUESTION, "documents": [{"text": SMALL_TEXT}], "max_tokens": max_tokens})
    status, seconds = _post("127.0.0.1", port, body.encode())
    if status != 200:
        raise RuntimeError(f"the small query answered {status}")
    return seconds


def attack(server: LimitedServer, clients: int, each: int, texts: int, chars: int, alone: int,
           max_tokens: int) -> dict:
    """One round: the small query timed alone, then beside the refusals."""
    before = cpu_s(server.proc.pid)
    alone_s = [small_query(server.port, max_tokens) for _ in range(alone)]
    small_cpu = (cpu_s(server.proc.pid) - before) / alone  # the server's CPU seconds for one small query alone
    idle = [rss_mib(server.proc.pid) for _ in range(5)]
    ctx = mp.get_context("fork")
    go, results = ctx.Event(), ctx.Queue()
    procs, body_bytes = [], 0
    for c in range(clients):
        bodies = [hostile_body(texts, chars, seed=c * each + i) for i in range(each)]
        body_bytes = max(body_bytes, *map(len, bodies))
        procs.append(ctx.Process(target=_client, args=(server.port, bodies, go, results), daemon=True))
        procs[-1].start()
        del bodies
    rss: list[float] = []
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_rss, args=(server.proc.pid, stop, rss), daemon=True)
    sampler.start()
    cpu_before = cpu_s(server.proc.pid)
    go.set()
    start, during, refusals = time.perf_counter(), [], []
    while len(refusals) < clients * each:
        during.append(small_query(server.port, max_tokens))
        while not results.empty():
            refusals.append(results.get())
    attack_s = time.perf_counter() - start
    server_cpu_s = cpu_s(server.proc.pid) - cpu_before
    stop.set()
    sampler.join()
    for p in procs:
        p.join(timeout=30)
    refused_s = [s for _, s in refusals]
    small_alone = statistics.median(alone_s)
    return dict(
        body_mb=round(body_bytes / 1e6, 2), statuses=sorted({str(status) for status, _ in refusals}),
        refused_s=[round(s, 3) for s in refused_s], refused_max_s=round(max(refused_s), 3),
        attack_s=round(attack_s, 2), server_cpu_s=round(server_cpu_s, 2), small_cpu_s=round(small_cpu, 2),
        small_alone_s=[round(s, 3) for s in alone_s], small_alone_median_s=round(small_alone, 3),
        small_during_s=[round(s, 3) for s in during], small_during_median_s=round(statistics.median(during), 3),
        small_ratio=round(statistics.median(during) / small_alone, 2),
        rss_idle_mib=round(statistics.median(idle), 1), rss_peak_mib=round(max(rss), 1),
        rss_peak_over_idle=round(max(rss) / statistics.median(idle), 3),
    )


def summary(rows: list[dict]) -> dict:
    """The rounds against the goals: each refusal within 2 s, the small query at most 2x alone, RSS at most 1.3x."""
    ratios = [r["small_ratio"] for r in rows]
    return dict(
        rounds=len(rows), body_mb=max(r["body_mb"] for r in rows),
        statuses=sorted({s for r in rows for s in r["statuses"]}),
        refused_max_s=max(r["refused_max_s"] for r in rows),
        small_ratio_median=statistics.median(ratios), small_ratio_max=max(ratios),
        rss_peak_over_idle_max=max(r["rss_peak_over_idle"] for r in rows),
    )


def run(model: str, clients: int, each: int, texts: int, chars: int, alone: int, max_tokens: int, rounds: int,
        out_dir: Path | None = None, tag: str = "") -> dict:
    params = dict(model=model, clients=clients, each=each, texts=texts, chars=chars, alone=alone, rounds=rounds,
                  max_tokens=max_tokens, tag=tag, pythonpath=os.environ.get("PYTHONPATH", ""))
    bench = report.Run("refusals", params, out_dir)
    server = LimitedServer(model, OPEN_FILES)
    rows = []
    try:
        small_query(server.port, max_tokens)  # compiles its text and warms the path
        for i in range(rounds):
            rows.append(attack(server, clients, each, texts, chars, alone, max_tokens))
            r = rows[-1]
            print(f"round {i + 1}: refusals {r['statuses']} within {r['refused_max_s']:.2f} s; small query "
                  f"{r['small_during_median_s']:.2f} s against {r['small_alone_median_s']:.2f} s alone "
                  f"({r['small_ratio']:.2f}x); RSS peak {r['rss_peak_over_idle']:.2f}x idle", flush=True)
    finally:
        server.close()
    total = summary(rows)
    for key, value in total.items():
        print(f"{key:24} {value}")
    paths = bench.finish(rows, dict(summary=total))
    return dict(results=rows, summary=total, paths=paths)
