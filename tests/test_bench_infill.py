"""bench/infill.py --quick runs end to end on a tiny model and writes its JSON (and PNG when matplotlib is there)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests import tiny

BENCH = Path(__file__).resolve().parents[1] / "bench" / "infill.py"
SOURCE = '''import math


class Rectangle:
    def __init__(self, width, height):
        self.width = width
        self.height = height

    def area(self):
        return self.width * self.height

    def diagonal(self):
        return math.sqrt(self.width ** 2 + self.height ** 2)


def scale(shape, factor):
    shape.width = shape.width * factor
    shape.height = shape.height * factor
    return shape
'''


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_infill", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def test_quick_run_on_a_tiny_model(tmp_path):
    model_dir = tmp_path / "tiny-qwen2"
    lm = tiny.make("qwen2")
    lm.model.save_pretrained(model_dir)
    lm.tokenizer.save_pretrained(model_dir)
    src = tmp_path / "src"
    src.mkdir()
    (src / "shapes.py").write_text(SOURCE)
    out = tmp_path / "results"
    result = load_bench().main(["--model", str(model_dir), "--quick", "--source", str(src), "--out", str(out),
                                "--prefix-chars", "120", "--suffix-chars", "40", "--quiet"])
    rows = {r["config"]: r for r in result["summary"]}
    assert set(rows) == {"no-reuse", "fim+prefix", "efim+prefix"}
    assert all(r["requests"] == 2 * 3 for r in rows.values())
    assert rows["no-reuse"]["cached_tokens_mean"] == 0
    # from round 2 on, EFIM recomputes only the typed increment: fewer rows than PSM with prefix reuse
    assert rows["efim+prefix"]["recomputed_tokens_mean_round2plus"] < rows["fim+prefix"]["recomputed_tokens_mean_round2plus"]
    assert rows["fim+prefix"]["recomputed_tokens_mean_round2plus"] < rows["no-reuse"]["recomputed_tokens_mean_round2plus"]
    saved = json.loads(result["paths"]["json"].read_text())
    assert saved["benchmark"] == "infill" and len(saved["requests"]) == 18 and saved["machine"]["load_average_start"]
    assert result["paths"]["json"].parent == out and result["paths"]["json"].name.startswith("infill-")
    if importlib.util.find_spec("matplotlib"):
        assert result["paths"]["png"].stat().st_size > 0


def test_ratios_are_named_for_the_configuration_they_are_against():
    """On vLLM no-reuse is not run: the ratios are against PSM with prefix caching, and their names say so."""
    def request(config, round_, ttft):
        return dict(config=config, round=round_, user="u", ttft_s=ttft, decode_s=0.1, total_s=ttft + 0.1,
                    prompt_tokens=10, cached_tokens=5, recomputed_tokens=0, completion_tokens=2)

    rows = load_bench().summarize([request(c, r, t) for c, t in (("fim+prefix", 0.4), ("efim+prefix", 0.1))
                                   for r in (1, 2)])
    efim = rows[1]
    assert efim["ttft_round2plus_vs_fim_prefix"] == 0.25 and efim["throughput_vs_fim_prefix"] == 2.5
    assert not [key for row in rows for key in row if key.endswith("vs_no_reuse")]


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        load_bench().main(["--users", "0"])
