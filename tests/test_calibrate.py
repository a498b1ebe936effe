"""`ragcache calibrate`: the smallest k whose agreement with `full` reaches the target, saved per model."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from ragcache import calibrate as cal
from ragcache.errors import BadRequest
from ragcache.linker import LinkParams
from ragcache.store import open_store
from tests import tiny


class _KnownRC:
    """A stand-in engine whose agreement with full is known: an item agrees exactly when k >= its threshold."""

    kv_codec = "int8"

    def __init__(self, thresholds: list[int]):
        self.thresholds = thresholds
        self.lm = SimpleNamespace(name="known", fingerprint="f" * 64, dtype=torch.float32,  # the profile's dtype
                                  adapter=None, base_weights=contextlib.nullcontext)

    def link(self, question, doc_ids, algorithm="legolink", k=16, ratio=0.15, **_):
        threshold = self.thresholds[int(question)]
        agrees = algorithm == "full" or (algorithm == "legolink" and k >= threshold) or \
            (algorithm == "cacheblend" and ratio >= threshold / 100) or \
            (algorithm == "focus" and ratio >= threshold / 200)  # focus needs half cacheblend's ratio here
        logits = torch.zeros(4)
        logits[0 if agrees else 1] = 1.0
        return SimpleNamespace(last_logits=logits)


def test_the_known_k_is_picked():
    items = [cal.Item(str(i), []) for i in range(20)]
    rc = _KnownRC([0] * 10 + [8] * 8 + [64] * 2)  # agreement: k=0 .5, k=8 .9, k=64 1.0
    profile = cal.calibrate(rc, items, target=0.9, ks=(0, 4, 8, 16, 64), at="first")
    assert profile.k == 8 and profile.agreement_by_k == {"0": 0.5, "4": 0.5, "8": 0.9}
    assert cal.calibrate(rc, items, target=1.0, ks=(0, 4, 8, 16, 64), at="first").k == 64
    assert cal.calibrate(rc, items, target=1.0, ks=(0, 4, 8), at="first").k is None  # never reached: no profile k
    assert profile.naive_agreement == 0.0
    assert profile.ratio == 0.15 and profile.focus_ratio == 0.05  # thresholds /100: 0.08; /200: 0.04
    assert profile.agreement_by_focus == {"0.05": 0.9}
    assert profile.kv_codec == "int8"  # the codec of the entries it measured over


def test_profiles_round_trip_per_fingerprint(tmp_path, monkeypatch):
    monkeypatch.setenv("RAGCACHE_MODEL_DIR", str(tmp_path))
    lm = tiny.make("llama")
    profile = cal.Profile(lm.name, lm.fingerprint, "float32", 0.95, 10, 32, 0.3, {"32": 0.96})
    cal.save_profile(profile)
    assert cal.load_profile(lm) == profile
    assert cal.load_profile(tiny.make("qwen2")) is None  # another model never inherits it
    assert [p.k for p in cal.profiles_by_model()[lm.name]] == [32]


def test_a_profile_per_kv_codec_and_the_nearest_one_where_this_codec_has_none(tmp_path, monkeypatch):
    """Two deployments of one model storing different codecs keep a profile each (one file overwrote the other);
    where this codec has none, one that did not record its codec serves, else the newest of another codec's."""
    monkeypatch.setenv("RAGCACHE_MODEL_DIR", str(tmp_path))
    lm = tiny.make("llama")

    def saved(k: int, codec: str, created: float) -> cal.Profile:
        profile = cal.Profile(lm.name, lm.fingerprint, "float32", 0.95, 10, k, 0.3, created=created, kv_codec=codec)
        cal.save_profile(profile)
        return profile

    int8, fp32 = saved(8, "int8", 1.0), saved(32, "fp32", 2.0)
    assert cal.load_profile(lm, "int8") == int8 and cal.load_profile(lm, "fp32") == fp32
    assert cal.load_profile(lm, "int4") == fp32  # the newest of the others
    unrecorded = saved(16, "", 0.5)
    assert cal.load_profile(lm, "int4") == unrecorded and cal.load_profile(lm, "int8") == int8
    assert sorted(p.k for p in cal.profiles_by_model()[lm.name]) == [8, 16, 32]
    assert cal.load_profile(tiny.make("qwen2"), "int8") is None


def test_a_damaged_profile_of_this_codec_is_read_once_and_another_codecs_serves(tmp_path, monkeypatch, caplog):
    """The search for another codec's profile matched this codec's file too: a damaged one was read, and warned
    about, twice."""
    monkeypatch.setenv("RAGCACHE_MODEL_DIR", str(tmp_path))
    lm = tiny.make("llama")
    fp32 = cal.Profile(lm.name, lm.fingerprint, "float32", 0.95, 10, 32, 0.3, created=2.0, kv_codec="fp32")
    cal.save_profile(fp32)
    cal.profile_path(lm.fingerprint, "float32", "int8").write_text("{not json")
    with caplog.at_level("WARNING", logger="ragcache"):
        assert cal.load_profile(lm, "int8") == fp32
    assert sum("cannot be read" in r.getMessage() for r in caplog.records) == 1


def test_on_a_tiny_model_k_at_the_chunk_length_is_exact():
    from ragcache.facade import RagCache
    from ragcache.settings import EngineConfig

    rc = RagCache(tiny.make("llama"), open_store("memory:"), EngineConfig(chunk_tokens=16))
    texts = [t * 3 for t in tiny.CORPUS[:4]]
    items = cal.items_from_documents(rc, texts, n=6)
    assert items and all(len(item.doc_ids) == 3 for item in items)
    longest = max(len(c) for doc in texts for c in rc.document_chunks(rc.compile([doc])[0])) + 1  # + BOS
    profile = cal.calibrate(rc, items, target=1.0, ks=(0, 2, longest))
    assert profile.k is not None and profile.k <= longest
    assert profile.agreement_by_k[str(profile.k)] == 1.0


def test_wilson_interval():
    low, high = cal.wilson_interval(19, 20)
    assert 0.7 < low < 0.95 < high <= 1.0
    assert cal.wilson_interval(0, 0) == (0.0, 1.0)
    assert cal.agreement_cell(23 / 24, 24) == "0.96 [0.80, 0.99]"


@pytest.mark.parametrize("bad", ["{not json", '{"model": 1}'])
def test_a_damaged_profile_is_ignored(tmp_path, monkeypatch, bad):
    monkeypatch.setenv("RAGCACHE_MODEL_DIR", str(tmp_path))
    lm = tiny.make("llama")
    path = cal.profile_path(lm.fingerprint, "float32")
    path.parent.mkdir(parents=True)
    path.write_text(bad)
    assert cal.load_profile(lm) is None


def test_at_the_content_word_full_and_the_candidates_are_read_there(monkeypatch):
    from ragcache import agreement as agree
    from ragcache.facade import RagCache
    from ragcache.settings import EngineConfig
    from ragcache.engine.sampling import eos_ids

    rc = RagCache(tiny.make("llama"), open_store("memory:"), EngineConfig(chunk_tokens=16))
    texts = [t * 3 for t in tiny.CORPUS[:4]]
    items = cal.items_from_documents(rc, texts, n=4)
    # random weights write no words: say the content word is the third answer token
    monkeypatch.setattr(agree, "content_position", lambda tok, answer: 2 if len(answer) > 2 else None)
    refs = [cal.reference(rc, item, "content") for item in items]
    assert any(ref.lead for ref in refs)
    for item, ref in zip(items, refs):
        full = rc.link(item.question, item.doc_ids, algorithm="full", max_new_tokens=cal.ANSWER_TOKENS)
        answer = agree.greedy(rc.runner, full, cal.ANSWER_TOKENS, eos_ids(rc.lm), {})
        expected = (answer[2], answer[:2]) if len(answer) > 2 else (int(full.last_logits.argmax()), [])
        assert (ref.token, ref.lead) == expected
        naive = rc.link(item.question, item.doc_ids, algorithm="naive", max_new_tokens=len(ref.lead))
        _, logits = agree.teacher_forced(rc.runner, naive, [*ref.lead, ref.token])
        assert cal._linked_token(rc, item, {"algorithm": "naive"}, ref) == int(logits[-1].argmax())
    longest = max(len(c) for doc in texts for c in rc.document_chunks(rc.compile([doc])[0])) + 1  # + BOS
    profile = cal.calibrate(rc, items, target=1.0, ks=(0, longest), ratios=(), focus_ratios=(), at="content")
    assert profile.at == "content" and profile.agreement_by_k[str(longest)] == 1.0
    with pytest.raises(BadRequest, match="content"):
        cal.calibrate(rc, items, at="middle")


def test_the_profile_sets_the_engine_defaults(tmp_path, monkeypatch):
    """A calibrated k and focus ratio become what a query without them links with; explicit values still win."""
    from ragcache.facade import RagCache
    from ragcache.settings import DEFAULT_FOCUS_RATIO, DEFAULT_K

    monkeypatch.setenv("RAGCACHE_MODEL_DIR", str(tmp_path))
    lm = tiny.make("llama")
    assert RagCache(lm, open_store("memory:")).params() == LinkParams("focus", DEFAULT_K, DEFAULT_FOCUS_RATIO)
    cal.save_profile(cal.Profile(lm.name, lm.fingerprint, "float32", 0.95, 10, 32, 0.3, focus_ratio=0.1))
    rc = RagCache(lm, open_store("memory:"))
    assert rc.params() == LinkParams("focus", 32, 0.1)
    assert rc.params("focus", ratio=0.5).ratio == 0.5
    assert rc.params("cacheblend").ratio == 0.15  # the focus ratio is focus's alone
    assert rc.params("legolink", k=4).k == 4
    cal.save_profile(cal.Profile(lm.name, lm.fingerprint, "float32", 0.95, 10, None, None, focus_ratio=None))
    assert RagCache(lm, open_store("memory:")).params() == LinkParams("focus", DEFAULT_K, DEFAULT_FOCUS_RATIO)


def test_calibrating_on_documents_without_a_sentence_to_ask_about_is_a_clear_error(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from ragcache.cli import app

    monkeypatch.setenv("RAGCACHE_MODEL_DIR", str(tmp_path / "cache"))  # a profile it wrongly saved stays here
    docs = tmp_path / "docs"
    docs.mkdir()
    for name in ("a.txt", "b.txt"):
        (docs / name).write_text("Short one. Tiny. Here are five words.\n\nOnly four words here.")
    result = CliRunner().invoke(app, ["calibrate", "--model", str(tiny.saved("llama", tmp_path / "tiny")), "--docs",
                                      str(docs), "--items", "2", "--adapter", "none", "--dtype", "float32"])
    assert result.exit_code == 3 and "none of them has a sentence of 6 words or more" in " ".join(result.output.split())
    with pytest.raises(BadRequest, match="at least one item"):
        cal.calibrate(None, [])


def test_a_profile_that_cannot_be_saved_still_shows_the_sweep_and_fails_cleanly(tmp_path, monkeypatch):
    """Minutes of sweep end in a table and an error naming where the profile should have gone, not a traceback."""
    from typer.testing import CliRunner

    from ragcache.cli import app

    monkeypatch.setenv("RAGCACHE_MODEL_DIR", str(tmp_path / "cache"))

    def read_only(profile):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(cal, "save_profile", read_only)
    docs = tmp_path / "docs"
    docs.mkdir()
    for name, text in (("a.txt", "The old lighthouse on the northern cape stands forty meters tall."),
                       ("b.txt", "The mountain railway climbs steadily through seven long tunnels.")):
        (docs / name).write_text(text)
    result = CliRunner().invoke(app, ["calibrate", "--model", str(tiny.saved("llama", tmp_path / "tiny")), "--docs",
                                      str(docs), "--items", "1", "--adapter", "none", "--dtype", "float32"])
    out = " ".join(result.output.split())
    assert result.exit_code == 1 and "could not be saved" in out and "Permission denied" in out, result.output
    assert "naive" in out and "legolink k=" in out  # the sweep's table


def test_an_unreadable_input_file_is_a_clear_error():
    from pathlib import Path

    from ragcache.request import read_text

    with pytest.raises(BadRequest, match="cannot read"):
        read_text(Path(__file__).parent)  # a directory: read_text raises IsADirectoryError


def test_a_profile_measured_over_another_codecs_entries_is_warned_about(tmp_path, monkeypatch, caplog):
    """A k calibrated over int8 entries agrees less over int4's: the engine still takes it, and says which codec to
    calibrate over."""
    import logging

    from ragcache.facade import RagCache
    from ragcache.settings import EngineConfig

    monkeypatch.setenv("RAGCACHE_MODEL_DIR", str(tmp_path))
    lm = tiny.make("llama")
    cal.save_profile(cal.Profile(lm.name, lm.fingerprint, "float32", 0.95, 10, 32, None, focus_ratio=0.1,
                                 kv_codec="int8"))
    with caplog.at_level(logging.WARNING, logger="ragcache"):
        same = RagCache(lm, open_store("memory:"), EngineConfig(kv_codec="int8"))
    profiled = [r.getMessage() for r in caplog.records if "calibration profile" in r.getMessage()]
    assert same.profile.kv_codec == "int8" and not profiled
    with caplog.at_level(logging.WARNING, logger="ragcache"):
        other = RagCache(lm, open_store("memory:"), EngineConfig(kv_codec="int4"))
    assert other.params().k == 32  # taken all the same
    (warned,) = [r.getMessage() for r in caplog.records if "calibration profile" in r.getMessage()]
    assert "over int8 entries" in warned and "--kv-codec int4" in warned
