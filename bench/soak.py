"""Soak: mixed algorithms from C clients against a real `ragcache serve` for a fixed time, while Redis is killed and
entries and records are tampered with, watching what breaks.

    python -m bench soak --model smollm2-135m --clients 8 --minutes 10

`ragcache serve` runs in a subprocess on a free loopback port over a disk store in a temporary folder, tiered with
a redis-server started here (`disk:DIR+redis://...`), and with a store key of its own. A fixed set of distinct
requests (a question, 2-4 documents of a pool, an algorithm: every algorithm in turn) is first asked once each,
serially: that is the baseline. Then C client threads, each on its own keep-alive connection, take request numbers
round-robin until the time is up; every `--abandon-every`-th request is a stream the client drops after its first
event. Meanwhile (bench/chaos.py) Redis is killed with SIGKILL every `--redis-every` seconds and started again,
empty, `--redis-down` seconds later, and every `--tamper-every` seconds one kind of damage is written into the disk
tier's files of a victim document (documents of their own, not the load's), which is then asked its question.
Reported: requests/s, p50/p99 latency, 5xx, connection errors (resets, refused), answers that differ from the
serial baseline (per algorithm), the server's RSS sampled every few seconds with its drift over the last half of
the run, Redis kills, and per kind of tampering how the victim's answers ended (clean, a typed error naming the
damage, wrong, untyped) and whether adding its text again repaired it. Writes bench/results/soak-<model>[-tag].json.
"""

from __future__ import annotations

import itertools
import secrets
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from ragcache.store.keys import STORE_KEY_ENV

from . import chaos, report, squad, throughput
from .common import LocalRedis

ALGORITHMS = ("focus", "naive", "cacheblend", "legolink", "legolink0", "full", "prefix")
RSS_EVERY_S = 5.0
VICTIMS = 3  # documents the tamperer damages (two at least: a foreign entry is another's)


def rss_mib(pid: int) -> float:
    return rss_parts(pid)["VmRSS"]


def rss_parts(pid: int) -> dict[str, float]:
    """MiB of the process's resident memory, whole (VmRSS) and by kind: anonymous (heap, tensors), file-backed
    (mapped files: weights, libraries), shared."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            out[name] = int(value.split()[0]) / 1024
    if "VmRSS" not in out:
        raise RuntimeError(f"no VmRSS for process {pid}")
    return out


def requests(pool: list[str], questions: list[str], distinct: int, algorithms: tuple[str, ...],
             max_tokens: int) -> list[dict]:
    return [dict(question=questions[i % len(questions)], documents=throughput.draw(pool, i, (2, 4)),
                 algorithm=algorithms[i % len(algorithms)], max_tokens=max_tokens) for i in range(distinct)]


def run(model: str, clients: int, seconds: float, distinct: int, pool_size: int, doc_tokens: int, max_tokens: int,
        abandon_every: int, algorithms: tuple[str, ...], out_dir: Path | None = None, tag: str = "",
        redis_every: float = 90.0, redis_down: float = 20.0, tamper_every: float = 15.0, new_text_every: int = 0,
        prefix_cache_mib: int | None = None, server_env: dict[str, str] | None = None) -> dict:
    import httpx
    from transformers import AutoTokenizer

    from ragcache import models

    params = dict(model=model, clients=clients, seconds=seconds, distinct=distinct, pool=pool_size,
                  doc_tokens=doc_tokens, max_tokens=max_tokens, abandon_every=abandon_every,
                  algorithms=list(algorithms), tag=tag, redis_every=redis_every, redis_down=redis_down,
                  tamper_every=tamper_every, new_text_every=new_text_every, prefix_cache_mib=prefix_cache_mib,
                  server_env=server_env or {},
                  server_threads=throughput.server_threads())
    bench = report.Run("soak", params, out_dir)
    tokenizer = AutoTokenizer.from_pretrained(models.resolve(model))
    texts = squad.timing_documents(tokenizer, pool_size, doc_tokens)
    victim_texts = _others(squad.timing_documents(tokenizer, 4 * VICTIMS, doc_tokens, seed=1), texts)[:VICTIMS]
    questions = squad.timing_questions(distinct)
    redis = LocalRedis().start()
    try:
        with tempfile.TemporaryDirectory(prefix="ragcache-soak-") as folder:
            store = Path(folder)
            env = {**(server_env or {}), STORE_KEY_ENV: secrets.token_hex(16)}
            if prefix_cache_mib is not None:
                env["RAGCACHE_PREFIX_CACHE_MIB"] = str(prefix_cache_mib)
            server = throughput.Server(model, f"disk:{store}+{redis.url}", max_queue=4 * clients, extra_env=env)
            try:
                with httpx.Client(base_url=server.url, timeout=900) as client:
                    # the victims first: the entry files each adds are then its own
                    victims = chaos.add_victims(client, store, victim_texts, lambda doc: dict(
                        question=questions[0], documents=[doc], algorithm="naive", max_tokens=max_tokens))
                    pool = throughput.upload(client, texts)
                    bodies = requests(pool, questions, distinct, algorithms, max_tokens)
                    baseline = [_answer(client, body) for body in bodies]
                    for victim in victims:
                        victim.clean = _answer(client, victim.body)
                breakers = [chaos.RedisChaos(redis, redis_every, redis_down)] if redis_every else []
                if tamper_every:
                    breakers.append(chaos.Tamperer(server.url, store, victims, tamper_every))
                for breaker in breakers:
                    breaker.start()
                try:
                    result = _load(server, bodies, baseline, clients, seconds, abandon_every,
                                   _new_texts(texts, new_text_every))
                finally:
                    broken = {breaker.name: breaker.stop() for breaker in breakers}
                result.update(broken)
            finally:
                server.stop()
    finally:
        redis.close()
    _print(result)
    paths = bench.finish([result])
    return dict(result=result, paths=paths)


def _others(texts: list[str], pool: list[str]) -> list[str]:
    """The distinct texts that are not in the pool (the timing documents repeat now and then): damage to a victim
    must not reach the load's documents."""
    return [t for t in dict.fromkeys(texts) if t not in pool]


def _new_texts(texts: list[str], every: int):
    """`every`-th request's new raw text (None: the request as it is): a pool text with its words shuffled, a new
    document each time, stored and compiled on the fly."""
    import random

    def new_text(i: int) -> str | None:
        if not every or i % every != every - 1:
            return None
        words = texts[i % len(texts)].split()
        random.Random(i).shuffle(words)
        return " ".join(words)

    return new_text


def _answer(client, body: dict) -> str:
    r = client.post("/v1/query", json=body)
    r.raise_for_status()
    return r.json()["answer"]


def cache_mib(url: str) -> dict[str, float]:
    """MiB the server's prefix caches hold (its /metrics): the memory it is allowed to grow by, up to their budget."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {f"{sample.labels['cache']}_cache": sample.value / 2**20 for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == "ragcache_prefix_cache_bytes"}


def sample(server: throughput.Server) -> dict[str, float]:
    return {**rss_parts(server.proc.pid), **cache_mib(server.url)}


def _load(server: throughput.Server, bodies: list[dict], baseline: list[str], clients: int, seconds: float,
          abandon_every: int, new_text=lambda i: None) -> dict:
    import httpx

    counter, lock, stop = itertools.count(), threading.Lock(), threading.Event()
    latencies: list[float] = []
    status: Counter[int] = Counter()
    wrong: Counter[str] = Counter()
    asked: Counter[str] = Counter()
    connection_errors: list[str] = []
    abandoned = new = 0

    def worker() -> None:
        nonlocal abandoned, new
        with httpx.Client(base_url=server.url, timeout=900) as client:
            while not stop.is_set():
                i = next(counter)
                body = bodies[i % len(bodies)]
                if (text := new_text(i)) is not None:  # its answer is not the baseline's: not compared
                    body = dict(body, documents=[{"text": text}, *body["documents"][1:]])
                started = time.perf_counter()
                try:
                    if abandon_every and i % abandon_every == abandon_every - 1:
                        with client.stream("POST", "/v1/query", json=dict(body, stream=True)) as r:
                            next(r.iter_lines(), None)  # the first event, then the client leaves
                        with lock:
                            abandoned += 1
                        continue
                    r = client.post("/v1/query", json=body)
                except httpx.HTTPError as exc:
                    with lock:
                        connection_errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                with lock:
                    status[r.status_code] += 1
                    if r.status_code == 200:
                        latencies.append(time.perf_counter() - started)
                        asked[body["algorithm"]] += 1
                        if text is not None:
                            new += 1
                        elif r.json()["answer"] != baseline[i % len(bodies)]:
                            wrong[body["algorithm"]] += 1

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(clients)]
    started = time.perf_counter()
    parts = [(0.0, sample(server))]
    for thread in threads:
        thread.start()
    while (elapsed := time.perf_counter() - started) < seconds:
        time.sleep(min(RSS_EVERY_S, seconds - elapsed))
        parts.append((round(time.perf_counter() - started, 1), sample(server)))
        t, now = parts[-1]
        print(f"{t:7.0f} s  rss {now['VmRSS']:7.0f} MiB (anon {now.get('RssAnon', 0):.0f}, file "
              f"{now.get('RssFile', 0):.0f}, prefix cache {now.get('prefix_cache', 0):.0f})  answered "
              f"{sum(status.values())}", file=sys.stderr, flush=True)
    rss = [(t, p["VmRSS"]) for t, p in parts]
    stop.set()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    late = [mib for t, mib in rss if t >= seconds / 2]
    ordered = sorted(latencies)
    return dict(clients=clients, wall_s=wall, answered=sum(status.values()), abandoned=abandoned, new_texts=new,
                requests_per_s=status[200] / wall, status={str(k): v for k, v in sorted(status.items())},
                server_errors=sum(v for k, v in status.items() if k >= 500),
                connection_errors=len(connection_errors), connection_error_samples=connection_errors[:5],
                wrong_answers=dict(wrong), answers_by_algorithm=dict(asked),
                p50_s=statistics.median(ordered) if ordered else None,
                p99_s=ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else None,
                rss_mib=rss, rss_parts_mib=parts, rss_late_drift=(max(late) - min(late)) / statistics.mean(late) if late else None)


def _print(r: dict) -> None:
    print(f"{r['answered']} answered in {r['wall_s']:.0f} s ({r['requests_per_s']:.2f} req/s), "
          f"p50 {report.ms(r['p50_s'])} ms, p99 {report.ms(r['p99_s'])} ms; statuses {r['status']}; "
          f"{r['connection_errors']} connection errors; {r['abandoned']} streams abandoned")
    print(f"answers unlike the serial baseline: {r['wrong_answers'] or 'none'} of {r['answers_by_algorithm']}")
    first, last = r["rss_mib"][0][1], r["rss_mib"][-1][1]
    drift = r["rss_late_drift"]
    print(f"server RSS {first:.0f} -> {last:.0f} MiB; drift over the last half "
          f"{'n/a' if drift is None else f'{100 * drift:.1f}%'}")
    if "redis" in r:
        print(f"Redis killed {r['redis']['kills']} times, down {r['redis']['down_total_s']:.0f} s in all")
    for kind, tally in r.get("tampering", {}).items():
        print(f"tampered {kind}: " + ", ".join(f"{o} {tally[o]}" for o in chaos.OUTCOMES) +
              f"; repaired {tally['repaired']}, not {tally['not_repaired']}" +
              (f"; e.g. {tally['samples'][0][:160]}" if tally["samples"] else ""))
