"""The benchmarks run end to end on tiny inputs (the real default model, one run each) and write well-formed
JSON and a PNG; the scoring helpers give the SQuAD values. No timing is asserted: timings belong to bench/."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from bench import accuracy, common, report, squad
from bench.__main__ import app


def invoke(*args: str) -> None:
    result = CliRunner().invoke(app, ["--threads", "1", *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output


def load(out: Path, name: str) -> dict:
    data = json.loads((out / f"{name}.json").read_text())
    assert (out / f"{name}.png").stat().st_size > 1000
    assert data["machine"]["cores"] >= 1 and "load_average_start" in data["machine"]
    return data


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x >= 0


# -- end to end on the real default model --------------------------------------------------------------------
@pytest.mark.real_model
def test_ttft(tmp_path):
    invoke("ttft", "--docs", "1,2", "--doc-tokens", "32", "--runs", "1", "--stores", "memory,disk,redis",
           "--algorithms", "full,prefix,legolink-16,legolink0", "--out", str(tmp_path))
    data = load(tmp_path, "ttft-smollm2-135m")
    stores = {r["store"] for r in data["results"]}
    assert {"memory (warm)", "disk (cold)"} <= stores
    assert len(data["results"]) == len(stores) * 2 * 4
    for r in data["results"]:
        assert r["label"] in {"full", "prefix", "legolink-16", "legolink0"} and r["n_docs"] in (1, 2)
        for key in ("ttft_s", "fetch_s", "rotate_s", "recompute_s"):
            assert finite(r[key]), (key, r)
        assert r["recomputed_tokens"] + r["cached_tokens"] == r["prompt_tokens"]
        assert r["compiled_chunks"] == 0  # everything was compiled before timing
        if r["label"] == "full":
            assert r["recomputed_tokens"] == r["prompt_tokens"] and r["ttft_over_full"] == 1.0


@pytest.mark.real_model
def test_lower_bound(tmp_path):
    invoke("lower-bound", "--docs", "1", "--doc-tokens", "32", "--runs", "1", "--store", "disk",
           "--algorithms", "full,naive,legolink0", "--out", str(tmp_path))
    data = load(tmp_path, "lower-bound-smollm2-135m")
    rows = {r["label"]: r for r in data["results"]}
    assert set(rows) == {"full", "naive", "legolink0"}
    assert rows["full"]["entries"] == 0 and rows["full"]["read_s"] == 0
    assert rows["naive"]["entries"] >= 1 and rows["naive"]["entry_bytes"] > 0
    for r in rows.values():
        assert all(finite(r[k]) for k in ("ttft_s", "link_s", "read_s", "rows_s", "rows_alone_s", "floor_s"))
        assert r["floor_s"] == pytest.approx(r["read_s"] + r["rows_s"], abs=1e-5)


@pytest.mark.real_model
def test_accuracy_on_the_shipped_sample(tmp_path):
    invoke("accuracy", "--sample", "--n", "2", "--algorithms", "naive,legolink", "--max-new-tokens", "4",
           "--out", str(tmp_path))
    data = load(tmp_path, "accuracy-smollm2-135m")
    assert data["params"]["n"] == 2 and len(data["items"]) == 2
    rows = {r["label"]: r for r in data["results"]}
    assert list(rows) == ["full", "naive", "legolink-16"]  # full is always there: agreement is measured against it
    assert rows["full"]["agree_with_full"]["mean"] == 1.0
    assert rows["full"]["top1"]["mean"] == 1.0 and rows["full"]["kl"]["mean"] == 0.0
    # the whole answer, against full's answer as served: full's is its own
    assert rows["full"]["reproduced"]["mean"] == rows["full"]["whole_answer"]["mean"] == 1.0
    for r in rows.values():
        assert r["whole_answer"]["mean"] <= r["reproduced"]["mean"] <= 1.0 and 0.0 <= r["token_agree"]["mean"] <= 1.0
    for item in data["items"]:  # the same first line in ids is the same text
        for a in item["answers"].values():
            assert not a["whole"] or a["agree"] == 1.0
    assert rows["full"]["delta_ll_vs_full"]["mean"] == 0.0 and rows["naive"]["delta_top1_vs_naive"]["mean"] == 0.0
    # full agrees with itself on 2 of 2: Wilson's interval, not the bootstrap's [1, 1]; the computed dtype and codec
    assert rows["full"]["top1"]["interval"] == "wilson" and rows["full"]["top1"]["ci95"][0] < 0.5
    assert rows["full"]["delta_ll_vs_full"]["ci95"] == [0.0, 0.0]  # a difference that is 0 on each item: not a share
    assert data["params"]["dtype"] and data["params"]["kv_codec"] in ("int8", "bf16", "fp16", "fp32")
    for r in rows.values():
        low, high = r["top1"]["ci95"]
        assert 0.0 <= low <= r["top1"]["mean"] <= high <= 1.0 and r["kl"]["mean"] >= 0.0
        for metric in ("em", "f1", "agree_with_full", "f1_vs_full"):
            low, high = r[metric]["ci95"]
            assert 0.0 <= low <= r[metric]["mean"] <= high <= 1.0
    for item in data["items"]:
        assert set(item["answers"]) == set(rows) and item["gold_answers"]
        assert item["answers"]["full"]["content_top1"] in (None, 1.0)  # None: no content word in 4 tokens
    words = sum(item["answers"]["full"]["content_top1"] is not None for item in data["items"])
    if words:
        assert rows["full"]["content_n"] == words and rows["full"]["content_top1"]["mean"] == 1.0
        assert rows["full"]["content_kl"]["mean"] == 0.0


def test_the_share_of_an_answer_reproduced_stops_at_its_first_departure():
    from bench.accuracy import first_line_ids, reproduced

    assert reproduced([1, 2, 3, 4], [1, 2, 3]) == 1.0  # what follows full's first line does not count
    assert reproduced([1, 9, 3], [1, 2, 3, 4]) == 0.25 and reproduced([5], [1, 2]) == 0.0
    assert reproduced([1, 2], [1, 2, 3, 4]) == 0.5  # stopped early: the rest is not reproduced
    assert reproduced([], []) == 1.0 and reproduced([7], []) == 0.0
    assert first_line_ids([5, 10, 6, 10, 7], {10: False}) == [5]
    assert first_line_ids([10, 5, 10], {10: False}) == [10, 5]  # a leading newline does not end the answer
    # a token holding text before its newline ("tall.\n") ends the line as part of it: "tall!\n" is another answer
    assert first_line_ids([5, 11, 6], {11: True}) == [5, 11] and first_line_ids([11, 6], {11: True}) == [11]


@pytest.mark.real_model
def test_throughput_through_the_rest_server(tmp_path):
    invoke("throughput", "--clients", "1,2", "--requests", "2", "--pool", "8", "--doc-tokens", "32", "--min-docs", "2",
           "--max-docs", "3", "--max-tokens", "2", "--algorithms", "legolink", "--out", str(tmp_path))
    data = load(tmp_path, "throughput-smollm2-135m")
    assert [(r["label"], r["clients"]) for r in data["results"]] == [("legolink-16", 1), ("legolink-16", 2)]
    for r in data["results"]:
        assert r["requests"] == 2 and r["errors"] == 0
        assert finite(r["requests_per_s"]) and r["p50_s"] <= r["p99_s"]


@pytest.mark.real_model
def test_serve_decode_cells_and_runner_steps(monkeypatch):
    from bench import serve
    from ragcache.engine import runner

    peer_models = []

    def loop(model, prompt, tokens):
        peer_models.append(model)
        return timed_loop(model, prompt, tokens)

    timed_loop = serve.transformers_loop
    monkeypatch.setattr(serve, "transformers_loop", loop)
    rows = serve.decode_cells("smollm2-135m", doc_tokens=32, tokens=3, streams=[1, 3], dtype="float32")
    # the peer is transformers' own code: no Linear padded by ragcache's runner, not its attention
    assert peer_models and all(model.config._attn_implementation != runner.ATTENTION_NAME for model in peer_models)
    assert not [m for model in peer_models for m in model.modules()
                if isinstance(m, torch.nn.Linear) and hasattr(m.forward, "unwrapped")]
    decode = [r for r in rows if r["kind"] == "decode"]
    assert [(r["engine"], r["streams"]) for r in decode] == [
        ("transformers cached loop", 1), ("ragcache scheduler", 1), ("ragcache scheduler", 3)]
    # the scheduler's rate is over decode-only steps (NaN for a run with none, their count beside it saying so);
    # each run here has them: EOS ignored, the stream linked last decodes its tokens after its first in steps that
    # no link shares
    assert all(r["runs_decode_only_steps"] and min(r["runs_decode_only_steps"]) > 0 for r in decode[1:])
    assert all(finite(r["tokens_per_s"]) and r["tokens_per_s"] > 0 for r in decode)
    assert all(finite(r["wall_tokens_per_s"]) and r["wall_tokens_per_s"] > 0 for r in decode[1:])
    assert finite(decode[2]["vs_one_stream"]) and decode[2]["identical_to_alone"] == 3  # batch-invariant by default
    steps = [r for r in rows if r["kind"] == "step"]
    assert [(r["rows"], r["pooled"]) for r in steps] == [(1, False), (3, True), (3, False)]
    assert steps[0]["cache_positions"] == steps[1]["cache_positions"] == decode[0]["prompt_tokens"]
    assert all(len(r["runs_ms"]) == serve.STEP_RUNS and r["step_ms"] > 0 for r in steps)


@pytest.mark.real_model
def test_adapter_times_the_base_model_and_the_adapter_both_ways(tmp_path):
    invoke("adapter", "--runs", "1", "--new-tokens", "2", "--dtype", "float32", "--out", str(tmp_path))
    [result] = json.loads((tmp_path / "adapter-smollm2-135m.json").read_text())["results"]  # a table, no plot
    assert result["engine"] == "ragcache" and sorted(result["median"]) == ["base", "merged", "unmerged"]
    assert all(finite(row["ttft_s"]) and finite(row["decode_tok_s"]) for row in result["median"].values())
    assert 0 < result["base_weights_kept_mib"] < result["model_mib"]


# -- helpers, no model ----------------------------------------------------------------------------------------
@pytest.mark.real_model
def test_peers(tmp_path):
    invoke("peers", "--docs", "1", "--doc-tokens", "32", "--runs", "1", "--decode-tokens", "2", "--dtypes", "float32",
           "--algorithms", "full,naive", "--out", str(tmp_path))
    data = json.loads((tmp_path / "peers-smollm2-135m.json").read_text())
    rows = {r["peer"]: r for r in data["results"]}
    assert {"ragcache full", "ragcache naive", "transformers", "llama.cpp"} <= set(rows)
    for name in ("ragcache full", "ragcache naive", "transformers"):
        assert finite(rows[name]["ttft_s"]) and rows[name]["ttft_vs_fastest_peer"] != 0
    assert finite(rows["transformers"]["decode_tok_s"]) and finite(rows["ragcache naive"]["decode_tok_s"])
    # every peer decodes the same number of tokens after the same prompt, EOS ignored
    assert rows["ragcache naive"]["decode_tokens"] == rows["transformers"]["decode_tokens"] == [2]
    llama = rows["llama.cpp"]
    try:
        import llama_cpp  # noqa: F401

        assert finite(llama["ttft_s"]) and finite(llama["decode_tok_s"]) and not llama["skipped"]
    except ImportError:  # the optional `peers` extra: the table says it was left out, and why
        assert llama["ttft_s"] is None and "not installed" in llama["skipped"]


def test_peers_speedups_are_against_the_fastest_first_request_of_another_engine():
    """A cached repeat (vLLM's prefix hit, an exact repeat) is not the peer, and plain vLLM through ragcache's
    connector ("no link") is a peer, not ours: rows say what they are where they are made, not by their names."""
    from bench import peers

    def row(name: str, ttft: float, decode: float | None = None, **kind) -> dict:
        return peers._row(peers.Peer(name, "bfloat16", ttft_s=[ttft], decode_tok_s=[decode] if decode else [],
                                     **kind))

    results = [row("ragcache naive", 0.30, 13.0, ours=True),
               row("transformers", 6.8, 8.0),
               row("vLLM cold", 10.8, 25.0),
               row("vLLM prefix hit", 0.05, cached_repeat=True),
               row("vLLM+ragcache naive reordered docs", 0.29, 31.0, ours=True),
               row("vLLM+ragcache naive exact repeat", 0.04, ours=True, cached_repeat=True),
               row("vLLM+ragcache, no link: cold", 5.0, 40.0),
               row("vLLM+ragcache, no link: prefix hit", 0.03, cached_repeat=True)]
    peers._speedups(results)
    by = {r["peer"]: r for r in results}
    assert by["ragcache naive"]["fastest_ttft_peer"] == "vLLM+ragcache, no link: cold (bfloat16)"
    assert by["ragcache naive"]["ttft_vs_fastest_peer"] == round(5.0 / 0.30, 2)
    assert by["vLLM+ragcache naive reordered docs"]["ttft_vs_fastest_peer"] == round(5.0 / 0.29, 2)
    assert by["vLLM+ragcache naive reordered docs"]["decode_vs_fastest_peer"] == round(31.0 / 40.0, 2)
    for name in ("vLLM+ragcache naive exact repeat", "vLLM+ragcache, no link: cold", "transformers"):
        assert by[name]["ttft_vs_fastest_peer"] is None and by[name]["decode_vs_fastest_peer"] is None


def test_serve_wall_clock_rate_spans_the_first_token_to_the_last():
    from types import SimpleNamespace

    from bench import serve

    def answer(tokens: int, decode_s: float):
        return SimpleNamespace(stats=SimpleNamespace(completion_tokens=tokens, decode_s=decode_s))

    # first tokens at 8 and 9 s, last at 10 and 12 s: 4 + 6 tokens after the first over 4 s
    assert serve.wall_rate([(answer(5, 2.0), 10.0), (answer(7, 3.0), 12.0)]) == 2.5


def test_rest_runs_record_the_threads_their_server_computes_with(tmp_path, monkeypatch):
    """The REST server is given the bench's thread count (OMP_NUM_THREADS), not torch's default: the result says it."""
    from bench import serve, throughput

    started, popen = [], subprocess.Popen

    def start(cmd, *args, **kwargs):
        if "ragcache.cli" not in cmd:  # git, for the run's commit
            return popen(cmd, *args, **kwargs)
        started.append(kwargs["env"])

    monkeypatch.setattr(subprocess, "Popen", start)
    monkeypatch.setattr(throughput.Server, "wait_healthy", lambda self: None)
    monkeypatch.setattr(serve, "rest_cells", lambda *args: [])
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        server = throughput.Server("smollm2-135m", "memory:")
        server.log.close()
        Path(server.log.name).unlink()
        ran = serve.run("smollm2-135m", [1], 2, 4, 32, (1, 2), 2, [], decode_tokens=0, decode_streams=[],
                        out_dir=tmp_path)
    finally:
        torch.set_num_threads(before)
    assert started[0]["OMP_NUM_THREADS"] == "1" and server.threads == 1
    assert json.loads(ran["paths"]["json"].read_text())["params"]["server_threads"] == 1


def test_a_run_records_uncommitted_changes_in_its_commit(tmp_path):
    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", "user.email=bench@test", "-c", "user.name=bench", *args], cwd=tmp_path,
                              check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "code.py").write_text("a = 1\n")
    git("add", "code.py")
    git("commit", "-q", "-m", "code")
    head = git("rev-parse", "--short", "HEAD")
    assert report.git_commit(tmp_path) == head
    (tmp_path / "code.py").write_text("a = 2\n")
    assert report.git_commit(tmp_path) == f"{head}-dirty"
    git("checkout", "-q", "code.py")
    (tmp_path / "new_module.py").write_text("b = 1\n")  # a file the run may import, not yet added
    assert report.git_commit(tmp_path) == f"{head}-dirty"


def test_a_decode_sample_with_no_time_is_an_error_not_a_rate():
    from bench import peers

    samples = iter([(32, -0.01), (32, 2.0), (0, 1.0), (32, 1.0)])
    peer = peers.Peer("vLLM cold", "bfloat16", decode=lambda: next(samples))
    for _ in range(4):
        peers.take_decode(peer)
    row = peers._row(peer)
    assert row["decode_all_tok_s"] == [16.0, 32.0] and row["decode_tok_s"] == 24.0
    assert len(row["decode_errors"]) == 2 and "2 decode samples left out" in peers._cells(dict(
        row, ttft_vs_fastest_peer=None, decode_vs_fastest_peer=None))[-1]


def test_the_vllm_worker_fails_when_vllm_keeps_its_prefix_cache():
    from types import SimpleNamespace

    from bench import vllm_worker

    vllm_worker.empty_prefix_cache(SimpleNamespace(reset_prefix_cache=lambda: True))
    with pytest.raises(RuntimeError, match="prefix cache"):
        vllm_worker.empty_prefix_cache(SimpleNamespace(reset_prefix_cache=lambda: False))


def test_adapter_decode_medians_are_over_the_same_queries_for_every_engine():
    """An answer that ends at its first token takes that query's decode sample out for every engine."""
    from types import SimpleNamespace

    from bench import adapter

    class Engine:
        def __init__(self, answers):  # (completion tokens, decode tok/s) per query
            self.answers = iter(answers)

        def compile(self, texts):
            return [f"doc{i}" for i in range(len(texts))]

        def warmup(self):
            pass

        def query(self, question, docs, algorithm, max_new_tokens):
            tokens, rate = next(self.answers)
            return SimpleNamespace(stats=SimpleNamespace(ttft_s=0.1, completion_tokens=tokens,
                                                         decode_s=(tokens - 1) / rate if rate else 0.0))

    got = adapter.measure({"base": Engine([(5, 10.0), (5, 20.0), (5, 30.0)]),
                           "merged": Engine([(1, None), (5, 40.0), (5, 50.0)])}, 3, "naive", 5, 2)
    assert got["median"]["base"]["decode_tok_s"] == 25.0 and got["median"]["merged"]["decode_tok_s"] == 45.0
    assert got["decode_runs_dropped"] == 1 and got["all"]["base"]["decode_tok_s"][0] is None
    with pytest.raises(RuntimeError, match="no decode sample"):
        adapter.measure({"base": Engine([(1, None)])}, 1, "naive", 5, 2)


def test_squad_scoring_matches_the_official_normalisation():
    assert squad.normalize("The  Cat, sat!") == "cat sat"
    assert squad.exact_match("the Denver Broncos", ["Denver Broncos", "Broncos"]) == 1.0
    assert squad.exact_match("Denver", ["Denver Broncos"]) == 0.0
    assert squad.token_f1("Denver", ["Denver Broncos"]) == pytest.approx(2 / 3)
    assert squad.token_f1("", ["x"]) == 0.0
    assert squad.token_f1("a b c", ["x", "b c"]) == pytest.approx(1.0)


def test_answer_is_cut_at_the_first_newline_once_started():
    assert accuracy.first_line("\n\n Paris\nLondon") == "Paris"
    assert accuracy.first_line("16,000 rpm.") == "16,000 rpm."
    assert accuracy.first_line("\n") == ""


def test_bootstrap_interval_contains_the_mean():
    mean, low, high = accuracy.bootstrap([0.0, 1.0] * 20)
    assert mean == 0.5 and 0.3 < low < 0.5 < high < 0.7
    assert accuracy.bootstrap([1.0] * 5) == (1.0, 1.0, 1.0)


def test_shipped_sample_is_well_formed():
    items = squad.load_items(sample=True)
    assert len(items) == 20 and len({i.id for i in items}) == 20
    for item in items:
        assert len(item.documents) == 4 and item.answers
        assert any(a in item.documents[item.gold] for a in item.answers)
    assert (squad.SAMPLE.parent / "README.md").read_text().count("CC BY-SA 4.0")


def test_items_apart_draw_every_question_and_never_an_avoided_paragraph():
    dev = {"data": [{"title": f"t{a}", "paragraphs": [
        {"context": f"a{a} p{p}", "qas": [{"id": f"{a}.{p}.{q}", "question": f"q{a}.{p}.{q}",
                                            "answers": [{"text": f"p{p}"}]} for q in range(3)]} for p in range(3)]}
        for a in range(5)]}
    avoid = {"a0 p0", "a1 p2", "a3 p1"}
    items = squad.items_apart(100, 2, avoid, dev=dev)
    assert len(items) == 5 * 3 * 3 - 3 * 3  # more items than paragraphs: every question of a kept paragraph
    assert len({i.id for i in items}) == len(items)
    for item in items:
        assert not avoid & set(item.documents) and len(item.documents) == 4
        a, p = item.id.split(".")[:2]
        assert item.documents[item.gold] == f"a{a} p{p}"
        assert len({d.split()[0] for d in item.documents}) == 4  # distractors from other articles
    assert squad.items_apart(100, 2, avoid, dev=dev) == items  # seeded


def test_variants_and_percentiles():
    assert [v.label for v in common.parse_variants("full,legolink,legolink-8,cacheblend-0.3")] == [
        "full", "legolink-16", "legolink-8", "cacheblend-0.3"]
    assert common.parse_variants("legolink-8")[0].kwargs == {"algorithm": "legolink", "k": 8}
    with pytest.raises(ValueError):
        common.parse_variants("bogus")
    assert report.percentile([1, 2, 3, 4], 50) == 2.5 and report.percentile([5], 99) == 5


# -- distribution-level agreement on tiny models, where the truth is known ----------------------------------
def _tiny_parts(family: str, dtype=torch.float32):
    from ragcache.compiler import PLAIN, Compiler
    from ragcache.linker import LinkInput
    from ragcache.engine.runner import Runner
    from tests import tiny

    lm = tiny.make(family, dtype=dtype)
    runner = Runner(lm)
    compiler = Compiler(lm, runner)
    tok = lm.tokenizer
    chunks = [tok(text, add_special_tokens=False)["input_ids"] for text in tiny.CORPUS[:3]]
    prefix = tok("Answer.", add_special_tokens=True)["input_ids"]
    parts = LinkInput(prefix, chunks, tok(" Question: where?", add_special_tokens=False)["input_ids"],
                      compiler.compile(prefix, PLAIN), [compiler.compile(c, PLAIN) for c in chunks])
    return runner, parts


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_legolink_covering_every_chunk_agrees_with_full_exactly(family):
    from bench import agreement
    from ragcache.linker import LinkParams, link

    runner, parts = _tiny_parts(family)
    longest = max(map(len, parts.chunk_ids))
    full = link(runner, parts, LinkParams("full"), extra_capacity=8)
    answer = agreement.greedy(runner, full, 6, set(), {})
    assert len(answer) == 6
    reference = agreement.teacher_forced_ll(runner, full, answer)
    covering = link(runner, parts, LinkParams("legolink", k=longest), extra_capacity=8)
    got = agreement.measure(runner, full.last_logits, covering, answer)
    assert got.top1 == 1.0 and got.kl < 1e-9 and abs(got.ll - reference) < 1e-3
    naive = agreement.measure(runner, full.last_logits, link(runner, parts, LinkParams("naive"), extra_capacity=8),
                              answer)
    assert naive.kl > 1e-6 and abs(naive.ll - reference) > 1e-4  # the metrics do see the seams naive leaves


def test_teacher_forcing_equals_the_model_forward():
    import torch

    from bench import agreement
    from ragcache.linker import LinkParams, link
    from tests import tiny

    runner, parts = _tiny_parts("llama")
    full = link(runner, parts, LinkParams("full"), extra_capacity=4)
    answer = [5, 17, 42, 9]
    logits = tiny.reference_logits(runner.lm, torch.cat([parts.token_ids, torch.tensor(answer)]))
    logp = torch.log_softmax(logits.double(), -1)
    start = parts.token_ids.numel() - 1
    expected = sum(float(logp[start + i, t]) for i, t in enumerate(answer))
    assert abs(agreement.teacher_forced_ll(runner, full, answer) - expected) < 1e-3


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_focus_recomputes_its_budget_and_equals_full_at_ratio_one(family):
    from bench import agreement
    from ragcache.linker import FOCUS_SINKS, LinkParams, link

    runner, parts = _tiny_parts(family)
    chunk_tokens = sum(map(len, parts.chunk_ids))
    full = link(runner, parts, LinkParams("full"))
    everything = link(runner, parts, LinkParams("focus", ratio=1.0))
    top1, kl = agreement.first_token(full.last_logits, everything.last_logits)
    assert top1 == 1.0 and kl < 1e-9
    quarter = link(runner, parts, LinkParams("focus", ratio=0.25))
    assert quarter.recomputed_tokens == math.ceil(0.25 * chunk_tokens) + len(parts.question_ids)
    from ragcache.linker import focus_rows

    scores = torch.zeros(parts.token_ids.numel())
    rows = focus_rows(parts, 0.25, scores)
    for start in parts.chunk_starts():  # every chunk's own sink rows are always in
        assert set(range(start, start + FOCUS_SINKS)) <= set(rows.tolist())
    from ragcache.linker import LinkInput

    empty = LinkInput(parts.prefix_ids, [[]], parts.question_ids)  # chunks with no row: nothing to choose, no scores
    assert focus_rows(empty, 0.25, None).numel() == 0


def test_empty_answer_agreement_is_the_first_position():
    from bench import agreement
    from ragcache.linker import LinkParams, link

    runner, parts = _tiny_parts("llama")
    full = link(runner, parts, LinkParams("full"))
    naive = link(runner, parts, LinkParams("naive"))
    got = agreement.measure(runner, full.last_logits, naive, [])
    assert got.ll == 0.0 and got.token_agree == got.answer_agree == got.top1


def test_the_gpu_script_runs_its_cpu_path_end_to_end(tmp_path):
    """bench/gpu.py (a CUDA machine's check and timing run) on its CPU path: the Triton kernels interpreted, every
    section reduced. The kernels match, `full` through the runner equals the model's own forward, each serving
    answer runs to its token limit (random weights: no EOS), so the tokens/s compare like with like, the
    invariance section finds every answer identical alone and packed with invariance on, and the link section
    times every algorithm, `full` at several row budgets, and a decoding stream's wait beside a long link."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "bench/gpu.py", "--device", "cpu", "--quick", "--models", "smollm2-135m",
                           "--invariance", "smollm2-135m", "--out", str(tmp_path)],
                          cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "gpu-cpu-quick.json").read_text())
    assert result["environment"]["commit"] and "bench/gpu.py --device cpu" in result["environment"]["command"]
    assert result["all_kernels_match"] and {k["attention_shape"] for k in result["kernels"]} == {
        "smollm2-135m", "qwen2.5-coder-1.5b"}
    assert {k["kernel"] for k in result["kernels"]} >= {  # every kernel the CUDA runner takes, and its promises
        "place_chunks int8", "place_chunks int4", "aligned_attention", "aligned_attention cut", "slot_run_attention",
        "write_slot_rows", "invariant_linear", "invariant_linear rows", "invariant_rms_norm",
        "invariant_rms_norm rows"}
    fulls = [m for m in result["model"] if "max_abs_logit_err" in m]
    assert fulls and all(m["max_abs_logit_err"] < 1e-4 for m in fulls)
    serving = result["serving"]
    assert {row["clients"] for row in serving} == {1, 4}
    for row in serving:
        assert row["completion_tokens"] == row["requests"] * row["new_tokens"] and row["tok_s"] > 0
    (mixed,) = [row for row in serving if "ttft_short_s" in row]  # long and short prompts, streamed
    assert mixed["ttft_short_s"]["n"] == mixed["ttft_long_s"]["n"] == mixed["requests"] // 2
    assert 0 < mixed["ttft_short_s"]["p50"] <= mixed["ttft_short_s"]["p99"]
    assert mixed["inter_token_s"]["n"] > 0 and mixed["inter_token_s"]["p99"] >= mixed["inter_token_s"]["p50"] > 0
    ours = [row for row in serving if "scheduler" in row]
    assert len(ours) == 2 and all(row["scheduler"]["decode_rows"] > 0 for row in ours)
    on, off = result["invariance"]  # on this CPU the invariant engine is the probed row tiles'
    assert on["batch_invariant"] and not off["batch_invariant"] and "row tiles" in on["how"]
    assert on["identical_2_at_a_time"] == on["identical_4_at_a_time"] == on["requests"] == 4
    assert on["identical_4_sampled_at_a_time"] == 4  # seeded sampling streams too, each drawing with its own generator
    # `full` whole and in pieces: the same bits where the start-up check found this CPU cut-invariant
    assert on["of"] == 4 and (not on["cut_invariant"] or on["full_first_logits_same_bits"] == on["full_answers_same"] == 4)
    # a repair past the prompt catches up at once; cut-invariant, an answer whose first token is full's is full's
    assert on["repair_caught_up"] == 4 and 0 <= on["focus_answers_same"] <= 4
    assert not on["cut_invariant"] or on["repair_answers_same"] == on["repair_first_token_same"]
    # a rate is there exactly when its run had decode-only steps (else None, the count 0 saying why); here each run
    # has them: no EOS, and the request linked last decodes its tokens after its first in steps no link shares
    for row in (on, off):
        assert row["decode_tok_s_many_sampled"] > 0, row
        for n in ("1", "many"):
            assert row[f"decode_only_steps_{n}"] > 0 and row[f"decode_tok_s_{n}"] is not None, row
            assert math.isfinite(row[f"decode_tok_s_{n}"]) and row[f"decode_tok_s_{n}"] > 0, row
    assert on["decode_tok_s_1_vs_off"] > 0
    (tile,) = result["tiles"]  # (h): on CPU one candidate, interpreted, checked against the torch reference
    assert tile["ok"] and tile["chosen"] and tile["max_abs_err"] < 1e-4
    links = [row for row in result["link"] if "algorithm" in row and "cold_s" not in row]  # (f): memory tier on CPU
    assert {(row["algorithm"], row["tier"]) for row in links} >= {(a, "memory") for a in (
        "full", "focus", "legolink", "naive", "cacheblend")}
    assert all(row["seconds"] > 0 and row["speedup_vs_forward"] > 0 for row in links)
    assert {row["row_budget"] for row in links if row["algorithm"] == "full"} >= {512}
    waits = [row for row in result["link"] if "longest_decode_step_s" in row]
    assert len(waits) == 2 and all(row["longest_decode_step_s"] > 0 for row in waits)
    # the stream decoded through the whole link: each of its steps was one the stream waited on
    assert all(row["outlasted"] and row["link_steps"] > 0 and row["tokens_beside_link"] > 0 for row in waits)
    checks = [row for row in result["link"] if "identical" in row]
    assert len(checks) == 2 and all(row["identical"] for row in checks)
    queued = [row for row in result["link"] if "asked at once" in row.get("what", "")]  # CPU: without prefetch only
    assert len(queued) == 2 and all(row["what"].endswith("no prefetch") and row["seconds"] > 0 for row in queued)
    decodes = {row["what"]: row for row in result["decode"] if "tok_s" in row}  # (g): no graphs to capture on CPU
    assert set(decodes) == {"ragcache decode, eager steps", "ragcache decode, ordinary steps",
                            "transformers decode, eager", "ragcache decode after focus, repair=0",
                            "ragcache decode after focus, repair=64", "ragcache decode after focus, repair=256"} and all(row["tok_s"] > 0 for row in decodes.values())
    (agree,) = [row for row in result["decode"] if "leading_identical" in row]
    assert agree["leading_identical"] == agree["of"]  # fp32: the whole-pool step decodes the ordinary step's tokens
    *compiled, profiled = result["compile"]  # (i): the codec "auto" keeps on this device (int8), and bf16; a profile
    assert [row["codec"] for row in compiled] == ["int8", "bf16"] and len({row["tokens"] for row in compiled}) == 1
    assert all(row["ours_tok_s"] > 0 and row["peer_tok_s"] > 0 and row["ratio"] > 0 for row in compiled)
    assert all(row["store"] == "memory" for row in compiled)  # on CPU: no GPU tier to compile into
    assert profiled["what"].startswith("profile of compile_documents") and profiled["wall_ms"] > 0


def test_compile_against_transformers_with_writes_and_a_decode_beside_it(tmp_path):
    """`python -m bench compile`: ours and transformers' over the very same chunks (their tokens counted once), the
    write rate of each store kind, and a decoding stream's gaps while a compile runs beside it."""
    from bench import compile as bench_compile

    got = bench_compile.run("smollm2-135m", docs=4, doc_tokens=64, runs=1, dtype="float32", peer_batch=2,
                            beside=True, out_dir=tmp_path)
    row = got["row"]
    assert row["chunks"] >= 4 and row["tokens"] > 4 * 32 and row["ours_tok_s"] > 0 and row["peer_tok_s"] > 0
    assert row["ratio"] == pytest.approx(row["tokens"] / row["peer_tok_s"] / row["ours_s"], rel=0.01)
    assert [w["store"] for w in got["writes"]] == ["memory", "disk"] and all(w["mb_s"] > 0 for w in got["writes"])
    waits = got["beside_a_decode"]
    assert waits["compiled_chunks"] >= 3 and waits["steps"] > 0
    if waits["stream_outlived_compile"]:  # a sampled answer may end first: then there is nothing to compare
        assert waits["tokens_during"] > 0 and waits["longest_gap_s"] > 0
    saved = json.loads((tmp_path / "compile-smollm2-135m.json").read_text())
    assert saved["machine"]["commit"] and saved["machine"]["command"] and saved["results"] == [row]


def test_the_gpu_suite_runs_its_sections_into_one_json_and_says_what_failed(tmp_path):
    """`bench/gpu.py --suite` on its CPU path, reduced to the checks and the compile section (the others run in the
    test above): one JSON with each section, its time, the commit and command, and exit 0 when nothing failed."""
    env = dict(os.environ, TRITON_INTERPRET="1", RAGCACHE_COMMIT="abc1234-dirty")
    done = subprocess.run([sys.executable, "bench/gpu.py", "--device", "cpu", "--quick", "--suite", "--shape",
                           "smollm2-135m", "--skip", "kernels,link,decode,serving,invariance", "--out", str(tmp_path)],
                          cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    name = "gpu-suite-cpu-abc1234-dirty-no-decode-no-invariance-no-kernels-no-link-no-serving-quick.json"
    result = json.loads((tmp_path / name).read_text())  # the commit measured in its name
    assert result["environment"]["commit"] == "abc1234-dirty" and "--suite" in result["environment"]["command"]
    assert len(result["environment"]["source_digest"]) == 16 and "running" not in result and "killed_in" not in result
    assert set(result["section_seconds"]) == {"check", "compile"} and "no check failed" in done.stdout
    checks = {row["check"]: row for row in result["check"]}
    assert checks["graph decode = eager step"]["ok"] and checks["int8 link ~ pageable link"]["ok"]
    int8 = checks["int8 link ~ pageable link"]
    assert int8["mean_abs_logit_err"] <= int8["relative_tolerance"] * int8["reference_logit_std"]
    assert len(result["compile"]) == 3 and "compile int8" in done.stdout  # auto (int8), bf16, a profile
    bad = subprocess.run([sys.executable, "bench/gpu.py", "--device", "cpu", "--quick", "--suite", "--skip", "tiles",
                          "--out", str(tmp_path)], cwd=Path(__file__).resolve().parents[1], env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--suite --skip takes kernels, check, link" in bad.stderr
    # a rerun of one part skips the checks too (the suite's own section names, not the plain run's)
    rerun = subprocess.run([sys.executable, "bench/gpu.py", "--device", "cpu", "--quick", "--suite", "--skip",
                            "kernels,check,link,decode,serving,invariance,compile", "--out", str(tmp_path)],
                           cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0 and "no check failed" in rerun.stdout, rerun.stderr[-2000:]
    # a deadline the next sections would pass: none starts, each is named with the --skip that runs it next
    late = subprocess.run([sys.executable, "bench/gpu.py", "--device", "cpu", "--quick", "--suite", "--skip",
                           "kernels,check,link,compile", "--deadline-s", "20", "--out", str(tmp_path)],
                          cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True, timeout=120)
    assert late.returncode == 0 and "no check failed" in late.stdout, late.stdout[-2000:] + late.stderr[-2000:]
    assert "left for time: decode, serving, invariance; run them with --suite --skip kernels,check,link,compile" in (
        late.stdout)


def test_the_suite_stops_itself_before_the_devices_limit_with_its_json_written(tmp_path, monkeypatch):
    """`--deadline-s` only decides whether a section starts: one that overran (a cold compile, a hang) was killed by
    the device's limit with nothing of it written, in CUDA code no signal handler interrupts."""
    import threading

    from bench import gpu

    exited = threading.Event()
    monkeypatch.setattr(gpu.os, "_exit", lambda code: exited.set())
    path = tmp_path / "suite.json"
    gpu._stop_at(0.2, time.perf_counter(), {"running": "link", "check": [{"check": "x", "ok": True}]}, path)
    assert exited.wait(30)
    written = json.loads(path.read_text())
    assert written["killed_in"] == "link" and written["check"] == [{"check": "x", "ok": True}]
    assert gpu._suite_summary(written)[0] == "link: stopped at the run's time limit"


def test_a_fault_a_section_caught_in_its_rows_still_counts_as_a_lost_context(monkeypatch):
    """A sub-step's try (codec links, cold read, repair cost) keeps an illegal access as a row and the section ends
    normally: the suite must still go on in a fresh process, or every later section fails with the broken context."""
    from bench import gpu

    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    assert not gpu._context_lost(cuda, [{"check": "codec links", "ok": True}])
    assert gpu._context_lost(cuda, [{"cold read": {"error": "RuntimeError('CUDA error: an illegal memory access was "
                                                            "encountered')"}}])

    def broken(device=None):
        raise RuntimeError("CUDA error: unspecified launch failure")

    monkeypatch.setattr(torch.cuda, "synchronize", broken)
    assert gpu._context_lost(cuda, [{"check": "codec links", "ok": True}])


def test_after_a_cuda_fault_the_suite_runs_the_rest_in_a_fresh_process_and_keeps_its_rows(tmp_path, monkeypatch):
    """An illegal access leaves the process's CUDA context broken: every later section of the H200 run at f044cdf
    failed with it. The suite replaces itself by a process that runs the sections not done (`--skip` the done ones)
    into the same JSON (`--suite-resume`), which keeps the first process's rows and names what never ran."""
    from bench import gpu

    ran = []

    class Replaced(Exception):
        pass

    def execv(exe, argv):
        ran.append(argv)
        raise Replaced

    monkeypatch.setattr(os, "execv", execv)
    monkeypatch.setattr(sys, "argv", ["bench/gpu.py", "--suite", "--skip", "serving", "--out", str(tmp_path)])
    with pytest.raises(Replaced):
        gpu._continue_in_a_fresh_process({"kernels", "check", "link", "serving"}, tmp_path / "suite.json")
    assert ran[0][2:] == ["--suite", "--out", str(tmp_path), "--skip", "check,kernels,link,serving",
                          "--suite-resume", str(tmp_path / "suite.json")]
    first = dict(benchmark="gpu --suite", skipped=["serving"], kernels=[{"kernel": "rope", "ok": True}],
                 check=[{"check": "graph decode = eager step", "ok": True}], link={"error": "RuntimeError('CUDA "
                 "error: an illegal memory access was encountered')"}, section_seconds=dict(kernels=1.0))
    (tmp_path / "suite.json").write_text(json.dumps(first))
    env = dict(os.environ, TRITON_INTERPRET="1", RAGCACHE_COMMIT="abc1234")
    resumed = subprocess.run([sys.executable, "bench/gpu.py", "--device", "cpu", "--quick", "--suite", "--skip",
                              "kernels,check,link,serving,compile,invariance", "--suite-resume",
                              str(tmp_path / "suite.json"), "--out", str(tmp_path)],
                             cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                             timeout=600)
    kept = json.loads((tmp_path / "suite.json").read_text())
    assert kept["check"] == first["check"] and kept["link"] == first["link"] and "decode" in kept
    said = resumed.stdout
    assert resumed.returncode == 1 and "link: RuntimeError" in said and "compile: not run" in said, said[-2000:]


def test_the_gpu_scripts_check_mode_runs_on_cpu(tmp_path):
    """`bench/gpu.py --check` compares each CUDA path with its reference; on CPU the graph check runs its eager step
    on both sides and the CUDA-only checks say they did not run (not a pass)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "bench/gpu.py", "--device", "cpu", "--quick", "--check", "--out",
                           str(tmp_path)], cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = {row["check"]: row for row in json.loads((tmp_path / "gpu-check-cpu.json").read_text())["checks"]}
    assert rows["graph decode = eager step"]["ok"] is True
    cuda_only = ("pinned", "gpu tier", "prefetched from pinned", "prefetched from pageable")
    assert all(rows[f"{name} link = pageable link"]["ok"] is None for name in cuda_only)
    assert rows["pinned placement leaves the host free"]["ok"] is None


def test_the_gpu_script_times_full_once():
    """The runner derives the contiguous hint from the rows, whatever a caller says: `full` has one row of timings
    (two labelled with and without the hint timed the same code)."""
    from bench import gpu

    rows = gpu.model_timings("smollm2-135m", torch.device("cpu"), torch.float32, quick=True)
    fulls = [r for r in rows if r["what"].startswith("full")]
    assert [r["what"] for r in fulls] == ["full, ragcache runner"] and fulls[0]["max_abs_logit_err"] < 1e-4


def test_the_gpu_scripts_decode_profile_lists_what_a_token_costs():
    """(g) with --profile: a table of a link and 16 tokens from the first kind of step, beside the timings rather
    than in place of them. On a GPU it lists every kernel; on CPU the profiler sees only the calling thread's ops,
    not the model thread's, so only the path and the row's form are checked here."""
    from bench import gpu

    rows = gpu.decode("smollm2-135m", 256, torch.device("cpu"), torch.float32, quick=True, profiled=True)
    (profile,) = [r for r in rows if r.get("what", "").startswith("profile of")]
    assert profile["what"].endswith("eager decode steps") and profile["sort"] == "self_cpu_time_total"
    assert profile["top"] and all(e["calls"] > 0 and e["ms"] >= 0 for e in profile["top"])
    assert sum(r.get("tok_s", 0) > 0 for r in rows) == 6  # the timings are all there, repair's three included
    repairs = {r["repair"]: r for r in rows if "repair" in r}
    assert set(repairs) == {0, 64, 256} and all(r["tok_s"] > 0 and r["ttft_s"] > 0 for r in repairs.values())


def test_the_gpu_scripts_link_profiles_say_how_much_of_the_wall_the_device_was_busy():
    """(f) with --profile: naive from each tier (one on CPU), then focus and full; each beside its wall time, since
    a link whose device time is far under its wall is held by the host (launches, a blocking copy)."""
    from bench import gpu

    rows = gpu.link("smollm2-135m", [], torch.device("cpu"), torch.float32, quick=True, profiled=True)
    profiles = [r for r in rows if r.get("what", "").startswith("profile of")]
    assert [r["what"] for r in profiles] == [f"profile of one {a} link" for a in ("naive", "focus", "full")]
    assert all(r["tier"] == "memory" and r["wall_ms"] > 0 and r["top"] for r in profiles)
    behind = [r for r in rows if r.get("what") == "short request behind a full link"]
    assert len(behind) == 2 and all(0 < r["short_answer_s"] and r["short_arrived_at_s"] < r["long_link_s"] for r in behind)
    codecs = [(r["codec"], r["algorithm"]) for r in rows if "codec" in r]
    assert codecs == [(c, a) for c in ("bf16", "int8", "int4") for a in ("naive", "legolink")]
    sizes = {r["codec"]: r["entry_bytes"] for r in rows if "codec" in r}
    assert sizes["int4"] < 0.6 * sizes["int8"] < 0.6 * sizes["bf16"]  # what crosses to the device
    named = [r["kv_codec"] for r in rows if "kv_codec" in r]  # the main link rows: auto's codec, named
    assert len(named) >= 3 and set(named) == {"int8"}
    (cold,) = [r for r in rows if r.get("tier") == "memory+disk"]  # gpu+memory+disk on CUDA
    assert cold["cold_s"] > 0 and cold["warm_s"] > 0


def test_store_io_entries_read_back_from_a_checking_tier(tmp_path):
    """bench/store_io times reads of its own entries: a tier that checks ids against keys must find them sound, or
    the bench times misses (its keys once salted the dtype slot, which the entries' metadata did not hold)."""
    from bench import store_io

    store = store_io.open_store(f"disk:{tmp_path}")
    entries = store_io.make_entries(2, 16, salt=3)
    store.put_many(entries)
    got = store.get_many(list(entries))
    assert all(g is not None and torch.equal(g.keys, e.keys) for g, e in zip(got, entries.values()))


def test_accuracy_summary_pools_decode_over_real_tokens_and_marks_pre_repair_teacher_forcing():
    """An answer that ended at its first step adds no token (it added -1); a repaired variant's teacher-forced
    metrics follow full's answer over the cache before any repair, and its row says so."""
    from bench.accuracy import summarize

    def answer(tokens, decode_s):
        return dict(f1=1.0, em=1.0, agree=1.0, f1_vs_full=1.0, top1=1.0, kl=0.0, reproduced=1.0, whole=1.0,
                    token_agree=1.0, ll=0.0, recomputed=1, prompt_tokens=10, tokens=tokens, decode_s=decode_s,
                    ttft_s=0.1)

    items = [dict(answers={"full": answer(5, 1.0), "focus+repair-64": answer(0, 0.0)}),
             dict(answers={"full": answer(5, 1.0), "focus+repair-64": answer(5, 2.0)})]
    full, repaired = summarize(items, ["full", "focus+repair-64"], repairing={"focus+repair-64"})
    assert repaired["decode_tok_s"] == 2.0 and full["decode_tok_s"] == 4.0
    assert repaired["teacher_forced"] == "over the cache before repair" and "teacher_forced" not in full


def test_a_prefix_link_timed_on_the_same_prompt_is_a_cached_repeat_not_a_speedup(monkeypatch):
    """`peers --algorithms prefix` times one prompt over and over: every sample a prefix-cache hit."""
    from bench import peers
    from bench.common import VARIANTS

    class Stub:
        def warmup(self): ...
        def compile(self, texts): return ["d"]
        def link(self, *args, **kwargs): return type("L", (), {"token_ids": torch.tensor([1, 2])})()
        def query(self, *args, **kwargs): ...

    monkeypatch.setattr(peers, "whole_documents", lambda lm, texts: Stub())
    mine, _ = peers.ragcache_peers(None, "float32", ["t"], "q?", [VARIANTS["naive"], VARIANTS["prefix"]], 2)
    assert [p.cached_repeat for p in mine] == [False, True]


def test_the_gpu_scripts_kernel_check_holds_a_promise_of_the_same_bits_to_the_bit(monkeypatch):
    """A case marked exact (a row's bits alone and among others, a piece cut anywhere) fails on one ulp, which the
    dtype's tolerance would let pass; the others are judged within the tolerance."""
    from bench import gpu

    x = torch.ones(4, 8)
    off_by_an_ulp = torch.nextafter(x, torch.full_like(x, 2.0))
    cases = [dict(kernel="k", shape="s", triton=lambda: off_by_an_ulp, torch=lambda: x, truth=None, exact=exact)
             for exact in (True, False)]
    monkeypatch.setattr(gpu, "kernel_cases", lambda *args: cases)
    monkeypatch.setattr(gpu, "ATTENTION_SHAPES", {"one": None})
    exact, close = gpu.check_and_time_kernels(torch.device("cpu"), torch.float32, quick=True)
    assert not exact["ok"] and exact["triton_ms"] is None and exact["torch_ms"] is None
    assert close["ok"] and close["torch_ms"] is not None


def test_greedy_ends_the_first_line_as_first_line_ids_does():
    """A token holding text before its newline ("tall.\\n") ends the answer as part of it; a bare newline ends it
    before; a leading one does not end it (bench/codecs.py and the int4 probes compare greedy answers)."""
    from bench import agreement
    from ragcache.linker import LinkParams, link

    runner, parts = _tiny_parts("llama")
    full = link(runner, parts, LinkParams("full"), extra_capacity=8)
    answer = agreement.greedy(runner, full, 4, set(), {})
    first, second = answer[0], answer[1]
    assert agreement.greedy(runner, full, 4, set(), {second: True}) == [first, second]
    assert agreement.greedy(runner, full, 4, set(), {second: False}) == [first]
    assert agreement.greedy(runner, full, 4, set(), {first: False}) == answer  # leading: the answer goes on
