"""The `ragcache` command line, run as a user runs it (subprocesses, real default model, disk store)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ragcache.settings import DATA_DIR

pytestmark = pytest.mark.real_model
DATA = DATA_DIR


def ragcache(*args, cwd, check=True, timeout=300):
    proc = subprocess.run([sys.executable, "-m", "ragcache", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "COLUMNS": "200"})
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def test_compile_twice_then_query_by_path(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for name in ("lighthouse.txt", "railway.txt", "library.txt"):
        (docs / name).write_text((DATA / "docs" / name).read_text())
    store = f"disk:{tmp_path / 'store'}"
    first = ragcache("compile", str(docs), "--store", store, "--chunk-tokens", "64", cwd=tmp_path)
    assert "documents 3 (already compiled 0)" in first.stdout
    second = ragcache("compile", str(docs), "--store", store, "--chunk-tokens", "64", cwd=tmp_path)
    assert "documents 3 (already compiled 3)" in second.stdout and "(compiled 0)" in second.stdout
    answer = ragcache("query", "How tall is the Harrow Point lighthouse?", "--doc", str(docs / "lighthouse.txt"),
                      "--store", store, "--json", "--max-new-tokens", "12", cwd=tmp_path)
    assert '"compiled_chunks": 0' in answer.stdout and '"store_hits"' in answer.stdout


# The compile blocks after its 5th stored chunk until it is interrupted, so the Ctrl-C lands mid-run however fast
# or loaded the machine is (sending it after a deadline could hit the model load, or a finished run).
# A suite started in the background of a non-interactive shell (`nohup make test &`) inherits SIGINT ignored, and
# Python then installs no KeyboardInterrupt handler: the child restores it, or the Ctrl-C below would do nothing.
PAUSED_COMPILE = """
import pathlib, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
from ragcache import facade
ready = pathlib.Path(sys.argv.pop(1))
compile_chunks = facade.RagCache._compile
compiled = []
def paused(self, chunks, layout, writer=None):
    stored = compile_chunks(self, chunks, layout, writer)
    compiled.extend(chunks)
    if len(compiled) >= 5:
        ready.touch()
        time.sleep(3600)
    return stored
facade.RagCache._compile = paused
from ragcache.cli import main
main()
"""


def test_interrupted_compile_resumes(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    text = (DATA / "docs" / "railway.txt").read_text()
    corpus.write_text("\n".join(f'{{"body": "Document {i}. {text.strip()}"}}' for i in range(40)))
    store_dir = tmp_path / "store"
    ready = tmp_path / "ready"
    args = [sys.executable, "-c", PAUSED_COMPILE, str(ready), "compile", str(corpus), "--jsonl", "body",
            "--store", f"disk:{store_dir}", "--chunk-tokens", "32"]
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 900  # a safety net only: the test waits for the pause, not for a time
    while not ready.exists():
        assert proc.poll() is None, proc.communicate()
        if time.time() > deadline:
            proc.kill()
            pytest.fail(f"the compile did not store 5 chunks in 15 minutes: {proc.communicate()}")
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    done_before = len(list(store_dir.glob("entries/*/*.kv")))
    assert 5 <= done_before < 40 * 3
    resumed = ragcache("compile", str(corpus), "--jsonl", "body", "--store", f"disk:{store_dir}",
                       "--chunk-tokens", "32", cwd=tmp_path)
    assert "documents 40" in resumed.stdout
    compiled_now = int(resumed.stdout.split("(compiled ")[1].split(")")[0])
    total = len(list(store_dir.glob("entries/*/*.kv")))
    assert compiled_now == total - done_before > 0
    again = ragcache("compile", str(corpus), "--jsonl", "body", "--store", f"disk:{store_dir}",
                     "--chunk-tokens", "32", cwd=tmp_path)
    assert "(compiled 0)" in again.stdout


def test_bad_input_exit_codes(tiny_cli, tmp_path):
    missing = tiny_cli("compile", tmp_path / "nope", "--store", "memory:")
    assert missing.exit_code == 3 and "no such file" in missing.text
    unknown = tiny_cli("query", "what?", "--doc", "0" * 32, "--store", "memory:")
    assert unknown.exit_code == 4 and "unknown document" in unknown.text
    (tmp_path / "note.txt").write_text("some text")
    algo = tiny_cli("query", "what?", "--doc", tmp_path / "note.txt", "--algorithm", "magic", "--store", "memory:")
    assert algo.exit_code == 3 and "unknown algorithm" in algo.text
    knob = tiny_cli("query", "what?", "--doc", tmp_path / "note.txt", "--ratio", "1.5", "--store", "memory:")
    assert knob.exit_code == 3 and "ratio must be less than or equal to 1" in knob.text


def test_an_empty_file_saved_with_a_byte_order_mark_is_skipped_as_empty(tiny_cli, tmp_path):
    """It failed the whole compile (validate_text drops the mark and finds nothing), where empty files are skipped."""
    (tmp_path / "bom.txt").write_text("\ufeff \n")
    (tmp_path / "note.txt").write_text("some text")
    bom = tiny_cli("compile", tmp_path, "--store", "memory:")
    assert bom.exit_code == 0 and "skipping 1 empty document(s)" in bom.text and "bom.txt" in bom.text


def test_a_linked_folder_is_named_not_skipped_silently(tiny_cli, tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "a.md").write_text("The bridge is old.")
    (tmp_path / "docs" / "top").mkdir(parents=True)
    (tmp_path / "docs" / "top" / "b.md").write_text("A long canal.")
    (tmp_path / "docs" / "linked").symlink_to(tmp_path / "real")
    for glob in ([], ["--glob", "**/*.md"]):
        done = tiny_cli("compile", tmp_path / "docs", *glob, "--store", "memory:")
        assert done.exit_code == 0 and "documents 1" in done.text
        assert "not following 1 linked folder(s)" in done.text and "linked" in done.text
    given = tiny_cli("compile", tmp_path / "real" / "a.md", "--glob", "*.txt", "--store", "memory:")
    assert given.exit_code == 0 and "--glob picks files in folders" in given.text and "documents 1" in given.text


def test_a_text_given_twice_is_a_repeat_not_a_document_compiled_before(tiny_cli, tmp_path):
    for name, text in (("a.txt", "The bridge is old."), ("b.txt", "The bridge is old."), ("c.txt", "A long canal.")):
        (tmp_path / name).write_text(text)
    first = tiny_cli("compile", tmp_path, "--store", "memory:")
    assert first.exit_code == 0 and "documents 3 (already compiled 0, repeats of others 1)" in first.text
    again = tiny_cli("compile", tmp_path, "--store", "memory:")
    assert again.exit_code == 0 and "documents 3 (already compiled 3)" in again.text


def test_inputs_are_checked_before_the_model_loads(tiny_cli, tmp_path):
    """A typo'd path is never taken for document text, and bad inputs fail at once with exit 3 and a clear message,
    the model never loaded."""
    typo = tiny_cli("query", "what?", "--doc", tmp_path / "lighthous.txt", "--store", "memory:")
    assert typo.exit_code == 3 and "neither an existing file nor a document id" in typo.text
    (tmp_path / "blob.txt").write_bytes(bytes(range(256)) * 4)
    binary = tiny_cli("compile", tmp_path / "blob.txt", "--store", "memory:")
    assert binary.exit_code == 3 and "not UTF-8 text" in binary.text and "Traceback" not in binary.text
    (tmp_path / "empty").mkdir()
    empty = tiny_cli("compile", tmp_path / "empty", "--store", "memory:")
    assert empty.exit_code == 3 and "no documents to compile" in empty.text
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "slides.pptx").write_bytes(b"PK")
    odd = tiny_cli("compile", tmp_path / "odd", "--store", "memory:")
    assert odd.exit_code == 3 and "slides.pptx" in odd.text and "skipping 1 file" in odd.text
    where = tiny_cli("calibrate", "--at", "middle")
    assert where.exit_code == 3 and "--at must be one of first, content" in where.text
    rows = []
    for name, line in (("string", '"a line whose text is not an object"'), ("number", '{"text": 42}')):
        (tmp_path / f"{name}.jsonl").write_text('{"text": "a fine first line"}\n' + line + "\n")
        rows.append(tiny_cli("compile", tmp_path / f"{name}.jsonl", "--store", "memory:"))
    assert all(run.exit_code == 3 and "Traceback" not in run.text for run in rows)
    assert ":2: no field 'text'" in rows[0].text and "is int, not text" in rows[1].text
    assert tiny_cli.opened == []


def test_demo_models_and_config(tmp_path):
    data = tmp_path / "data"
    (data / "docs").mkdir(parents=True)
    questions = [line for line in (DATA / "questions.jsonl").read_text().splitlines() if line.strip()][:4]
    (data / "questions.jsonl").write_text("\n".join(questions))
    for line in questions:
        name = json.loads(line)["doc"]
        (data / "docs" / name).write_text((DATA / "docs" / name).read_text())
    demo = ragcache("demo", "--questions", "1", "--data", str(data), "--store", f"disk:{tmp_path / 'demo'}",
                    cwd=tmp_path)
    assert "focus" in demo.stdout and "full" in demo.stdout and "TTFT" in demo.stdout
    listed = ragcache("models", "list", cwd=tmp_path)
    assert "smollm2-135m" in listed.stdout and "gemma3-270m" in listed.stdout
    (tmp_path / "ragcache.toml").write_text('chunk_tokens = 128\n')
    shown = subprocess.run([sys.executable, "-m", "ragcache.cli", "config"], cwd=tmp_path, capture_output=True,
                           text=True, env={**os.environ, "RAGCACHE_K": "24", "COLUMNS": "200"})
    assert "128" in shown.stdout and "24" in shown.stdout


def test_kv_codec_from_compile_to_stats_to_query(tmp_path):
    """--kv-codec int8 end to end: compiled as int8, reported by `store stats` in bytes per token beside the fp32
    entries of the same document, read back by a query in int8; an unknown codec is a usage error."""
    doc = tmp_path / "lighthouse.txt"
    doc.write_text((DATA / "docs" / "lighthouse.txt").read_text())
    store = f"disk:{tmp_path / 'store'}"
    fp32 = ("--dtype", "float32")  # computed in fp32, so that the system prompt's entry is fp32 too
    ragcache("compile", str(doc), "--store", store, "--chunk-tokens", "64", "--kv-codec", "fp32", *fp32, cwd=tmp_path)
    ragcache("compile", str(doc), "--store", store, "--chunk-tokens", "64", "--kv-codec", "int8", *fp32, cwd=tmp_path)
    stats = json.loads(ragcache("store", "stats", "--store", store, "--json", cwd=tmp_path).stdout)
    codecs = stats["tiers"][0]["codecs"]
    # the chunks once per codec; the system prompt's entry is stored as computed (fp32) under either
    assert set(codecs) == {"fp32", "int8"} and 0 < codecs["int8"]["tokens"] < codecs["fp32"]["tokens"]
    assert codecs["int8"]["bytes_per_token"] < 0.3 * codecs["fp32"]["bytes_per_token"]
    answer = ragcache("query", "How tall is the Harrow Point lighthouse?", "--doc", str(doc), "--store", store,
                      "--json", "--max-new-tokens", "8", "--kv-codec", "int8", *fp32, cwd=tmp_path)
    assert '"compiled_chunks": 0' in answer.stdout  # every chunk came from the int8 entries
    bad = ragcache("query", "q", "--doc", str(doc), "--store", store, "--kv-codec", "int3", cwd=tmp_path, check=False)
    assert bad.returncode == 3 and "kv_codec" in bad.stderr


def test_calibrate_warns_on_the_builtin_set_and_saves_the_profile_beside_the_model(tmp_path, smollm2):
    """The built-in set's short paragraphs need fewer rows than most users' documents (docs/ACCURACY.md), so a
    profile calibrated on it says so; with --docs there is no warning. The model cache is a private one holding a
    link to the pulled model: the shared cache's profiles, which set the default k of other tests, stay as they are."""
    from ragcache import fetch

    cache = tmp_path / "models"
    cache.mkdir()
    (cache / "smollm2-135m").symlink_to(fetch.builtin_path("smollm2-135m"))
    env = {**os.environ, "COLUMNS": "200", "RAGCACHE_MODEL_DIR": str(cache)}
    calibrate = [sys.executable, "-m", "ragcache.cli", "calibrate", "--model", "smollm2-135m", "--items", "1"]
    builtin = subprocess.run(calibrate, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)
    assert builtin.returncode == 0, builtin.stderr
    assert "warning" in builtin.stderr and "built-in set" in builtin.stderr and "--docs" in builtin.stderr
    assert len(list((cache / "profiles").glob("*.json"))) == 1
    docs = tmp_path / "docs"
    docs.mkdir()
    for name in ("lighthouse.txt", "railway.txt"):
        (docs / name).write_text((DATA / "docs" / name).read_text())
    own = subprocess.run([*calibrate, "--docs", str(docs)], cwd=tmp_path, capture_output=True, text=True, env=env,
                         timeout=600)
    assert own.returncode == 0, own.stderr
    assert "warning" not in own.stderr and "profile:" in own.stdout


# -- the CLI's own checks and messages, in process, on a tiny random model (tests/tiny.py): seconds, not minutes

@pytest.fixture
def tiny_cli(monkeypatch):
    """`run(*args)` invokes `ragcache` with `_open` giving a tiny model; each store URL opens one store for the
    test, so a later command sees what an earlier one compiled. `run.opened` lists the stores opened (the model
    loads), `run.engines` the engines they gave."""
    from typer.testing import CliRunner

    from ragcache import cli
    from ragcache.facade import RagCache
    from ragcache.settings import EngineConfig
    from ragcache.settings import Settings
    from ragcache.store import open_store
    from tests import tiny

    lm, stores = tiny.make("llama"), {}

    def opened(model, store, chunk_tokens=None, dtype=None, device=None, kv_codec=None, adapter=None):
        s = Settings.model_construct(store=store or "memory:")
        stores.setdefault(s.store, open_store(s.store))
        run.opened.append(s.store)
        run.engines.append(RagCache(lm, stores[s.store], EngineConfig(chunk_tokens=chunk_tokens or 32)))
        return run.engines[-1], s

    def run(*args):
        result = CliRunner().invoke(cli.app, [str(a) for a in args])
        assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
        result.text = " ".join(result.output.split())  # rich wraps at 80 columns here
        return result

    run.opened, run.engines = [], []
    monkeypatch.setattr(cli, "_open", opened)
    return run


def test_file_names_line_separators_and_byte_order_marks_keep_their_documents(tiny_cli, tmp_path):
    """A file name that is not UTF-8 is kept in the source with U+FFFD; only "\\n" ends a JSONL line (U+2028 may
    sit inside a JSON string); a UTF-8 BOM is no part of a document, so it changes neither JSON nor the id."""
    from ragcache.store.keys import document_id

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / os.fsdecode(b"caf\xe9.txt")).write_text("A cafe by the harbour.")
    (docs / "bom.txt").write_text("\ufeffThe bridge is old.", encoding="utf-8")
    (docs / "lines.jsonl").write_text('\ufeff{"text": "one\u2028two\u2029three\x85four"}\n{"text": "five"}\n',
                                      encoding="utf-8")
    # Windows line ends stay the text's, as the same bytes sent to the API: one id (read_text made them "\n")
    (docs / "crlf.txt").write_bytes(b"Line one.\r\nLine two.\r\n")
    (docs / "crlf.jsonl").write_bytes(b'{"text": "six"}\r\n{"text": "seven"}\r\n')
    store = f"disk:{tmp_path / 'store'}"
    done = tiny_cli("compile", docs, "--store", store)
    assert done.exit_code == 0, done.output
    assert "documents 7" in done.text
    rc = tiny_cli.engines[-1]
    texts = {rc.document(i)["text"]: rc.document(i)["meta"]["source"] for i in rc.document_ids()}
    assert texts["A cafe by the harbour."] == os.fsencode(docs).decode() + "/caf\ufffd.txt"
    assert "one\u2028two\u2029three\x85four" in texts and "five" in texts
    assert document_id("The bridge is old.") in rc.document_ids()
    assert document_id("Line one.\r\nLine two.\r\n") in rc.document_ids() and {"six", "seven"} <= texts.keys()


def test_bad_input_is_refused_with_exit_3_before_the_model_loads(tiny_cli, tmp_path, monkeypatch):
    (tmp_path / "half.jsonl").write_text('{"text": "fine"}\n{"text": "half a pair \\ud800"}\n')
    half = tiny_cli("compile", tmp_path / "half.jsonl")
    assert half.exit_code == 3 and "half.jsonl:2 holds a lone surrogate" in half.text
    both = tiny_cli("query", "what?", "--doc", "0" * 32, "--stream", "--json")
    assert both.exit_code == 3 and "--stream and --json do not go together" in both.text
    plan = tiny_cli("compile", tmp_path / "half.jsonl", "--plan")  # checked as the compile checks it
    assert plan.exit_code == 3 and "half.jsonl:2 holds a lone surrogate" in plan.text
    (tmp_path / "deep.jsonl").write_text('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    deep = tiny_cli("compile", tmp_path / "deep.jsonl")
    assert deep.exit_code == 3 and "deep.jsonl:1: not JSON" in deep.text and "Traceback" not in deep.text
    question = tiny_cli("query", "caf\udce9?", "--doc", "0" * 32)
    assert question.exit_code == 3 and "the question holds a lone surrogate" in question.text
    pasted = "Paste of a whole document instead of its path. " * 100
    long_doc = tiny_cli("query", "what?", "--doc", pasted)
    assert long_doc.exit_code == 3 and "neither an existing file nor a document id" in long_doc.text
    assert "(4702 characters)" in long_doc.text
    long_path = tiny_cli("compile", pasted)
    assert long_path.exit_code == 3 and "File name too long" in long_path.text
    absolute = tiny_cli("compile", tmp_path, "--glob", str(tmp_path / "*.txt"))
    assert absolute.exit_code == 3 and "must be relative" in absolute.text
    corpus = tiny_cli("query", "what?", "--doc", tmp_path / "half.jsonl")
    assert corpus.exit_code == 3 and "holds one document per line" in corpus.text and "ragcache compile" in corpus.text
    (tmp_path / "d").mkdir()
    no_data = tiny_cli("demo", "--data", tmp_path / "d")
    assert no_data.exit_code == 3 and "questions.jsonl" in no_data.text
    (tmp_path / "d" / "docs").mkdir()
    for n in range(4):
        (tmp_path / "d" / "docs" / f"{n}.txt").write_text(f"Document {n}.")
    for line in ('{"question": "Why?"', '{"question": "Why?", "doc": "9.txt"}'):
        (tmp_path / "d" / "questions.jsonl").write_text(line + "\n")
        bad_rows = tiny_cli("demo", "--data", tmp_path / "d")
        assert bad_rows.exit_code == 3 and "questions.jsonl:1" in bad_rows.text, bad_rows.output
    assert tiny_cli("demo", "--questions", "-1").exit_code == 2
    (tmp_path / "upper").mkdir()
    (tmp_path / "upper" / "NOTE.TXT").write_text("A note in upper case.")
    upper = tiny_cli("compile", tmp_path / "upper", "--store", "memory:", "--plan", "--model", tmp_path / "none")
    assert "skipping" not in upper.text  # an upper-case suffix is the same kind of file
    assert tiny_cli.opened == []


def test_max_new_tokens_0_is_refused_not_taken_for_the_default(tiny_cli, tmp_path):
    (tmp_path / "note.txt").write_text("The bridge is old.")
    zero = tiny_cli("query", "how old?", "--doc", tmp_path / "note.txt", "--max-new-tokens", "0")
    assert zero.exit_code == 2 and "--max-new-tokens" in zero.text and tiny_cli.opened == []


def test_pdf_damage_is_bad_input_and_query_reads_a_pdf_as_compile_does(tiny_cli, tmp_path, monkeypatch):
    """pypdf is optional: a stand-in with its error classes. A damaged PDF names the file (exit 3); `query --doc`
    reads a PDF's text as `compile` does, so the two give one id."""
    import types

    from ragcache.store.keys import document_id

    class PyPdfError(Exception):
        pass

    class EmptyFileError(PyPdfError):
        pass

    class PdfReader:
        def __init__(self, path):
            if not path.read_bytes():
                raise EmptyFileError("Cannot read an empty file")
            self.pages = [types.SimpleNamespace(extract_text=lambda: "The orchard has pears.")]

    monkeypatch.setitem(sys.modules, "pypdf", types.SimpleNamespace(PdfReader=PdfReader))
    monkeypatch.setitem(sys.modules, "pypdf.errors", types.SimpleNamespace(PyPdfError=PyPdfError))
    (tmp_path / "empty.pdf").write_bytes(b"")
    empty = tiny_cli("compile", tmp_path / "empty.pdf")
    assert empty.exit_code == 3 and "empty.pdf is not a readable PDF: Cannot read an empty file" in empty.text
    (tmp_path / "orchard.pdf").write_bytes(b"%PDF-1.4 \xff\xfe binary")
    asked = tiny_cli("query", "what fruit?", "--doc", tmp_path / "orchard.pdf", "--max-new-tokens", "1")
    assert asked.exit_code == 0, asked.output
    assert tiny_cli.engines[-1].document_ids() == [document_id("The orchard has pears.")]


def test_query_summary_shows_store_hits_and_misses(tiny_cli, tmp_path):
    """A store compiled with another --kv-codec or --dtype misses every chunk: the summary line says so."""
    (tmp_path / "note.txt").write_text("The bridge is old. It was built of stone.")
    asked = tiny_cli("query", "how old?", "--doc", tmp_path / "note.txt", "--max-new-tokens", "1")
    assert asked.exit_code == 0, asked.output
    assert "chunks: store hits 0, misses 1, compiled 1" in asked.text
    again = tiny_cli("query", "how old?", "--doc", tmp_path / "note.txt", "--max-new-tokens", "1")
    assert "chunks: store hits 1, misses 0, compiled 0" in again.text


def test_answers_and_document_ids_reach_stdout_as_they_are(tiny_cli, tmp_path):
    """rich wrapped them at 80 columns in a pipe: an answer got newlines it never had, and a compiled document's
    `<id>  <source>` line broke before a long path, so `read id src` got lines of ids alone."""
    from ragcache.store.keys import document_id

    text = "The bridge is old. It was built of stone."
    long = tmp_path / ("a-folder-with-a-long-name-" * 3) / "note-with-a-long-name-too.txt"
    long.parent.mkdir()
    long.write_text(text)
    compiled = tiny_cli("compile", long)
    assert f"{document_id(text)}  {long}\n" in compiled.stdout, compiled.stdout
    for stream in ([], ["--stream"]):
        asked = tiny_cli("query", "how old?", "--doc", long, "--max-new-tokens", "120", *stream)
        answer = tiny_cli.engines[-1].query("how old?", docs=[{"text": text}], max_new_tokens=120).text
        assert len(answer) > 100 and asked.stdout == answer + "\n", (stream, asked.stdout)


def test_compile_skips_hidden_folders_and_warns_what_it_cannot_keep(tiny_cli, tmp_path):
    """A folder's hidden folders (.git, .venv) are not read unless --glob names them; a memory: store ends with the
    command; a document compiled before keeps its first chunk budget, and the output says which."""
    docs = tmp_path / "docs"
    for name in ("a.txt", ".venv/lib/b.md", ".git/c.txt", ".notes/d.md"):
        (docs / name).parent.mkdir(parents=True, exist_ok=True)
        (docs / name).write_text(f"The text of {name}.")
    walked = tiny_cli("compile", docs)
    assert walked.exit_code == 0, walked.output
    assert "documents 1 " in walked.text and "hidden folder(s) .git, .notes, .venv" in walked.text
    assert "memory:, which ends with this command" in walked.text
    named = tiny_cli("compile", docs, "--glob", ".notes/*.md", "--store", f"disk:{tmp_path / 'store'}")
    assert "documents 1 " in named.text and "d.md" in named.text and "memory:" not in named.text
    rebudget = tiny_cli("compile", docs, "--glob", ".notes/*.md", "--chunk-tokens", "16", "--store",
                        f"disk:{tmp_path / 'store'}")
    doc_id = tiny_cli.engines[-1].document_ids()[0]
    assert f"compiled before at another chunk budget and keep it (a document's budget is set when it is first " \
           f"added): {doc_id} (32 tokens)" in rebudget.text


def test_a_misspelled_key_in_ragcache_toml_is_refused(tmp_path, monkeypatch):
    """Ignored, its value silently never used: `kv_codc = "int4"` left the default codec."""
    from typer.testing import CliRunner

    from ragcache import cli

    (tmp_path / "ragcache.toml").write_text('kv_codc = "int4"\nchunk_tokens = 128\n')
    monkeypatch.chdir(tmp_path)
    shown = CliRunner().invoke(cli.app, ["config"])
    assert shown.exit_code == 3 and "'kv_codc' is no setting" in " ".join(shown.output.split()), shown.output


@pytest.mark.parametrize("case", ["no toml", "list not json", "missing config"])
def test_settings_that_cannot_be_read_are_bad_input_named(case, tmp_path, monkeypatch):
    """A ragcache.toml that is no TOML, a RAGCACHE_* list that is no JSON and a RAGCACHE_CONFIG naming no file: exit
    3 and what to fix, not a traceback (or, for the last, the file silently not read)."""
    from typer.testing import CliRunner

    from ragcache import cli

    monkeypatch.chdir(tmp_path)
    if case == "no toml":
        (tmp_path / "ragcache.toml").write_text("chunk_tokens =\n")
        said = "ragcache.toml: Invalid value"
    elif case == "list not json":
        monkeypatch.setenv("RAGCACHE_PUBLIC_PATHS", "/health,/metrics")
        said = '"public_paths" from source "EnvSettingsSource": a list or table in RAGCACHE_* is JSON'
    else:
        monkeypatch.setenv("RAGCACHE_CONFIG", str(tmp_path / "nowhere.toml"))
        said = "nowhere.toml': no such file"
    shown = CliRunner().invoke(cli.app, ["config"])
    assert shown.exit_code == 3 and said in " ".join(shown.output.split()), shown.output


def test_config_shows_no_store_password(monkeypatch):
    from typer.testing import CliRunner

    from ragcache import cli

    monkeypatch.setenv("RAGCACHE_STORE", "memory+redis://:s3cret@h:6379/0")
    monkeypatch.setenv("COLUMNS", "200")
    shown = CliRunner().invoke(cli.app, ["config"])
    assert shown.exit_code == 0 and "redis://:***@h:6379/0" in shown.output and "s3cret" not in shown.output


def test_names_and_errors_holding_brackets_are_printed_as_they_are(tiny_cli, tmp_path, monkeypatch):
    """Rich read them as markup: "notes[draft].md" lost its "[draft]", and an error quoting "[/x]" failed with a
    traceback of rich's instead of the error; a glob pathlib refuses is the CLI's error too."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "notes[draft].md").write_text("The text of the draft.")
    compiled = tiny_cli("compile", docs)
    assert compiled.exit_code == 0 and "notes[draft].md" in compiled.text, compiled.output
    monkeypatch.chdir(tmp_path)  # a short path: the message clips a long one
    missing = tiny_cli("compile", "nope[/x]")
    assert missing.exit_code == 3 and "nope[/x]" in missing.text, missing.output
    bad_glob = tiny_cli("compile", docs, "--glob", "**.md")
    assert bad_glob.exit_code == 3 and "--glob" in bad_glob.text, bad_glob.output


def test_the_demo_reads_at_80_columns():
    """Each question is a block: its figures on one line, its answer under them, nothing past 80 columns."""
    from rich.console import Console

    from ragcache.demo import REPAIR_ROWS, run_demo
    from ragcache.facade import RagCache
    from ragcache.settings import EngineConfig
    from ragcache.store.memory import MemoryStore
    from tests import tiny

    lm = tiny.make("llama")
    lm.model.config.max_position_embeddings = 2048  # the demo's four documents and a question
    rc = RagCache(lm, MemoryStore(), EngineConfig(chunk_tokens=64))
    console = Console(width=80, record=True, color_system=None)
    rows = run_demo(rc, DATA, 2, console)
    text = console.export_text()
    lines = text.splitlines()
    assert len(rows) == 6 and all(len(line) <= 80 for line in lines)  # full, the default, the default with repair
    figures = [line for line in lines if "TTFT" in line]
    assert len(figures) == 6 and all("recomputed" in line and "cached" in line for line in figures)
    for row in rows:
        assert row["question"] in text
    repaired = [row for row in rows if row["repair"]]
    assert len(repaired) == 2 and all(row["repaired_tokens"] > 0 for row in repaired)
    assert text.count(f"with repair={REPAIR_ROWS}: ") == 2 and text.count("stale rows repaired") == 2
    linked = [row for row in rows if row["algorithm"] != "full"]  # each says whether it is full's answer
    assert text.count("same answer as full") == sum(row["same_as_full"] for row in linked)
    assert text.count("answer differs from full") == sum(not row["same_as_full"] for row in linked)


def test_the_demo_leaves_out_the_repair_row_where_the_engine_cannot_repair():
    """vLLM's engine refuses `repair` (its scheduler owns the decode steps): the demo failed at its third row after
    two answers. It now shows full and the default, and says why there is no repair row."""
    from rich.console import Console

    from ragcache.demo import run_demo
    from ragcache.errors import ParameterOutOfRange
    from ragcache.facade import RagCache
    from ragcache.settings import DEFAULT_ALGORITHM, REPAIR_ON_VLLM, EngineConfig
    from ragcache.store.memory import MemoryStore
    from tests import tiny

    lm = tiny.make("llama")
    lm.model.config.max_position_embeddings = 2048
    rc = RagCache(lm, MemoryStore(), EngineConfig(chunk_tokens=64))

    def refuse_repair(params):
        if params.repair:
            raise ParameterOutOfRange(REPAIR_ON_VLLM)

    rc.refuse_unrunnable = refuse_repair  # as vLLM's engine does
    console = Console(width=200, record=True, color_system=None)
    rows = run_demo(rc, DATA, 1, console)
    assert [(row["algorithm"], row["repair"]) for row in rows] == [("full", 0), (DEFAULT_ALGORITHM, 0)]
    assert "no repair row (repair (recomputing" in console.export_text()


def test_the_demo_shows_where_an_answer_departs_from_fulls_even_past_what_a_row_shows():
    """Rows show LIMIT characters of an answer; where a link's answer departs from full's past them, every row of the
    question shows the same stretch, starting shortly before the departure, so "answer differs" is visible."""
    from ragcache.demo import CONTEXT, LIMIT, _departure, _short, _window_start

    lead = "The Amber Line is a 27-kilometer railway that runs from the town of Orsk to the mountain pass of "
    full, other = lead + "Vell, and it was built in 1911.", lead + "Kest, where the record was set."
    at = _departure(full, other)
    assert at == len(lead) > LIMIT - CONTEXT and _departure(full, full) is None
    assert _departure("same start", "same start and more") == len("same start")
    start = _window_start(at)
    shown = [_short(text, start) for text in (full, other)]
    assert all(s.startswith("…") and len(s) <= LIMIT for s in shown)
    assert "Vell" in shown[0] and "Kest" in shown[1] and shown[0] != shown[1]
    assert _window_start(None) == _window_start(5) == 0 and _short(full, 0) == full[: LIMIT - 1] + "…"
    assert _short("short\x07 answer") == "short\ufffd answer"


def test_compile_shards_writes_each_entry_as_kv_head_shards_once(tiny_cli, tmp_path):
    """--shards 2 stores every chunk's entry also as the 2 shards a TP=2 vLLM reads, beside the whole entry; a second
    run writes none; a count the model's 2 KV heads do not split into fails before anything is written."""
    from ragcache.store.keys import document_id
    from ragcache.store.shards import HeadRange

    (tmp_path / "note.txt").write_text("The bridge is old. It was built of stone. Rivers flow to the sea.")
    store = f"disk:{tmp_path / 'store'}"
    done = tiny_cli("compile", tmp_path / "note.txt", "--store", store, "--chunk-tokens", "8", "--shards", "2")
    assert done.exit_code == 0, done.output
    rc = tiny_cli.engines[-1]
    layout, chunks = rc.layouts["default"], rc.document_chunks(rc.document_ids()[0])
    for heads in (None, *HeadRange.split(2, 2)):
        assert all(rc.store.contains_many([rc.compiler.key(ids, layout, heads) for ids in chunks]))
    written = int(done.text.split("shards written ")[1].split()[0])
    assert written >= 2 * len({tuple(ids) for ids in chunks})
    from ragcache.store import open_store
    from ragcache.store_cli import summary

    (tier,) = summary(open_store(store))["tiers"]  # the shards apart: they weigh their chunks' tokens again
    assert tier["shards"]["entries"] == written and sum(c["entries"] for c in tier["codecs"].values()) == (
        tier["entries"] - written)
    again = tiny_cli("compile", tmp_path / "note.txt", "--store", store, "--chunk-tokens", "8", "--shards", "2")
    assert again.exit_code == 0 and "shards written 0" in again.text
    assert "shards written" not in tiny_cli("compile", tmp_path / "note.txt", "--store", store).text
    (tmp_path / "other.txt").write_text("A new text.")
    for bad, message in (("0", "--shards must be >= 1"), ("3", "3 ranks do not replicate 2 KV heads evenly")):
        refused = tiny_cli("compile", tmp_path / "other.txt", "--store", store, "--shards", bad)
        assert refused.exit_code != 0 and message in refused.text, refused.output
    assert document_id("A new text.") not in tiny_cli.engines[-1].document_ids()


@pytest.mark.parametrize("command", ["query", "serve", "serve --workers 2"])
def test_a_mistyped_store_url_is_bad_input_before_the_model_loads(tmp_path, monkeypatch, command):
    """Exit 3 and the forms a store takes, at once: it was exit 1 once the model had loaded (on a fresh machine, once
    its download had ended)."""
    from typer.testing import CliRunner

    from ragcache import cli, models

    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("the model loaded before the store was read"))
    (tmp_path / "doc.txt").write_text("A document.")
    args = ["query", "what?", "--doc", str(tmp_path / "doc.txt")] if command == "query" else command.split()
    result = CliRunner().invoke(cli.app, [*args, "--store", "memory+s3://bucket"])
    assert result.exit_code == 3 and "unknown store 'memory+s3://bucket'" in result.output, result.output


def test_ctrl_c_ends_every_long_command_with_exit_130(monkeypatch, tmp_path):
    """README: 130 interrupted. `demo`, `calibrate`, `models pull` and the store's commands fell through to click:
    "Aborted!" and exit 1."""
    from typer.testing import CliRunner

    from ragcache import cli, fetch, store_cli

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    from ragcache.api import server

    monkeypatch.setattr(fetch, "pull", interrupt)
    monkeypatch.setattr(store_cli, "summary", interrupt)
    monkeypatch.setattr(cli, "_open", interrupt)
    monkeypatch.setattr(cli, "_read_inputs", interrupt)
    monkeypatch.setattr(server, "run", interrupt)
    for args in (["models", "pull", "smollm2-135m"], ["store", "stats", "--store", "memory:"], ["demo"],
                 ["calibrate", "--at", "first"], ["compile", str(tmp_path), "--plan"], ["serve"]):
        result = CliRunner().invoke(cli.app, args)
        assert result.exit_code == 130 and "interrupted" in result.output, (args, result.output)


def test_input_the_cli_can_refuse_before_the_model_loads(tiny_cli, tmp_path, monkeypatch):
    """A blank question, a damaged PDF (pypdf raises IndexError and KeyError on some) and a demo folder whose
    questions are no UTF-8: exit 3 naming the input, not a traceback, and no model loaded for the first."""
    import sys
    import types

    blank = tiny_cli("query", "  ", "--doc", "0" * 32)
    assert blank.exit_code == 3 and "the question is empty" in blank.text and tiny_cli.opened == []

    class Damaged:
        def __init__(self, path):
            self.pages = [self]

        def extract_text(self):
            raise IndexError("list index out of range")

    pypdf, errors = types.ModuleType("pypdf"), types.ModuleType("pypdf.errors")  # pypdf is optional: not installed
    pypdf.PdfReader, errors.PyPdfError = Damaged, type("PyPdfError", (Exception,), {})
    monkeypatch.setitem(sys.modules, "pypdf", pypdf)
    monkeypatch.setitem(sys.modules, "pypdf.errors", errors)
    (tmp_path / "a.pdf").write_bytes(b"%PDF-1.4 broken")
    pdf = tiny_cli("compile", tmp_path / "a.pdf")
    assert pdf.exit_code == 3 and "a.pdf is not a readable PDF (IndexError" in pdf.text, pdf.output

    data = tmp_path / "data"
    (data / "docs").mkdir(parents=True)
    for n in range(4):
        (data / "docs" / f"{n}.txt").write_text(f"Document {n}.")
    (data / "questions.jsonl").write_bytes(b'{"question": "caf\xe9?", "doc": "0.txt"}\n')
    demo = tiny_cli("demo", "--data", data)
    assert demo.exit_code == 3 and "questions.jsonl is not UTF-8 text" in demo.text, demo.output


def test_a_second_ctrl_c_while_compile_stores_does_not_say_the_chunks_are_stored(tiny_cli, tmp_path, monkeypatch):
    """The first Ctrl-C lets the writer store what was compiled; a second gives that up, and `compile` must say so
    (it said "finished chunks are stored")."""
    from ragcache.catalog import Writer
    from ragcache.errors import WritesAbandoned

    def abandoned(self):
        raise WritesAbandoned(3)

    monkeypatch.setattr(Writer, "flush", abandoned)
    (tmp_path / "a.txt").write_text("A document to compile.")
    result = tiny_cli("compile", str(tmp_path / "a.txt"))
    assert result.exit_code == 130, result.output
    assert "3 compiled batch(es) not stored" in result.output and "finished chunks are stored" not in result.output


def test_a_chunk_that_cannot_compile_ends_compile_with_its_cause_not_a_traceback(tiny_cli, tmp_path, monkeypatch):
    """An error of the model's or the encoding's own (a ValueError here; out of memory on a GPU) escaped `ragcache
    compile` as a traceback: it is CompileFailed, a red line and exit 1."""
    from ragcache.compiler import Compiler

    def failing(self, *args, **kwargs):
        raise ValueError("this chunk cannot be encoded")

    monkeypatch.setattr(Compiler, "entry", failing)
    (tmp_path / "a.txt").write_text("A document that will not compile.")
    result = tiny_cli("compile", tmp_path / "a.txt", "--store", "memory:")
    assert result.exit_code == 1 and "ValueError: this chunk cannot be encoded" in result.text, result.output


def test_serve_on_a_taken_port_says_so_before_the_model_loads(monkeypatch):
    """It loaded (on a new machine, fetched) and warmed the model first, then uvicorn logged the error and exited
    with the code kept for bad input."""
    import socket

    from typer.testing import CliRunner

    import ragcache.api.server as server
    from ragcache import cli

    monkeypatch.setattr(server, "open_engine", lambda s: pytest.fail("the model loaded before the port was bound"))
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = CliRunner().invoke(cli.app, ["serve", "--port", str(port), "--store", "memory:"])
    assert result.exit_code == 1 and f"cannot listen on 127.0.0.1:{port}" in " ".join(result.output.split())


def test_a_misspelt_algorithm_or_setting_is_one_clear_line_before_the_model_loads(monkeypatch, tmp_path):
    """`--algorithm fcous` was refused only after the model loaded (RAGCACHE_ALGORITHM=fcous served, refusing every
    request); a bad --dtype printed pydantic's whole dump."""
    from typer.testing import CliRunner

    from ragcache import cli, models
    from ragcache.errors import BadRequest, UnknownAlgorithm
    from ragcache.settings import load_settings

    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("the model loaded"))
    (tmp_path / "doc.txt").write_text("A document.")
    result = CliRunner().invoke(cli.app, ["query", "q", "--doc", str(tmp_path / "doc.txt"), "--algorithm", "fcous"])
    assert result.exit_code == 3 and "unknown algorithm 'fcous'" in result.output, result.output
    from ragcache.api.server import run

    with pytest.raises(UnknownAlgorithm):  # RAGCACHE_ALGORITHM=fcous: serve refuses it before the model loads
        run(load_settings(algorithm="fcous", store="memory:"))
    with pytest.raises(BadRequest) as bad:
        load_settings(dtype="fp16")
    message = str(bad.value)
    assert message.startswith("dtype: ") and "'fp16'" in message and "RAGCACHE_DTYPE" in message
    assert "pydantic" not in message and "\n" not in message
    # a check across settings quotes no input (it is every setting, the API key among them); a secret none at all
    with pytest.raises(BadRequest) as across:
        load_settings(max_per_client=10, max_queue=5, api_key="s3cret")
    with pytest.raises(BadRequest) as secret:
        load_settings(store=7, api_key="s3cret")
    assert "s3cret" not in str(across.value) + str(secret.value) and "max_per_client" in str(across.value)
    # RAGCACHE_API_KEY="" (a secret a template failed to fill in) is no key at all: refused, not an open API
    with pytest.raises(BadRequest, match="api_key: .*at least 1 character"):
        load_settings(api_key="")


def test_calibrate_reads_another_jsonl_field_as_its_hint_says(monkeypatch, tmp_path):
    """The hint named --jsonl, which calibrate did not have."""
    from typer.testing import CliRunner

    from ragcache import cli

    monkeypatch.setattr(cli, "_open", lambda *a, **k: pytest.fail("read past the documents"))
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"body": "one"}\n{"body": "two"}\n')
    result = CliRunner().invoke(cli.app, ["calibrate", "--docs", str(rows)])
    assert result.exit_code == 3 and "--jsonl FIELD" in result.output
    from ragcache import calibrate

    seen = []

    def checked(texts):
        seen.append(texts)
        raise KeyboardInterrupt  # read: stop before the model loads

    monkeypatch.setattr(calibrate, "check_documents", checked)
    result = CliRunner().invoke(cli.app, ["calibrate", "--docs", str(rows), "--jsonl", "body"])
    assert result.exit_code == 130 and seen == [["one", "two"]], result.output


def test_every_command_closes_the_engine_and_store_it_opened(monkeypatch, tmp_path):
    """A tiered store writes what a tier missed, and warns of what it could not, at its close: the CLI never closed
    the engine it opened (only the driver's exit hook ran), on success or failure."""
    from typer.testing import CliRunner

    from ragcache import cli
    from ragcache.facade import RagCache
    from ragcache.settings import EngineConfig
    from ragcache.store.memory import MemoryStore
    from tests import tiny

    closed, lm = [], tiny.make("llama")
    monkeypatch.setattr(MemoryStore, "close", lambda self: closed.append(type(self).__name__))
    monkeypatch.setattr(RagCache, "from_settings", classmethod(lambda cls, s: cls(lm, MemoryStore(), EngineConfig())))
    (tmp_path / "a.txt").write_text("A document to compile.")
    for args, code in ((["compile", str(tmp_path / "a.txt")], 0), (["query", "Why?", "--doc", "0" * 32], 4),
                       (["store", "stats", "--store", "memory:"], 0)):
        before = len(closed)
        result = CliRunner().invoke(cli.app, args)
        assert result.exit_code == code, (args, result.output)
        assert len(closed) == before + 1, args
