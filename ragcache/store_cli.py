"""`ragcache store ...`: look at and maintain a store without loading a model.

  stats      entries, bytes, hits per tier; entries per model; bytes per token by kv codec; records
  ls         entries with size, model, tokens, dtype (--limit, --json)
  verify     decode every entry and read every record; --fix deletes the bad ones; exit 1 if bad ones remain
  gc         disk: temp files of killed writers, index reconciled with the files, eviction to the budget;
             redis: parts no manifest points to, manifests whose parts are gone; --unreferenced also drops
             entries no document refers to (system-prompt prefixes included: they are recompiled on demand),
             except those written since the gc began (a concurrent compile's)
  rm ID      a document id: its records and the chunk entries derivable from them; a chunk key: that entry

Exit codes: 0 ok, 1 store failure or bad entries left, 2 usage error, 3 bad settings (ragcache.toml, RAGCACHE_*).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.progress import TaskID
from rich.table import Table

from ragcache.store import codec as kv_codec
from ragcache.store import open_store, shown, tier_urls
from ragcache.store.base import Store
from ragcache.store.disk import DiskStore, holds_store
from ragcache.store.keys import HEADS, STORE_KEY_ENV, entry_form, is_document_id, kv_form, summary_codec

from . import maintenance
from .cli_options import StoreOpt
from .console import bars, closing_opened, console, err, fail, interrupted, opened
from .errors import BadRequest, StoreError
from .settings import load_settings

store_app = typer.Typer(help="Inspect and maintain the document KV store (no model needed).", no_args_is_help=True)


@store_app.callback()
def _each_command(ctx: typer.Context) -> None:
    ctx.call_on_close(closing_opened())  # the store the command opens, closed as it ends (also run on its own)


def _settings_store(url: str | None) -> str:
    """The --store given, else the settings' store, as compile and query take it (RAGCACHE_STORE, ragcache.toml)."""
    if url:  # the other settings (engine, guard, adapter) mean nothing here: not read, so not checked
        return url
    try:
        return load_settings(store=url).store
    except BadRequest as exc:  # a bad value in ragcache.toml, say
        fail(exc)


AsJson = Annotated[bool, typer.Option("--json", help="print JSON instead of tables")]


# -- helpers (usable without the CLI) -------------------------------------------------------------------
def entry_rows(
    store: Store,
    limit: int | None = None,
    progress: maintenance.Progress = maintenance.silent,
    total: int = 0,
) -> Iterator[dict]:
    """key, size, tokens, dtype, shape, model of each entry (from headers / manifests, not the tensors), a batch of
    headers at a time: a store of millions of entries is never held in memory whole. `progress` hears of each batch
    (`total`: the entries expected, as the tier counts them)."""
    stage = f"reading {store.name}'s entries"
    for count, (key, info) in enumerate(maintenance.headers(store, progress, stage, total)):
        if limit is not None and count >= limit:
            return
        meta = info.get("meta") or {}
        yield {
            "key": key,
            "size": info.get("size", 0),
            "tokens": info.get("tokens"),
            "dtype": info.get("dtype"),
            "codec": summary_codec(info),
            "form": entry_form(info),
            "shape": info.get("shape"),
            "model_name": meta.get("model_name") or (meta.get("model", "")[:12] or "?"),
            "model": meta.get("model", ""),
            "tokenizer": meta.get("tokenizer", ""),
            "layout": meta.get("layout", ""),
            "heads": meta.get(HEADS) or "",  # a tensor-parallel rank's shard of a chunk's entry
            "error": info.get("error"),
        }


def summary(store: Store, progress: maintenance.Progress = maintenance.silent) -> dict:
    """Each tier's stats and its entries counted from their headers (minutes at millions of entries: `progress`)."""
    tiers: list[dict] = []
    for tier in maintenance.tiers_of(store):
        try:  # a tier that fails while its entries are read is one tier's error too, not the command's
            stats = tier.stats()
            total = stats["entries"] if isinstance(stats.get("entries"), int) else 0
            rows = entry_rows(tier, progress=progress, total=total)
            tiers.append({**stats, **_tally(rows)})
        except StoreError as exc:
            tiers.append({"tier": tier.name, "error": str(exc)})
    names = store.record_names()
    return {
        "store": store.name,
        "tiers": tiers,
        "records": len(names),
        "documents": sum(1 for n in names if n.startswith("doc/")),
    }


def _tally(rows: Iterable[dict]) -> dict:
    """A tier's entries counted as they stream by: bytes, models, forms, and per kv codec (store/codec.py) entries,
    tokens, stored bytes and bytes per token. KV-head shards apart: they weigh their chunks' tokens again."""
    entries = size = unreadable = 0
    models: Counter[str] = Counter()
    forms: Counter[str] = Counter()
    shards = {"entries": 0, "bytes": 0}
    codecs: dict[str, dict] = {}
    for r in rows:
        entries, size = entries + 1, size + r["size"]
        models[r["model_name"]] += 1
        if r["error"]:
            unreadable += 1
            continue
        forms[r["form"]] += 1
        if r["heads"]:
            shards["entries"], shards["bytes"] = shards["entries"] + 1, shards["bytes"] + r["size"]
        elif r["tokens"]:
            c = codecs.setdefault(r["codec"] or "?", {"entries": 0, "tokens": 0, "bytes": 0})
            c["entries"], c["tokens"], c["bytes"] = c["entries"] + 1, c["tokens"] + r["tokens"], c["bytes"] + r["size"]
    for c in codecs.values():
        c["bytes_per_token"] = round(c["bytes"] / c["tokens"], 1)
    return {
        "entries": entries,
        "bytes": size,
        "models": dict(models),
        "codecs": codecs,
        "shards": shards,
        "forms": dict(forms),
        "unreadable_headers": unreadable,
    }


# -- commands -----------------------------------------------------------------------------------------------
def _open(url: str | None) -> Store:
    """The store at `url` (else the settings'); a disk folder no store was made in is refused, not made into one
    (these commands look at or maintain a store, never create one)."""
    url = _settings_store(url)
    for part in tier_urls(url):
        if part.startswith("disk:") and not holds_store(Path(path := DiskStore.url_parts(part)[0])):
            fail(f"no store at {path!r} (nothing compiled there yet?)", 1)
    return opened(open_store(url))  # a StoreError: the command's _guard


def size_text(n: float) -> str:
    """Bytes as a reader takes them: 1.5 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


@contextmanager
def _bars() -> Iterator[maintenance.Progress]:
    """A maintenance.Progress drawing one bar per stage on stderr; gone once the work is done."""
    with bars(transient=True) as bar:
        tasks: dict[str, TaskID] = {}

        def update(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done, total=total)

        yield update


def _guard(fn):
    """Store failures become a red line and exit code 1, not a traceback; Ctrl-C exit 130."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            interrupted()
        except StoreError as exc:
            fail(exc)

    return wrapper


@store_app.command()
@_guard
def stats(store: StoreOpt = None, as_json: AsJson = False) -> None:
    """Entries, bytes and hits per tier, entries per model, records."""
    store = _settings_store(store)
    with _bars() as progress:
        info = summary(_open(store), progress)
    if as_json:
        console.print_json(json.dumps(info, default=str))
        return
    table = Table(title=f"store {shown(store)}")
    for col in ("tier", "entries", "bytes", "budget", "hits", "models", "bytes/token by codec"):
        table.add_column(col, justify="right" if col in ("entries", "bytes", "budget", "hits") else "left")
    for t in info["tiers"]:
        if "error" in t:
            table.add_row(t["tier"], "-", "-", "-", "-", f"[red]{t['error']}[/red]", "-")
            continue
        codecs = ", ".join(f"{name}: {c['bytes_per_token']:,.0f}" for name, c in sorted(t["codecs"].items())) or "-"
        budget = t.get("budget_bytes") or t.get("maxmemory") or 0
        hits = t.get("index_hits", t.get("server_hits", t.get("hits", 0)))
        models = ", ".join(f"{m}: {n}" for m, n in sorted(t["models"].items())) or "-"
        table.add_row(
            t["tier"],
            str(t["entries"]),
            size_text(t["bytes"]),
            size_text(budget) if budget else "-",
            str(hits),
            models,
            codecs,
        )
    console.print(table)
    for t in info["tiers"]:  # a line, not a column: the forms are what `gc --drop-form` takes, spelled out
        if t.get("forms"):
            forms = ", ".join(f"{form}: {n}" for form, n in sorted(t["forms"].items()))
            console.print(f"{t['tier']} entries by form: {forms}")
    console.print(f"records: {info['records']} ({info['documents']} documents)")


@store_app.command("ls")
@_guard
def ls(
    store: StoreOpt = None,
    limit: Annotated[int, typer.Option(min=0, help="at most this many entries")] = 50,
    as_json: AsJson = False,
) -> None:
    """Entries with their size, model and token count."""
    rows = list(entry_rows(_open(store), limit=limit))
    if as_json:
        console.print_json(json.dumps(rows))
        return
    table = Table()
    for col in ("key", "size", "tokens", "dtype", "shape", "model"):
        table.add_column(col, justify="right" if col in ("size", "tokens") else "left", no_wrap=col == "key")
    for r in rows:  # a key prefix is enough for `rm`; --json has the full keys
        if r["error"]:
            table.add_row(r["key"][:16], size_text(r["size"]), "-", "-", "-", f"[red]{r['error']}[/red]")
        else:
            table.add_row(
                r["key"][:16],
                size_text(r["size"]),
                str(r["tokens"]),
                r["dtype"] or "-",
                "x".join(map(str, r["shape"] or [])),
                r["model_name"],
            )
    console.print(table)
    console.print(f"{len(rows)} entries shown (--limit {limit})")


@store_app.command()
@_guard
def verify(
    store: StoreOpt = None,
    fix: Annotated[
        bool,
        typer.Option(
            "--fix",
            help="delete the bad entries and records (not the records whose only fault is their checksum, nor "
            "document records whose text still hashes to their id: see --drop-checksum-only)",
        ),
    ] = False,
    drop_checksum_only: Annotated[
        bool,
        typer.Option(
            "--drop-checksum-only",
            help="with --fix, also delete records sound in every field but their checksum and document records "
            f"whose text is intact: document texts, which nothing can rebuild (first check {STORE_KEY_ENV})",
        ),
    ] = False,
    as_json: AsJson = False,
) -> None:
    """Full integrity check: decode every entry (checksum, key, shapes), read every record."""
    if drop_checksum_only and not fix:
        raise typer.BadParameter("only goes with --fix", param_hint="--drop-checksum-only")
    with _bars() as progress:
        report = maintenance.verify(_open(store), fix=fix, drop_checksum_only=drop_checksum_only, progress=progress)
    bad = len(report["bad"]) + len(report["bad_records"])
    for tier in report["unverified"]:
        said = escape(f"tier {tier['tier']}: {tier['problem']}")  # a path's brackets are no markup
        err.print(f"[red]not verified[/red] {said}", highlight=False, soft_wrap=True)
    if as_json:
        console.print_json(json.dumps(report))
    else:
        lines = [
            *(f"{b['tier']} entry {b['key']}: {b['problem']}" for b in report["bad"]),
            *(f"{b['tier']} record {b['name']}: {b['problem']}" for b in report["bad_records"]),
        ]
        for line in lines:  # one line each, whatever the terminal's width: scripts grep them
            console.print(f"[red]bad[/red] {escape(line)}", highlight=False, soft_wrap=True)
        console.print(
            f"{report['checked']} entries and {report['records_checked']} records checked, {bad} bad"
            + (f", {report['fixed']} deleted" if fix else "")
        )
        if report["kept"]:
            err.print(
                f"[yellow]kept {report['kept']} record(s)[/yellow] whose only fault is their checksum (most "
                f"likely {STORE_KEY_ENV} is not the one they were written with: run again with that key) or "
                "whose document text is intact (upload the text again to rewrite its record); add "
                "--drop-checksum-only to delete them anyway (document texts cannot be rebuilt)."
            )
    if bad > report["fixed"] or report["unverified"]:
        raise typer.Exit(1)


def _form(form: str) -> str:
    """A form as `store stats` lists it: an entry stored in its compute dtype is named by that dtype alone, so
    "float32/fp32" is "float32" (it would match nothing as given)."""
    dtype, _, codec = form.partition("/")
    if dtype not in ("float32", "bfloat16", "float16") or (codec and codec not in kv_codec.CODECS):
        raise typer.BadParameter(
            f"{form!r} is not a form: a compute dtype (float32, bfloat16, float16), then "
            f"optionally /codec ({', '.join(kv_codec.CODECS)})",
            param_hint="--drop-form",
        )
    return kv_form(dtype, codec) if codec else dtype


@store_app.command()
@_guard
def gc(
    store: StoreOpt = None,
    tmp_age: Annotated[
        float,
        typer.Option(
            min=60.0,
            help="seconds before a temp file / an orphan Redis part counts as abandoned (at least 60: a younger one "
            "may be a write under way in another process, which deleting it would fail)",
        ),
    ] = 600.0,
    unreferenced: Annotated[
        bool,
        typer.Option(
            "--unreferenced",
            help="also delete entries no document refers "
            "to (system-prompt prefixes included), except those written "
            "since the gc began",
        ),
    ] = False,
    drop_form: Annotated[
        list[str],
        typer.Option(
            "--drop-form",
            help="also delete every entry compiled in this "
            "form, as `store stats` lists them (e.g. float32/int8: the "
            "entries of the fp32 default of before); repeatable",
        ),
    ] = [],  # noqa: B006 - the command only reads it
    as_json: AsJson = False,
) -> None:
    """Reclaim space: abandoned temp files / orphan parts, index drift, eviction to the budget."""
    s = _open(store)
    forms = tuple(_form(form) for form in drop_form)
    with _bars() as progress:
        report = maintenance.collect_garbage(
            s, tmp_age_s=tmp_age, unreferenced=unreferenced, drop_forms=forms, progress=progress
        )
    if as_json:
        console.print_json(json.dumps(report))
        return
    for tier, what in report.items():
        console.print(f"{tier}: {what}")


@store_app.command()
@_guard
def rm(
    id: Annotated[
        str,
        typer.Argument(
            help="a document id (32 hex), or a chunk key or a unique prefix of one (8 hex or more, as `ls` shows)"
        ),
    ],
    store: StoreOpt = None,
) -> None:
    """Delete a document (its records and chunk entries) or one chunk entry."""
    id = id.lower()
    if len(id) < 8 or len(id) > 64 or any(c not in "0123456789abcdef" for c in id):
        fail(f"{id!r} is neither a document id (32 hex) nor a chunk key (8 to 64 hex)", 3)
    store = _settings_store(store)
    s = _open(store)
    with _bars() as progress:
        result = maintenance.delete(s, id, progress) if is_document_id(id) else None
    if result is not None:
        console.print(
            f"document {id}: {result['records']} records and {result['entries']} chunk entries deleted "
            "(entries shared with other documents kept)"
        )
        return
    matches = [id] if len(id) == 64 else sorted({k for k in s if k.startswith(id)})
    if len(matches) > 1:
        fail(f"{id} matches {len(matches)} entries; give more of the key", 3)
    if not matches or not s.delete(matches[0]):
        fail(f"no document or entry {id} in {shown(store)}", 4)  # README: 4 is an unknown document
    console.print(f"entry {matches[0]} deleted")
