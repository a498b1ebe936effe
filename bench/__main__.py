"""python -m bench ttft | lower-bound | throughput | serve | soak | slow-clients | refusals | accuracy | codecs | peers | compile | adapter | markdown | squad-sample
(each: --help)."""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # `python bench/__main__.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "bench"

import typer  # noqa: E402

from bench import common  # noqa: E402

app = typer.Typer(help="ragcache benchmarks: tables on stdout, JSON + PNG under bench/results/.",
                  no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False)

ALL = ",".join(common.VARIANTS)
Model = typer.Option("smollm2-135m", "--model", "-m", help="built-in name, transformers directory or hub id")
Out = typer.Option(None, "--out", help="results folder (default bench/results)")
Tag = typer.Option("", "--tag", help="suffix of the result file names")


@app.callback()
def _options(threads: int = typer.Option(None, "--threads", min=1, help="torch CPU threads (default: torch's)")):
    """ragcache benchmarks: tables on stdout, JSON + PNG under bench/results/."""
    if threads:
        import torch

        torch.set_num_threads(threads)


def _variants(text: str):
    try:
        return common.parse_variants(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc


def _stores(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in ("memory", "disk", "redis")]
    if bad:
        raise typer.BadParameter(f"unknown store(s) {bad}: memory, disk, redis")
    return names


@app.command()
def ttft(
    model: str = Model,
    docs: str = typer.Option("2,4,8,16", help="numbers of documents N"),
    doc_tokens: int = typer.Option(512, help="tokens per document (one chunk each)"),
    runs: int = typer.Option(3, min=1, help="timed runs per point (median)"),
    algorithms: str = typer.Option(ALL, help="comma-separated: " + ALL),
    stores: str = typer.Option("memory,disk,redis", help="memory (warm), disk (cold), redis (cold)"),
    redis: str = typer.Option(None, "--redis", help="Redis URL (default: start a local redis-server if there is one)"),
    out: Path = Out,
    tag: str = Tag,
):
    """TTFT of every algorithm vs number of documents, warm (memory) and cold (disk, redis)."""
    from bench import ttft as mod

    mod.run(model, common.parse_ints(docs), doc_tokens, runs, _variants(algorithms), _stores(stores), redis, out, tag)


@app.command("lower-bound")
def lower_bound(
    model: str = Model,
    docs: str = typer.Option("2,4,8", help="numbers of documents N"),
    doc_tokens: int = typer.Option(512, help="tokens per document (one chunk each)"),
    runs: int = typer.Option(3, min=1, help="timed runs per point (median)"),
    algorithms: str = typer.Option(ALL, help="comma-separated: " + ALL),
    store: str = typer.Option("memory", help="memory, disk or redis: where the entries are read from"),
    redis: str = typer.Option(None, "--redis", help="Redis URL for --store redis"),
    kv_codec: str = typer.Option("auto", "--kv-codec", help="auto | fp32 | fp16 | bf16 | int8: how entries are stored"),
    out: Path = Out,
    tag: str = Tag,
):
    """How close linking is to its floor: store read alone + selected rows alone vs TTFT."""
    from bench import lower_bound as mod

    mod.run(model, common.parse_ints(docs), doc_tokens, runs, _variants(algorithms), _stores(store)[0], redis, out,
            tag, kv_codec)


@app.command()
def throughput(
    model: str = Model,
    clients: str = typer.Option("1,4,16", help="concurrent clients C (closed loop)"),
    requests: int = typer.Option(32, min=1, help="timed requests per (algorithm, C)"),
    pool: int = typer.Option(100, min=8, help="documents in the pool"),
    doc_tokens: int = typer.Option(128, help="tokens per document (100 x 128 tokens x 2 layouts fit the default "
                                             "2 GiB memory store of SmolLM2)"),
    min_docs: int = typer.Option(4, min=1, help="documents per query, at least"),
    max_docs: int = typer.Option(8, min=1, help="documents per query, at most"),
    max_tokens: int = typer.Option(8, min=1, help="tokens generated per request"),
    algorithms: str = typer.Option("full,prefix,naive,cacheblend,legolink-16,legolink0", help="comma-separated"),
    store: str = typer.Option("memory:", help="the server's store"),
    url: str = typer.Option(None, "--url", help="drive a server already running there instead of starting one"),
    out: Path = Out,
    tag: str = Tag,
):
    """Requests/s and p50/p99 latency through the REST server, C concurrent clients."""
    from bench import throughput as mod

    if min_docs > max_docs:
        raise typer.BadParameter("--min-docs must be <= --max-docs")
    mod.run(model, common.parse_ints(clients), requests, pool, doc_tokens, (min_docs, max_docs), max_tokens,
            _variants(algorithms), store, url, out, tag)


@app.command()
def serve(
    model: str = Model,
    clients: str = typer.Option("1,4,16", help="concurrent REST clients C (closed loop)"),
    requests: int = typer.Option(16, min=1, help="timed requests per (algorithm, C); the same ones in every cell"),
    pool: int = typer.Option(24, min=8, help="documents in the pool"),
    doc_tokens: int = typer.Option(128, help="tokens per document"),
    min_docs: int = typer.Option(3, min=1, help="documents per query, at least"),
    max_docs: int = typer.Option(4, min=1, help="documents per query, at most"),
    max_tokens: int = typer.Option(8, min=1, help="tokens generated per REST request"),
    algorithms: str = typer.Option("full,legolink-16", help="comma-separated"),
    decode_tokens: int = typer.Option(32, min=0, help="tokens per decode-speed run (0: skip that part)"),
    decode_streams: str = typer.Option("1,16", help="concurrent streams for the decode-speed part"),
    dtype: str = typer.Option("auto", help="compute dtype of the decode-speed part: auto, float32 or bfloat16"),
    repeats: int = typer.Option(1, min=1, help="decode-speed cells, each run this many times interleaved (median)"),
    batch_invariant: bool = typer.Option(True, "--batch-invariant/--no-batch-invariant",
                                         help="the decode-speed part's engine setting (README: Batch invariance)"),
    out: Path = Out,
    tag: str = Tag,
):
    """REST requests/s and p50/p99 latency at C = 1, 4, 16; decode tok/s alone, at C streams, vs transformers."""
    from bench import serve as mod

    if min_docs > max_docs:
        raise typer.BadParameter("--min-docs must be <= --max-docs")
    mod.run(model, common.parse_ints(clients), requests, pool, doc_tokens, (min_docs, max_docs), max_tokens,
            _variants(algorithms), decode_tokens, common.parse_ints(decode_streams), out, tag, dtype,
            repeats, batch_invariant)


@app.command()
def accuracy(
    model: str = Model,
    n: int = typer.Option(50, "--n", min=1, help="questions"),
    sample: bool = typer.Option(False, "--sample", help="use the shipped 20-item sample (no download)"),
    seed: int = typer.Option(0, help="item selection and shuffling"),
    algorithms: str = typer.Option("full,naive,cacheblend,legolink-16,legolink0",
                                   help="comma-separated (prefix is left out by default: exact prefix reuse, the same "
                                        "answers as full)"),
    max_new_tokens: int = typer.Option(16, min=1, help="greedy tokens per answer (stops at a newline)"),
    system: str = typer.Option(None, help="system prompt (default: none)"),
    out: Path = Out,
    tag: str = Tag,
):
    """SQuAD v1.1 dev: gold + 3 distractor paragraphs; EM, F1 and agreement with full, 95% CIs."""
    from bench import accuracy as mod

    mod.run(model, n, sample, seed, _variants(algorithms), max_new_tokens, system, out, tag)


@app.command()
def codecs(
    model: str = Model,
    n: int = typer.Option(60, "--n", min=1, help="questions"),
    sample: bool = typer.Option(False, "--sample", help="use the shipped 20-item sample (no download)"),
    seed: int = typer.Option(0, help="item selection and shuffling"),
    kv_codecs: str = typer.Option("fp32,fp16,bf16,int8", "--codecs",
                                  help="comma-separated kv codecs; DTYPE/CODEC computes in DTYPE (bfloat16/int8)"),
    algorithms: str = typer.Option("naive,legolink-16", help="comma-separated algorithms linked with each codec"),
    max_new_tokens: int = typer.Option(16, min=1, help="greedy tokens per answer (stops at a newline)"),
    out: Path = Out,
    tag: str = Tag,
):
    """Each kv codec against fp32 entries and against full: top-1, KL, F1 with 95% CIs, bytes per token."""
    from bench import codecs as mod

    mod.run(model, n, sample, seed, [c.strip() for c in kv_codecs.split(",") if c.strip()], _variants(algorithms),
            max_new_tokens, out, tag)


@app.command("compile")
def compile_(
    model: str = Model,
    docs: int = typer.Option(32, min=2, help="documents (one chunk each at the default --doc-tokens)"),
    doc_tokens: int = typer.Option(512, min=8, help="tokens per document, at most"),
    chunk_tokens: int = typer.Option(None, min=8, help="the chunker's budget (default: --doc-tokens, one chunk a "
                                     "document); smaller, documents are cut as a corpus is: chunks of this many "
                                     "tokens and up to twice that, to a sentence end"),
    runs: int = typer.Option(3, min=1, help="timed runs of ours and of transformers, interleaved (median)"),
    dtype: str = typer.Option("auto", help="compute dtype of both: auto, float32 or bfloat16"),
    peer_batch: int = typer.Option(8, min=1, help="chunks per call of transformers' batched forward"),
    beside: bool = typer.Option(True, "--beside/--no-beside", help="also time a decoding stream beside a compile"),
    batch_invariant: bool = typer.Option(None, "--batch-invariant/--no-batch-invariant",
                                         help="the engine's setting (default: the device's, README: Batch invariance)"),
    row_budget: int = typer.Option(None, min=16, help="the engine's rows a step (default: the device's); on CPU "
                                   "with batch invariance, the Linears' row tiles are probed up to it"),
    out: Path = Out,
    tag: str = Tag,
):
    """Compile tokens/s against transformers' forward over the same chunks; write rates; a decode's wait beside it."""
    from bench import compile as mod

    mod.run(model, docs, doc_tokens, runs, dtype, peer_batch, beside, out, tag, batch_invariant, row_budget,
            chunk_tokens)


@app.command()
def peers(
    model: str = Model,
    docs: int = typer.Option(6, min=1, help="documents in the prompt"),
    doc_tokens: int = typer.Option(650, help="tokens per document, at most (6 x 650: about 3.9k prompt tokens)"),
    runs: int = typer.Option(3, min=1, help="timed runs per peer, interleaved (median)"),
    decode_tokens: int = typer.Option(32, min=2, help="tokens per decode sample"),
    dtypes: str = typer.Option("float32,bfloat16", help="dtypes of ragcache and transformers"),
    algorithms: str = typer.Option("full,legolink-16,naive", help="ragcache algorithms"),
    only: str = typer.Option("ragcache,transformers,llama.cpp", "--peers",
                             help="which peers run (vllm, vllm-ragcache too: vLLM's own venv, RAGCACHE_VLLM_PYTHON)"),
    out: Path = Out,
    tag: str = Tag,
):
    """ragcache vs transformers (forward, cached decode) vs llama.cpp: same prompt ids, same model, one run."""
    from bench import peers as mod

    wanted = [p.strip() for p in only.split(",") if p.strip()]
    bad = [p for p in wanted if p not in mod.PEERS]
    if bad:
        raise typer.BadParameter(f"unknown peer(s) {bad}: {', '.join(mod.PEERS)}")
    kinds = [d.strip() for d in dtypes.split(",") if d.strip()]
    if not kinds or any(d not in ("float32", "bfloat16", "float16") for d in kinds):
        raise typer.BadParameter(f"--dtypes {dtypes!r}: float32, bfloat16, float16")
    mod.run(model, docs, doc_tokens, runs, decode_tokens, kinds, _variants(algorithms), wanted, out, tag)


@app.command()
def markdown(files: list[Path] = typer.Argument(..., help="result JSON files (bench/results/*.json)")):
    """Print result files as Markdown tables (what docs/BENCHMARKS.md quotes)."""
    import json

    from bench import accuracy as acc
    from bench import codecs as co
    from bench import lower_bound as lb
    from bench import peers as pe
    from bench import throughput as tp
    from bench import ttft as tt

    renderers = {"ttft": tt.markdown, "lower-bound": lb.markdown, "throughput": tp.markdown, "accuracy": acc.markdown,
                 "peers": pe.markdown, "codecs": co.markdown}
    for path in files:
        data = json.loads(path.read_text())
        render = renderers.get(data.get("benchmark"))
        if render is None:
            print(f"{path}: not a result of ttft, lower-bound, throughput, accuracy, codecs or peers\n")
            continue
        print(f"### {path.name}\n\n{render(data)}\n")


@app.command("slow-clients")
def slow_clients(
    model: str = Model,
    sockets: int = typer.Option(1030, min=1, help="connections that send half a request line, then nothing"),
    open_files: int = typer.Option(1024, min=64, help="the server's open-file limit (RLIMIT_NOFILE, soft and hard)"),
    seconds: float = typer.Option(40.0, min=1, help="how long /health is probed while they hang"),
    out: Path = Out,
    tag: str = Tag,
):
    """Slow-loris sockets against `ragcache serve` under an open-file limit: /health answers and latency, the
    server's open files, the sockets it closed, and how much its log grew."""
    from bench import slow_clients as mod

    mod.run(model, sockets, open_files, seconds, out, tag)


@app.command()
def refusals(
    model: str = Model,
    clients: int = typer.Option(4, min=1, help="processes that each send --each queries refused for length"),
    each: int = typer.Option(2, min=1, help="queries each of them sends, one after another"),
    texts: int = typer.Option(64, min=1, help="raw texts in each of those queries"),
    chars: int = typer.Option(200_000, min=1, help="characters of each raw text"),
    alone: int = typer.Option(3, min=1, help="times the small query is timed alone in each round, first"),
    rounds: int = typer.Option(5, min=1, help="rounds of refusals, each with its own timings alone"),
    max_tokens: int = typer.Option(8, min=1, help="tokens the small query generates"),
    out: Path = Out,
    tag: str = Tag,
):
    """Queries refused for length (12.8 MB bodies at the defaults) beside a small query: each refusal's time, the
    small query's time against its time alone, and the server's RSS peak against idle."""
    from bench import refusals as mod

    mod.run(model, clients, each, texts, chars, alone, max_tokens, rounds, out, tag)


@app.command()
def soak(
    model: str = Model,
    clients: int = typer.Option(8, min=1, help="concurrent clients, each on its own keep-alive connection"),
    minutes: float = typer.Option(10.0, min=0.1, help="how long the load runs"),
    distinct: int = typer.Option(28, min=1, help="distinct requests (each algorithm in turn), asked serially first"),
    pool: int = typer.Option(12, min=4, help="documents in the pool"),
    doc_tokens: int = typer.Option(128, help="tokens per document"),
    max_tokens: int = typer.Option(12, min=1, help="tokens generated per request"),
    abandon_every: int = typer.Option(10, min=0, help="every n-th request is a stream dropped after its first "
                                      "event (0: none)"),
    algorithms: str = typer.Option(",".join(("focus", "naive", "cacheblend", "legolink", "legolink0", "full",
                                             "prefix")), help="comma-separated"),
    redis_every: float = typer.Option(90.0, min=0, help="seconds between kills of the store's Redis (0: never)"),
    redis_down: float = typer.Option(20.0, min=0, help="seconds Redis stays down after each kill"),
    tamper_every: float = typer.Option(15.0, min=0, help="seconds between tamperings of a victim document's entries "
                                       "or records (0: none)"),
    new_text_every: int = typer.Option(0, min=0, help="every n-th request carries a new raw text (a pool document "
                                       "with its words shuffled), stored and compiled on the fly (0: none)"),
    prefix_cache_mib: int = typer.Option(None, min=0, help="the server's prefix cache (default: its own, 256 MiB)"),
    server_env: list[str] = typer.Option([], help="NAME=VALUE in the server's environment alone (repeatable), "
                                         "say LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"),
    out: Path = Out,
    tag: str = Tag,
):
    """Mixed algorithms from C clients for a fixed time, Redis killed and restarted, a victim document's entries and
    records tampered with: req/s, p50/p99, 5xx, connection errors, answers unlike the serial baseline, the
    server's RSS over time, and how each kind of tampering ended."""
    from bench import soak as mod

    names = tuple(a.strip() for a in algorithms.split(",") if a.strip())
    if bad := [a for a in names if a not in mod.ALGORITHMS]:
        raise typer.BadParameter(f"unknown algorithm(s) {bad}: {', '.join(mod.ALGORITHMS)}")
    if bad := [pair for pair in server_env if "=" not in pair]:
        raise typer.BadParameter(f"--server-env takes NAME=VALUE: {bad}")
    mod.run(model, clients, 60 * minutes, distinct, pool, doc_tokens, max_tokens, abandon_every, names, out, tag,
            redis_every, redis_down, tamper_every, new_text_every, prefix_cache_mib,
            dict(pair.split("=", 1) for pair in server_env))


@app.command()
def adapter(
    model: str = Model,
    path: Path = typer.Option(None, "--adapter", help="a link adapter directory (default: a random rank-16 LoRA of "
                                                      "the shape `ragcache train link` fits: the cost is the shape's)"),
    dtype: str = typer.Option("auto", help="auto | float32 | bfloat16"),
    runs: int = typer.Option(7, min=1, help="timed queries per engine (median), the engines taking turns"),
    algorithm: str = typer.Option("naive", help="the link the queries use"),
    new_tokens: int = typer.Option(32, min=2, help="tokens decoded per query"),
    engine: str = typer.Option("ragcache", help="ragcache (merged, beside, base) | vllm (merged, vLLM's LoRA, base; "
                                                "run from .venv-vllm)"),
    out: Path = Out,
    tag: str = Tag,
):
    """A link adapter merged into the weights or beside them, and the base model: TTFT and decode tok/s."""
    from bench import adapter as mod
    from bench.report import Run
    from ragcache.models import default_dtype

    dtype = default_dtype("cpu") if dtype == "auto" else dtype
    if engine not in ("ragcache", "vllm"):
        raise typer.BadParameter(f"--engine must be ragcache or vllm, got {engine!r}")
    bench = Run("adapter", dict(model=model, adapter=path, dtype=dtype, runs=runs, algorithm=algorithm,
                                new_tokens=new_tokens, engine=engine, tag=tag), out)
    result = mod.run(model, path, dtype, runs, algorithm, new_tokens, engine=engine)
    for name, row in result["median"].items():
        print(f"{name:>12}: ttft {row['ttft_s'] * 1000:.1f} ms, decode {row.get('decode_tok_s', 0):.1f} tok/s")
    if "base_weights_kept_mib" in result:
        print(f"merged: the adapted layers' base weights kept for compile take "
              f"{result['base_weights_kept_mib']:.0f} MiB (the model: {result['model_mib']:.0f} MiB)")
    bench.finish([result])


@app.command("squad-sample")
def squad_sample(n: int = typer.Option(20, "--n"), seed: int = typer.Option(0)):
    """Rewrite bench/data/squad_sample.jsonl from SQuAD v1.1 dev (downloads bigbench once)."""
    from bench import squad

    print(f"wrote {squad.write_sample(n=n, seed=seed)}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
