"""Where the commands print (results to stdout, everything else to stderr), and how a failure ends one: a red line
and an exit code scripts can rely on (ragcache/cli.py's docstring lists them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn

from .errors import BadRequest, ModelFetchError, PromptTooLong, UnknownDocument, UnsupportedModel

T = TypeVar("T")
console = Console()
err = Console(stderr=True)

# error kinds -> exit code; the first class that matches wins
EXIT_CODES: list[tuple[type[Exception], int]] = [
    (UnknownDocument, 4),
    (BadRequest, 3),
    (PromptTooLong, 3),  # bad input too (the API's 413), though not a BadRequest: it carries the numbers
    (ModelFetchError, 5),
    (UnsupportedModel, 5),
    (Exception, 1),
]


_opened: list = []  # what a command opened (an engine, a store): closed as the command ends, however it ends


def opened(thing: T) -> T:
    """`thing` (with a close()), closed when the command ends: a tiered store writes what a tier missed, and says
    what it could not, only as it closes."""
    _opened.append(thing)
    return thing


def closing_opened() -> Callable[[], None]:
    """At a command's start: what closes what it opens (what was opened outside a command is its caller's)."""
    _opened.clear()

    def close() -> None:
        while _opened:
            thing = _opened.pop()
            try:
                thing.close()
            except Exception as exc:  # noqa: BLE001 - the command's own outcome stands; a failed close is said
                err.print(f"[yellow]warning:[/yellow] closing the {type(thing).__name__} failed: {escape(str(exc))}")

    return close


def bars(*extra: ProgressColumn, transient: bool = False, rate_window_s: float = 30.0) -> Progress:
    """Progress bars on stderr: each task's name, bar, done/total and time so far, then `extra` columns. A time
    remaining comes from the rate over the last `rate_window_s` (rich's default): none while fewer than two updates
    fall within it."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        *extra,
        console=err,
        transient=transient,
        speed_estimate_period=rate_window_s,
    )


def out(text: str, end: str = "\n") -> None:
    """Text for stdout as it is: a model's answer, ids a script reads. rich would wrap it at the terminal's width
    (80 columns in a pipe), strip spaces at the breaks and turn tabs into spaces."""
    console.file.write(text + end)
    console.file.flush()


def interrupted(kept: str = "") -> NoReturn:
    """Ctrl-C: a yellow line (what was kept, how to resume) and exit 130, not click's "Aborted!" and exit 1."""
    err.print("[yellow]interrupted[/yellow]" + (f": {escape(kept)}" if kept else ""))
    raise typer.Exit(130)


def fail(exc: Exception | str, code: int | None = None) -> NoReturn:
    """A red line on stderr, then exit with `code`, else the exit code of the error's kind."""
    err.print(f"[red]error:[/red] {escape(str(exc))}")  # an error quotes input: its brackets are no markup
    raise typer.Exit(next(c for kind, c in EXIT_CODES if isinstance(exc, kind)) if code is None else code)
