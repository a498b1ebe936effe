"""Multi-round infilling (the EFIM paper's experiment at our scale): U users type into real code for R rounds.

    python bench/infill.py [--model qwen2.5-coder-0.5b] [--users 4] [--rounds 6] [--max-new-tokens 8] [--quick]
    .venv-vllm/bin/python bench/infill.py --engine vllm ...   # the same on vLLM (RagCache.open(engine="vllm"))

Each user opens a Python source file (the standard library's top-level modules, or --source) at a seeded line:
the prefix is the text before it (--prefix-chars), the suffix the text after the region the user will type
(--suffix-chars). Every round the user appends the next 1..4 real characters of the file to the prefix (so the
cursor is often inside a word) and asks for a completion: rc.infill(prefix, suffix, session=user), greedy.
Three configurations, each on its own engine (own caches) over one loaded model:

    no-reuse      mode psm,  reuse=False  every request is a full prefill
    fim+prefix    mode psm,  reuse=True   prefix caching: the prefix is reused, the suffix behind it recomputed
    efim+prefix   mode efim, reuse=True   <PRE>base<SUF>suffix<MID> stays cached per session; only the typed
                                          increment (after <MID>) is computed

Requests go round by round, configurations taking turns inside a round and users inside a configuration, so a
change of machine load hits all three alike. Requests are served one at a time (the engine serializes model
work), so throughput = completion tokens / the configuration's summed request seconds. Reported: TTFT (mean, p50,
p90, over all rounds and over rounds >= 2, where reuse can happen), time per output token (decode seconds / tokens
after the first), tokens/s and requests/s, prompt / recomputed / reused tokens per request. Writes
bench/results/infill-<model>[-tag].json and .png, the machine and its load average inside the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from bench import report  # noqa: E402


@dataclass(frozen=True)
class Config:
    label: str
    mode: str
    reuse: bool


VLLM_CONTEXT = 4096  # the vLLM engine's max_model_len: the windows below fit it

CONFIGS = (Config("no-reuse", "psm", False), Config("fim+prefix", "psm", True), Config("efim+prefix", "efim", True))


@dataclass
class User:
    name: str
    file: str
    line: int
    base: str  # prefix before the first round
    typed: list[str]  # what each round appends
    suffix: str

    def prefix(self, round_index: int) -> str:
        return self.base + "".join(self.typed[: round_index + 1])


def make_users(n: int, rounds: int, seed: int, prefix_chars: int, suffix_chars: int, typed: tuple[int, int],
               source: Path | None) -> list[User]:
    from ragcache.train.tasks import source_files

    rng = random.Random(seed)
    files = source_files(source)
    users: list[User] = []
    for attempt in range(100 * n):
        if len(users) == n:
            break
        path = rng.choice(files)
        text = path.read_text(encoding="utf-8", errors="replace")
        starts = [i + 1 for i, ch in enumerate(text) if ch == "\n"]
        pieces = [rng.randint(*typed) for _ in range(rounds)]
        need = sum(pieces)
        # a line start with room for the prefix window before and the typed text + suffix after
        ok = [s for s in starts if s >= min(prefix_chars, len(text) // 3) and s + need + 1 < len(text)
              and text[s:s + need].strip()]
        if not ok:
            continue
        at = rng.choice(ok)
        p0 = max(0, at - prefix_chars)
        nl = text.find("\n", p0, at)
        p0 = nl + 1 if p0 > 0 and nl != -1 else p0
        marks = [at + sum(pieces[:i]) for i in range(rounds + 1)]
        users.append(User(f"user{len(users)}", path.name, text.count("\n", 0, at) + 1, text[p0:at],
                          [text[a:b] for a, b in zip(marks, marks[1:])], text[marks[-1]:marks[-1] + suffix_chars]))
    if len(users) < n:
        raise SystemExit(f"could not place {n} users in the source files")
    return users


def run(args) -> dict:
    from ragcache import models
    from ragcache.facade import RagCache
    from ragcache.store.memory import MemoryStore

    users = make_users(args.users, args.rounds, args.seed, args.prefix_chars, args.suffix_chars,
                       (args.typed_min, args.typed_max), Path(args.source) if args.source else None)
    configs = [cfg for cfg in CONFIGS if cfg.reuse or args.engine == "ragcache"]  # vLLM's prefix cache is always on
    engines = {}
    with contextlib.ExitStack() as stack:
        if args.engine == "vllm":  # one vLLM per configuration: its own prefix cache
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="ragcache-infill-"))
            for cfg in configs:
                engines[cfg.label] = RagCache.open(args.model, f"disk:{folder}/{cfg.label}", engine="vllm",
                                                   max_model_len=VLLM_CONTEXT, kv_cache_gib=1)
                stack.callback(engines[cfg.label].close)
        else:
            lm = models.load(args.model)
            engines = {cfg.label: RagCache(lm, MemoryStore()) for cfg in configs}
        for cfg in configs:  # one-time initialisation, untimed
            engines[cfg.label].infill("def warm_up(", "):\n    pass\n", mode=cfg.mode, reuse=cfg.reuse,
                                      max_new_tokens=2)
        requests = rounds(args, users, configs, engines)
    return dict(users=[dict(name=u.name, file=u.file, line=u.line, base_chars=len(u.base), suffix_chars=len(u.suffix),
                            typed=u.typed) for u in users], requests=requests)


def rounds(args, users: list[User], configs: list[Config], engines: dict) -> list[dict]:
    requests = []
    for r in range(args.rounds):
        for cfg in configs:
            rc = engines[cfg.label]
            for user in users:
                answer = rc.infill(user.prefix(r), user.suffix, session=user.name, mode=cfg.mode, reuse=cfg.reuse,
                                   max_new_tokens=args.max_new_tokens)
                st = answer.stats
                requests.append(dict(config=cfg.label, round=r + 1, user=user.name, ttft_s=st.ttft_s,
                                     decode_s=st.decode_s, total_s=st.total_s, prompt_tokens=st.prompt_tokens,
                                     cached_tokens=st.cached_tokens, recomputed_tokens=st.recomputed_tokens,
                                     completion_tokens=st.completion_tokens, text=answer.text[:60]))
        if not args.quiet:
            done = [q for q in requests if q["round"] == r + 1]
            line = "  ".join(f"{c.label} {1e3 * statistics.fmean(q['ttft_s'] for q in done if q['config'] == c.label):.0f}ms"
                             for c in configs)
            print(f"round {r + 1}/{args.rounds}: mean TTFT {line}  (load {report.load_average()})", flush=True)
    return requests


def summarize(requests: list[dict]) -> list[dict]:
    rows = []
    for cfg in (cfg for cfg in CONFIGS if any(q["config"] == cfg.label for q in requests)):
        mine = [q for q in requests if q["config"] == cfg.label]
        later = [q for q in mine if q["round"] >= 2]
        ttft = [q["ttft_s"] for q in mine]
        ttft_later = [q["ttft_s"] for q in later]
        busy = sum(q["total_s"] for q in mine)
        tokens = sum(q["completion_tokens"] for q in mine)
        after_first = sum(max(0, q["completion_tokens"] - 1) for q in mine)
        rows.append(dict(
            config=cfg.label, mode=cfg.mode, reuse=cfg.reuse, requests=len(mine),
            ttft_mean_s=statistics.fmean(ttft), ttft_p50_s=report.percentile(ttft, 50),
            ttft_p90_s=report.percentile(ttft, 90),
            ttft_mean_round2plus_s=statistics.fmean(ttft_later) if later else None,
            ttft_p90_round2plus_s=report.percentile(ttft_later, 90) if later else None,
            tpot_s=sum(q["decode_s"] for q in mine) / after_first if after_first else None,
            latency_mean_s=busy / len(mine),
            tokens_per_s=tokens / busy if busy else None, requests_per_s=len(mine) / busy if busy else None,
            completion_tokens_mean=tokens / len(mine),
            prompt_tokens_mean=statistics.fmean(q["prompt_tokens"] for q in mine),
            recomputed_tokens_mean=statistics.fmean(q["recomputed_tokens"] for q in mine),
            cached_tokens_mean=statistics.fmean(q["cached_tokens"] for q in mine),
            recomputed_tokens_mean_round2plus=statistics.fmean(q["recomputed_tokens"] for q in later) if later else None,
            ttft_by_round_s=[statistics.fmean(q["ttft_s"] for q in mine if q["round"] == r)
                             for r in sorted({q["round"] for q in mine})],
        ))
    # against the first configuration that ran: no-reuse, or on vLLM (no no-reuse there) PSM with prefix caching;
    # the field names say which
    base = rows[0]
    against = base["config"].replace("+", "_").replace("-", "_")
    for row in rows:
        row[f"ttft_round2plus_vs_{against}"] = (row["ttft_mean_round2plus_s"] / base["ttft_mean_round2plus_s"]
                                                if row["ttft_mean_round2plus_s"] and base["ttft_mean_round2plus_s"]
                                                else None)
        row[f"throughput_vs_{against}"] = (row["requests_per_s"] / base["requests_per_s"]
                                           if row["requests_per_s"] and base["requests_per_s"] else None)
    return rows


def plot(rows: list[dict], machine: dict, title: str):
    def draw(path: Path) -> None:
        plt = report.pyplot()
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
        labels = [r["config"] for r in rows]
        for r in rows:
            xs = list(range(1, len(r["ttft_by_round_s"]) + 1))
            axes[0].plot(xs, [t * 1e3 for t in r["ttft_by_round_s"]], marker="o", label=r["config"])
        axes[0].set(xlabel="round", ylabel="mean TTFT (ms)", title="TTFT by round", xticks=xs)
        axes[0].legend()
        later = [(r["ttft_mean_round2plus_s"] or 0) * 1e3 for r in rows]
        tpot = [(r["tpot_s"] or 0) * 1e3 for r in rows]
        xs = range(len(rows))
        axes[1].bar([x - 0.2 for x in xs], later, width=0.4, label="TTFT, rounds >= 2")
        axes[1].bar([x + 0.2 for x in xs], tpot, width=0.4, label="time per output token")
        axes[1].set(xticks=list(xs), xticklabels=labels, ylabel="ms", title="latency")
        axes[1].legend()
        axes[2].bar(labels, [r["requests_per_s"] or 0 for r in rows], color="tab:green")
        axes[2].set(ylabel="requests / s (one at a time)", title="throughput")
        threads = f"{machine.get('torch_threads')} torch threads"
        fig.suptitle(f"{title}\n{report.subtitle(machine, threads)}", fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    return draw


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", "-m", default="qwen2.5-coder-0.5b", help="built-in name, transformers dir or hub id")
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--prefix-chars", type=int, default=1200)
    ap.add_argument("--suffix-chars", type=int, default=600)
    ap.add_argument("--typed-min", type=int, default=1, help="characters a user types per round, at least")
    ap.add_argument("--typed-max", type=int, default=4, help="... at most")
    ap.add_argument("--source", default=None, help="Python sources the users edit (default: the stdlib)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    ap.add_argument("--tag", default="", help="suffix of the result file names")
    ap.add_argument("--quick", action="store_true", help="2 users x 3 rounds, short windows, 4 new tokens")
    ap.add_argument("--engine", choices=("ragcache", "vllm"), default="ragcache",
                    help="vllm: the same requests through RagCache.open(engine='vllm') (run with vLLM's venv), where "
                         "no-reuse is not offered")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.users, args.rounds, args.max_new_tokens = min(args.users, 2), min(args.rounds, 3), min(args.max_new_tokens, 4)
        args.prefix_chars, args.suffix_chars = min(args.prefix_chars, 200), min(args.suffix_chars, 80)
    if args.users < 1 or args.rounds < 1 or args.max_new_tokens < 1 or not 1 <= args.typed_min <= args.typed_max:
        ap.error("--users, --rounds, --max-new-tokens must be >= 1 and 1 <= --typed-min <= --typed-max")

    if args.threads:  # before the machine is recorded; on a loaded 2-core box 1 thread beat 2 by 4-6x (spinning)
        import torch

        torch.set_num_threads(args.threads)
    params = {k: v for k, v in vars(args).items() if k not in ("quiet", "out")}
    bench = report.Run("infill", params, Path(args.out) if args.out else None)
    data = run(args)
    rows = summarize(data["requests"])
    table = [[r["config"], f"{r['mode']}{' reuse' if r['reuse'] else ''}", r["requests"], report.ms(r["ttft_mean_s"]),
              report.ms(r["ttft_p50_s"]), report.ms(r["ttft_p90_s"]), report.ms(r["ttft_mean_round2plus_s"]),
              report.ms(r["tpot_s"]), f"{r['tokens_per_s']:.2f}", f"{r['requests_per_s']:.3f}",
              f"{r['prompt_tokens_mean']:.0f}", f"{r['recomputed_tokens_mean']:.0f}", f"{r['cached_tokens_mean']:.0f}"]
             for r in rows]
    title = (f"infill: {args.model}, {args.users} users x {args.rounds} rounds, typing {args.typed_min}-"
             f"{args.typed_max} chars/round, max {args.max_new_tokens} new tokens")
    report.print_table(title, ["config", "mode", "n", "TTFT ms", "p50", "p90", "TTFT r>=2", "TPOT ms", "tok/s",
                               "req/s", "prompt", "recomputed", "reused"], table,
                       caption=f"load average {bench.machine['load_average_start']} -> {report.load_average()}")
    extra = dict(users=data["users"], requests=data["requests"],
                 note="CPU timings on a shared machine; see machine.load_average_start/_end")
    paths = bench.finish(rows, extra=extra, plot=_plot_or_none(rows, bench.machine, title))
    return dict(summary=rows, paths=paths)


def _plot_or_none(rows, machine, title):
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install matplotlib)")
        return None
    return plot(rows, machine, title)


if __name__ == "__main__":
    main()
