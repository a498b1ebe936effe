"""Serving link adapters: merged at load, the installed default once calibrated, shown in listings, and calibrated
against the base model's `full` (tiny random models and random LoRAs: the mechanics, not the accuracy)."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from typer.testing import CliRunner

from bench.adapter import random_adapter
from ragcache import adapters, loaded, lora, models
from ragcache import calibrate as cal
from ragcache.facade import RagCache
from ragcache.errors import BadAdapter
from ragcache.settings import INSTALLED, EngineConfig, Settings, parse_adapter
from ragcache.store import open_store
from tests import tiny

peft = pytest.importorskip("peft")

IDS = torch.tensor([1, 40, 41, 42, 60, 61, 62, 63, 70, 71])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny.saved("llama", tmp_path_factory.mktemp("tiny-llama"))


def make_adapter(base_dir, out, seed: int = 0):
    """A random rank-4 LoRA on the attention projections (B not zero, so it changes the answers), saved as
    `ragcache train link` saves one."""
    lm = models.load(str(base_dir), dtype="float32")
    torch.manual_seed(seed)
    return random_adapter(lm, out, rank=4)


@pytest.fixture(scope="module")
def adapter_dir(tiny_dir, tmp_path_factory):
    return make_adapter(tiny_dir, tmp_path_factory.mktemp("adapter"))


def logits(lm) -> torch.Tensor:
    return tiny.reference_logits(lm, IDS)


def test_a_merged_adapter_answers_as_the_unmerged_one_and_compiles_with_the_base_weights(tiny_dir, adapter_dir):
    base = models.load(str(tiny_dir), dtype="float32")
    merged = models.load(str(tiny_dir), dtype="float32", adapter=adapter_dir)
    beside = models.load(str(tiny_dir), dtype="float32", adapter=adapter_dir, merge=False)
    assert merged.adapter.merged and not beside.adapter.merged
    assert not torch.allclose(logits(merged), logits(base), atol=1e-3)  # the adapter changes the answers
    assert torch.allclose(logits(merged), logits(beside), atol=1e-4)
    with merged.base_weights():
        assert torch.equal(logits(merged), logits(base))  # the very base tensors, not base + delta - delta
    assert torch.allclose(logits(merged), logits(beside), atol=1e-4)  # and the merged ones are back after
    assert merged.fingerprint == beside.fingerprint != base.fingerprint  # profiles are the adapted model's own
    assert merged.compile_fingerprint == beside.compile_fingerprint == base.fingerprint


@pytest.mark.parametrize("merge", [True, False])
def test_the_base_weights_held_twice_stay_until_the_outer_holder_lets_go(tiny_dir, adapter_dir, merge):
    """`calibrate` holds the base weights while the engine's compile steps take them too (on the model thread): the
    inner release put the merged weights back under the outer holder, whose `full` references were then the adapted
    model's."""
    import threading

    base = models.load(str(tiny_dir), dtype="float32")
    adapted = models.load(str(tiny_dir), dtype="float32", adapter=adapter_dir, merge=merge)
    with adapted.base_weights():
        with adapted.base_weights():  # the compile step's, nested
            assert torch.equal(logits(adapted), logits(base))
        assert torch.equal(logits(adapted), logits(base))  # still the base model's
        taken = threading.Event()

        def compile_step():
            with adapted.base_weights():
                taken.set()

        worker = threading.Thread(target=compile_step)
        worker.start()
        worker.join(10)
        assert taken.is_set() and torch.equal(logits(adapted), logits(base))  # another thread's, too
    assert not torch.allclose(logits(adapted), logits(base), atol=1e-3)  # the adapter back after the last


@pytest.mark.parametrize("config", [{"bias": "lora_only"}, {"bias": "all"}, {"modules_to_save": ["lm_head"]},
                                    {"trainable_token_indices": [1, 2]}, {"layer_replication": [[0, 1]]},
                                    {"target_parameters": ["mlp.gate_up_proj"]}])
def test_an_adapter_that_would_change_the_base_models_own_parameters_is_refused_before_it_is_loaded(
        tiny_dir, adapter_dir, tmp_path, config):
    """PEFT loads trained biases and whole trained modules over the base layers', which neither the merge's swap
    nor disable_adapter puts back: compiling under the base model's keys would store another model's K/V."""
    edited = tmp_path / "edited"
    shutil.copytree(adapter_dir, edited)
    path = edited / lora.ADAPTER_FILES[0]
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    base = models.load(str(tiny_dir), dtype="float32")
    before = {name: p.clone() for name, p in base.model.named_parameters()}
    with pytest.raises(BadAdapter, match="base model's own"):
        lora.attach_adapter(base, edited)
    after = dict(base.model.named_parameters())
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)


def test_a_model_or_merge_that_does_not_fit_the_device_is_a_typed_error(tiny_dir, adapter_dir, monkeypatch):
    """CUDA running out of memory while a model is placed or an adapter merged was a torch traceback from `serve`,
    `demo`, `RagCache.open`: it is ModelTooLarge (exit 5, a line saying what to change). Out of memory simulated: no
    GPU here."""
    from peft.tuners.lora import LoraModel

    from ragcache.errors import ModelTooLarge

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with monkeypatch.context() as m:
        m.setattr(torch.nn.Module, "to", out_of_memory)
        with pytest.raises(ModelTooLarge, match="does not fit cuda's free memory .* GiB of weights as loaded"):
            models.load(str(tiny_dir), dtype="float32", device="cuda")
    with monkeypatch.context() as m:
        m.setattr(LoraModel, "merge_and_unload", out_of_memory)
        with pytest.raises(ModelTooLarge, match="merging the adapter needs a second copy .*--no-merge-adapter"):
            models.load(str(tiny_dir), dtype="float32", adapter=adapter_dir)


def test_an_adapter_with_lora_biases_runs_beside_the_weights_and_says_so(tiny_dir, adapter_dir, tmp_path, caplog):
    """Merging a LoRA bias would change the layers' biases, which the base-weights swap does not keep aside: such an
    adapter runs unmerged, slower on every linked row, which is said rather than left for a user to find."""
    edited = tmp_path / "edited"
    shutil.copytree(adapter_dir, edited)
    path = edited / lora.ADAPTER_FILES[0]
    path.write_text(json.dumps({**json.loads(path.read_text()), "lora_bias": True}))
    with caplog.at_level("WARNING", logger="ragcache.lora"):
        adapted = models.load(str(tiny_dir), dtype="float32", adapter=edited)
    assert not adapted.adapter.merged
    assert any("lora_bias runs beside the weights" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("merge", [True, False])
def test_the_adapter_never_reaches_the_chunk_entries_or_their_keys(tiny_dir, adapter_dir, tmp_path, merge):
    """Compile runs with the adapter off, so an entry is the base model's whoever compiles it, and its key (the
    compile fingerprint) is the base model's: an adapted engine and the base one share the store's entries. What the
    adapter does change is keyed by the adapted fingerprint (calibration profiles)."""
    store = open_store(f"disk:{tmp_path / 'store'}")
    base = RagCache(models.load(str(tiny_dir), dtype="float32"), store, EngineConfig(chunk_tokens=16))
    adapted = RagCache(models.load(str(tiny_dir), dtype="float32", adapter=adapter_dir, merge=merge), store,
                       EngineConfig(chunk_tokens=16))
    text = tiny.CORPUS[0] * 2
    doc_id = adapted.compile([text])[0]
    layout = base.layouts["default"]
    for chunk in adapted.document_chunks(doc_id):
        assert adapted.compiler.key(chunk, layout) == base.compiler.key(chunk, layout)
        mine, theirs = adapted.compiler.compile(chunk, layout), base.compiler.compile(chunk, layout)
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
        stored = store.get_many([adapted.compiler.key(chunk, layout)])[0]  # the engine's scheduled compile
        assert torch.allclose(stored.keys, theirs.keys, atol=1e-5) and torch.allclose(stored.values, theirs.values,
                                                                                        atol=1e-5)
    assert cal.profile_path(adapted.lm.fingerprint, "float32") != cal.profile_path(base.lm.fingerprint, "float32")
    linked = adapted.link("What is tall?", [doc_id], algorithm="naive").last_logits
    assert not torch.allclose(linked, base.link("What is tall?", [doc_id], algorithm="naive").last_logits, atol=1e-3)


@pytest.mark.parametrize("merge", [True, False])
def test_the_guard_compares_with_the_base_models_full_as_calibration_does(tiny_dir, adapter_dir, merge):
    """The guard's `full` (a background link) runs with the adapter off, so its agreement is measured against what
    the calibrated target was; the adapter is back on for every request after it."""
    from ragcache import guard

    store = open_store("memory:")
    base = RagCache(models.load(str(tiny_dir), dtype="float32"), store, EngineConfig(chunk_tokens=16))
    rc = RagCache(models.load(str(tiny_dir), dtype="float32", adapter=adapter_dir, merge=merge), store,
                  EngineConfig(chunk_tokens=16))
    ids = rc.compile([tiny.CORPUS[0] * 2, tiny.CORPUS[1] * 2])
    question = "What is tall?"
    base_full = base.link(question, ids, algorithm="full").last_logits
    adapted_full = rc.link(question, ids, algorithm="full").last_logits
    assert not torch.allclose(base_full, adapted_full, atol=1e-3)
    before = "".join(rc.stream(question, ids, algorithm="naive", max_new_tokens=8))
    assert torch.allclose(rc.link(question, ids, algorithm="full", background=True).last_logits, base_full, atol=1e-4)
    assert "".join(rc.stream(question, ids, algorithm="naive", max_new_tokens=8)) == before
    assert torch.allclose(rc.link(question, ids, algorithm="full").last_logits, adapted_full, atol=1e-5)
    # a background `prefix` link neither takes the adapter's prompts from the prefix cache nor leaves its own there
    # for the requests, whose first token would then come from the base weights
    assert torch.allclose(rc.link(question, ids, algorithm="prefix", background=True).last_logits, base_full,
                          atol=1e-4)
    assert torch.allclose(rc.link(question, ids, algorithm="prefix").last_logits, adapted_full, atol=1e-4)
    assert torch.allclose(rc.link(question, ids, algorithm="prefix", background=True).last_logits, base_full,
                          atol=1e-4)
    linked = rc.link(question, ids, algorithm="naive").last_logits
    assert rc.check(question, ids, algorithm="naive").kl == pytest.approx(
        guard.compare("naive", base_full, linked).kl, abs=1e-5)


def calibrated(lm_dir, adapter_path, where=None) -> cal.Profile:
    """A profile saved for the model with the adapter at `adapter_path`: in the user's profiles, or in `where`."""
    lm = models.load(str(lm_dir), dtype="float32")
    fingerprint = lora.adapted_fingerprint(lm.fingerprint, lora.adapter_sha256(adapter_path))
    profile = cal.Profile(lm.name, fingerprint, "float32", 0.95, 10, 8, 0.3, focus_ratio=0.1,
                          adapter=lora.adapter_sha256(adapter_path))
    if where is None:
        cal.save_profile(profile)
    else:
        where.mkdir(parents=True, exist_ok=True)
        (where / cal.profile_path(fingerprint, "float32").name).write_text(json.dumps(vars(profile)))
    return profile


def test_the_installed_adapter_is_the_default_once_calibrated(tiny_dir, adapter_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("RAGCACHE_MODEL_DIR", str(tmp_path / "cache"))
    model = str(tiny_dir)
    assert RagCache.open(model, "memory:", dtype="float32").lm.adapter is None  # nothing installed
    path = adapters.install(adapter_dir, model)
    assert adapters.installed(model) == path and path.parent == adapters.install_dir()
    assert RagCache.open(model, "memory:", dtype="float32").lm.adapter is None  # installed, not calibrated
    calibrated(tiny_dir, path)
    rc = RagCache.open(model, "memory:", dtype="float32")
    assert rc.lm.adapter is not None and rc.lm.adapter.path == path and rc.lm.adapter.merged
    assert rc.profile is not None and rc.profile.adapter == rc.lm.adapter.sha256 and rc.default_focus_ratio == 0.1
    assert RagCache.open(model, "memory:", dtype="float32", adapter=None).lm.adapter is None
    assert RagCache.open(model, "memory:", dtype="float16").lm.adapter is None  # calibrated at float32 only
    reached_nothing = cal.Profile(**{**vars(rc.profile), "k": None, "ratio": None, "focus_ratio": None})
    cal.save_profile(reached_nothing)  # a calibration in which no link reached the target: not trusted
    assert RagCache.open(model, "memory:", dtype="float32").lm.adapter is None
    cacheblend_only = cal.Profile(**{**vars(rc.profile), "k": None, "ratio": 0.3, "focus_ratio": None})
    cal.save_profile(cacheblend_only)  # the engine never applies cacheblend's ratio: the links it serves did not reach
    assert RagCache.open(model, "memory:", dtype="float32").lm.adapter is None
    cal.save_profile(rc.profile)
    # the settings and the CLI: `installed` is the default, `none` the base model
    assert Settings().adapter == INSTALLED
    assert RagCache.from_settings(Settings(model=model, store="memory:", dtype="float32")).lm.adapter is not None
    assert RagCache.from_settings(Settings(model=model, store="memory:", dtype="float32",
                                           adapter="none")).lm.adapter is None
    assert [parse_adapter(v) for v in (None, "none", "None", "installed")] == [None, None, None, INSTALLED]


def test_an_adapter_ships_its_calibration(tiny_dir, adapter_dir, tmp_path, monkeypatch):
    """A profile inside the adapter's directory (how the package ships one) makes it the default too."""
    monkeypatch.setenv("RAGCACHE_MODEL_DIR", str(tmp_path / "cache"))
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    for name in (*lora.ADAPTER_FILES, lora.ADAPTER_META):
        (shipped / name).write_bytes((adapter_dir / name).read_bytes())
    calibrated(tiny_dir, shipped, where=shipped / lora.ADAPTER_PROFILES)
    path = adapters.install(shipped, str(tiny_dir))
    assert (path / lora.ADAPTER_PROFILES).is_dir()
    assert RagCache.open(str(tiny_dir), "memory:", dtype="float32").lm.adapter.path == path


def test_an_unusable_installed_adapter_leaves_the_base_model(tiny_dir, adapter_dir, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("RAGCACHE_MODEL_DIR", str(tmp_path / "cache"))
    other = tiny.make("qwen2")  # another configuration
    path = adapters.install(adapter_dir, str(tiny_dir))
    meta = json.loads((path / lora.ADAPTER_META).read_text())
    (path / lora.ADAPTER_META).write_text(json.dumps({**meta, "base_config": loaded.config_fingerprint(other.model)}))
    assert RagCache.open(str(tiny_dir), "memory:", dtype="float32").lm.adapter is None
    assert "not used" in caplog.text


def test_the_vllm_engine_takes_the_adapter_setting_as_ragcaches_does(monkeypatch):
    opened = []
    monkeypatch.setattr(RagCache, "from_config", classmethod(lambda cls, config: opened.append(config)))
    RagCache.from_settings(Settings(engine="vllm", adapter="/some/adapter"))
    assert opened[-1].engine == "vllm" and str(opened[-1].adapter) == "/some/adapter"
    RagCache.from_settings(Settings(engine="vllm"))
    assert opened[-1].adapter == INSTALLED
    RagCache.from_settings(Settings(engine="vllm", adapter="none"))
    assert opened[-1].adapter is None and opened[-1].merge_adapter is True
    RagCache.from_settings(Settings(engine="vllm", merge_adapter=False))
    assert opened[-1].merge_adapter is False
    RagCache.from_settings(Settings(merge_adapter=False))
    assert opened[-1].merge_adapter is False and opened[-1].engine == "ragcache"


def test_settings_reach_the_engine_whole():
    """Every engine knob of Settings arrives in the EngineConfig the engine is opened with, under its own name
    (the prefix cache in bytes, the vllm engine's in vllm_args)."""
    s = Settings(model="m", store="memory:", engine="vllm", device="cpu", dtype="float32", chunk_tokens=64,
                 kv_codec="fp16", prefix_cache_mib=3, batch_invariant=False, adapter="none", merge_adapter=False,
                 max_model_len=512, kv_cache_gib=2)
    assert s.engine_config() == EngineConfig(model="m", store="memory:", engine="vllm", device="cpu",
                                             dtype="float32", chunk_tokens=64, kv_codec="fp16",
                                             prefix_cache_bytes=3 << 20, batch_invariant=False, adapter=None,
                                             merge_adapter=False, vllm_args={"max_model_len": 512,
                                                                             "kv_cache_gib": 2})
    own = Settings(model="m", store="memory:", row_budget=64, link_row_budget=256, batch_invariant=False,
                   decode_graphs=True, decode_compile=True, prefetch_mib=2).engine_config()  # ragcache's engine's
    assert (own.row_budget, own.link_row_budget, own.batch_invariant, own.decode_graphs, own.decode_compile,
            own.prefetch_bytes) == (64, 256, False, True, True, 2 << 20)
    assert EngineConfig.of("m", "memory:", chunk_tokens=8, max_model_len=64) == EngineConfig(
        "m", "memory:", chunk_tokens=8, vllm_args={"max_model_len": 64})


def test_ragcache_engine_options_are_refused_on_the_vllm_engine():
    """vLLM plans its own steps: a row budget or decode setting given with engine=vllm would be ignored."""
    with pytest.raises(ValueError, match="row_budget, decode_compile: options of ragcache.s engine"):
        Settings(engine="vllm", row_budget=1024, decode_compile=True)
    Settings(engine="vllm", decode_compile=False)  # as the defaults are
    with pytest.raises(ValueError, match="repair .*ragcache's engine only"):  # said before vLLM loads, not per request
        Settings(engine="vllm", repair=8)
    Settings(engine="vllm", repair=0)
    Settings(row_budget=1024, decode_compile=True)


def test_serve_passes_the_adapter_flags_to_the_settings(monkeypatch):
    import ragcache.api.server as server
    from ragcache.cli import app

    ran = {}
    monkeypatch.setattr(server, "run", lambda settings, workers=1: ran.update(settings=settings))
    result = CliRunner().invoke(app, ["serve", "--engine", "vllm", "--adapter", "/a", "--no-merge-adapter"])
    assert result.exit_code == 0, result.output
    assert ran["settings"].merge_adapter is False and ran["settings"].adapter == "/a"
    CliRunner().invoke(app, ["serve"])
    assert ran["settings"].merge_adapter is True and ran["settings"].row_budget is None
    result = CliRunner().invoke(app, ["serve", "--row-budget", "1024", "--link-row-budget", "16384"])
    assert result.exit_code == 0 and (ran["settings"].row_budget, ran["settings"].link_row_budget) == (1024, 16384)
    assert CliRunner().invoke(app, ["serve", "--row-budget", "0"]).exit_code != 0  # at least one row


def test_models_list_shows_the_installed_adapter(tiny_dir, adapter_dir, tmp_path, monkeypatch):
    from ragcache.cli import app

    monkeypatch.setenv("RAGCACHE_MODEL_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("COLUMNS", "400")
    path = adapters.install(adapter_dir, "gemma3-270m")
    digest = lora.adapter_sha256(path)
    out = CliRunner().invoke(app, ["models", "list"]).output
    assert f"{digest[:12]} (not calibrated" in out
    cal.save_profile(cal.Profile("gemma3-270m", "f" * 32, "bfloat16", 0.95, 10, 8, 0.3, adapter=digest))
    out = CliRunner().invoke(app, ["models", "list"]).output
    assert f"{digest[:12]} (default at bfloat16)" in out and "with its adapter" in out
    cal.save_profile(cal.Profile("gemma3-270m", "e" * 32, "float32", 0.95, 10, None, None, adapter=digest))
    out = CliRunner().invoke(app, ["models", "list"]).output
    assert f"{digest[:12]} (default at bfloat16; no link reached the target at float32: not the default)" in out


def merged(base_dir, adapter) -> tuple[Path, object]:
    """The vLLM engine's merged copy of the model with `adapter`, and the hold on it."""
    base = models.load(str(base_dir), dtype="float32")
    digest = lora.check_adapter(base, adapter)
    return adapters.merged_checkpoint(base, adapter, digest, lora.adapted_fingerprint(base.fingerprint, digest))


def test_writing_a_merged_copy_checks_the_adapter_it_merges_without_a_false_warning(tiny_dir, adapter_dir, tmp_path,
                                                                                   monkeypatch, caplog):
    """The copy merged took the adapter's PEFT files without the record of what it was fitted to: every new merged
    copy logged that its adapter was attached unchecked, though the original had just been checked."""
    monkeypatch.setenv("RAGCACHE_MODEL_DIR", str(tmp_path / "cache"))
    with caplog.at_level("WARNING", logger="ragcache"):
        _, hold = merged(tiny_dir, shutil.copytree(adapter_dir, tmp_path / "one"))
    hold.close()
    assert "without checking" not in caplog.text


def test_merged_copies_are_written_once_listed_and_removed_unless_served(tiny_dir, adapter_dir, tmp_path, monkeypatch):
    """The vLLM engine's merged checkpoints: written once (with the adapter's own files, readable by others), then
    reused; a newer copy of the same adapter path replaces the older; `models merged` finds which no longer match
    their adapter and removes those (or all), never one a server holds."""
    import stat

    from ragcache.cli import app

    monkeypatch.setenv("RAGCACHE_MODEL_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("COLUMNS", "400")
    one, two = (shutil.copytree(adapter_dir, tmp_path / name) for name in ("one", "two"))
    first, hold = merged(tiny_dir, one)
    hold.close()
    assert merged(tiny_dir, two)[0] == first  # the same adapter bytes: the same copy, reused
    assert stat.S_IMODE(first.stat().st_mode) == 0o755
    assert lora.adapter_sha256(first / adapters.MERGED_ADAPTER) == lora.adapter_sha256(one)
    make_adapter(tiny_dir, two, seed=1)
    second, hold_two = merged(tiny_dir, two)
    assert second != first
    assert torch.allclose(logits(models.load(str(second), dtype="float32")),
                          logits(models.load(str(tiny_dir), dtype="float32", adapter=two)), atol=1e-4)
    make_adapter(tiny_dir, two, seed=2)
    third, hold_three = merged(tiny_dir, two)
    assert second.exists()  # the copy it replaces is held (a server runs from it): kept
    hold_three.close()
    make_adapter(tiny_dir, two, seed=3)
    hold_two.close()
    fourth, hold = merged(tiny_dir, two)
    hold.close()
    # two's older copies (seeds 1 and 2) are gone, replaced by seed 3's; the copy made from one stays
    assert {c.path for c in adapters.merged_copies()} == {first, fourth} and not third.exists()
    assert lora.adapter_sha256(fourth / adapters.MERGED_ADAPTER) == lora.adapter_sha256(two)
    spare = shutil.copytree(one, tmp_path / "spare")
    first_again, hold = merged(tiny_dir, spare)  # another path to the same bytes: recorded
    hold.close()
    assert first_again == first and [c.adapters for c in adapters.merged_copies() if c.path == first] == \
        [tuple(str(p.resolve()) for p in (one, two, spare))]
    shutil.move(one, tmp_path / "moved")  # the path it was made from; spare still holds the bytes
    assert {c.path: c.stale for c in adapters.merged_copies()}[first] is None
    shutil.rmtree(spare)  # two, its other path, holds other bytes
    assert {c.path: c.stale for c in adapters.merged_copies()}[first] == "its adapter changed since"
    shutil.move(tmp_path / "moved", one)
    interrupted = adapters.merged_dir() / f".{first.name}-abcd1234"
    interrupted.mkdir()
    make_adapter(tiny_dir, two, seed=4)  # seed 3's copy is stale now
    states = {c.path: c.stale for c in adapters.merged_copies()}
    assert states == {first: None, fourth: "its adapter changed since",
                      interrupted: "left unfinished by an interrupted start"}
    shutil.rmtree(one)  # the path its copy was made from; the copy's other paths hold other bytes now
    assert {c.path: c.stale for c in adapters.merged_copies()}[first] == "its adapter changed since"
    shutil.rmtree(two)
    assert {c.path: c.stale for c in adapters.merged_copies()}[first] == "its adapter is gone"
    out = CliRunner().invoke(app, ["models", "list"]).output
    assert "3 copies of a model with an adapter merged in" in out and "3 no longer served" in out
    out = CliRunner().invoke(app, ["models", "merged"]).output
    assert "its adapter is gone" in out and "removed" not in out and first.exists()
    shutil.copytree(adapter_dir, one)  # the same files back: current again
    out = CliRunner().invoke(app, ["models", "merged", "--remove-stale"]).output
    assert "removed 2 copies" in out, out
    assert [c.path for c in adapters.merged_copies()] == [first]
    first_again, hold = merged(tiny_dir, one)  # a server runs from it
    out = CliRunner().invoke(app, ["models", "merged", "--remove-all"]).output
    assert "a server runs from it" in out and "kept 1 copy" in out and first.exists()
    hold.close()
    out = CliRunner().invoke(app, ["models", "merged", "--remove-all"]).output
    assert "removed 1 copy" in out and adapters.merged_copies() == []


def test_a_copy_another_user_made_is_reused_though_its_record_cannot_take_the_new_path(
        tiny_dir, adapter_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("RAGCACHE_MODEL_DIR", str(tmp_path / "cache"))
    first, hold = merged(tiny_dir, adapter_dir)
    hold.close()

    def not_ours(target, path):
        raise PermissionError(13, "Permission denied", str(target / adapters.MERGED_SOURCE))

    monkeypatch.setattr(adapters, "_record_path", not_ours)
    again, hold = merged(tiny_dir, shutil.copytree(adapter_dir, tmp_path / "mine"))
    hold.close()
    assert again == first


def test_a_merged_copy_for_a_changed_base_model_replaces_the_old_one(tiny_dir, adapter_dir, tmp_path, monkeypatch):
    """The same adapter path and bytes over another base model (another fingerprint): the old copy is no use."""
    monkeypatch.setenv("RAGCACHE_MODEL_DIR", str(tmp_path / "cache"))
    copies = []
    for fingerprint in ("a" * 32, "b" * 32):
        base = models.load(str(tiny_dir), dtype="float32")  # merging adapts it in place
        copy, hold = adapters.merged_checkpoint(base, adapter_dir, lora.check_adapter(base, adapter_dir), fingerprint)
        hold.close()
        copies.append(copy)
    assert [c.path for c in adapters.merged_copies()] == copies[1:]


def test_v1_models_shows_the_adapter(tiny_dir, adapter_dir):
    from ragcache.api.app import create_app
    from tests.test_api import Server, settings

    for adapter in (adapter_dir, None):
        rc = RagCache(models.load(str(tiny_dir), dtype="float32", adapter=adapter), open_store("memory:"))
        with Server(create_app(rc, settings(model=str(tiny_dir)))) as server:
            card = httpx.get(f"{server.url}/v1/models").json()["data"][0]["ragcache"]
        expected = None if adapter is None else {"sha256": lora.adapter_sha256(adapter_dir), "name": adapter_dir.name,
                                                 "merged": True}  # not its path: the server's file system
        assert card["adapter"] == expected


class _AdaptedRC:
    """A stand-in engine with an adapter: its own `full` answers 1, the base model's `full` answers 0, and a cheap
    link answers 0 (as the base's full does) exactly when k >= the item's threshold."""

    kv_codec = "int8"

    def __init__(self, thresholds: list[int]):
        self.thresholds = thresholds
        self.base = False
        self.lm = SimpleNamespace(name="known", fingerprint="a" * 64, dtype=torch.float32,
                                  adapter=SimpleNamespace(sha256="d" * 32), base_weights=self._base_weights)

    @contextlib.contextmanager
    def _base_weights(self):
        self.base = True
        try:
            yield
        finally:
            self.base = False

    def link(self, question, doc_ids, algorithm="legolink", k=16, ratio=0.15, **_):
        if algorithm == "full":
            token = 0 if self.base else 1
        else:
            token = 0 if algorithm == "legolink" and k >= self.thresholds[int(question)] else 2
        logits = torch.zeros(4)
        logits[token] = 1.0
        return SimpleNamespace(last_logits=logits)


def test_calibration_with_an_adapter_measures_against_the_base_models_full():
    items = [cal.Item(str(i), []) for i in range(10)]
    rc = _AdaptedRC([0] * 5 + [8] * 4 + [32])  # against the base's full: k=0 .5, k=8 .9, k=32 1.0
    profile = cal.calibrate(rc, items, target=0.9, ks=(0, 4, 8, 16, 32), ratios=(), focus_ratios=(), at="first")
    assert profile.k == 8 and profile.agreement_by_k == {"0": 0.5, "4": 0.5, "8": 0.9}  # against its own: never
    assert profile.adapter == "d" * 32 and not rc.base  # the base weights are given back


def test_train_link_install_makes_it_the_models_installed_adapter(adapter_dir, tmp_path, monkeypatch):
    from ragcache.cli import app
    from ragcache.train import link as tl

    def trained(cfg, rc=None, progress=None):  # the fit itself is tests/test_train_link.py's
        shutil.copytree(adapter_dir, cfg.out, dirs_exist_ok=True)
        held = {k: dict(base=0.0, adapted=0.0, diff=0.0, low=0.0, high=0.0) for k in ("top1", "kl")}
        return tl.LinkReport(1, [0.1], held, dict(train=1, eval=1), 0.0, str(cfg.out))

    monkeypatch.setenv("RAGCACHE_MODEL_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tl, "open_engine", lambda cfg: None)
    monkeypatch.setattr(tl, "train_link", trained)
    result = CliRunner().invoke(app, ["train", "link", "--model", "my-model", "--out", str(tmp_path / "out"),
                                      "--install"])
    assert result.exit_code == 0, result.output
    assert adapters.installed("my-model") == adapters.install_dir() / "my-model"
    assert lora.adapter_sha256(adapters.installed("my-model")) == lora.adapter_sha256(adapter_dir)


def test_an_adapter_attaches_to_its_base_weights_at_any_dtype_and_to_no_others(tiny_dir, adapter_dir, tmp_path,
                                                                                caplog):
    """`ragcache train link` records the base model's weights beside the adapter: another checkpoint of the same
    configuration is refused, the same one loaded at another dtype is not; an adapter without that record (saved
    before it was kept, or without ragcache's file at all) is attached with a warning."""
    recorded = adapter_dir  # saved as train link saves one: with the record
    meta = json.loads((recorded / lora.ADAPTER_META).read_text())
    assert "base_weights" in meta
    base = models.load(str(tiny_dir), dtype="float32")
    for dtype in ("float32", "bfloat16", "float16"):
        assert lora.attach_adapter(models.load(str(tiny_dir), dtype=dtype), recorded).adapter is not None
    other = tiny.make("llama", seed=1)  # the same configuration, other weights
    other.model.save_pretrained(tmp_path / "other")
    other.tokenizer.save_pretrained(tmp_path / "other")
    other = models.load(str(tmp_path / "other"), dtype="float32")
    named = (f"weights of '{tiny_dir}' \\(fingerprint {base.fingerprint} in float32\\), not to those of "
             f"'{tmp_path / 'other'}' \\(fingerprint {other.fingerprint} in float32\\)")
    with pytest.raises(BadAdapter, match=named):
        lora.attach_adapter(other, recorded)
    assert "without checking" not in caplog.text
    older, bare = tmp_path / "older", tmp_path / "bare"
    for path in (older, bare):
        shutil.copytree(adapter_dir, path)
    (bare / lora.ADAPTER_META).unlink()
    (older / lora.ADAPTER_META).write_text(json.dumps({k: v for k, v in meta.items() if k != "base_weights"}))
    for unchecked, why in ((older, "records no weights"), (bare, f"no {lora.ADAPTER_META}")):
        assert lora.attach_adapter(other, unchecked).adapter is not None
        assert f"{unchecked} is attached without checking" in caplog.text and why in caplog.text


def test_an_adapter_whose_save_did_not_finish_is_refused_not_attached(tiny_dir, adapter_dir, tmp_path):
    """`train link` writes the adapter's record first saying a save is under way and last with the files' digest:
    a kill in between, or files changed since, is refused; a record from before digests were kept is taken."""
    half = tmp_path / "half"
    shutil.copytree(adapter_dir, half)
    meta = json.loads((half / lora.ADAPTER_META).read_text())
    base = models.load(str(tiny_dir), dtype="float32")
    for digest in (None, "0" * 32):
        (half / lora.ADAPTER_META).write_text(json.dumps({**meta, "adapter_sha256": digest}))
        with pytest.raises(BadAdapter, match="does not match"):
            lora.attach_adapter(base, half)
    (half / lora.ADAPTER_META).write_text(json.dumps({**meta, "adapter_sha256": lora.adapter_sha256(half)}))
    assert lora.attach_adapter(models.load(str(tiny_dir), dtype="float32"), half).adapter is not None


def test_a_swap_to_the_base_weights_that_fails_holds_nothing_and_puts_back_what_it_swapped():
    """Counted before the swap, a failed one left every later holder believing the base weights in (compiles then
    stored the adapter's K/V under the base model's keys); a merged swap half done left layers mixed."""
    class Weight:
        def __init__(self, data):
            self._data = data

        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, value):
            if isinstance(value, str) and value == "refused":
                raise RuntimeError("cannot swap")
            self._data = value

    first, second = SimpleNamespace(weight=Weight("merged-1")), SimpleNamespace(weight=Weight("merged-2"))
    adapter = loaded.Adapter(Path("a"), "0" * 64, swapped=((first, "base-1", "merged-1"), (second, "refused", "merged-2")))
    with pytest.raises(RuntimeError, match="cannot swap"), adapter.base_weights():
        pass
    assert first.weight.data == "merged-1" and adapter._holders.count == 0
    adapter = loaded.Adapter(Path("a"), "0" * 64, swapped=((first, "base-1", "merged-1"),))
    with adapter.base_weights():
        assert first.weight.data == "base-1"
    assert first.weight.data == "merged-1" and adapter._holders.count == 0
