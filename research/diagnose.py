"""Why does LegoLink lose `full`'s answer? Vary one thing at a time on SQuAD (gold + 3 distractors, one chunk
per paragraph) and measure, per item, the cheap distribution-level metrics of bench/agreement.py.

    python -m research.diagnose --model qwen2.5-coder-0.5b --n 60 --out research/results/diagnose-qwen.json

Configurations (each item's chunks are compiled once per layout and reused by every selection):
  layouts   plain (today), sep ("\\n\\n" closing every stored chunk), bos (<|endoftext|> stored in front of
            every chunk: full sees it too), sink (4 dummy sinks prefilled and dropped), prefixed (compiled
            behind the real system prefix, dropped), filler (compiled behind the system prefix and one fixed
            other document, both dropped: each chunk is stored as it looks after *some* document), system (a
            system prompt in the chat header), qfirst (the question before the documents, in the exact prefix;
            the chunks were compiled without it)
  selections at fraction f of chunk tokens: first (LegoLink), random, qattn (question attention at one
            layer), qattn-all (summed over layers), mixed (first 4 per chunk + qattn), oracle (rows whose
            placed K/V deviate most from full's), focus (the linker's `focus`, = mixed), mixed16 (first 16 per
            chunk + qattn), late (mixed, attention summed over the upper half of the layers only), chunk (first 4
            per chunk, then whole chunks from their start, most-attended chunk first), qfull (mixed scored by
            full's question attention: what a perfect attention estimate would pick), span (mixed, each
            scored row bringing the SPAN rows before it), focus2 (focus in two rounds: half the budget, then
            the question's attention measured again on that cache picks the other half), tempF (focus with the
            keys of the rows it leaves stale times F: APE's attention temperature 1/F on them), exact1 (prefixed
            setup only: mixed's budget spent on the chunks after the first, whose cache is already full's)
  cacheblend at ratio r by K deviation (the linker's default) and, with --vratios, by V deviation (EPIC's code)
The JSON is rewritten after every item, so a run can be read while it goes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench import agreement, squad
from research import rows as proto
from bench.common import load_model
from ragcache import prompt
from ragcache.compiler import PLAIN, Compiler, Layout
from ragcache.engine import eos_ids
from ragcache import linker
from ragcache.linker import LinkInput, LinkParams, link
from ragcache.engine import Runner

SINKS = 4
DECIDED = 0.2  # full's first-token margin p(top-1) - p(top-2) from which an item counts as decided, not a near-tie
SPAN = 2  # `span`: each row the question reads brings this many rows before it
PROBE_STRIDE = 8  # `probe`: every 8th chunk row is recomputed to estimate the chunk's shift (12.5% of the budget)
SYSTEM = "You are a helpful assistant. Answer the question with a short span copied from the documents."
# EPIC's LongBench QA suffix (benchmarks_ours/data_sets/hotpotqa.py): without it Qwen answers in sentences, so the
# first answer token is boilerplate ("The", "Based") and F1 over a few tokens means little.
INSTRUCTION = ("Answer the question based on the given passages. Only give me the answer and do not output any "
               "other words.\n\nQuestion: {question}\nAnswer within 5 words:")
# --setups qfirst: the question opens the user turn, before the documents, and the instruction after them drops it
QFIRST = "Question: {question}\n\n"
QFIRST_INSTRUCTION = ("Answer the question based on the given passages. Only give me the answer and do not output "
                      "any other words.\nAnswer within 5 words:")
TWO = "Question 1: {0}\nQuestion 2: {1}"  # --task two: both questions in one, answers separated by ";"
TWO_INSTRUCTION = ("Answer the two questions based on the given passages. Only give me the two answers, separated by "
                   "a semicolon, and do not output any other words.\n\n{question}\nAnswers within 5 words each:")


@dataclass
class Setup:
    name: str
    layout: Layout
    separator: str = ""
    system: str | None = None


def filler_text() -> str:
    """A Wikipedia paragraph from the shipped sample (seed 0), for the `filler` layout's context."""
    return squad.load_items(1, sample=True)[0].documents[0].strip()


def layouts(lm, prefix_ids: list[int]) -> dict[str, Setup]:
    filler = lm.tokenizer(filler_text(), add_special_tokens=False)["input_ids"]  # documents follow one another
    pad = lm.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    if not isinstance(pad, int) or pad < 0:
        pad = lm.tokenizer.eos_token_id
    return {
        "plain": Setup("plain", PLAIN),
        "sep": Setup("sep", PLAIN, separator="\n\n"),
        "bos": Setup("bos", Layout("bos", lead_ids=(pad,))),
        "sink": Setup("sink", Layout("sink", sink_ids=(pad,) * SINKS)),
        "prefixed": Setup("prefixed", Layout("prefixed", sink_ids=tuple(prefix_ids))),
        "filler": Setup("filler", Layout("filler", sink_ids=tuple(prefix_ids + filler))),
        "system": Setup("system", PLAIN, system=SYSTEM),
        "qfirst": Setup("qfirst", PLAIN),
    }


def newline_ids(tok) -> dict[int, bool]:
    """Ids whose text holds a newline (byte-level BPE spells it 'Ċ'), each with whether text comes before it
    (agreement.greedy); decoding 150k ids one by one is slow."""
    tokens = tok.convert_ids_to_tokens(list(range(len(tok))))
    return {
        i: bool(t.replace("Ċ", "\n").split("\n", 1)[0].strip())
        for i, t in enumerate(tokens)
        if t and ("\n" in t or "Ċ" in t)
    }


class Item:
    """One SQuAD item in one setup: its link inputs with compiled entries, full's reference and answer."""

    def __init__(self, runner: Runner, compiler: Compiler, lm, fmt, item: squad.Item, setup: Setup, instruct: bool):
        tok = lm.tokenizer
        prefix = prompt.system_prefix_ids(tok, fmt, setup.system)
        chunks = [tok(doc.strip() + setup.separator, add_special_tokens=False)["input_ids"] for doc in item.documents]
        question = prompt.question_ids(tok, fmt, item.question, with_docs=True)
        if instruct:
            template = TWO_INSTRUCTION if item.question.startswith("Question 1:") else INSTRUCTION
            text = "\n\n" + template.format(question=item.question.strip()) + fmt.tail
            question = tok(text, add_special_tokens=False)["input_ids"]
        if setup.name == "qfirst":  # the prefix is compiled per item, so it stays exact; the chunks never see it
            prefix = prefix + tok(QFIRST.format(question=item.question.strip()), add_special_tokens=False)["input_ids"]
            question = tok("\n\n" + QFIRST_INSTRUCTION + fmt.tail, add_special_tokens=False)["input_ids"]
        layout = setup.layout
        if layout.name == "prefixed":
            layout = Layout("prefixed", sink_ids=tuple(prefix))
        self.parts = LinkInput(prefix, [compiler.stored_ids(c, layout) for c in chunks], question)
        self.parts.chunk_entries = [compiler.compile(c, layout) for c in chunks]
        self.parts.prefix_entry = compiler.compile(prefix, PLAIN) if prefix else None
        self.chunk_tokens = sum(map(len, self.parts.chunk_ids))


def run(model: str, n: int, seed: int, out: Path, fractions: list[float], ks: list[int], ratios: list[float],
        setups: list[str], decode: list[str], max_new: int, qlayer: int, selections: list[str],
        instruct: bool = True, vratios: list[float] = (), start: int = 0, task: str = "squad",
        dtype: str = "auto", reference: str | None = None) -> None:
    lm = load_model(model, dtype)
    dtype = str(next(lm.model.parameters()).dtype).removeprefix("torch.")
    runner = Runner(lm)
    compiler = Compiler(lm, runner)
    if reference:  # full in another dtype is the reference; full in this one becomes a config (full-<dtype>)
        ref_lm = load_model(model, reference)
        ref_runner = Runner(ref_lm)
        ref_compiler = Compiler(ref_lm, ref_runner)
    fmt = prompt.PromptFormat.for_tokenizer(lm.tokenizer)
    stops = eos_ids(runner.lm)
    newline = newline_ids(lm.tokenizer)
    plain_prefix = prompt.system_prefix_ids(lm.tokenizer, fmt, None)
    known = layouts(lm, plain_prefix)
    items = (two_document_items(n, seed) if task == "two" else squad.load_items(n, seed=seed))[start:]
    records: list[dict] = []
    started = time.perf_counter()
    for i, sq in enumerate(items):
        record = dict(id=sq.id, question=sq.question, answers=sq.answers, configs={})
        if isinstance(sq, TwoItem):
            record["answers2"] = sq.answers2
        for name in setups:
            item = Item(runner, compiler, lm, fmt, sq, known[name], instruct)
            ref = (ref_runner, Item(ref_runner, ref_compiler, ref_lm, fmt, sq, known[name], instruct).parts,
                   dtype) if reference else None
            _setup(runner, item, name, record, fractions, ks, ratios, decode, stops, newline, max_new, qlayer,
                   lm.tokenizer, start + i, selections, vratios, ref)
            print(f"  {name} {time.perf_counter() - started:.0f}s", file=sys.stderr, flush=True)
        records.append(record)
        kind = f"{dtype} against a {reference} full" if reference else dtype  # never paired with a same-dtype run
        out.write_text(json.dumps(dict(model=model, dtype=kind, n=len(records), seed=seed, start=start, qlayer=qlayer,
                                       task=task, instruct=instruct, items=records)))
        print(f"[{i + 1}/{len(items)}] {time.perf_counter() - started:.0f}s", file=sys.stderr, flush=True)


def _setup(runner, item: Item, name: str, record: dict, fractions, ks, ratios, decode, stops, newline, max_new,
           qlayer, tok, seed, selections, vratios=(), reference=None) -> None:
    """`reference`: (runner, parts, this dtype's name) of a model in another dtype, whose `full` every config is
    measured against, this dtype's `full` included (as `full-<dtype>`: the floor that precision alone sets)."""
    parts = item.parts
    full = link(runner, parts, LinkParams("full"), extra_capacity=max_new + 1)
    ref_runner, ref = runner, full
    if reference:
        ref_runner = reference[0]
        ref = link(ref_runner, reference[1], LinkParams("full"), extra_capacity=max_new + 1)
    answer = agreement.greedy(ref_runner, ref, max_new, stops, newline) if max_new else []
    text = tok.decode(answer).strip()
    configs = record["configs"]
    content = agreement.content_position(tok, answer)
    ref_forced = agreement.teacher_forced(ref_runner, ref, answer)
    full_forced = ref_forced[1] if content is not None else None
    # full against itself: token/answer agreement 1 unless batched and one-by-one decoding split a tie
    configs[f"{name}/full"] = dict(vars(agreement.measure(ref_runner, ref.last_logits, ref, answer, full_forced,
                                                          content, forced=ref_forced)),
                                   margin=agreement.margin(ref.last_logits), recomputed=parts.token_ids.numel(),
                                   chunk_tokens=item.chunk_tokens, text=text, **score(text, record))

    def measure(label: str, linked, rows: int) -> None:
        row = dict(vars(agreement.measure(runner, ref.last_logits, linked, answer, full_forced, content)),
                   recomputed=rows, chunk_tokens=item.chunk_tokens)
        if any(label.endswith(d) for d in decode) and max_new:
            got = tok.decode(agreement.greedy(runner, linked, max_new, stops, newline)).strip()
            row.update(text=got, **score(got, record))
        configs[f"{name}/{label}"] = row

    cap = max_new + 1
    if reference:
        measure(f"full-{reference[2]}", full, parts.token_ids.numel())
    for k in ks:
        linked = link(runner, parts, LinkParams("legolink", k=k), extra_capacity=cap)
        measure(f"legolink-{k}", linked, sum(min(k, len(c)) for c in parts.chunk_ids))
    for r in ratios:
        linked = link(runner, parts, LinkParams("cacheblend", ratio=r), extra_capacity=cap)
        measure(f"cacheblend-{r}", linked, linked.recomputed_tokens - len(parts.question_ids))
    for r in vratios:
        linked = link(runner, parts, LinkParams("cacheblend", ratio=r, deviation="value"), extra_capacity=cap)
        measure(f"cacheblend-v-{r}", linked, linked.recomputed_tokens - len(parts.question_ids))
    if not fractions:
        return
    attention = proto.question_attention(runner, parts)
    names = {label.partition("@")[0] for label in selections}
    if "oracle" in names:
        keys, values = proto.placed_kv(runner, parts)
        oracle = proto.deviation_from_full(full, keys, values)
        record.setdefault("profiles", {})[name] = deviation_profile(full, keys, values, parts, attention)
    if "qfull" in names:  # full's cache already holds the question's K/V: the pass rewrites the same values
        with torch.inference_mode():
            true_attention = linker.question_attention(runner, parts, full.cache)
    sinks, firsts = proto.leading_rows(parts, 4), proto.leading_rows(parts, 16)
    upper = attention[attention.shape[0] // 2:].sum(0)
    for f in fractions:
        count = proto.budget(parts, f)
        choices = {
            "first": lambda: proto.first_rows(parts, f),
            "random": lambda: proto.random_rows(parts, f, seed),
            "qattn": lambda: proto.top_rows(parts, attention[qlayer], count),
            "qattn-all": lambda: proto.top_rows(parts, attention.sum(0), count),
            "mixed": lambda: proto.top_rows(parts, attention.sum(0), count, forced=sinks[:count]),
            "mixed16": lambda: proto.top_rows(parts, attention.sum(0), count, forced=firsts[:count]),
            "late": lambda: proto.top_rows(parts, upper, count, forced=sinks[:count]),
            "chunk": lambda: proto.chunk_first_rows(parts, attention.sum(0), count),
            "qfull": lambda: proto.top_rows(parts, true_attention.sum(0), count, forced=sinks[:count]),
            "span": lambda: proto.top_rows(parts, proto.preceding_span(attention.sum(0), SPAN), count,
                                               forced=sinks[:count]),
            "oracle": lambda: proto.top_rows(parts, oracle, count),
            "exact1": lambda: proto.exact_first_rows(parts, attention.sum(0), count),
        }
        for label in selections:
            label, _, only = label.partition("@")  # "chunk@0.25": this selection at that fraction only
            if only and float(only) != f:
                continue
            if label in ("focus", "focus2", "shift", "shiftkv", "probe", "probekv"):
                linked = (link(runner, parts, LinkParams("focus", ratio=f), extra_capacity=cap) if label == "focus"
                          else proto.focus_two_rounds(runner, parts, f, extra_capacity=cap) if label == "focus2"
                          else proto.focus_shifted(runner, parts, f, label.endswith("kv"), extra_capacity=cap,
                                                       stride=PROBE_STRIDE if label.startswith("probe") else None))
                measure(f"{label}@{f}", linked, linked.recomputed_tokens - len(parts.question_ids))
                continue
            if label.startswith("temp"):  # "temp1.1": focus, stale keys times 1.1 (proto.focus_tempered)
                linked = proto.focus_tempered(runner, parts, f, float(label[4:]), extra_capacity=cap)
                measure(f"{label}@{f}", linked, linked.recomputed_tokens - len(parts.question_ids))
                continue
            if label == "exact1" and name != "prefixed":
                continue  # only the prefixed setup compiles the first chunk behind its prefix, so only there is it exact
            rows = choices[label]()
            linked = proto.link_rows(runner, parts, rows, extra_capacity=cap)
            measure(f"{label}@{f}", linked, int(rows.numel()))


@dataclass
class TwoItem(squad.Item):
    answers2: list[str] | None = None


def two_document_items(n: int, seed: int) -> list[TwoItem]:
    """Items whose answer needs two documents: two SQuAD questions from different articles asked together, over
    both gold paragraphs and one distractor of each (4 chunks, as in the one-question set), shuffled. Conjunctive,
    not a bridge: neither answer depends on the other (the archive holds no HotpotQA-style data, FACTS.md)."""
    import random

    pool = squad.load_items(3 * n, seed=seed)
    rng = random.Random(seed)
    items = []
    for a, b in zip(pool[0::2], pool[1::2]):
        if a.title == b.title:
            continue
        docs = [a.documents[a.gold], b.documents[b.gold], a.documents[(a.gold + 1) % len(a.documents)],
                b.documents[(b.gold + 1) % len(b.documents)]]
        rng.shuffle(docs)
        items.append(TwoItem(f"{a.id}+{b.id}", a.title, TWO.format(a.question.strip(), b.question.strip()),
                             a.answers, docs, -1, b.answers))
        if len(items) == n:
            break
    return items


def score(text: str, record: dict) -> dict:
    """EM/F1 against gold; a two-question item splits the answer at its first ";" and averages the two."""
    if "answers2" not in record:
        return dict(f1=squad.token_f1(text, record["answers"]), em=squad.exact_match(text, record["answers"]))
    first, _, second = text.partition(";")
    golds = (record["answers"], record["answers2"])
    return dict(f1=sum(squad.token_f1(t, g) for t, g in zip((first, second), golds)) / 2,
                em=sum(squad.exact_match(t, g) for t, g in zip((first, second), golds)) / 2)


BUCKETS = ((0, 1), (1, 4), (4, 16), (16, 64), (64, 10**9))


def deviation_profile(full, keys, values, parts: LinkInput, attention: torch.Tensor) -> dict:
    """Where naive's K/V differ from full's: relative error per layer, and per position-inside-chunk bucket
    (summed over layers); plus where the question's attention goes (share per bucket, layer-summed)."""
    length = parts.token_ids.numel()
    fk, fv = full.cache.keys[:, :, :length].float(), full.cache.values[:, :, :length].float()
    rk = ((keys.float() - fk).norm(dim=-1) / fk.norm(dim=-1).clamp_min(1e-6)).mean(1)  # [layers, length]
    rv = ((values.float() - fv).norm(dim=-1) / fv.norm(dim=-1).clamp_min(1e-6)).mean(1)
    offset = torch.full((length,), -1)
    for a, b in proto.chunk_spans(parts):
        offset[a:b] = torch.arange(b - a)
    chunk = offset >= 0
    share = attention.sum(0) / attention.sum()
    out = dict(k_by_layer=rk[:, chunk].mean(1).tolist(), v_by_layer=rv[:, chunk].mean(1).tolist(),
               chunk_attention_share=float(share[chunk].sum()))
    for lo, hi in BUCKETS:
        sel = (offset >= lo) & (offset < hi)
        out[f"k@{lo}-{hi}"] = float(rk[:, sel].mean())
        out[f"v@{lo}-{hi}"] = float(rv[:, sel].mean())
        out[f"attn@{lo}-{hi}"] = float(share[sel].sum())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--n", type=int, default=60)
    ap.add_argument("--seed", type=int, default=1)  # seed 0 is the shipped sample (used for tuning earlier)
    ap.add_argument("--out", type=Path, default=Path("research/results/diagnose.json"))
    ap.add_argument("--fractions", default="0.05,0.1,0.25")
    ap.add_argument("--ks", default="0,4,8,16,32,64,128,100000")
    ap.add_argument("--ratios", default="0.05,0.15,0.3")
    ap.add_argument("--vratios", default="", help="cacheblend ratios by V deviation (EPIC's choice)")
    ap.add_argument("--start", type=int, default=0, help="skip the first items (to split a run over processes)")
    ap.add_argument("--task", choices=("squad", "two"), default="squad",
                    help="two: two questions from two articles asked together (the answer needs two documents)")
    ap.add_argument("--setups", default="plain,sep,bos,sink,prefixed,system")
    ap.add_argument("--decode", default="full,legolink-16,legolink-0,qattn-all@0.25,mixed@0.25,first@0.25")
    ap.add_argument("--max-new", type=int, default=12)
    ap.add_argument("--qlayer", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--dtype", default="auto", help="compute dtype (auto: bf16 where the CPU has it, as served)")
    ap.add_argument("--reference", help="measure against full in this dtype (float32), --dtype's full included")
    ap.add_argument("--selections", default="first,random,qattn,qattn-all,mixed,oracle")
    ap.add_argument("--verbose-question", action="store_true", help="the engine's question format (no instruction)")
    ap.add_argument("--report", type=Path, nargs="*", help="print the tables of these result files and exit")
    ap.add_argument("--curve", type=Path, nargs="*",
                    help="the EPIC-style curve of these files (one model), over the items that have every config")
    ap.add_argument("--decided", type=float, default=DECIDED,
                    help="with --curve/--report: full's first-token margin from which an item counts as decided")
    ap.add_argument("--plot", type=Path, help="with --curve: also draw top-1 and KL against recompute to this PNG")
    ap.add_argument("--escalation", type=Path, nargs="*",
                    help="what linking again at a wider focus ratio when unsure would give, from these files' runs")
    a = ap.parse_args()
    if a.curve or a.report or a.escalation:
        try:  # summarize reads the files first: a mix is refused before any table is printed
            print_tables(a)
        except MixedRuns as e:
            ap.error(str(e))
        return
    if a.threads:
        torch.set_num_threads(a.threads)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    floats = lambda s: [float(x) for x in s.split(",") if x]  # noqa: E731
    run(a.model, a.n, a.seed, a.out, floats(a.fractions), [int(x) for x in a.ks.split(",") if x], floats(a.ratios),
        a.setups.split(","), a.decode.split(","), a.max_new, a.qlayer, a.selections.split(","), not a.verbose_question,
        floats(a.vratios), a.start, a.task, a.dtype, a.reference)



# -- summary ----------------------------------------------------------------------------------------------
def print_tables(a: argparse.Namespace) -> None:
    if a.escalation:
        print(escalation_table(a.escalation))
        return
    if a.curve:
        rows = summarize(a.curve, common=True, threshold=a.decided)
        print(curve_table(rows))
        print(gap_table(rows))
        print(paired_table(a.curve, CURVE_PAIRS, a.decided))
        if a.plot:
            plot_curve(rows, a.plot, json.loads(a.curve[-1].read_text())["model"])
        return
    rows = summarize(a.report, threshold=a.decided)
    print(table(rows))
    print(gap_table(rows))
    print(paired_table(a.report, threshold=a.decided))
    profiles = profile_summary(a.report)
    if profiles["n"]:  # only runs with the oracle selection record deviation profiles
        print(json.dumps(profiles, indent=None))


ESCALATION_THRESHOLDS = (0.3, 0.4, 0.5, 0.6)


def escalation_table(paths: list[Path], wide: str = "plain/focus@0.5") -> str:
    """Link with focus at a small fraction b; when unsure, link again as focus at the `wide` fraction. Unsure is
    either the answer's own top-1 probability under a threshold (what the linker knows alone), or naive's argmax
    differing from focus@b's (linked_top1_rank names the argmax by its rank in full's distribution). A second
    round that reruns every row of the wide link gives exactly that link, so each item's recorded one-shot runs
    give the policy's result; its cost is b's rows plus, when escalated, the wide link's. Per policy: top-1
    agreement with full [95% CI], mean recompute, share escalated; the plain focus runs for comparison. Every row
    is over the same items: those with every focus fraction the files hold (and naive, if any item has it)."""
    from bench.accuracy import bootstrap

    items = merged_items(paths)
    fractions = sorted({k.partition("@")[2] for c in items.values() for k in c if k.startswith("plain/focus@")},
                       key=float)
    naive = "plain/legolink-0"
    needed = [f"plain/focus@{f}" for f in fractions] + ([naive] if any(naive in c for c in items.values()) else [])
    got = [c for c in items.values() if all(k in c for k in needed)]
    lines = ["| policy | n | top-1 | recompute | escalated |", "|---|---|---|---|---|"]
    notes = []

    def row(label: str, base: str, escalated: list[bool]) -> None:
        top1 = [c[wide]["top1"] if e else c[base]["top1"] for c, e in zip(got, escalated)]
        cost = [(c[base]["recomputed"] + (c[wide]["recomputed"] if e else 0)) / c[base]["chunk_tokens"]
                for c, e in zip(got, escalated)]
        mean, low, high = bootstrap(top1)
        lines.append(f"| {label} | {len(top1)} | {mean:.3f} [{low:.3f}, {high:.3f}] | {sum(cost) / len(cost):.1%} "
                     f"| {sum(escalated) / len(escalated):.0%} |")

    if not got:
        return "no item has every focus fraction of these files"
    for f in fractions:
        row(f"focus@{f} alone", f"plain/focus@{f}", [False] * len(got))
    for f in fractions:
        base = f"plain/focus@{f}"
        if float(f) >= float(wide.partition("@")[2]):
            continue
        then = f"focus@{f}, then {wide.partition('/')[2]} if"
        if all(c[base].get("linked_p_top1") is not None for c in got):
            for t in ESCALATION_THRESHOLDS:
                row(f"{then} p(top-1) < {t}", base, [c[base]["linked_p_top1"] < t for c in got])
        else:
            notes.append(f"focus@{f}: p(top-1) not recorded (a run from before it was), its thresholds left out")
        if naive in needed:  # the rank in full's distribution names the argmax
            row(f"{then} naive's argmax differs", base,
                [c[naive]["linked_top1_rank"] != c[base]["linked_top1_rank"] for c in got])
    lines += [f"- {note}" for note in notes]
    return "\n".join(lines)


class MixedRuns(ValueError):
    """Result files from different models or compute dtypes: their configurations cannot be paired."""


def merged_items(paths: list[Path]) -> dict[str, dict]:
    """Item id -> every configuration the files recorded for it. The files must share a model and a dtype: a
    bf16 run measures against a bf16 `full`, so pairing it with an fp32 run would mix two references. Files from
    before the dtype was recorded were all fp32."""
    items: dict[str, dict] = {}
    kinds = set()
    for path in paths:
        run = json.loads(Path(path).read_text())
        kinds.add((run.get("model"), run.get("dtype", "float32")))
        for it in run["items"]:
            items.setdefault(it["id"], {}).update(it["configs"])
    if len(kinds) > 1:
        raise MixedRuns(f"these runs differ in model or dtype and cannot be paired: {sorted(kinds)}")
    return items


def summarize(paths: list[Path], reference: str = "plain/legolink-0", common: bool = False,
              threshold: float = DECIDED) -> list[dict]:
    """Per configuration: mean [95% bootstrap CI] of top-1, KL, ΔLL vs full, F1 where decoded, recompute share;
    and the paired difference of top-1 from `reference` (naive) on the same items. `common`: only the items that
    have every configuration of the last file's runs, so those rows are over the same items (others: over the
    items they have; each row says its n)."""
    from bench.accuracy import bootstrap

    items = merged_items(paths)
    ids = [i for i in items if reference in items[i]]
    if common:  # the last run's configurations (a run that went on with fewer configs comes last)
        last = json.loads(Path(paths[-1]).read_text())["items"]
        wanted = set(last[0]["configs"]) if last else set()
        ids = [i for i in ids if wanted <= set(items[i])]
    labels = sorted({k for i in ids for k in items[i]}, key=_order)
    rows = []
    for label in labels:
        got = [(items[i][label], items[i]) for i in ids if label in items[i]]
        setup = label.split("/")[0]
        row = dict(label=label, n=len(got))
        row["top1"] = bootstrap([g["top1"] for g, _ in got])
        row["kl"] = bootstrap([g["kl"] for g, _ in got])
        row["dll"] = bootstrap([g["ll"] - c[f"{setup}/full"]["ll"] for g, c in got])
        row["d_top1_vs_naive"] = bootstrap([g["top1"] - c[reference]["top1"] for g, c in got])
        row["recompute"] = sum(g["recomputed"] / g["chunk_tokens"] for g, _ in got) / len(got)
        row.update(_follow(got, setup, threshold))
        if all("f1" in g for g, _ in got):
            f1 = [g["f1"] for g, _ in got]
            full = [c[f"{setup}/full"]["f1"] for _, c in got]
            row["f1"] = bootstrap(f1)
            row["f1_share"] = _ratio_ci(f1, full)
        rows.append(row)
    return rows


def decided(config: dict, setup: str, threshold: float = DECIDED) -> bool | None:
    """Whether full's first token is decided on this item (None: a run from before margins were recorded)."""
    margin = config[f"{setup}/full"].get("margin")
    return None if margin is None else margin >= threshold


def _follow(got: list[tuple[dict, dict]], setup: str, threshold: float) -> dict:
    """The metrics that tell near-ties from real errors, where every item has them (older runs lack them):
    token/answer agreement along full's answer, and top-1 over the decided items only."""
    from bench.accuracy import bootstrap

    out = {}
    for key in ("token_agree", "answer_agree", "linked_p_full_top1"):
        if all(key in g for g, _ in got):
            out[key] = bootstrap([g[key] for g, _ in got])
    if all("content_top1" in g for g, _ in got):  # over the items whose answer has a content word
        words = [g for g, _ in got if g["content_top1"] is not None]
        out["n_content"] = len(words)
        if words:
            out["content_top1"] = bootstrap([g["content_top1"] for g in words])
            out["content_kl"] = bootstrap([g["content_kl"] for g in words])
    flags = [decided(c, setup, threshold) for _, c in got]
    if None not in flags:
        out["threshold"] = threshold
        out["top1_decided"] = bootstrap([g["top1"] for (g, _), d in zip(got, flags) if d])
        out["n_decided"] = sum(flags)
        out["misses_tied"] = sum(1 for (g, _), d in zip(got, flags) if not d and g["top1"] < 1)
        out["misses_decided"] = sum(1 for (g, _), d in zip(got, flags) if d and g["top1"] < 1)
        if all("linked_top1_rank" in g for g, _ in got):  # a miss that picks full's own second choice
            out["runner_up_tied"] = sum(1 for (g, _), d in zip(got, flags) if not d and g["linked_top1_rank"] == 2)
            out["runner_up_decided"] = sum(1 for (g, _), d in zip(got, flags) if d and g["linked_top1_rank"] == 2)
    return out


def _ratio_ci(xs: list[float], ys: list[float], resamples: int = 2000) -> tuple[float, float, float]:
    """sum(xs)/sum(ys) with a paired percentile bootstrap over items."""
    import random

    rng = random.Random(0)
    n = len(xs)
    if sum(ys) <= 0:
        return float("nan"), float("nan"), float("nan")
    ratios = []
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        ratios.append(sum(xs[i] for i in idx) / max(sum(ys[i] for i in idx), 1e-9))  # a 0/0 draw counts as 0
    ratios.sort()
    return sum(xs) / max(sum(ys), 1e-9), ratios[int(0.025 * resamples)], ratios[int(0.975 * resamples)]


def _order(label: str):
    setup, algo = label.split("/")
    name, _, frac = algo.partition("@")
    return (setup != "plain", setup, "@" in algo, float(frac) if frac else 0.0, name)


def table(rows: list[dict]) -> str:
    lines = ["| config | n | recompute | top-1 | Δtop-1 vs naive | KL(full‖linked) | ΔLL vs full | F1 | F1 / full's F1 "
             "| top-1, decided (n) | token-agree | answer-agree |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        n_dec = f" ({r['n_decided']})" if "n_decided" in r else ""
        lines.append(f"| {r['label']} | {r['n']} | {r['recompute']:.1%} | {_ci(r, 'top1')} "
                     f"| {_ci(r, 'd_top1_vs_naive')} | {_ci(r, 'kl')} | {_ci(r, 'dll')} | {_ci(r, 'f1')} "
                     f"| {_ci(r, 'f1_share')} | {_ci(r, 'top1_decided')}{n_dec} | {_ci(r, 'token_agree')} "
                     f"| {_ci(r, 'answer_agree')} |")
    return "\n".join(lines)


PAIRS = (("plain/mixed@0.25", "plain/first@0.25"), ("plain/qattn-all@0.25", "plain/first@0.25"),
         ("plain/oracle@0.25", "plain/first@0.25"), ("plain/mixed@0.25", "plain/legolink-64"),
         ("plain/legolink-16", "plain/legolink-0"), ("plain/cacheblend-0.15", "plain/legolink-16"),
         ("bos/legolink-16", "plain/legolink-16"), ("prefixed/legolink-16", "plain/legolink-16"),
         ("sep/legolink-16", "plain/legolink-16"), ("bos/legolink-0", "plain/legolink-0"),
         ("prefixed/legolink-0", "plain/legolink-0"), ("sep/legolink-0", "plain/legolink-0"),
         ("qfirst/legolink-0", "plain/legolink-0"), ("qfirst/legolink-16", "plain/legolink-16"),
         ("qfirst/focus@0.25", "plain/focus@0.25"), ("qfirst/focus@0.25", "qfirst/legolink-0"),
         ("system/legolink-0", "plain/legolink-0"), ("system/legolink-16", "plain/legolink-16"),
         ("system/focus@0.25", "plain/focus@0.25"), ("filler/legolink-0", "plain/legolink-0"),
         ("filler/focus@0.25", "plain/focus@0.25"), ("filler/focus@0.1", "plain/focus@0.1"),
         ("filler/focus@0.1", "plain/focus@0.25"),
         ("prefixed/exact1@0.25", "prefixed/focus@0.25"), ("prefixed/exact1@0.25", "plain/focus@0.25"),
         ("prefixed/focus@0.25", "plain/focus@0.25"),
         # --reference float32: what linking costs beyond what bf16 alone costs, both against an fp32 full
         ("plain/focus@0.25", "plain/full-bfloat16"), ("plain/focus@0.5", "plain/full-bfloat16"),
         ("plain/legolink-0", "plain/full-bfloat16"))


def paired_table(paths: list[Path], pairs=PAIRS, threshold: float = DECIDED) -> str:
    """Paired differences (a - b) over the items both have: top-1, KL, ΔLL (each vs its own setup's full), and
    where the runs recorded them, top-1 over the decided items and token agreement ("-" otherwise)."""
    from bench.accuracy import bootstrap

    items = merged_items(paths)
    fmt = lambda t: f"{t[0]:+.3f} [{t[1]:+.3f}, {t[2]:+.3f}]"  # noqa: E731
    lines = ["| a − b | n | Δtop-1 | ΔKL | Δ(ΔLL) | Δtop-1, decided (n) | Δtoken-agree |",
             "|---|---|---|---|---|---|---|"]
    for a, b in pairs:
        both = [c for c in items.values() if a in c and b in c]
        if not both:
            continue
        dll = lambda c, x: c[x]["ll"] - c[x.split("/")[0] + "/full"]["ll"]  # noqa: E731
        flags = [decided(c, a.split("/")[0], threshold) for c in both]
        dec = [c for c, d in zip(both, flags) if d]
        top1_dec = (f"{fmt(bootstrap([c[a]['top1'] - c[b]['top1'] for c in dec]))} ({len(dec)})"
                    if None not in flags and dec else "-")
        tokens = (fmt(bootstrap([c[a]["token_agree"] - c[b]["token_agree"] for c in both]))
                  if all("token_agree" in c[a] and "token_agree" in c[b] for c in both) else "-")
        lines.append(f"| {a} − {b} | {len(both)} | {fmt(bootstrap([c[a]['top1'] - c[b]['top1'] for c in both]))} "
                     f"| {fmt(bootstrap([c[a]['kl'] - c[b]['kl'] for c in both]))} "
                     f"| {fmt(bootstrap([dll(c, a) - dll(c, b) for c in both]))} | {top1_dec} | {tokens} |")
    return "\n".join(lines)


CURVE_PAIRS = (("plain/legolink-4", "plain/legolink-0"), ("plain/legolink-8", "plain/legolink-0"),
               ("plain/legolink-16", "plain/legolink-0"), ("plain/legolink-32", "plain/legolink-0"),
               ("plain/legolink-64", "plain/legolink-0"), ("plain/cacheblend-0.15", "plain/legolink-0"),
               ("plain/focus@0.05", "plain/legolink-0"), ("plain/focus@0.1", "plain/legolink-0"),
               ("plain/focus@0.25", "plain/legolink-0"),
               ("plain/focus@0.05", "plain/legolink-8"), ("plain/focus@0.1", "plain/legolink-16"),
               ("plain/focus@0.25", "plain/first@0.25"), ("plain/chunk@0.25", "plain/first@0.25"),
               ("plain/mixed16@0.25", "plain/first@0.25"), ("plain/chunk@0.25", "plain/focus@0.25"),
               ("plain/mixed16@0.25", "plain/focus@0.25"), ("plain/qfull@0.25", "plain/focus@0.25"),
               ("plain/focus@0.25", "plain/legolink-64"), ("plain/cacheblend-v-0.15", "plain/cacheblend-0.15"),
               ("plain/focus@0.1", "plain/cacheblend-0.15"), ("plain/focus@0.25", "plain/cacheblend-0.3"),
               ("plain/focus2@0.25", "plain/focus@0.25"), ("plain/span@0.25", "plain/focus@0.25"),
               ("plain/focus@0.25", "plain/legolink-32"), ("plain/shift@0.1", "plain/focus@0.1"),
               ("plain/shiftkv@0.1", "plain/focus@0.1"), ("plain/shift@0.25", "plain/focus@0.25"),
               ("plain/shiftkv@0.25", "plain/focus@0.25"), ("plain/focus@0.4", "plain/focus@0.25"),
               ("plain/focus@0.5", "plain/focus@0.25"), ("plain/focus@0.75", "plain/focus@0.5"),
               ("plain/focus@0.5", "plain/legolink-128"))


def _family(label: str) -> str:
    algo = label.split("/")[1]
    if algo.startswith("legolink-") or algo.startswith("first@"):
        return "legolink (first rows)"
    if algo.startswith("cacheblend-v-"):
        return "cacheblend (V)"
    if algo.startswith("cacheblend-"):
        return "cacheblend (K)"
    if algo.startswith("focus@"):
        return "focus"
    return algo.partition("@")[0]


def _ci(row: dict, key: str) -> str:
    t = row.get(key)
    return "-" if t is None or t[0] != t[0] else f"{t[0]:.3f} [{t[1]:.3f}, {t[2]:.3f}]"


def curve_table(rows: list[dict]) -> str:
    """The curve as a table: every configuration by share of chunk tokens recomputed. The last columns ("-" for
    runs that predate them) split the first-token gap: top-1 on the items where full's margin >= DECIDED, and
    agreement along full's whole answer."""
    lines = ["| config | n | recompute | top-1 | Δtop-1 vs naive | KL(full‖linked) | ΔLL vs full "
             "| F1 / full's F1 | top-1, decided (n) | token-agree | answer-agree | top-1, first content word (n) "
             "| KL there |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["recompute"], r["label"])):
        n_dec = f" ({r['n_decided']})" if "n_decided" in r else ""
        n_word = f" ({r['n_content']})" if "n_content" in r else ""
        lines.append(f"| {r['label'].removeprefix('plain/')} | {r['n']} | {r['recompute']:.1%} | {_ci(r, 'top1')} "
                     f"| {_ci(r, 'd_top1_vs_naive')} | {_ci(r, 'kl')} | {_ci(r, 'dll')} | {_ci(r, 'f1_share')} "
                     f"| {_ci(r, 'top1_decided')}{n_dec} | {_ci(r, 'token_agree')} | {_ci(r, 'answer_agree')} "
                     f"| {_ci(r, 'content_top1')}{n_word} | {_ci(r, 'content_kl')} |")
    return "\n".join(lines)


def gap_table(rows: list[dict]) -> str:
    """Where each configuration's first-token misses fall: on near-ties (full's margin < DECIDED) or on decided
    items, with the linked cache's mean probability of full's top-1 token."""
    threshold = next((r["threshold"] for r in rows if "threshold" in r), DECIDED)
    lines = [f"| config | n | misses | on near-ties (margin < {threshold}) | on decided items | decided n "
             "| p_linked(full's top-1) |", "|---|---|---|---|---|---|---|"]
    up = lambda r, k: f" ({r[k]} on full's 2nd)" if k in r else ""  # noqa: E731
    for r in sorted(rows, key=lambda r: (r["recompute"], r["label"])):
        if "n_decided" not in r or r["label"].endswith("/full"):
            continue
        tied, dec = f"{r['misses_tied']}{up(r, 'runner_up_tied')}", f"{r['misses_decided']}{up(r, 'runner_up_decided')}"
        lines.append(f"| {r['label'].removeprefix('plain/')} | {r['n']} | {r['misses_tied'] + r['misses_decided']} "
                     f"| {tied} | {dec} | {r['n_decided']} | {_ci(r, 'linked_p_full_top1')} |")
    return "\n".join(lines)


def plot_curve(rows: list[dict], path: Path, model: str) -> None:
    """Top-1 agreement and KL against the share of chunk tokens recomputed, one line per algorithm family."""
    from bench.report import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    families: dict[str, list[dict]] = {}
    for r in rows:
        if not r["label"].endswith("/full") and _family(r["label"]) not in ("mixed", "qattn-all", "oracle"):
            families.setdefault(_family(r["label"]), []).append(r)  # mixed is focus; the others were diagnostics
    for name, got in sorted(families.items()):
        got.sort(key=lambda r: r["recompute"])
        x = [100 * r["recompute"] for r in got]
        for ax, key in zip(axes, ("top1", "kl")):
            mean = [r[key][0] for r in got]
            err = [[m - r[key][1] for m, r in zip(mean, got)], [r[key][2] - m for m, r in zip(mean, got)]]
            ax.errorbar(x, mean, yerr=err, marker="o", capsize=3, label=name, linestyle="-" if len(got) > 1 else "")
    axes[0].axhline(0.95, color="grey", linestyle=":", label="goal 0.95")
    axes[0].set_ylabel("top-1 agreement with full")
    axes[1].set_ylabel("KL(full || linked), nats")
    for ax in axes:
        ax.set_xlabel("chunk tokens recomputed (%)")
        ax.axvline(25, color="grey", linestyle="--", linewidth=0.8)
    axes[0].legend(fontsize=7)
    n = max(r["n"] for r in rows)
    fig.suptitle(f"{model}: held-out SQuAD (gold + 3 distractors), n = {n}, 95% bootstrap intervals")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def profile_summary(paths: list[Path], setup: str = "plain") -> dict:
    """Means over items of the naive-vs-full deviation profile (relative K/V error, question attention share)."""
    profiles = [it["profiles"][setup] for p in paths for it in json.loads(Path(p).read_text())["items"]
                if setup in it.get("profiles", {})]
    out = {}
    for key in profiles[0] if profiles else []:
        vals = [p[key] for p in profiles]
        out[key] = ([sum(v[i] for v in vals) / len(vals) for i in range(len(vals[0]))] if isinstance(vals[0], list)
                    else sum(vals) / len(vals))
    out["n"] = len(profiles)
    return out


if __name__ == "__main__":
    main()
