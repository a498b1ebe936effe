"""Requests per second through the REST server: a closed loop of C concurrent clients.

    python -m bench throughput --model smollm2-135m --clients 1,4,16 --requests 32 [--url http://host:port]

Starts `ragcache serve` as a subprocess on a free 127.0.0.1 port (unless --url names a running server), waits
for GET /health == 200, uploads a pool of documents (POST /v1/documents), then for each algorithm and each C:
C client threads (httpx) take the next request number until --requests have been answered; request i asks
a question over 4-8 documents drawn from the pool with seed i, so documents repeat across requests and every
(algorithm, C) sees the same request sequence. Latency is client-side (send to full JSON answer); the server's
own ttft_s and queue_s are kept too. Before timing each algorithm, untimed requests cover the whole pool (this
compiles legolink0's sink-layout entries; the others were compiled at upload). The server is stopped at the end.
Writes bench/results/throughput-<model>.json and .png.
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from . import report, squad
from .common import Variant, free_port

START_TIMEOUT_S = 300.0


def server_threads() -> int:
    """The torch threads a server started here computes with: this process's count (`--threads`, else torch's
    default), passed as OMP_NUM_THREADS, so the server computes as this process would."""
    import torch

    return torch.get_num_threads()


class Server:
    """`ragcache serve` in a subprocess on a free loopback port; stop() ends it (SIGINT, then SIGKILL)."""

    def __init__(self, model: str, store: str, max_queue: int = 64, extra_env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="ragcache-bench-serve-", suffix=".log", delete=False)
        self.threads = server_threads()
        # every client of a benchmark comes from 127.0.0.1: one client to max_per_client, which may fill the queue
        env = dict(os.environ, RAGCACHE_MAX_QUEUE=str(max_queue), RAGCACHE_MAX_PER_CLIENT=str(max_queue),
                   HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(self.threads))
        env.pop("RAGCACHE_API_KEY", None)
        env.update(extra_env or {})  # what this server alone is given (a store key)
        cmd = [sys.executable, "-m", "ragcache.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--model", model, "--store", store]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     cwd=tempfile.gettempdir())  # no ./ragcache.toml of the caller's
        self.wait_healthy()

    def wait_healthy(self) -> None:
        import httpx

        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"the server did not become healthy in {START_TIMEOUT_S:.0f} s:\n{self.log_tail()}")

    def log_tail(self) -> str:
        try:
            return Path(self.log.name).read_text()[-3000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


def upload(client, texts: list[str], batch: int = 10) -> list[str]:
    ids = []
    for start in range(0, len(texts), batch):
        r = client.post("/v1/documents", json={"documents": [{"text": t} for t in texts[start:start + batch]]})
        r.raise_for_status()
        ids += r.json()["ids"]
    return ids


def draw(pool: list[str], i: int, docs: tuple[int, int], seed: int = 0) -> list[str]:
    rng = random.Random(seed * 1_000_003 + i)
    return rng.sample(pool, rng.randint(docs[0], min(docs[1], len(pool))))


def closed_loop(url: str, clients: int, total: int, body_for) -> tuple[float, list[dict]]:
    """C threads, each with its own connection, take request numbers 0..total-1; (wall seconds, records)."""
    import httpx

    counter = itertools.count()
    records: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()

    def worker() -> None:
        with httpx.Client(base_url=url, timeout=900) as client:
            while (i := next(counter)) < total:
                started = time.perf_counter()
                try:
                    r = client.post("/v1/query", json=body_for(i))
                    latency = time.perf_counter() - started
                    r.raise_for_status()
                    data = r.json()
                except httpx.HTTPError as exc:
                    with lock:
                        errors.append(f"request {i}: {exc}")
                    continue
                with lock:
                    records.append(dict(i=i, latency_s=latency, ttft_s=data["timings"]["ttft_s"],
                                        queue_s=data["timings"]["queue_s"],
                                        prompt_tokens=data["usage"]["prompt_tokens"],
                                        recomputed_tokens=data["usage"]["recomputed_tokens"],
                                        completion_tokens=data["usage"]["completion_tokens"],
                                        store_misses=data["store"]["misses"], compiled=data["store"]["compiled"]))

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    if errors:
        print(f"{len(errors)} failed requests, e.g. {errors[0]}", file=sys.stderr)
    return wall, records + [dict(error=e) for e in errors]


def run(model: str, clients: list[int], requests: int, pool_size: int, doc_tokens: int, docs: tuple[int, int],
        max_tokens: int, variants: list[Variant], store: str = "memory:", url: str | None = None,
        out_dir: Path | None = None, tag: str = "") -> dict:
    import httpx
    from transformers import AutoTokenizer

    from ragcache import models

    params = dict(model=model, clients=clients, requests=requests, pool=pool_size, doc_tokens=doc_tokens,
                  docs_per_query=list(docs), max_tokens=max_tokens, algorithms=[v.label for v in variants],
                  store=store, url=url, tag=tag, server_threads=None if url else server_threads())
    bench = report.Run("throughput", params, out_dir)
    if requests < 2 * max(clients):
        print(f"note: {requests} requests for up to {max(clients)} clients: a C larger than about half of --requests "
              "is a burst more than a steady closed loop", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(models.resolve(model))
    texts = squad.timing_documents(tokenizer, pool_size, doc_tokens)
    questions = squad.timing_questions(64)
    server = None if url else Server(model, store, max_queue=max(64, 2 * max(clients)))
    base = url or server.url
    results = []
    try:
        with httpx.Client(base_url=base, timeout=900) as client:
            started = time.perf_counter()
            pool = upload(client, texts)
            upload_s = time.perf_counter() - started
            print(f"uploaded {len(pool)} documents in {upload_s:.1f} s", file=sys.stderr, flush=True)
            for v in variants:
                def body(i: int, v=v, n=max_tokens) -> dict:
                    return dict(question=questions[i % len(questions)], documents=draw(pool, i, docs), max_tokens=n,
                                **v.kwargs)

                for start in range(0, len(pool), docs[1]):  # untimed: every document once, in this algorithm
                    client.post("/v1/query", json=dict(body(0), documents=pool[start:start + docs[1]], max_tokens=1)
                                ).raise_for_status()
                for c in clients:
                    wall, records = closed_loop(base, c, requests, body)
                    results.append(_row(v, c, wall, records))
                    r = results[-1]
                    print(f"{v.label} C={c}: {r['requests_per_s']:.2f} req/s, p50 {report.ms(r['p50_s'])} ms, "
                          f"p99 {report.ms(r['p99_s'])} ms", file=sys.stderr, flush=True)
    finally:
        if server is not None:
            server.stop()
    _print(results, bench.machine)
    paths = bench.finish(results, dict(upload_s=round(upload_s, 2), server="started here" if server else base),
                         plot=lambda p: plot(results, bench.machine, p, model))
    return dict(results=results, paths=paths)


def _row(v: Variant, clients: int, wall: float, records: list[dict]) -> dict:
    ok = [r for r in records if "error" not in r]
    lat = [r["latency_s"] for r in ok]

    def mean(key):
        return round(sum(r[key] for r in ok) / len(ok), 2) if ok else None

    row = dict(algorithm=v.algorithm, label=v.label, **v.params, clients=clients, requests=len(ok),
               errors=len(records) - len(ok), wall_s=round(wall, 3),
               requests_per_s=round(len(ok) / wall, 4) if wall else None,
               p50_s=report.percentile(lat, 50), p99_s=report.percentile(lat, 99),
               mean_s=round(sum(lat) / len(lat), 4) if lat else None,
               ttft_p50_s=report.percentile([r["ttft_s"] for r in ok], 50),
               queue_p50_s=report.percentile([r["queue_s"] for r in ok], 50),
               mean_prompt_tokens=mean("prompt_tokens"), mean_recomputed_tokens=mean("recomputed_tokens"),
               mean_completion_tokens=mean("completion_tokens"),
               store_misses=sum(r["store_misses"] for r in ok), compiled_chunks=sum(r["compiled"] for r in ok))
    if row["compiled_chunks"]:
        print(f"note: {row['compiled_chunks']} chunks were compiled during timed {v.label} requests (store misses)",
              file=sys.stderr)
    return row


def _print(results: list[dict], machine: dict) -> None:
    headers = ["algorithm", "C", "requests", "req/s", "p50 ms", "p99 ms", "server TTFT p50", "queue p50",
               "prompt tok", "recomputed", "errors"]
    rows = [[r["label"], r["clients"], r["requests"], f"{r['requests_per_s']:.2f}", report.ms(r["p50_s"]),
             report.ms(r["p99_s"]), report.ms(r["ttft_p50_s"]), report.ms(r["queue_p50_s"]), r["mean_prompt_tokens"],
             r["mean_recomputed_tokens"], r["errors"]] for r in results]
    report.print_table("REST throughput, closed loop (latency client-side)", headers, rows,
                       caption=report.subtitle(machine))


def plot(results: list[dict], machine: dict, path: Path, model: str) -> None:
    plt = report.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label in dict.fromkeys(r["label"] for r in results):
        mine = sorted((r for r in results if r["label"] == label), key=lambda r: r["clients"])
        cs = [r["clients"] for r in mine]
        ax1.plot(cs, [r["requests_per_s"] for r in mine], marker="o", label=label)
        ax2.plot(cs, [(r["p99_s"] or 0) * 1e3 for r in mine], marker="o", label=label)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.grid(True, which="both", alpha=0.3)
    ax1.set_ylabel("requests / s")
    ax1.set_yscale("log")
    ax2.set_ylabel("p99 latency (ms)")
    ax2.set_yscale("log")
    ax1.legend(fontsize=8)
    fig.suptitle(f"REST throughput, {model} — {report.subtitle(machine)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(data: dict) -> str:
    headers = ["algorithm", "C", "requests", "req/s", "p50 ms", "p99 ms", "server TTFT p50 ms", "prompt tokens",
               "recomputed", "errors"]
    rows = [[r["label"], r["clients"], r["requests"], f"{r['requests_per_s']:.2f}", report.ms(r["p50_s"]),
             report.ms(r["p99_s"]), report.ms(r["ttft_p50_s"]), r["mean_prompt_tokens"], r["mean_recomputed_tokens"],
             r["errors"]] for r in data["results"]]
    return report.header_line(data) + "\n\n" + report.markdown_table(headers, rows)
