"""Data for the benchmarks: SQuAD v1.1 dev items for the accuracy harness (read by `ragcache.train.squad`, which
`ragcache train link` uses too), and text for the timing benchmarks.

`bench/data/squad_sample.jsonl` ships 20 such items (seed 0) for CI and `--sample`; SQuAD is CC BY-SA 4.0
(bench/data/README.md).
"""

from __future__ import annotations

import json
import random
import re
import string
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from ragcache.train import squad as _dev
from ragcache.train.squad import Item, items_apart  # noqa: F401 (items_apart: the bench's and research's name)

SAMPLE = Path(__file__).resolve().parent / "data" / "squad_sample.jsonl"


def load_items(n: int | None = None, seed: int = 0, sample: bool = False, distractors: int = 3) -> list[Item]:
    if sample:
        items = [Item.from_dict(json.loads(line)) for line in SAMPLE.read_text().splitlines() if line.strip()]
        return items[:n] if n else items
    return _dev.load_items(n, seed, distractors)


def write_sample(path: Path = SAMPLE, n: int = 20, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    items = load_items(n, seed)
    path.write_text("".join(json.dumps(asdict(item), ensure_ascii=False) + "\n" for item in items))
    return path


# -- SQuAD scoring (the official v1.1 normalisation) ------------------------------------------------------
_PUNCTUATION = frozenset(string.punctuation)


def normalize(text: str) -> str:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, answers: list[str]) -> float:
    return float(max(normalize(prediction) == normalize(a) for a in answers))


def token_f1(prediction: str, answers: list[str]) -> float:
    return max(_f1(normalize(prediction).split(), normalize(a).split()) for a in answers)


def _f1(pred: list[str], gold: list[str]) -> float:
    if not pred or not gold:
        return float(pred == gold)
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


# -- text for the timing benchmarks -----------------------------------------------------------------------
QUESTION_LEAD = "Using only the documents above, answer the following question in a few words, without explanation. "


def sample_paragraphs() -> list[str]:
    """The distinct paragraphs of the shipped sample (about 80, CC BY-SA 4.0)."""
    seen: dict[str, None] = {}
    for item in load_items(sample=True):
        for doc in item.documents:
            seen.setdefault(doc, None)
    return list(seen)


def timing_documents(tokenizer, count: int, tokens: int, seed: int = 0) -> list[str]:
    """`count` distinct documents of about `tokens` tokens (at most), each ending at a sentence end: sample
    paragraphs in a per-document shuffled order, cut at the token budget and trimmed back to a full stop."""
    paragraphs = sample_paragraphs()
    docs = []
    for i in range(count):
        rng = random.Random(seed * 100_003 + i)
        order = paragraphs[:]
        rng.shuffle(order)
        text, ids = "", []
        for para in order:
            text = (text + "\n\n" + para).strip()
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) >= tokens:
                break
        cut = tokenizer.decode(ids[:tokens])
        end = max(cut.rfind(". "), cut.rfind(".\n"), cut.rfind(".") if cut.endswith(".") else -1)
        docs.append(cut[: end + 1] if end > 0 else cut)
    return docs


def timing_questions(count: int, seed: int = 0) -> list[str]:
    """`count` questions of about 25-35 tokens: an instruction plus a SQuAD question from the sample."""
    questions = [item.question for item in load_items(sample=True)]
    random.Random(seed).shuffle(questions)
    return [QUESTION_LEAD + questions[i % len(questions)] for i in range(count)]
