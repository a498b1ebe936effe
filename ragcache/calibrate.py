"""Per-model calibration: the smallest recompute that agrees with `full` often enough, stored as a profile.

For each item (a question over a few documents) `full` is linked once; each candidate (legolink k, cacheblend
ratio, focus ratio) is linked on the same ids, and agreement is the fraction of items whose next-token argmax
equals full's at one position of `full`'s answer: by default its first content word (agreement.content_position),
with `at="first"` its first token. A reader that opens every answer with "The answer is" agrees on "The" whatever
the linking did: on the built-in set SmolLM2's naive linking agrees on 1.00 of first tokens, so a first-token
calibration would pick k = 0, and on 0.79 of content words (docs/ACCURACY.md). The content word costs a greedy
decode of `full`'s answer and, per candidate, one teacher-forced pass over the answer up to that word; linking
without decoding keeps the sweep cheap otherwise. The smallest k (and ratio, and focus ratio) whose agreement
reaches the target becomes the model's profile; `RagCache` then uses that k (and focus ratio) as its default. `focus` is swept because it beat LegoLink's first rows at the same budget (docs/ACCURACY.md).

With a link adapter attached (ragcache/adapters.py), `full` is the base model's (the adapter off) and every
candidate links with the adapter on: the profile says which cheap link of the adapted model answers as the base model
does, and it is what makes an installed adapter the model's default.

Profiles live beside the model cache, one JSON file per model fingerprint, dtype and kv codec, so a different model
(or dtype) never inherits another's k, and two deployments of one model that store different codecs keep one each; an
adapter may ship its own in its directory (`profiles/`), read after the user's.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ragcache.store import durable

from . import agreement as agree
from . import fetch, loaded, lora
from .engine import eos_ids
from .errors import BadRequest
from .request import read_text
from .settings import DATA_DIR, DEFAULT_FOCUS_RATIOS, DEFAULT_KS, DEFAULT_RATIOS, DEFAULT_TARGET

log = logging.getLogger("ragcache")

POSITIONS = ("first", "content")
ANSWER_TOKENS = 16  # how far along full's answer a content word is looked for
SENTENCE_WORDS = 6  # a sentence of the user's documents that a calibration item may ask about: half of it is the cue


@dataclass
class Item:
    question: str
    doc_ids: list[str]


@dataclass
class Profile:
    model: str
    fingerprint: str
    dtype: str
    target: float
    items: int
    k: int | None  # None: no candidate reached the target
    ratio: float | None
    agreement_by_k: dict[str, float] = field(default_factory=dict)
    agreement_by_ratio: dict[str, float] = field(default_factory=dict)
    naive_agreement: float = 0.0
    created: float = 0.0
    focus_ratio: float | None = None  # the smallest `focus` ratio that reached the target
    agreement_by_focus: dict[str, float] = field(default_factory=dict)
    at: str = "first"  # where along full's answer agreement was measured (POSITIONS)
    adapter: str = ""  # the link adapter's digest when the model was calibrated with one (loaded.Adapter.sha256)
    kv_codec: str = ""  # the codec of the entries the links were measured over ("": not recorded)

    def reached(self) -> bool:
        """Whether a link whose knob the engine takes from the profile reached the target: legolink's k or focus's
        ratio (cacheblend's ratio is reported, never applied)."""
        return self.k is not None or self.focus_ratio is not None


def profile_path(fingerprint: str, dtype: str, kv_codec: str = "") -> Path:
    """Where the profile measured over `kv_codec`'s entries is saved ("": a profile that did not record its codec)."""
    return fetch.model_cache_dir() / "profiles" / f"{fingerprint[:24]}-{dtype}{f'-{kv_codec}' if kv_codec else ''}.json"


def load_profile(lm: loaded.LoadedModel, kv_codec: str = "") -> Profile | None:
    shipped = lm.adapter.path / lora.ADAPTER_PROFILES if lm.adapter is not None else None
    return find_profile(lm.fingerprint, dtype_name(lm), shipped, kv_codec)


def find_profile(fingerprint: str, dtype: str, shipped: Path | None = None, kv_codec: str = "") -> Profile | None:
    """The profile of a model fingerprint at a dtype: the user's own, else one an adapter ships with (`shipped`). In
    each place the one measured over `kv_codec`'s entries comes first, then one that did not record its codec, then
    the newest measured over another codec (a calibration still nearer than the defaults; the engine warns)."""
    exact, unrecorded = profile_path(fingerprint, dtype, kv_codec), profile_path(fingerprint, dtype)
    for folder in (exact.parent, shipped):
        if folder is None:
            continue
        tried = dict.fromkeys((exact.name, unrecorded.name))  # one name where no codec is given
        for name in tried:
            profile = read_profile(folder / name)
            if profile is not None and profile.fingerprint == fingerprint:
                return profile
        paths = sorted(p for p in folder.glob(f"{unrecorded.stem}-*.json") if p.name not in tried)
        read = (read_profile(path) for path in paths)
        others = [p for p in read if p is not None and p.fingerprint == fingerprint and p.dtype == dtype]
        if others:
            return max(others, key=lambda p: p.created)
    return None


def read_profile(path: Path) -> Profile | None:
    """None for a missing file, or an old or damaged one (calibrate again: said in the log, as the defaults serve
    instead of what was calibrated)."""
    try:
        return _checked(Profile(**json.loads(path.read_text())))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError, OSError) as exc:
        log.warning("calibration profile %s cannot be read (%s); the defaults serve: calibrate again", path, exc)
        return None


def _checked(profile: Profile) -> Profile:
    """The profile, if each knob it sets is one a link takes (ValueError otherwise): an edited file whose k reads
    16.0 would otherwise be every request's default, each refused ("k must be an integer"), or fail deeper."""

    def number(value) -> bool:
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)

    if profile.k is not None and (not isinstance(profile.k, int) or isinstance(profile.k, bool) or profile.k < 0):
        raise ValueError(f"k {profile.k!r} is not a whole number >= 0")
    for name in ("ratio", "focus_ratio"):
        value = getattr(profile, name)
        if value is not None and not (number(value) and 0 <= value <= 1):
            raise ValueError(f"{name} {value!r} is not a number in [0, 1]")
    if not (number(profile.target) and 0 < profile.target <= 1) or profile.at not in POSITIONS:
        raise ValueError(f"target {profile.target!r} or position {profile.at!r} is not one calibrate writes")
    return profile


def save_profile(profile: Profile) -> Path:
    path = profile_path(profile.fingerprint, profile.dtype, profile.kv_codec)
    path.parent.mkdir(parents=True, exist_ok=True)
    durable.write_file(path, json.dumps(asdict(profile), indent=1))
    return path


def profiles_by_model() -> dict[str, list[Profile]]:
    """Every saved profile, by model name (for listings; a model is matched by fingerprint when it is loaded)."""
    out: dict[str, list[Profile]] = {}
    for profile in map(read_profile, sorted((fetch.model_cache_dir() / "profiles").glob("*.json"))):
        if profile is not None:
            out.setdefault(profile.model, []).append(profile)
    return out


def builtin_items(
    rc, n: int, docs_per_item: int = 4, seed: int = 0, data: Path = DATA_DIR, ids: dict[str, str] | None = None
) -> list[Item]:
    """Questions of the sample set in `data`, each over its own document and distractors (the answer among them);
    `ids`: the documents' ids by file name, where the caller has compiled them (else they are compiled here)."""
    docs = {p.name: read_text(p) for p in sorted((data / "docs").glob("*.txt"))}  # as `compile` reads them
    ids = ids or dict(zip(docs, rc.compile(list(docs.values()))))
    rows = [json.loads(line) for line in read_text(data / "questions.jsonl").splitlines() if line.strip()]
    rng = random.Random(seed)
    items = []
    for row in rows[:n]:
        others = rng.sample([name for name in docs if name != row["doc"]], docs_per_item - 1)
        chosen = [*others[: len(others) // 2], row["doc"], *others[len(others) // 2 :]]
        items.append(Item(row["question"], [ids[name] for name in chosen]))
    return items


def _sentences(text: str) -> list[str]:
    return [s.strip() for s in text.replace("\n", " ").split(".") if len(s.split()) >= SENTENCE_WORDS]


def check_documents(texts: list[str]) -> None:
    """BadRequest unless items can be made from these documents (checked before a model loads)."""
    if not any(_sentences(text) for text in texts):
        raise BadRequest(
            f"calibration asks how a sentence of your documents continues, and none of them has a "
            f"sentence of {SENTENCE_WORDS} words or more (sentences end with '.'): pass documents of "
            "running text, or leave out --docs to calibrate on the built-in set"
        )


def items_from_documents(rc, texts: list[str], n: int, docs_per_item: int = 3, seed: int = 0) -> list[Item]:
    """Items over the user's own documents, with no questions given: each asks for what a sentence of one of the
    documents says next, among other documents, so the answer needs the right chunk's content."""
    check_documents(texts)
    ids = rc.compile(texts)
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        pick = rng.randrange(len(texts))
        sentences = _sentences(texts[pick])
        if not sentences:
            continue
        words = rng.choice(sentences).split()
        cue = " ".join(words[: max(3, len(words) // 2)])
        others = rng.sample([i for i in range(len(texts)) if i != pick], min(docs_per_item - 1, len(texts) - 1))
        order = [*others[: len(others) // 2], pick, *others[len(others) // 2 :]]
        items.append(
            Item(
                f'According to the documents, how does the sentence starting "{cue}" continue?', [ids[i] for i in order]
            )
        )
    return items


@dataclass
class Reference:
    """What `full` says at the measured position: the token, and the answer tokens fed before it."""

    token: int
    lead: list[int] = field(default_factory=list)


def reference(rc, item: Item, at: str) -> Reference:
    """`full`'s token at the answer's first position, or at its first content word (the first position where
    its greedy answer has none)."""
    room = ANSWER_TOKENS if at == "content" else 0
    full = rc.link(item.question, item.doc_ids, algorithm="full", max_new_tokens=room)
    first = Reference(int(full.last_logits.argmax()))
    if at == "first":
        return first
    answer = rc.with_runner(agree.greedy, full, ANSWER_TOKENS, eos_ids(rc.lm), {})
    position = agree.content_position(rc.tokenizer, answer)
    return first if position is None else Reference(answer[position], answer[:position])


def _linked_token(rc, item: Item, link_kwargs: dict, ref: Reference) -> int:
    """The linked cache's argmax at the reference's position (teacher-forced along full's answer up to there)."""
    linked = rc.link(item.question, item.doc_ids, max_new_tokens=len(ref.lead), **link_kwargs)
    if not ref.lead:
        return int(linked.last_logits.argmax())
    _, logits = rc.with_runner(agree.teacher_forced, linked, [*ref.lead, ref.token])
    return int(logits[-1].argmax())


def agreement(rc, items: list[Item], link_kwargs: dict, refs: list[Reference]) -> float:
    return sum(_linked_token(rc, item, link_kwargs, ref) == ref.token for item, ref in zip(items, refs)) / len(items)


def calibrate(
    rc,
    items: list[Item],
    target: float = DEFAULT_TARGET,
    ks=DEFAULT_KS,
    ratios=DEFAULT_RATIOS,
    focus_ratios=DEFAULT_FOCUS_RATIOS,
    progress: Callable[[str], None] | None = None,
    at: str = "content",
) -> Profile:
    """Sweep k (and ratio) upwards; stop at the first that reaches `target`. Agreement is monotone enough in k for
    the first hit to be the answer here, and stopping early saves most of the sweep."""
    if not items:
        raise BadRequest("calibration needs at least one item")
    if at not in POSITIONS:
        raise BadRequest(f"at must be one of {', '.join(POSITIONS)}, got {at!r}")
    say = progress or (lambda _: None)
    # against the base model's own full, also when a link adapter is attached: the adapter is there to make a cheap
    # link answer as the base model does, not to move full (calibration is the engine's only user meanwhile)
    with torch.inference_mode(), rc.lm.base_weights():
        refs = [reference(rc, item, at) for item in items]
    moved = sum(bool(ref.lead) for ref in refs)
    say(
        f"full: {len(items)} items linked"
        + (f", {moved} measured past the answer's first token" if at != "first" else "")
    )
    profile = Profile(
        rc.lm.name,
        rc.lm.fingerprint,
        dtype_name(rc.lm),
        target,
        len(items),
        None,
        None,
        created=time.time(),
        at=at,
        adapter=rc.lm.adapter.sha256 if rc.lm.adapter else "",
        kv_codec=rc.kv_codec,
    )
    profile.naive_agreement = agreement(rc, items, {"algorithm": "naive"}, refs)
    say(f"naive: {profile.naive_agreement:.2f}")
    profile.k = _smallest(rc, items, refs, target, "legolink", "k", ks, profile.agreement_by_k, say)
    profile.ratio = _smallest(rc, items, refs, target, "cacheblend", "ratio", ratios, profile.agreement_by_ratio, say)
    profile.focus_ratio = _smallest(
        rc, items, refs, target, "focus", "ratio", focus_ratios, profile.agreement_by_focus, say
    )
    return profile


def _smallest(rc, items, refs, target, algorithm, knob, values, scores: dict, say):
    """The first of `values` (ascending) whose agreement reaches `target`, recording each score on the way."""
    for value in values:
        scores[str(value)] = agreement(rc, items, {"algorithm": algorithm, knob: value}, refs)
        say(f"{algorithm} {knob}={value}: {scores[str(value)]:.2f}")
        if scores[str(value)] >= target:
            return value
    return None


def agreement_cell(score: float, n: int) -> str:
    """An agreement and its 95% interval: at 24 items, 0.96 means anything from 0.80 to 0.99."""
    low, high = wilson_interval(round(score * n), n)
    return f"{score:.2f} [{low:.2f}, {high:.2f}]"


def wilson_interval(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% interval of a proportion (Wilson): honest at the small n a calibration runs on."""
    if n == 0:
        return 0.0, 1.0
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def dtype_name(lm: loaded.LoadedModel) -> str:
    return str(lm.dtype).removeprefix("torch.")
