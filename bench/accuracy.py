"""Accuracy of every algorithm on SQuAD v1.1 dev: the gold paragraph plus 3 distractors from other articles,
shuffled, each a separate document (chunk). All algorithms answer the same items from the same token ids.

    python -m bench accuracy --model gemma3-270m --n 50
    python -m bench accuracy --sample --n 5            # the shipped 20-item sample, no download

Greedy, at most --max-new-tokens tokens, cut at the first newline once the answer has started (a leading newline,
which Gemma often produces, does not end it). Scores (SQuAD v1.1 normalisation, max over the
gold answers): exact match (EM) and token F1; agreement with full's answer (normalised text equal, and F1
against it); each with a 95% interval over items (Wilson's for a share of items, else the percentile bootstrap,
2,000 resamples), and the paired
difference of F1 from full's with its own interval. Writes bench/results/accuracy-<model>.json and .png.

The whole answer against `full`'s answer as the engine serves it (its first line, in ids): the share of it each
algorithm's greedy answer reproduces before it first departs, and whether it reproduces all of it; and,
teacher-forced along that same answer of full's on the linked cache (bench/agreement.py), the share of positions
where its argmax is full's token (results before 2026-12-01 teacher-forced along a greedy loop of full's own, which
departed from the served answer in bf16).

Distribution-level metrics (bench/agreement.py), from linking without decoding, at the answer's first position:
next-token top-1 agreement with full, KL(full || linked), and the teacher-forced log-likelihood of full's served
answer under the linked cache (its paired difference from full's own). These resolve algorithms on small models
where EM/F1 intervals all overlap; the paired difference of top-1 agreement from naive's says whether an
algorithm recovers what naive loses.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

from ragcache.calibrate import wilson_interval

from . import agreement, report, squad
from .common import Variant, engine, load_model

RESAMPLES = 2000
STOP = "the first newline after the answer's first visible character"


def first_line(text: str) -> str:
    """The answer up to the first newline once it has started: a model that opens with a newline (Gemma often
    does) is not cut to nothing, which a plain stop string at "\n" would do."""
    return text.lstrip().split("\n", 1)[0].strip()


def bootstrap(values: list[float], seed: int = 0, resamples: int = RESAMPLES) -> tuple[float, float, float]:
    """(mean, low, high): 95% percentile bootstrap over items."""
    if not values:
        return float("nan"), float("nan"), float("nan")
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(values[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    return sum(values) / n, means[int(0.025 * resamples)], means[min(int(0.975 * resamples), resamples - 1)]


def _ci(values: list[float], seed: int, share: bool = False) -> dict:
    """Mean and 95% interval: Wilson's for a `share` of items (each value 0 or 1: EM, agreement, top-1), whose
    percentile bootstrap is [1, 1] when all of them hold (n = 30 is no proof of 1.000); the bootstrap for the rest
    (F1, KL, differences, which may be 0 on every item and are then [0, 0])."""
    if share and values:
        low, high = wilson_interval(int(sum(values)), len(values))
        return dict(mean=round(sum(values) / len(values), 4), ci95=[round(low, 4), round(high, 4)], interval="wilson")
    mean, low, high = bootstrap(values, seed)
    return dict(mean=round(mean, 4), ci95=[round(low, 4), round(high, 4)])


def run(model: str, n: int, sample: bool, seed: int, variants: list[Variant], max_new_tokens: int,
        system: str | None = None, out_dir: Path | None = None, tag: str = "") -> dict:
    items = squad.load_items(n, seed=seed, sample=sample)
    params = dict(model=model, n=len(items), sample=sample, seed=seed, algorithms=[v.label for v in variants],
                  max_new_tokens=max_new_tokens, stop=STOP, system=system, distractors=3,
                  data="bench/data/squad_sample.jsonl" if sample else "SQuAD v1.1 dev (bigbench==1.0.0)", tag=tag)
    bench = report.Run("accuracy", params, out_dir)
    lm = load_model(model)
    rc = engine(lm, "memory:", 512)
    bench.params.update(dtype=str(lm.dtype).removeprefix("torch."), kv_codec=rc.compiler.codec)  # as computed, stored
    rc.warmup()
    labels = [v.label for v in variants]
    if "full" not in labels:
        variants = [Variant("full", "full")] + variants  # agreement is measured against full
        labels = ["full"] + labels
    per_item = []
    started = time.perf_counter()
    stops = agreement_stops(rc)
    for i, item in enumerate(items):
        doc_ids = rc.compile(item.documents)
        answers = {}
        full = rc.link(item.question, doc_ids, system=system, algorithm="full", max_new_tokens=max_new_tokens)
        # full's answer as the engine serves it, to its first line: what the teacher-forced metrics follow as the
        # whole-answer ones do (a greedy loop of its own over this cache departed from it in bf16)
        served = rc.query(item.question, doc_ids, max_new_tokens=max_new_tokens, system=system, algorithm="full")
        full_ids = first_line_ids(served.token_ids, stops[1])
        content = agreement.content_position(rc.tokenizer, full_ids)
        full_forced = rc.with_runner(agreement.teacher_forced, full, full_ids)[1] if content is not None else None
        for v in variants:
            ans = rc.query(item.question, doc_ids, max_new_tokens=max_new_tokens, system=system, **v.kwargs)
            text = first_line(ans.text)
            answers[v.label] = dict(text=text, em=squad.exact_match(text, item.answers),
                                    f1=squad.token_f1(text, item.answers),
                                    token_ids=ans.token_ids,
                                    recomputed=ans.stats.recomputed_tokens, prompt_tokens=ans.stats.prompt_tokens,
                                    ttft_s=ans.stats.ttft_s, decode_s=ans.stats.decode_s,
                                    tokens=len(ans.token_ids))
            linked = full if v.algorithm == "full" else rc.link(item.question, doc_ids, system=system,
                                                                  max_new_tokens=max_new_tokens, **v.kwargs)
            answers[v.label].update(vars(rc.with_runner(agreement.measure, full.last_logits, linked, full_ids,
                                                        full_forced, content)))
        full = answers["full"]["text"]
        full_answer = first_line_ids(answers["full"]["token_ids"], stops[1])  # full's own answer, as served
        for a in answers.values():
            ids = first_line_ids(a.pop("token_ids"), stops[1])
            a["reproduced"], a["whole"] = reproduced(ids, full_answer), float(ids == full_answer)
            a["agree"] = float(squad.normalize(a["text"]) == squad.normalize(full))
            a["f1_vs_full"] = squad.token_f1(a["text"], [full]) if full else float(not a["text"])
        per_item.append(dict(id=item.id, question=item.question, gold_answers=item.answers, gold_doc=item.gold,
                             answers=answers))
        for doc_id in set(doc_ids):
            rc.delete_document(doc_id)  # keep the memory store small; every item's documents are new anyway
        elapsed = time.perf_counter() - started
        print(f"[{i + 1}/{len(items)}] {elapsed:.0f}s  " + "  ".join(f"{k}={answers[k]['f1']:.2f}" for k in labels),
              file=sys.stderr, flush=True)
    results = summarize(per_item, labels, seed, {v.label for v in variants if v.params.get("repair")})
    _print(results, bench.machine, model, len(items))
    paths = bench.finish(results, dict(items=per_item),
                         plot=lambda p: plot(results, bench.machine, p, model, len(items)))
    return dict(results=results, paths=paths)


def first_line_ids(ids: list[int], newlines: dict[int, bool]) -> list[int]:
    """An answer's ids up to its first line's end (a newline once it has started), as `first_line` cuts its text.
    `newlines`: the ids whose text holds a newline -> whether text comes before it in that token ("tall.\n"): such
    a token ends the line and is part of it (cut before it, "tall!\n" and "tall.\n" would read as the same answer)."""
    for i, token in enumerate(ids):
        if token in newlines:
            if newlines[token]:
                return ids[: i + 1]
            if i > 0:
                return ids[:i]
    return ids


def reproduced(answer: list[int], full_answer: list[int]) -> float:
    """The share of full's greedy answer (to its first line) that this answer reproduces before it first departs:
    1.0 for all of it, 0.0 when the first token differs. An empty full answer is reproduced by an empty one."""
    if not full_answer:
        return float(not answer)
    same = next((i for i, (a, b) in enumerate(zip(answer, full_answer)) if a != b), min(len(answer), len(full_answer)))
    return same / len(full_answer)


def agreement_stops(rc) -> tuple[set[int], dict[int, bool]]:
    """End-of-turn ids, and the ids whose text holds a newline (an answer ends at its first line), each with
    whether text comes before its newline (`first_line_ids`)."""
    from ragcache.engine import eos_ids

    tok, newlines = rc.tokenizer, {}
    for i in range(len(tok)):
        text = tok.decode([i])
        if "\n" in text:
            newlines[i] = bool(text.split("\n", 1)[0].strip())
    return eos_ids(rc.lm), newlines


def summarize(per_item: list[dict], labels: list[str], seed: int = 0, repairing: set[str] = frozenset()) -> list[dict]:
    """Per label. `repairing`: labels whose answers were repaired while decoded; their teacher-forced metrics (token
    agreement, ΔLL, the content word's) follow full's answer over the link's cache before any repair, and say so."""
    out = []
    full_f1 = [it["answers"]["full"]["f1"] for it in per_item]
    full_ll = [it["answers"]["full"]["ll"] for it in per_item]
    naive = [it["answers"]["naive"]["top1"] for it in per_item] if "naive" in labels else None
    for label in labels:
        got = [it["answers"][label] for it in per_item]
        f1 = [a["f1"] for a in got]
        top1 = [a["top1"] for a in got]
        row = dict(label=label, n=len(got), em=_ci([a["em"] for a in got], seed, share=True), f1=_ci(f1, seed),
                   agree_with_full=_ci([a["agree"] for a in got], seed, share=True),
                   f1_vs_full=_ci([a["f1_vs_full"] for a in got], seed),
                   delta_f1_vs_full=_ci([x - y for x, y in zip(f1, full_f1)], seed),
                   top1=_ci(top1, seed, share=True), kl=_ci([a["kl"] for a in got], seed),
                   # the whole answer: greedy share of full's reproduced before departing, and teacher-forced along it
                   reproduced=_ci([a["reproduced"] for a in got], seed),
                   whole_answer=_ci([a["whole"] for a in got], seed, share=True),
                   token_agree=_ci([a["token_agree"] for a in got], seed),
                   delta_ll_vs_full=_ci([a["ll"] - y for a, y in zip(got, full_ll)], seed),
                   delta_top1_vs_naive=_ci([x - y for x, y in zip(top1, naive)], seed) if naive else None,
                   mean_recomputed=round(sum(a["recomputed"] for a in got) / max(len(got), 1), 1),
                   # the answers' tokens after the first over their decode time, all items pooled (repair's cost)
                   decode_tok_s=round(sum(max(a["tokens"] - 1, 0) for a in got)  # an answer that ended at once: 0
                                      / max(sum(a["decode_s"] for a in got), 1e-9), 2),
                   mean_ttft_s=round(sum(a["ttft_s"] for a in got) / max(len(got), 1), 4),
                   mean_prompt_tokens=round(sum(a["prompt_tokens"] for a in got) / max(len(got), 1), 1))
        if label in repairing:
            row["teacher_forced"] = "over the cache before repair"
        words = [a for a in got if a.get("content_top1") is not None]  # items whose answer has a content word
        if words:
            row.update(content_n=len(words), content_top1=_ci([a["content_top1"] for a in words], seed, share=True),
                       content_kl=_ci([a["content_kl"] for a in words], seed))
        out.append(row)
    return out


def _fmt(ci: dict) -> str:
    return f"{ci['mean']:.3f} [{ci['ci95'][0]:.3f}, {ci['ci95'][1]:.3f}]"


def _print(results: list[dict], machine: dict, model: str, n: int) -> None:
    headers = ["algorithm", "n", "EM", "F1", "ΔF1 vs full", "agree w/ full", "F1 vs full", "recomputed/prompt"]
    rows = [[r["label"], r["n"], _fmt(r["em"]), _fmt(r["f1"]), _fmt(r["delta_f1_vs_full"]), _fmt(r["agree_with_full"]),
             _fmt(r["f1_vs_full"]), f"{r['mean_recomputed']:.0f}/{r['mean_prompt_tokens']:.0f}"] for r in results]
    report.print_table(f"SQuAD v1.1 dev, gold + 3 distractors, {model} (mean [95% CI: Wilson for shares, else bootstrap])", headers, rows,
                       caption=report.subtitle(machine, f"n={n}"))
    report.print_table(f"First answer position vs full, {model} (mean [95% CI: Wilson for shares, else paired bootstrap])",
                       *_distribution_rows(results), caption=report.subtitle(machine, f"n={n}"))
    report.print_table(f"The whole answer vs full's served answer, {model} (mean [95% CI: Wilson for shares, else bootstrap])",
                       ["algorithm", "first token", "share reproduced before departing", "whole answer",
                        "teacher-forced token agreement", "F1 vs full", "TTFT s", "decode tok/s"],
                       [[r["label"], _fmt(r["top1"]), _fmt(r["reproduced"]), _fmt(r["whole_answer"]),
                         _fmt(r["token_agree"]) + (" (before repair)" if "teacher_forced" in r else ""),
                         _fmt(r["f1_vs_full"]), f"{r['mean_ttft_s']:.3f}",
                         f"{r['decode_tok_s']:.1f}"] for r in results],
                       caption=report.subtitle(machine, f"n={n}"))


def _distribution_rows(results: list[dict]) -> tuple[list[str], list[list[str]]]:
    headers = ["algorithm", "top-1 agreement", "Δtop-1 vs naive", "KL(full||linked)", "Δ teacher-forced LL",
               "top-1 at first content word (n)", "KL there"]
    rows = [[r["label"], _fmt(r["top1"]), _fmt(r["delta_top1_vs_naive"]) if r.get("delta_top1_vs_naive") else "-",
             _fmt(r["kl"]), _fmt(r["delta_ll_vs_full"]),
             f"{_fmt(r['content_top1'])} ({r['content_n']})" if "content_top1" in r else "-",
             _fmt(r["content_kl"]) if "content_kl" in r else "-"] for r in results if "top1" in r]
    return headers, rows


def plot(results: list[dict], machine: dict, path: Path, model: str, n: int) -> None:
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    metrics = [("em", "EM"), ("f1", "F1"), ("agree_with_full", "agrees with full")]
    width = 0.8 / len(metrics)
    for j, (key, name) in enumerate(metrics):
        xs = [i + (j - 1) * width for i in range(len(results))]
        means = [r[key]["mean"] for r in results]
        errs = [[m - r[key]["ci95"][0] for m, r in zip(means, results)],
                [r[key]["ci95"][1] - m for m, r in zip(means, results)]]
        ax.bar(xs, means, width, yerr=errs, capsize=2, label=name)
    ax.set_xticks(range(len(results)), [r["label"] for r in results], rotation=20)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("mean, 95% CI (Wilson for shares)")
    ax.legend(fontsize=8)
    ax.set_title(f"SQuAD v1.1 dev (gold + 3 distractors), {model}, n={n} — {report.subtitle(machine)}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(data: dict) -> str:
    headers = ["algorithm", "n", "EM", "F1", "ΔF1 vs full", "agrees with full", "F1 vs full's answer",
               "recomputed / prompt tokens"]
    rows = [[r["label"], r["n"], _fmt(r["em"]), _fmt(r["f1"]), _fmt(r["delta_f1_vs_full"]), _fmt(r["agree_with_full"]),
             _fmt(r["f1_vs_full"]), f"{r['mean_recomputed']:.0f} / {r['mean_prompt_tokens']:.0f}"]
            for r in data["results"]]
    text = report.header_line(data) + "\n\n" + report.markdown_table(headers, rows)
    if any("top1" in r for r in data["results"]):
        text += "\n\n" + report.markdown_table(*_distribution_rows(data["results"]))
    return text
