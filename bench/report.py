"""What every benchmark writes: a rich table on stdout, JSON and a PNG plot under bench/results/.

The JSON carries the machine next to the numbers (CPU, cores, torch threads, load average before and after the
run): CPU timings on a shared box are noisy, and a figure without its load average cannot be compared."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


# -- the machine ------------------------------------------------------------------------------------------
def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def load_average() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


RESULT_FOLDERS = ("bench/results", "research/results")


def git_commit(checkout: Path | None = None) -> str | None:
    """HEAD's short hash, "-dirty" appended when files differ from it, a new file not yet added included (a new
    module the run imports): the code a run measured is then not that commit's. Tags are left out, so the name is
    always a hash. None, said on stderr, where git cannot tell (not a checkout, no git)."""
    where = checkout or Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "describe", "--always", "--exclude=*"], capture_output=True, text=True,
                              timeout=5, cwd=where).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=normal", "--", ".",
                                  *(f":!{results}" for results in RESULT_FOLDERS)],  # earlier runs' files: no code
                                 capture_output=True, text=True, timeout=30, cwd=where).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        head = changed = ""
    if not head:
        print(f"no commit recorded: git could not describe {where}", file=sys.stderr)
        return None
    return f"{head}-dirty" if changed else head


def machine() -> dict:
    import torch

    return dict(cpu=cpu_name(), cores=os.cpu_count(), torch_threads=torch.get_num_threads(), torch=torch.__version__,
                python=platform.python_version(), cuda=torch.cuda.is_available(), load_average_start=load_average(),
                commit=git_commit(), command=" ".join(sys.argv))


class Run:
    """One benchmark run: its parameters, the machine, its result rows; `finish()` writes JSON (+ PNG)."""

    def __init__(self, benchmark: str, params: dict, out_dir: Path | None = None):
        self.benchmark = benchmark
        self.params = params
        self.out_dir = Path(out_dir) if out_dir else RESULTS
        self.machine = machine()
        self.started = time.time()
        self._loads: list[float] = []
        self._stop = threading.Event()
        threading.Thread(target=self._sample_load, daemon=True).start()

    def _sample_load(self, every_s: float = 5.0) -> None:
        """The 1-minute load average every few seconds: other people's work on a shared box changes under a run."""
        while True:
            avg = load_average()
            if avg:
                self._loads.append(avg[0])
            if self._stop.wait(every_s):
                return

    def path(self, suffix: str) -> Path:
        tag = self.params.get("tag") or ""
        name = f"{self.benchmark}-{slug(self.params.get('model', ''))}" + (f"-{slug(tag)}" if tag else "")
        return self.out_dir / f"{name.strip('-')}.{suffix}"

    def finish(self, results: list[dict], extra: dict | None = None, plot=None) -> dict[str, Path]:
        """Write `<benchmark>-<model>[-tag].json` and, when `plot(path)` is given, the PNG; return both paths."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._stop.set()
        loads = self._loads
        machine = dict(self.machine, load_average_end=load_average(), load_1min_during=dict(
            samples=len(loads), min=min(loads, default=None), median=median(loads), max=max(loads, default=None)))
        report = dict(benchmark=self.benchmark, created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                      seconds=round(time.time() - self.started, 1), machine=machine, params=self.params,
                      **(extra or {}), results=results)
        paths = {"json": self.path("json")}
        paths["json"].write_text(json.dumps(report, indent=2, default=_jsonable) + "\n")
        if plot is not None:
            paths["png"] = self.path("png")
            plot(paths["png"])
        for p in paths.values():
            print(f"wrote {p}")
        return paths


def slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in ".-" else "-" for c in str(Path(text).name if "/" in text else text))


def _jsonable(value):
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


# -- numbers ----------------------------------------------------------------------------------------------
def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.1f}"


# -- output -----------------------------------------------------------------------------------------------
def print_table(title: str, headers: list[str], rows: list[list[str]], caption: str | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, caption=caption)
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i < 2 else "right", no_wrap=True)
    for r in rows:
        table.add_row(*[str(c) for c in r])
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    console.print(table)


def pyplot():
    """matplotlib with a file-only backend (benchmarks run headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def subtitle(machine: dict, extra: str = "") -> str:
    load = machine.get("load_average_start")
    load_s = f", load {load[0]:.1f}" if load else ""
    return f"{machine.get('cpu', '')[:40]}, {machine.get('cores')} cores{load_s}" + (f"; {extra}" if extra else "")


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def header_line(data: dict) -> str:
    m = data["machine"]
    start, end = m.get("load_average_start"), m.get("load_average_end")
    load = f"load average {start[0]:.1f} at start, {end[0]:.1f} at end" if start and end else "load average unknown"
    during = m.get("load_1min_during") or {}
    if during.get("samples"):
        load += (f" (1-min load during the run: min {during['min']:.1f}, median {during['median']:.1f}, "
                 f"max {during['max']:.1f})")
    return (f"{data['created']}, commit {m.get('commit')}, {m['cpu']}, {m['cores']} cores, torch {m['torch']} with "
            f"{m['torch_threads']} thread(s), {load}; {data['seconds']:.0f} s")
