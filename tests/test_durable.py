"""What the project writes outside the store survives a crash whole, with the mode a plain write gives it, and a
file a crash damaged is a typed error or is made again, never a traceback or a silent wrong answer."""

from __future__ import annotations

import io
import json
import logging
import os
import stat
import tarfile

import pytest
import torch

from ragcache import errors
from ragcache.store import durable


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_durable_write_replaces_whole_with_open_s_mode_and_leaves_no_temp_file(tmp_path, umask_022):
    path = tmp_path / "f.json"
    durable.write_file(path, "one")
    durable.write_file(path, b"two")
    assert path.read_text() == "two" and mode(path) == 0o644 and os.listdir(tmp_path) == ["f.json"]

    class Boom(Exception):
        pass

    def failing(fd, *args, **kwargs):
        fh = open(fd, *args, **kwargs)
        fh.write = lambda data: (_ for _ in ()).throw(Boom())
        return fh

    durable.open = failing
    try:
        with pytest.raises(Boom):
            durable.write_file(path, b"three")
    finally:
        del durable.open
    assert path.read_text() == "two" and os.listdir(tmp_path) == ["f.json"]  # the temp file went with the failure


def test_a_staging_folder_has_mkdir_s_mode_not_mkdtemp_s(tmp_path, umask_022):
    folder = durable.staging_folder(tmp_path, ".x-")
    assert folder.name.startswith(".x-") and mode(folder) == 0o755


def test_a_checkpoint_of_something_else_or_with_damaged_weights_is_a_bad_request(tmp_path):
    """A state.pt that is not a run's (a KeyError at its key) and weights a power loss cut short (safetensors' own
    error) were tracebacks."""
    from safetensors.torch import save_file

    from ragcache.train import checkpoint

    checkpoint.save(tmp_path, lambda f: save_file({"w": torch.ones(2)}, f / "w.safetensors"), {"step": 1}, {"r": 1})
    folder, _ = checkpoint.load(tmp_path, {"r": 1})
    assert torch.equal(checkpoint.weights(folder, "w.safetensors")["w"], torch.ones(2))
    (folder / "w.safetensors").write_bytes(b"cut")
    with pytest.raises(errors.BadRequest, match="cannot be read"):
        checkpoint.weights(folder, "w.safetensors")
    torch.save({"something": "else"}, folder / checkpoint.STATE)
    with pytest.raises(errors.BadRequest, match="cannot be read"):
        checkpoint.load(tmp_path, {"r": 1})
    with pytest.raises(errors.BadRequest, match="cannot be read"):
        checkpoint.check_steps(tmp_path, 10)
    torch.save([1, 2], folder / checkpoint.STATE)
    with pytest.raises(errors.BadRequest, match="cannot be read"):
        checkpoint.load(tmp_path, {"r": 1})


def test_a_damaged_prepared_target_is_prepared_again(tmp_path, caplog):
    from ragcache.train import link

    path = tmp_path / "t.pt"
    path.write_bytes(b"")  # what a power loss leaves of a file renamed before its data reached the disk
    with caplog.at_level(logging.WARNING, logger="ragcache"):
        assert link._target(path) is None
    assert not path.exists() and "preparing it again" in caplog.text


def test_a_damaged_model_file_is_a_model_fetch_error_naming_the_folder(tmp_path):
    from ragcache import models
    from tests import tiny

    checkpoint = tiny.saved("llama", tmp_path / "m")
    next(checkpoint.glob("*.safetensors")).write_bytes(b"\0" * 16)
    with pytest.raises(errors.ModelFetchError, match="damaged"):
        models.load(str(checkpoint), dtype="float32")


def test_a_damaged_kept_fingerprint_is_computed_again_not_served_empty(tmp_path, monkeypatch):
    """An empty fingerprint keyed every entry on nothing: a vLLM worker missed what `compile` stored."""
    from ragcache import models
    from tests import tiny

    monkeypatch.setenv("RAGCACHE_MODEL_DIR", str(tmp_path / "cache"))
    checkpoint = tiny.saved("llama", tmp_path / "m")
    first = models.checkpoint_fingerprint(str(checkpoint), "float32")
    (kept,) = [p for p in (tmp_path / "cache" / "fingerprints").iterdir() if not p.name.endswith(".lock")]
    kept.write_text("")
    assert models.checkpoint_fingerprint(str(checkpoint), "float32") == first and kept.read_text() == first


def test_a_damaged_calibration_profile_is_said_in_the_log(tmp_path, caplog):
    from ragcache import calibrate

    path = tmp_path / "p.json"
    path.write_text('{"cut')
    with caplog.at_level(logging.WARNING, logger="ragcache"):
        assert calibrate.read_profile(path) is None
    assert "calibrate again" in caplog.text
    caplog.clear()
    assert calibrate.read_profile(tmp_path / "none.json") is None and not caplog.text  # no profile: nothing to say


def test_a_damaged_cached_squad_dev_set_is_extracted_again(tmp_path, monkeypatch):
    from ragcache.train import squad

    monkeypatch.setenv("RAGCACHE_DATA_DIR", str(tmp_path))
    archive = tmp_path / "a.tar.gz"
    raw = json.dumps({"data": []}).encode()
    with tarfile.open(archive, "w:gz") as tar:
        info = tarfile.TarInfo(f"x/{squad.MEMBER}")
        info.size = len(raw)
        tar.addfile(info, io.BytesIO(raw))
    monkeypatch.setattr(squad, "_archive", lambda: archive)
    assert squad.dev_set() == {"data": []}
    squad.dev_set_path().write_text("")
    assert squad.dev_set() == {"data": []}


def test_an_installed_adapter_is_readable_by_the_other_users_of_the_cache(tmp_path, monkeypatch, umask_022):
    """mkdtemp's 0700 folder was renamed into place: another user's RagCache.open failed on it with a traceback."""
    from ragcache import adapters, lora

    monkeypatch.setenv("RAGCACHE_MODEL_DIR", str(tmp_path / "cache"))
    source = tmp_path / "adapter"
    source.mkdir()
    for name in lora.ADAPTER_FILES:
        (source / name).write_text("{}")
    monkeypatch.setattr(lora, "adapter_sha256", lambda path: "0" * 64)
    path = adapters.install(source, "some-model")
    assert mode(path) == 0o755


def test_an_installed_adapter_that_cannot_be_read_leaves_the_base_model(tmp_path, monkeypatch, caplog):
    from pathlib import Path

    from ragcache import adapters

    monkeypatch.setenv("RAGCACHE_MODEL_DIR", str(tmp_path / "cache"))

    def refused(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "is_file", refused)
    with caplog.at_level(logging.WARNING, logger="ragcache"):
        assert adapters.installed("some-model") is None
    assert "cannot be read" in caplog.text


def test_the_compile_rate_file_is_readable_by_the_other_users_of_the_cache(tmp_path, monkeypatch, umask_022):
    from ragcache import capacity

    monkeypatch.setenv("RAGCACHE_MODEL_DIR", str(tmp_path))
    assert capacity.record_rate("m", "cpu", "float32", "int8", 100_000, 10.0)
    assert capacity.record_rate("m", "cpu", "float32", "int4", 100_000, 20.0)
    assert mode(capacity.rates_path()) == 0o644 and len(capacity.read_rates()) == 2


def test_a_deleted_record_s_folder_is_synced(tmp_path, monkeypatch):
    """An unlinked record came back after a power loss (a document `store rm` had removed)."""
    from ragcache.store import disk

    store = disk.DiskStore(tmp_path)
    store.put_record("doc/a", {"x": 1})
    synced = []
    monkeypatch.setattr(disk, "sync_folder", lambda folder: synced.append(folder))
    assert store.delete_record("doc/a") and synced == [store.records_dir]


def test_a_model_that_fails_to_load_for_another_reason_is_not_called_damaged(tmp_path, monkeypatch):
    """A missing package or memory is no damaged file: the advice to remove the folder would delete good weights."""
    import transformers

    from ragcache import models
    from tests import tiny

    checkpoint = tiny.saved("llama", tmp_path / "m")

    def missing(*args, **kwargs):
        raise ImportError("this tokenizer needs sentencepiece")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", missing)
    with pytest.raises(ImportError, match="sentencepiece"):
        models.load(str(checkpoint), dtype="float32")


@pytest.mark.parametrize("edit", [{"k": 16.0}, {"k": -1}, {"focus_ratio": "0.25"}, {"ratio": 2.0}, {"target": 0},
                                  {"at": "last"}, {"k": True}])
def test_a_calibration_profile_whose_knobs_no_link_takes_is_said_in_the_log(tmp_path, caplog, edit):
    """It parsed, so it served: `k` 16.0 became every request's default k, each refused with a 422."""
    import json
    from dataclasses import asdict

    from ragcache import calibrate

    good = calibrate.Profile("m", "f" * 64, "float32", 0.9, 30, 16, 0.25, focus_ratio=0.2)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(asdict(good)))
    assert calibrate.read_profile(path) == good
    path.write_text(json.dumps(asdict(good) | edit))
    with caplog.at_level(logging.WARNING, logger="ragcache"):
        assert calibrate.read_profile(path) is None
    assert "calibrate again" in caplog.text
