"""Accuracy and bytes of each KV codec (store/codec.py), against fp32 entries and against `full`, on the same items.

    python -m bench codecs --model smollm2-135m --n 60
    python -m bench codecs --sample --n 5                  # the shipped 20-item sample, no download
    python -m bench codecs --codecs bfloat16/bf16,bfloat16/int8 --algorithms full,legolink-16   # compute in bf16

Items are bench/accuracy.py's (SQuAD v1.1 dev: the gold paragraph plus 3 distractors, each a document). Every codec
links the same token ids with each algorithm (naive and legolink-16 by default). At the answer's first position:
  top-1 agreement and KL(fp32 || codec) with the same algorithm on fp32 entries (what the codec alone changes),
  top-1 agreement and KL(full || codec) with `full`,
the share of greedy answers identical to fp32 entries' answers, and the task F1 of the greedy answer against the
gold answers, with its paired difference from fp32 entries'.
Every figure comes with a 95% interval over items (Wilson's for a share of items, else the bootstrap). Bytes per token are read from the stored entries.

The rule for a default (issue 12): a codec is offered only where its top-1 agreement with fp32 entries is >= 0.95
and its F1 interval overlaps fp32's; `default_ok` in the JSON says which pass, per algorithm.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from ragcache.facade import RagCache
from ragcache.settings import EngineConfig
from ragcache.store import codec as kv_codec
from ragcache.store.memory import MemoryStore

from . import agreement, report, squad
from .accuracy import _ci, agreement_stops, bootstrap, first_line
from .common import Variant, load_model

DEFAULT_AGREEMENT = 0.95


def run(model: str, n: int, sample: bool, seed: int, codecs: list[str], variants: list[Variant],
        max_new_tokens: int, out_dir: Path | None = None, tag: str = "") -> dict:
    items = squad.load_items(n, seed=seed, sample=sample)
    params = dict(model=model, n=len(items), sample=sample, seed=seed, codecs=codecs,
                  algorithms=[v.label for v in variants], max_new_tokens=max_new_tokens, tag=tag,
                  data="bench/data/squad_sample.jsonl" if sample else "SQuAD v1.1 dev (bigbench==1.0.0)")
    bench = report.Run("codecs", params, out_dir)
    codecs = ["fp32"] + [c for c in codecs if c not in ("fp32", "auto")]  # fp32 entries are the reference
    models = {dtype: load_model(model, dtype) for dtype in {compute_dtype(c) for c in codecs}}
    engines = {c: RagCache(models[compute_dtype(c)], MemoryStore(), EngineConfig(chunk_tokens=512, kv_codec=stored_codec(c)))
               for c in codecs}
    reference = engines["fp32"]
    reference.warmup()
    stops = agreement_stops(reference)
    per_item, stored = [], {c: [0, 0] for c in codecs}  # codec -> [bytes, tokens]
    started = time.perf_counter()
    for i, item in enumerate(items):
        full = reference.link(item.question, reference.compile(item.documents), algorithm="full",
                              max_new_tokens=max_new_tokens)
        row = {}
        for c, rc in engines.items():
            ids = rc.compile(item.documents)
            _count_stored(rc, ids, stored[c])
            for v in variants:
                linked = rc.link(item.question, ids, max_new_tokens=max_new_tokens, **v.kwargs)
                text = first_line(rc.tokenizer.decode(rc.with_runner(agreement.greedy, linked, max_new_tokens, *stops)))
                top1, kl = agreement.first_token(full.last_logits, linked.last_logits)
                row[f"{c}/{v.label}"] = dict(logits=linked.last_logits, top1_vs_full=top1, kl_vs_full=kl, text=text,
                                             f1=squad.token_f1(text, item.answers))
            for doc_id in set(ids):
                rc.delete_document(doc_id)  # every item's documents are new: keep the stores small
        for key, got in row.items():
            ref = row[f"fp32/{key.rsplit('/', 1)[1]}"]
            got["top1_vs_fp32"], got["kl_vs_fp32"] = agreement.first_token(ref["logits"], got["logits"])
        for got in row.values():
            del got["logits"]
        per_item.append(dict(id=item.id, question=item.question, gold_answers=item.answers, results=row))
        print(f"[{i + 1}/{len(items)}] {time.perf_counter() - started:.0f}s  " + "  ".join(
            f"{k}={v['top1_vs_fp32']:.0f}" for k, v in row.items() if not k.startswith("fp32/")), file=sys.stderr,
            flush=True)
    bytes_per_token = {c: round(b / max(t, 1), 1) for c, (b, t) in stored.items()}
    results = summarize(per_item, codecs, [v.label for v in variants], bytes_per_token, seed)
    _print(results, model, len(items))
    grouping = int8_grouping(reference, items[:ERROR_ITEMS])
    print(f"int8 relative error by grouping (KIVI: keys per channel, values per token): {grouping}")
    paths = bench.finish(results, dict(items=per_item, bytes_per_token=bytes_per_token, int8_grouping=grouping))
    return dict(results=results, paths=paths)


ERROR_ITEMS = 10


def compute_dtype(spec: str) -> str:
    """A codec spec is CODEC (linked in float32) or DTYPE/CODEC (linked in that compute dtype, e.g.
    bfloat16/int8): the second form measures what a compute dtype costs against fp32, on the same items."""
    return spec.rpartition("/")[0] or "float32"


def stored_codec(spec: str) -> str:
    codec = spec.rpartition("/")[2]
    kv_codec.validate(codec)
    return codec


def int8_grouping(rc: RagCache, items: list) -> dict:
    """KIVI's finding on this model's real K/V: relative error ||x - decode(encode(x))|| / ||x|| of int8 with one
    (scale, zero) per channel (over a chunk's tokens) or per token (over its channels), for keys and for values."""
    errors = {f"{name}_per_{group}": [0.0, 0.0] for name in ("keys", "values") for group in ("channel", "token")}
    for item in items:
        ids = rc.compile(item.documents)
        for doc_id in ids:
            for chunk in rc.document_chunks(doc_id):
                entry = rc.store.get(rc.compiler.key(chunk, rc.layouts["default"]))
                for name, x in (("keys", entry.keys.float()), ("values", entry.values.float())):
                    for group, dim in (("channel", 2), ("token", 3)):
                        codes, pairs = kv_codec.quantize(x, dim)
                        pairs = pairs.unsqueeze(dim)  # back to broadcastable (scale, zero) along the other dims
                        decoded = codes.float() * pairs[..., 0] + pairs[..., 1]
                        errors[f"{name}_per_{group}"][0] += float((decoded - x).pow(2).sum())
                        errors[f"{name}_per_{group}"][1] += float(x.pow(2).sum())
        for doc_id in set(ids):
            rc.delete_document(doc_id)
    return {k: round((err / max(norm, 1e-30)) ** 0.5, 5) for k, (err, norm) in errors.items()}


def _count_stored(rc: RagCache, doc_ids: list[str], total: list[int]) -> None:
    """Bytes and tokens of the documents' chunk entries (the system prefix is stored as computed by every codec)."""
    keys = [rc.compiler.key(chunk, rc.layouts["default"]) for doc_id in doc_ids for chunk in rc.document_chunks(doc_id)]
    for entry in rc.store.get_many(keys):
        total[0] += entry.nbytes
        total[1] += entry.num_tokens


def summarize(per_item: list[dict], codecs: list[str], labels: list[str], bytes_per_token: dict,
              seed: int = 0) -> list[dict]:
    out = []
    for label in labels:
        fp32_f1 = [it["results"][f"fp32/{label}"]["f1"] for it in per_item]
        fp32_text = [it["results"][f"fp32/{label}"]["text"] for it in per_item]
        fp32_ci = _ci(fp32_f1, seed)
        for c in codecs:
            got = [it["results"][f"{c}/{label}"] for it in per_item]
            f1 = _ci([g["f1"] for g in got], seed)
            top1_vs_fp32 = _ci([g["top1_vs_fp32"] for g in got], seed, share=True)
            overlap = f1["ci95"][0] <= fp32_ci["ci95"][1] and fp32_ci["ci95"][0] <= f1["ci95"][1]
            out.append(dict(codec=c, algorithm=label, n=len(got), bytes_per_token=bytes_per_token[c],
                            bytes_vs_fp32=round(bytes_per_token[c] / bytes_per_token["fp32"], 3),
                            top1_vs_fp32=top1_vs_fp32, kl_vs_fp32=_fine_ci([g["kl_vs_fp32"] for g in got], seed),
                            same_answer_as_fp32=_ci([float(g["text"] == t) for g, t in zip(got, fp32_text)], seed, share=True),
                            top1_vs_full=_ci([g["top1_vs_full"] for g in got], seed, share=True),
                            kl_vs_full=_ci([g["kl_vs_full"] for g in got], seed), f1=f1,
                            delta_f1_vs_fp32=_ci([g["f1"] - r for g, r in zip(got, fp32_f1)], seed),
                            default_ok=bool(top1_vs_fp32["mean"] >= DEFAULT_AGREEMENT and overlap)))
    return out


def _fine_ci(values: list[float], seed: int) -> dict:
    """As accuracy._ci, to 3 significant digits: the KL a codec adds can be 1e-6 nats."""
    mean, low, high = bootstrap(values, seed)
    return dict(mean=float(f"{mean:.3g}"), ci95=[float(f"{low:.3g}"), float(f"{high:.3g}")])


def _fmt(ci: dict, digits: int = 3) -> str:
    return f"{ci['mean']:.{digits}f} [{ci['ci95'][0]:.{digits}f}, {ci['ci95'][1]:.{digits}f}]"


def _fmt_small(ci: dict) -> str:
    return f"{ci['mean']:.2g} [{ci['ci95'][0]:.2g}, {ci['ci95'][1]:.2g}]"


def _print(results: list[dict], model: str, n: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kv codecs, {model}, n={n} (95% intervals: Wilson for shares, else bootstrap)")
    for col in ("algorithm", "codec", "bytes vs fp32", "top-1 vs fp32", "KL vs fp32", "same answer", "top-1 vs full",
                "KL vs full", "F1", "dF1 vs fp32", "default ok"):
        table.add_column(col)
    for r in results:
        table.add_row(r["algorithm"], r["codec"], f"{r['bytes_vs_fp32']:.3f}", _fmt(r["top1_vs_fp32"]),
                      _fmt_small(r["kl_vs_fp32"]), _fmt(r["same_answer_as_fp32"]), _fmt(r["top1_vs_full"]), _fmt(r["kl_vs_full"]), _fmt(r["f1"]),
                      _fmt(r["delta_f1_vs_fp32"]), "yes" if r["default_ok"] else "no")
    Console(width=220).print(table)


def markdown(data: dict) -> str:
    lines = ["| algorithm | codec | bytes vs fp32 | top-1 vs fp32 | KL vs fp32 | same answer as fp32 | top-1 vs full | "
             "KL vs full | F1 | ΔF1 vs fp32 | default ok |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["results"]:
        lines.append(f"| {r['algorithm']} | {r['codec']} | {r['bytes_vs_fp32']:.3f} | {_fmt(r['top1_vs_fp32'])} | "
                     f"{_fmt_small(r['kl_vs_fp32'])} | {_fmt(r['same_answer_as_fp32'])} | {_fmt(r['top1_vs_full'])} | {_fmt(r['kl_vs_full'])} | "
                     f"{_fmt(r['f1'])} | {_fmt(r['delta_f1_vs_fp32'])} | {'yes' if r['default_ok'] else 'no'} |")
    return "\n".join(lines)

