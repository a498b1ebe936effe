"""Infilling tasks cut from real Python sources, deterministically (the same seed gives the same tasks).

Every task puts the cursor *inside an identifier* (`self.comp|utation`), the partial-word case EFIM meets
when the user's latest keystrokes go after <MID>:

    line   middle = the rest of the line from the cursor (a single-line infilling task)
    span   middle = 4..48 characters from the cursor, ending anywhere (inside a word, across a line end)

`split` is the EFIM base: prefix[:split] is what the session cached, prefix[split:] the 1..8 characters typed
since, ending at the cursor. The default source is the Python standard library's top-level modules (the
`human-eval-infilling` name on PyPI is an empty placeholder without data or code).
"""

from __future__ import annotations

import ast
import random
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import BadRequest

KINDS = ("line", "span")
SKIP_FILES = {"this.py", "antigravity.py"}


@dataclass(frozen=True)
class InfillTask:
    task_id: str  # "<file>:<line>:<column>:<kind>"
    kind: str
    prefix: str
    suffix: str
    middle: str
    split: int  # EFIM: prefix[:split] cached, prefix[split:] the increment (ends inside a word)
    path: str  # the source file and the middle's character offsets in it (for the syntax check)
    start: int
    end: int

    def as_dict(self) -> dict:
        return asdict(self)


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(source: Path | None = None) -> list[Path]:
    """Python files to cut tasks from: the stdlib's top-level modules by default, else every *.py under source."""
    if source is None:
        files = [p for p in stdlib_dir().glob("*.py") if p.name not in SKIP_FILES and not p.name.startswith("_")]
    else:
        source = Path(source)
        files = [source] if source.is_file() else list(source.rglob("*.py"))
    # a dangling link, a folder named x.py: no file to read
    files = sorted(p for p in files if p.is_file() and 200 <= p.stat().st_size <= 400_000)
    if not files:
        raise BadRequest(f"no Python source files under {source or stdlib_dir()}")
    return files


def _is_word(ch: str) -> bool:
    return ch.isalnum() or ch == "_"


def _code_lines(text: str) -> list[tuple[int, str]]:
    """(offset, line) of lines worth a task: some code, not a comment, at least 12 characters."""
    out, at = [], 0
    for line in text.splitlines(keepends=True):
        body = line.strip()
        if len(body) >= 12 and not body.startswith(("#", '"', "'")) and any(c in body for c in "=(["):
            out.append((at, line))
        at += len(line)
    return out


def _window(text: str, start: int, end: int, prefix_chars: int, suffix_chars: int) -> tuple[str, str]:
    """Prefix from a line start at most prefix_chars before `start`; suffix up to a line end."""
    p0 = max(0, start - prefix_chars)
    if p0 > 0:
        nl = text.find("\n", p0, start)
        p0 = nl + 1 if nl != -1 else p0  # a window shorter than the line: cut inside it
    s1 = min(len(text), end + suffix_chars)
    if s1 < len(text):
        nl = text.rfind("\n", end, s1)
        s1 = nl + 1 if nl != -1 else end
    return text[p0:start], text[end:s1]


def make_task(
    path: Path, text: str, rng: random.Random, kind: str, prefix_chars: int, suffix_chars: int, max_increment: int = 8
) -> InfillTask | None:
    lines = _code_lines(text)
    if not lines:
        return None
    offset, line = rng.choice(lines)
    indent = len(line) - len(line.lstrip())
    content = line.rstrip("\r\n")
    cursors = [c for c in range(indent + 1, len(content.rstrip())) if _is_word(content[c - 1]) and _is_word(content[c])]
    if not cursors:
        return None
    col = rng.choice(cursors)
    start = offset + col
    if kind == "line":
        end = offset + len(content)
    else:
        end = min(len(text), start + rng.randint(4, 48))
    prefix, suffix = _window(text, start, end, prefix_chars, suffix_chars)
    if not prefix:  # a window cut to nothing: no typed increment to take back
        return None
    typed = rng.randint(1, min(max_increment, col - indent, len(prefix)))
    line_no = text.count("\n", 0, offset) + 1
    return InfillTask(
        f"{path.name}:{line_no}:{col}:{kind}",
        kind,
        prefix,
        suffix,
        text[start:end],
        len(prefix) - typed,
        str(path),
        start,
        end,
    )


def build_tasks(
    n: int,
    seed: int = 0,
    kinds: tuple[str, ...] = KINDS,
    source: Path | None = None,
    prefix_chars: int = 1200,
    suffix_chars: int = 400,
) -> list[InfillTask]:
    """n tasks, kinds taking turns, files and positions drawn from random.Random(seed)."""
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise BadRequest(f"unknown task kind(s) {bad}; choose from {', '.join(KINDS)}")
    if n < 1:
        raise BadRequest(f"the number of tasks must be >= 1, got {n}")
    files = source_files(source)
    rng = random.Random(seed)
    texts: dict[Path, str | None] = {}
    tasks: list[InfillTask] = []
    seen: set[str] = set()
    for _ in range(200 * n):
        if len(tasks) == n:
            break
        path = rng.choice(files)
        if path not in texts:
            texts[path] = _parsable(path)
        text = texts[path]
        if text is None:
            continue
        task = make_task(path, text, rng, kinds[len(tasks) % len(kinds)], prefix_chars, suffix_chars)
        if task is not None and task.task_id not in seen:
            seen.add(task.task_id)
            tasks.append(task)
    if len(tasks) < n:
        raise BadRequest(f"found only {len(tasks)} of {n} tasks in {source or stdlib_dir()}")
    return tasks


def _parsable(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8")
        ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return None
    return text


def syntax_ok(task: InfillTask, prediction: str) -> bool | None:
    """Does the file parse with the prediction in place of the middle? None when the file is gone."""
    try:
        text = Path(task.path).read_text(encoding="utf-8")
    except OSError:
        return None
    try:
        ast.parse(text[: task.start] + prediction + text[task.end :])
    except (SyntaxError, ValueError):
        return False
    return True
