"""The capacity plan (ragcache/capacity.py, `ragcache compile --plan`): bytes per token of each codec as compiled
entries really weigh, the corpus counted as a compile counts it, and the compile rate measured on this machine."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from ragcache import capacity
from ragcache.cli import app
from ragcache.facade import RagCache
from ragcache.settings import EngineConfig
from ragcache.store.memory import MemoryStore
from tests import tiny

TEXTS = [f"{text} {text} {text}" for text in tiny.CORPUS]


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8", "int4", "int2"])
def test_the_planned_bytes_are_what_the_compiled_entries_weigh(codec):
    rc = RagCache(tiny.make("llama"), MemoryStore(), EngineConfig(chunk_tokens=24, kv_codec=codec))
    report = rc.compile_documents(TEXTS)
    lead = list(rc.layouts["default"].lead_ids)
    chunks = [lead + ids for doc_id in report.ids for ids in rc.document_chunks(doc_id)]
    layout = rc.layouts["default"]
    stored = rc.store.get_many([rc.compiler.key(ids[len(lead):], layout) for ids in {tuple(c): c for c in chunks}.values()])
    plan = capacity.plan("tiny", capacity.model_shape(rc.lm.config), chunks, len(TEXTS), None)
    (row,) = [r for r in plan.codecs if r["codec"] == codec]
    assert plan.tokens == sum(e.token_ids.numel() for e in stored) and plan.chunks == len(stored)
    assert row["total_bytes"] == pytest.approx(sum(e.nbytes for e in stored), abs=1)
    assert plan.seconds is None
    rc.close()


def test_a_rate_is_recorded_only_from_a_compile_long_enough_to_time(tmp_path, monkeypatch):
    monkeypatch.setenv("RAGCACHE_MODEL_DIR", str(tmp_path))
    assert not capacity.record_rate("m", "cpu", "float32", "int8", capacity.RATE_MIN_TOKENS - 1, 1.0)
    assert capacity.measured_rate("m", "cpu", "float32", "int8") is None
    assert capacity.record_rate("m", "cpu", "float32", "int8", 8192, 4.0)
    assert capacity.measured_rate("m", "cpu", "float32", "int8")["tok_s"] == 2048.0
    other = capacity.measured_rate("m", "cpu", "float32", "fp32")  # another codec's, saying so
    assert other["tok_s"] == 2048.0 and other["codec"] == "int8"
    assert capacity.measured_rate("m", "cpu", "bfloat16", "int8") is None  # never another dtype's or device's
    (tmp_path / "compile-rates.json").write_text("{not json")
    assert capacity.measured_rate("m", "cpu", "float32", "int8") is None  # a damaged file is no rate, not a crash


def a_model_and_docs(tmp_path, monkeypatch, texts: list[str]):
    """A tiny model saved as a user's would be, a model cache of the test's own, and a folder of `texts`."""
    model = tiny.saved("llama", tmp_path / "model")
    monkeypatch.setenv("RAGCACHE_MODEL_DIR", str(tmp_path / "cache"))
    docs = tmp_path / "docs"
    docs.mkdir()
    for n, text in enumerate(texts):
        (docs / f"{n}.txt").write_text(text)
    return model, docs


def test_a_compile_that_skipped_documents_keeps_the_rate_measured_before(tmp_path, monkeypatch):
    model, docs = a_model_and_docs(tmp_path, monkeypatch, TEXTS[:1])
    monkeypatch.setattr(capacity, "RATE_MIN_TOKENS", 1)
    args = ["compile", str(docs), "--model", str(model), "--store", f"disk:{tmp_path / 'store'}", "--dtype",
            "float32", "--kv-codec", "int8"]
    assert CliRunner().invoke(app, args).exit_code == 0
    first = capacity.measured_rate(str(model), "cpu", "float32", "int8")
    assert first is not None
    (docs / "1.txt").write_text(TEXTS[1])
    assert CliRunner().invoke(app, args).exit_code == 0  # 0.txt skipped
    assert capacity.measured_rate(str(model), "cpu", "float32", "int8") == first


def test_a_compile_keeps_its_rate_when_it_compiled_nearly_all_it_read(tmp_path, monkeypatch):
    """A text given twice is tokenized twice and compiled once: a run of mostly repeats would read as a slow
    compile, and a corpus with one repeat among many is a fair measure."""
    from ragcache import cli

    model, docs = a_model_and_docs(tmp_path, monkeypatch, [TEXTS[0], TEXTS[1], TEXTS[0]])
    monkeypatch.setattr(capacity, "RATE_MIN_TOKENS", 1)
    args = ["compile", str(docs), "--model", str(model), "--dtype", "float32", "--kv-codec", "int8", "--store"]
    assert CliRunner().invoke(app, [*args, f"disk:{tmp_path / 'a'}"]).exit_code == 0
    assert capacity.measured_rate(str(model), "cpu", "float32", "int8") is None  # a third of it repeated
    monkeypatch.setattr(cli, "RATE_SHARE", 0.5)
    assert CliRunner().invoke(app, [*args, f"disk:{tmp_path / 'b'}"]).exit_code == 0
    assert capacity.measured_rate(str(model), "cpu", "float32", "int8") is not None


def test_a_compile_whose_disk_tier_evicts_its_entries_says_so(tmp_path, monkeypatch):
    model, docs = a_model_and_docs(tmp_path, monkeypatch, TEXTS)
    args = ["compile", str(docs), "--model", str(model), "--dtype", "float32", "--chunk-tokens", "24"]
    roomy = CliRunner().invoke(app, [*args, "--store", f"disk:{tmp_path / 'a'}"], terminal_width=200)
    assert roomy.exit_code == 0 and "evicted" not in roomy.output
    tight = CliRunner().invoke(app, [*args, "--store", f"disk:{tmp_path / 'b'}?size=4KiB"], terminal_width=200)
    assert tight.exit_code == 0, tight.output
    assert "the disk tier evicted" in " ".join(tight.output.split())


def test_compile_plan_counts_the_corpus_and_estimates_the_time_from_the_measured_rate(tmp_path, monkeypatch):
    model, docs = a_model_and_docs(tmp_path, monkeypatch, TEXTS)
    args = ["compile", str(docs), "--plan", "--model", str(model), "--chunk-tokens", "24", "--dtype", "float32",
            "--kv-codec", "int8"]
    first = CliRunner().invoke(app, args, terminal_width=200)
    said = " ".join(first.output.split())
    assert first.exit_code == 0, first.output
    assert f"{len(TEXTS)} documents" in said and "int8 (configured)" in said and "no rate measured here yet" in said
    capacity.record_rate(str(model), "cpu", "float32", "int8", 10_000, 5.0)
    again = " ".join(CliRunner().invoke(app, args, terminal_width=200).output.split())
    assert "at 2,000 tok/s" in again and "int8 entries" in again
    small = [*args, "--store", f"disk:{tmp_path / 'store'}?size=1KiB"]  # the corpus's entries would not fit
    warned = " ".join(CliRunner().invoke(app, small, terminal_width=200).output.split())
    assert "exceed the disk tier's budget (1.0 KiB)" in warned and "?size=1GiB" in warned
    assert "exceed" not in again  # the default 20 GiB holds it
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("   ")
    refused = CliRunner().invoke(app, ["compile", str(empty), "--plan", "--model", str(model)])
    assert refused.exit_code == 3 and "nothing to plan" in refused.output


def test_the_planned_bytes_with_shards_are_what_the_whole_entries_and_their_shards_weigh():
    """`compile --plan --shards N`: a compile with shards stores the whole entries and their shards, about twice
    the bytes; a plan that left the shards out let a disk budget look big enough that was not."""
    from ragcache.store.shards import HeadRange

    rc = RagCache(tiny.make("llama"), MemoryStore(), EngineConfig(chunk_tokens=24, kv_codec="int8"))
    report = rc.compile_documents(TEXTS, shards=2)
    lead, layout = list(rc.layouts["default"].lead_ids), rc.layouts["default"]
    unique = {tuple(ids): ids for doc_id in report.ids for ids in rc.document_chunks(doc_id)}
    keys = [rc.compiler.key(ids, layout, heads) for ids in unique.values() for heads in (None, *HeadRange.split(2, 2))]
    stored = rc.store.get_many(keys)
    assert all(e is not None for e in stored)
    plan = capacity.plan("tiny", capacity.model_shape(rc.lm.config), [lead + ids for ids in unique.values()],
                         len(TEXTS), None, shards=2)
    (row,) = [r for r in plan.codecs if r["codec"] == "int8"]
    assert row["total_bytes"] == pytest.approx(sum(e.nbytes for e in stored), abs=1)
    rc.close()


def test_a_compile_whose_rate_cannot_be_recorded_still_succeeds(tmp_path, monkeypatch):
    """The rate is for later plans: a model folder this user cannot write is a warning, not a failed compile that
    prints no document ids after storing every entry."""
    model, docs = a_model_and_docs(tmp_path, monkeypatch, TEXTS[:1])
    monkeypatch.setattr(capacity, "RATE_MIN_TOKENS", 1)
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(capacity, "rates_path", lambda: tmp_path / "file" / "compile-rates.json")
    args = ["compile", str(docs), "--model", str(model), "--store", f"disk:{tmp_path / 'store'}", "--dtype",
            "float32"]
    done = CliRunner().invoke(app, args, terminal_width=200)
    assert done.exit_code == 0, done.output
    assert "the compile rate was not recorded" in " ".join(done.output.split()) and "0.txt" in done.output


def test_plan_and_config_refuse_bad_settings_with_the_exit_codes_of_bad_input(tmp_path, monkeypatch):
    model, docs = a_model_and_docs(tmp_path, monkeypatch, TEXTS[:1])
    weird = tmp_path / "weird"
    weird.mkdir()
    (weird / "config.json").write_text("{}")
    plan = ["compile", str(docs), "--plan", "--model"]
    for args, code in (
        ([*plan, str(model), "--dtype", "fp16"], 3),
        ([*plan, str(model), "--device", "gpu"], 3),
        ([*plan, str(tmp_path / "no-such-model")], 5),
        ([*plan, str(model), "--device", "cuda"], 0),  # a plan for a GPU, on a machine that may have none
        ([*plan, str(weird), "--device", "cpu"], 5),  # a folder transformers does not recognize
        ([*plan, str(model), "--shards", "0"], 3),
        ([*plan, str(model), "--shards", "3"], 3),  # 3 ranks do not share 2 KV heads: the compile refuses them
    ):
        result = CliRunner().invoke(app, args, terminal_width=200)
        assert result.exit_code == code and "Traceback" not in result.output, (args, result.output)
    monkeypatch.setenv("RAGCACHE_DTYPE", "fp16")
    shown = CliRunner().invoke(app, ["config"])
    assert shown.exit_code == 3 and "dtype" in shown.output and not isinstance(shown.exception, ValueError)


def test_a_prompt_too_long_is_bad_input_for_scripts_too():
    import typer

    from ragcache.console import fail
    from ragcache.errors import PromptTooLong

    with pytest.raises(typer.Exit) as ended:
        fail(PromptTooLong(5000, 16, 4096))
    assert ended.value.exit_code == 3
