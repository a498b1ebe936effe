"""`python -m bench peers --peers vllm,vllm-ragcache` runs, in vLLM's environment, with its two vLLM workers."""

from __future__ import annotations

import json
import math
import re
import sys

RUNS = 1


def decode_rate_or_why_not(row: dict) -> None:
    """Each run gave the row a decode sample or a recorded reason for none, and its rate is there exactly when a
    sample is. vLLM's sample is a difference of two timings (bench/peers.py: take_decode) that a busy machine can
    bring to zero or below (seen in CI with two test workers on two cores): such a sample is an error of that kind,
    "N tokens in S s" with S <= 0, never a rate and never silently missing."""
    samples, errors = row["decode_all_tok_s"], row["decode_errors"]
    assert len(samples) + len(errors) == RUNS, row
    assert all(math.isfinite(x) and x > 0 for x in samples), row
    for error in errors:
        tokens, seconds = re.fullmatch(r"(-?\d+) tokens in (-?\d+\.\d+) s", error).groups()
        assert int(tokens) <= 0 or float(seconds) <= 0, row
    if samples:
        assert row["decode_tok_s"] is not None and math.isfinite(row["decode_tok_s"]) and row["decode_tok_s"] > 0, row
    else:
        assert row["decode_tok_s"] is None, row


def test_peers_with_vllm_and_the_connector(tmp_path, monkeypatch):
    from tests.test_bench import invoke

    monkeypatch.setenv("RAGCACHE_VLLM_PYTHON", sys.executable)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    # 16 decode tokens keep vLLM's timing difference (above) well over the noise most of the time; when it is not,
    # the row says why it has no decode rate, which is what is asserted
    invoke("peers", "--docs", "2", "--doc-tokens", "48", "--runs", str(RUNS), "--decode-tokens", "16", "--dtypes",
           "float32", "--algorithms", "naive", "--peers", "vllm,vllm-ragcache", "--out", str(tmp_path))
    rows = {r["peer"]: r for r in json.loads((tmp_path / "peers-smollm2-135m.json").read_text())["results"]}
    linked, plain = rows["vLLM+ragcache naive reordered docs"], rows["vLLM reordered docs"]
    for row in (linked, plain, rows["vLLM+ragcache naive exact repeat"], rows["vLLM prefix hit"],
                rows["vLLM+ragcache, no link: reordered docs"]):
        assert math.isfinite(row["ttft_s"]) and row["ttft_s"] > 0 and not row["skipped"]
    unlinked = rows["vLLM+ragcache, no link: reordered docs"]  # requests without documents, connector loaded
    for row in (linked, plain, unlinked):
        assert sorted(row["requests_per_s"]) == ["1", "16", "4"]
        assert all(math.isfinite(v) and v > 0 for v in row["requests_per_s"].values())
    for row in (linked, plain):  # two documents: two clients, each with its own order
        assert math.isfinite(row["own_order_requests_per_s"]) and len(row["own_order_all_requests_per_s"]) == 1
    assert unlinked["own_order_requests_per_s"] is None
    for row in (linked, rows["vLLM cold"], rows["vLLM+ragcache, no link: cold"]):  # the rows that decode
        decode_rate_or_why_not(row)
    assert linked["ttft_vs_fastest_peer"] is not None
    # speedups are against a first request of another engine: never a cached repeat, and plain requests through
    # the connector are a peer, not ours
    assert linked["ours"] and not unlinked["ours"] and unlinked["ttft_vs_fastest_peer"] is None
    assert "prefix hit" not in linked["fastest_ttft_peer"] and "repeat" not in linked["fastest_ttft_peer"]
    assert rows["vLLM+ragcache naive exact repeat"]["ttft_vs_fastest_peer"] is None


def test_adapter_on_the_vllm_engine_merged_and_as_vllms_lora(tmp_path):
    from tests.test_bench import invoke

    invoke("adapter", "--engine", "vllm", "--runs", "1", "--new-tokens", "2", "--dtype", "float32", "--out",
           str(tmp_path))
    [result] = json.loads((tmp_path / "adapter-smollm2-135m.json").read_text())["results"]
    assert result["engine"] == "vllm" and sorted(result["median"]) == ["vllm LoRA", "vllm base", "vllm merged"]
    assert all(math.isfinite(row["ttft_s"]) and math.isfinite(row["decode_tok_s"]) for row in result["median"].values())
