"""The link knobs are declared once (ragcache.settings.LinkKnobs) and every front door derives from that declaration:
a knob added there, and held by the linker's LinkParams, reaches the REST schemas, Settings, the CLI, the Python API,
llama-index, LangChain, training and the vLLM spec with no other edit."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from ragcache.errors import ParameterOutOfRange
from ragcache.front import Front
from ragcache.linker import LinkParams
from ragcache.settings import LinkKnobs, Settings

ROOT = Path(__file__).resolve().parents[1]
KNOBS = set(LinkKnobs.model_fields)


def test_every_door_takes_every_knob():
    pytest.importorskip("langchain_core")
    pytest.importorskip("llama_index.core")
    import typer.main

    from ragcache.api.schemas import ChatRequest, CompletionRequest, LinkOptions, QueryRequest
    from ragcache.cli import app
    from ragcache.integrations.langchain.chat_model import ChatRagCache
    from ragcache.integrations.llama_index.llm import RagCacheLLM
    from ragcache.integrations.llama_index.query_engine import RagCacheQueryEngine
    from ragcache.integrations.vllm.spec import LinkSpec

    assert {f.name for f in dataclasses.fields(LinkParams)} == KNOBS  # the linker holds each knob, resolved
    for model in (Settings, LinkOptions, QueryRequest, ChatRagCache, RagCacheLLM, RagCacheQueryEngine):
        assert set(model.model_fields) >= KNOBS, model
    for request in (ChatRequest, CompletionRequest):  # OpenAI bodies carry them under "ragcache"
        assert request.model_fields["ragcache"].annotation == LinkOptions | None
    query = typer.main.get_command(app).commands["query"]
    assert {p.name for p in query.params} >= KNOBS
    assert set(LinkSpec(1, (2,), 3).as_dict()) >= KNOBS
    schema = QueryRequest.model_json_schema()["properties"]
    assert set(schema) >= KNOBS and "legolink" in schema["algorithm"]["enum"]


def test_knobs_resolve_request_over_server_over_profile():
    profile = SimpleNamespace(default_k=32, default_focus_ratio=0.1)  # what `ragcache calibrate` found
    server = Settings(algorithm="legolink", k=8, check_layer=2)
    assert Front.resolve(profile) == LinkParams("focus", 32, 0.1)  # nothing set: the profile's, then the linker's
    assert Front.resolve(profile, server) == LinkParams("legolink", 8, None, 2)
    got = Front.resolve(profile, server, LinkKnobs(algorithm="cacheblend", ratio=0.5, deviation="value"))
    assert got == LinkParams("cacheblend", 8, 0.5, 2, "value")
    assert Front.resolve(profile, LinkKnobs(algorithm="cacheblend")).ratio == 0.15  # focus's ratio is focus's alone
    profile.resolve = lambda *layers: Front.resolve(profile, *layers)
    assert Front.params(profile, "legolink", 8) == Front.params(profile, algorithm="legolink", k=8)  # knobs in order
    assert Front.params(profile, "legolink", 8) == LinkParams("legolink", 8)


@pytest.mark.parametrize(("knobs", "match"), [
    ({"k": -1}, "k must be greater than or equal to 0, got -1"),
    ({"ratio": 1.5}, "ratio must be less than or equal to 1"),
    ({"k": True}, "k must be a valid integer"),  # a JSON true is no number
    ({"deviation": "v"}, "deviation must be 'key' or 'value'"),
    ({"algorith": "naive"}, "unknown link knob"),
    ({"repair": 1}, "repair must be 0 \\(off\\) or at least 2: a repair of 1 row a decode step never catches up"),
])
def test_bad_knobs_are_typed_errors_naming_the_knob(knobs, match):
    with pytest.raises(ParameterOutOfRange, match=match):
        LinkKnobs.of(**knobs)


def test_check_layer_is_checked_where_it_is_read_or_was_set():
    """cacheblend reads a layer's deviation; the others never read check_layer, so its default (layer 1) refused
    every link of a one-layer model. Set by hand (a server's default made for another model), it is still checked."""
    from ragcache.linker import ALGORITHMS

    for name in ALGORITHMS:
        params = LinkParams(name)
        if params.algorithm == "cacheblend":
            with pytest.raises(ParameterOutOfRange, match="check_layer must be within \\[0, 0\\], got 1"):
                params.validate(num_layers=1)
        else:
            params.validate(num_layers=1)
        with pytest.raises(ParameterOutOfRange, match="check_layer must be within"):
            LinkParams(name, check_layer=4).validate(num_layers=4)
    LinkParams("cacheblend", check_layer=0).validate(num_layers=1)


def test_settings_read_the_knobs_from_the_environment(monkeypatch):
    monkeypatch.setenv("RAGCACHE_K", "8")
    monkeypatch.setenv("RAGCACHE_RATIO", "0.5")
    monkeypatch.setenv("RAGCACHE_DEVIATION", "value")
    assert Settings().given() == {"k": 8, "ratio": 0.5, "deviation": "value"}
    monkeypatch.setenv("RAGCACHE_K", "eight")
    with pytest.raises(ValueError, match="k"):
        Settings()


PROBE = """
import json, os, subprocess, sys
from types import SimpleNamespace
import typer.main
from typer.testing import CliRunner
from ragcache.api.schemas import ChatRequest, QueryRequest
from ragcache.cli import app
from ragcache.front import Front
from ragcache.integrations.langchain.chat_model import ChatRagCache
from ragcache.integrations.llama_index.query_engine import RagCacheQueryEngine
from ragcache.integrations.vllm.spec import LinkSpec
from ragcache.linker import LinkParams
from ragcache.settings import LinkKnobs, Settings
from ragcache.train.link import LinkTrainConfig

profile = SimpleNamespace(default_k=16, default_focus_ratio=0.25)
profile.resolve = lambda *layers: Front.resolve(profile, *layers)
rest = QueryRequest.model_validate({"question": "q", "probe": 5})
chat = ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "q"}],
                                   "ragcache": {"probe": 6}})
os.environ["RAGCACHE_PROBE"] = "4"
spec = LinkSpec(1, (2,), 3, LinkParams(probe=7))
print(json.dumps({
    "rest": Front.resolve(profile, Settings(), rest).probe,
    "openai": Front.resolve(profile, chat.ragcache).probe,
    "settings": Front.resolve(profile, Settings()).probe,
    "python": Front.params(profile, "naive", probe=3).probe,
    "langchain": ChatRagCache.model_fields["probe"].description,
    "llama_index": RagCacheQueryEngine.model_fields["probe"].description,
    "cli": [p.help for p in typer.main.get_command(app).commands["query"].params if p.name == "probe"],
    "train_cli": [p.help for p in typer.main.get_command(app).commands["train"].commands["link"].params
                  if p.name == "probe"],
    "train": Front.resolve(profile, LinkTrainConfig(link=LinkKnobs(probe=8)).link).probe,
    "vllm": LinkSpec.parse(spec.as_dict(), 6).params().probe,
    "schema": "probe" in QueryRequest.model_json_schema()["properties"],
}))
"""


@pytest.mark.timeout(300)
def test_a_knob_declared_once_reaches_every_front_door(tmp_path):
    """A copy of the package with one more knob, `probe`: declared in LinkKnobs and held by LinkParams (the linker
    must hold a knob to use it), nothing else edited."""
    pytest.importorskip("langchain_core")
    pytest.importorskip("llama_index.core")
    tree = tmp_path / "ragcache"
    shutil.copytree(ROOT / "ragcache", tree, ignore=shutil.ignore_patterns("__pycache__", "data"))
    for folder in ("store", "kernels", "api"):
        shutil.copytree(ROOT / folder, tree / folder, ignore=shutil.ignore_patterns("__pycache__"))
    settings, linker = tree / "settings.py", tree / "linker.py"
    declared = '    def knobs(self) -> dict:\n'
    assert declared in settings.read_text()
    settings.write_text(settings.read_text().replace(declared, textwrap.indent(textwrap.dedent('''
        probe: int | None = Field(default=None, strict=True, description="a knob added in one place")

    '''), "    ").lstrip("\n") + declared, 1))
    held = '    deviation: str = "key"\n'
    assert held in linker.read_text()
    linker.write_text(linker.read_text().replace(held, held + "    probe: int = 0\n", 1))
    run = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True, text=True, timeout=240,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path), "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got == {"rest": 5, "openai": 6, "settings": 4, "python": 3, "langchain": "a knob added in one place",
                   "llama_index": "a knob added in one place", "cli": ["a knob added in one place"], "vllm": 7,
                   "train_cli": [], "train": 8,  # `train link` declares only what a fitted link reads
                   "schema": True}
