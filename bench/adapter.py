"""Serving a link adapter merged into the weights or beside them (PEFT's LoRA layers), against the base model:
time to first token of a linked query and decode speed, the engines taking turns so drift hits each alike. On the
vLLM engine (`engine="vllm"`): the base model against the adapter merged into a checkpoint and as vLLM's LoRA."""

from __future__ import annotations

import copy
import json
import statistics
import tempfile
from pathlib import Path

import torch

from ragcache import adapters, loaded, lora, models
from ragcache.facade import RagCache
from ragcache.settings import DATA_DIR
from ragcache.store import open_store

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def random_adapter(lm: loaded.LoadedModel, out: Path, rank: int) -> Path:
    """A LoRA of the shape `ragcache train link` fits (rank `rank`, attention projections): its cost is its shape's."""
    import peft

    fitted = peft.get_peft_model(copy.deepcopy(lm.model), peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=ATTENTION, init_lora_weights=False))
    fitted.save_pretrained(out)
    (out / lora.ADAPTER_META).write_text(json.dumps({"base_model": lm.name,
                                                       "base_config": loaded.config_fingerprint(lm.model),
                                                       "base_weights": lora.base_weights_record(lm)}))
    return out


def run(model: str, adapter: Path | None, dtype: str, runs: int, algorithm: str, new_tokens: int,
        rank: int = 16, docs_per_query: int = 4, engine: str = "ragcache") -> dict:
    """`engine` "vllm": the base model, the adapter merged and the adapter as vLLM's LoRA on the vLLM engine
    instead, over a disk store."""
    label = str(adapter) if adapter is not None else f"random rank-{rank} LoRA on {', '.join(ATTENTION)}"
    with tempfile.TemporaryDirectory() as tmp:  # held while vLLM serves: it reads a LoRA at its first request
        if adapter is None:
            adapter = random_adapter(models.load(model, dtype=dtype), Path(tmp), rank)
        if engine == "vllm":
            engines = {name: RagCache.open(model, f"disk:{tmp}/store", engine="vllm", dtype=dtype, adapter=chosen,
                                           merge_adapter=merge)
                       for name, chosen, merge in (("vllm base", None, True), ("vllm merged", adapter, True),
                                                   ("vllm LoRA", adapter, False))}
            try:
                result = measure(engines, runs, algorithm, new_tokens, docs_per_query)
            finally:
                for rc in engines.values():
                    rc.close()
                if label.startswith("random"):  # a whole model's copy, of an adapter gone with this run
                    adapters.remove_merged(Path(engines["vllm merged"].served.checkpoint))
            sizes = {}
        else:
            store = open_store("memory:")
            engines = {"base": RagCache(models.load(model, dtype=dtype), store),
                       "unmerged": RagCache(models.load(model, dtype=dtype, adapter=adapter, merge=False), store),
                       "merged": RagCache(models.load(model, dtype=dtype, adapter=adapter, merge=True), store)}
            result = measure(engines, runs, algorithm, new_tokens, docs_per_query)
            kept = sum(base.numel() * base.element_size() for _, base, _ in engines["merged"].lm.adapter.swapped)
            model_bytes = sum(p.numel() * p.element_size() for p in engines["base"].lm.model.parameters())
            sizes = {"base_weights_kept_mib": kept / 2**20, "model_mib": model_bytes / 2**20}
    return {"model": model, "engine": engine, "dtype": dtype, "algorithm": algorithm, "runs": runs,
            "documents": docs_per_query, "threads": torch.get_num_threads(), "adapter": label, **sizes, **result}


def measure(engines: dict, runs: int, algorithm: str, new_tokens: int, docs_per_query: int) -> dict:
    """TTFT and decode tok/s of each engine, the engines taking turns on the same queries. A run in which any
    engine's answer ended at its first token (EOS) has no decode sample for any engine (None in "all"), so every
    engine's decode median is over the same queries; `decode_runs_dropped` counts those runs."""
    questions = [json.loads(line) for line in (DATA_DIR / "questions.jsonl").read_text().splitlines() if line.strip()]
    texts = [p.read_text() for p in sorted((DATA_DIR / "docs").glob("*.txt"))]
    doc_ids = next(iter(engines.values())).compile(texts)
    times: dict[str, dict[str, list]] = {name: {"ttft_s": [], "decode_tok_s": []} for name in engines}
    for rc in engines.values():
        rc.warmup()
    dropped = 0
    for i in range(runs):
        question = questions[i % len(questions)]["question"]
        docs = doc_ids[i % len(doc_ids):] + doc_ids[: i % len(doc_ids)]
        decode = {}
        for name, rc in engines.items():
            st = rc.query(question, docs[:docs_per_query], algorithm=algorithm, max_new_tokens=new_tokens).stats
            times[name]["ttft_s"].append(st.ttft_s)
            decode[name] = (st.completion_tokens - 1) / st.decode_s if st.completion_tokens > 1 else None
        if None in decode.values():
            dropped += 1
            decode = dict.fromkeys(decode)
        for name, rate in decode.items():
            times[name]["decode_tok_s"].append(rate)
    if dropped == runs:
        raise RuntimeError(f"no decode sample: in each of the {runs} runs some engine's answer ended at its first "
                           "token")
    return {"median": {name: {k: statistics.median(x for x in v if x is not None) for k, v in t.items()}
                       for name, t in times.items()},
            "all": times, "decode_runs_dropped": dropped}
