"""Decode steps with fixed shapes (ragcache.engine.graphs): the whole-pool step gives the tokens the ordinary decode gives,
with streams joining, leaving and finishing at different tokens, and its dummy rows leave every cache as it was.
On CUDA the same step is captured into a graph; here it runs eagerly (bench/gpu.py --check compares the replay)."""

from __future__ import annotations

import threading

import pytest
import torch

import ragcache.kernels as kernels
from ragcache.facade import RagCache
from ragcache.errors import ParameterOutOfRange
from ragcache.engine.sequence import Piece
from ragcache.settings import EngineConfig
from ragcache.store.memory import MemoryStore
from tests import tiny
from tests.hold import held

QUESTIONS = ["Where is the tower?", "Which mountain is the highest?", "When was it released?", "Where do rivers go?",
             "What is tall?"]


def engine(family: str, graphs: bool, compiled: bool = False) -> RagCache:
    rc = RagCache(tiny.make(family), MemoryStore(), EngineConfig(chunk_tokens=24, kv_codec="fp32",
                                                                 batch_invariant=False, decode_graphs=graphs,
                                                                 decode_compile=compiled))
    rc.doc_ids = rc.compile(tiny.CORPUS[:4])
    return rc


def answers(rc: RagCache, questions: list[str] = QUESTIONS, repair=lambda i: 0) -> list[list[int]]:
    """Streams opened together (so the pool holds several slots, some idle while others link), each asking for its
    own number of tokens (so they leave the pool at different steps) and `repair(i)` rows a step."""
    streams = [rc.stream(q, rc.doc_ids[i % 3: i % 3 + 2], algorithm="naive", max_new_tokens=3 + 2 * i,
                         repair=repair(i)) for i, q in enumerate(questions)]
    ended = [threading.Event() for _ in streams]
    with held(rc):
        for stream, end in zip(streams, ended):
            stream.open(lambda event, end=end: isinstance(event, Piece) or end.set())
    assert all(end.wait(120) for end in ended)
    return [stream.answer.token_ids for stream in streams]


@pytest.mark.parametrize("family", ["llama", "gemma3"])  # gemma3: sliding-window layers beside global ones
def test_whole_pool_steps_give_the_ordinary_decodes_tokens(family):
    plain, graphed = engine(family, False), engine(family, True)
    steps = []
    step = graphed.runner.graphs.step
    graphed.runner.graphs.step = lambda tokens, caches, repairs=(): steps.append(len(caches)) or step(tokens, caches, repairs)
    expected = answers(plain)
    assert answers(graphed) == expected
    assert any(n > 1 for n in steps), "no decode step ran through the whole-pool path with several streams"
    assert [len(tokens) for tokens in expected] == [3 + 2 * i for i in range(len(QUESTIONS))]  # none stopped early
    # a second round reuses the pool's slots (and the allocation's step) for new streams
    assert answers(graphed) == answers(plain)


def test_the_cuda_kernels_of_the_whole_pool_step_give_the_same_tokens(monkeypatch):
    """The step as CUDA runs it (the split-KV decode and the slot writes in Triton, here interpreted), with the
    rest of the engine as on CPU; gemma3 has windowed layers beside global ones."""
    from ragcache.kernels import triton_ops

    family = "gemma3"
    monkeypatch.setattr(triton_ops, "DECODE_PROGRAMS", 32)  # 2-4 splits of each row's keys, by the pool's slots
    calls = []
    for name in ("slot_decode_attention", "write_slot_rows"):
        monkeypatch.setattr(kernels, name, lambda *a, _f=getattr(triton_ops, name), **k: calls.append(1) or _f(*a, **k))
    plain, graphed = engine(family, False), engine(family, True)
    assert answers(graphed, QUESTIONS[:2]) == answers(plain, QUESTIONS[:2])  # two streams: interpreted, programs cost
    assert calls


def test_a_compiled_step_gives_the_same_tokens():
    """decode_compile: the step through torch.compile (inductor's CPU code here, fused Triton on CUDA) gives the
    same tokens, traced whole (no graph break, one graph) and reused by every step on the same pool."""
    from torch._dynamo.utils import counters

    plain, compiled = engine("llama", False), engine("llama", True, compiled=True)
    breaks, before = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
    for _ in range(2):  # the second round reuses the pool's allocation and its compiled step
        assert answers(compiled) == answers(plain)
    assert counters["stats"]["unique_graphs"] - before == 1
    assert sum(counters["graph_break"].values()) == breaks


def test_idle_slots_keep_their_caches():
    """A slot without a row in the step runs a dummy row that leaves its slot as it is."""
    rc = engine("llama", True)
    pool, graphs = rc.runner.pool, rc.runner.graphs
    caches = [rc.runner.new_cache(40) for _ in range(3)]
    for i, cache in enumerate(caches):
        cache.length = 10 + i
        cache.keys.normal_(generator=torch.Generator().manual_seed(i))
        cache.values.normal_(generator=torch.Generator().manual_seed(10 + i))
        rc.runner.adopt(cache)
    before = pool.keys.clone(), pool.values.clone()
    logits = graphs.step([5], [caches[1]])  # slot 1 alone
    assert logits.shape[0] == 1 and caches[1].length == 12 and [c.length for c in caches] == [10, 12, 12]
    changed = (pool.keys != before[0]).any(-1)  # [layers, slots, heads, capacity]
    assert changed[:, 1, :, 11].all() and changed.sum() == changed[:, 1, :, 11].sum()
    assert torch.equal(pool.values[:, [0, 2]], before[1][:, [0, 2]])
    for cache in caches:
        rc.runner.release(cache)


def test_graphs_need_the_pooled_decode():
    with pytest.raises(ParameterOutOfRange, match="pooled decode"):
        RagCache(tiny.make("llama"), MemoryStore(), EngineConfig(batch_invariant=True, decode_graphs=True))
    with pytest.raises(ParameterOutOfRange, match="turn decode_graphs on"):
        RagCache(tiny.make("llama"), MemoryStore(), EngineConfig(batch_invariant=False, decode_compile=True))
    with pytest.raises(ParameterOutOfRange, match=r"decode_eager runs .* turn decode_graphs on"):
        RagCache(tiny.make("llama"), MemoryStore(), EngineConfig(batch_invariant=False, decode_eager=True))
    eager = RagCache(tiny.make("llama"), MemoryStore(), EngineConfig(batch_invariant=False, decode_graphs=True,
                                                                     decode_eager=True))
    assert eager.runner.graphs is not None and not eager.runner.graphs.capture  # on CUDA too (bench/gpu.py --check)
    assert "decode_eager" in EngineConfig(engine="vllm", decode_eager=True).vllm_problem()
    # the default: graphs only on CUDA
    assert RagCache(tiny.make("llama"), MemoryStore(), EngineConfig(batch_invariant=False)).runner.graphs is None


def test_repair_lanes_in_the_whole_pool_step_give_the_packed_steps_tokens():
    """Several streams repairing at once, at different widths, beside streams that do not: their repair rows run in
    the whole-pool step, a lane each (lanes and rows rounded up, the spare ones idle), to the tokens the ordinary
    packed steps give."""
    plain, graphed = engine("llama", False), engine("llama", True)
    lanes, step = [], graphed.runner.graphs.step
    graphed.runner.graphs.step = lambda tokens, caches, repairs=(): lanes.append(len(repairs)) or step(
        tokens, caches, repairs
    )
    widths = lambda i: (0, 3, 8, 5, 0)[i]  # noqa: E731
    expected = answers(plain, repair=widths)
    assert answers(graphed, repair=widths) == expected
    assert max(lanes) == 3 and 0 in lanes  # three lanes side by side (a fourth idle); and steps with none


def test_a_capture_is_this_threads_alone_on_a_stream_of_its_own(monkeypatch):
    """Captures come mid-serve (the pool grows) while API threads copy entries: in torch's default capture mode
    their allocations invalidated the capture and every decoding stream failed; and a capture stream from the
    pool other threads' streams come from could be one they queue copies on. (Faked CUDA: the arguments only.)"""
    import contextlib
    from types import SimpleNamespace

    from ragcache.engine import graphs as graphs_module

    made, captured = [], []

    class Stream:
        def __init__(self, device=None, priority=0):
            made.append(priority)

        def wait_stream(self, other):
            pass

    @contextlib.contextmanager
    def graph(g, **kwargs):
        captured.append(kwargs)
        yield

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: SimpleNamespace())
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    current = object.__new__(Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    graphs = graphs_module.DecodeGraphs(runner=None, capture=True)
    graphs._forward = lambda pool, step: "logits"
    for _ in range(3):  # three captures (the pool grew twice): one stream for all
        graphs._capture(None, SimpleNamespace())
    assert made == [-1] and len(captured) == 3
    assert all(c["capture_error_mode"] == "thread_local" and isinstance(c["stream"], Stream) for c in captured)


def test_a_repair_lane_wider_than_a_captured_one_runs_its_step_eagerly(monkeypatch):
    """A client's repair width made a graph of any lane width (the whole prompt's rows, rounded up), whose memory
    stayed allocated with the pool; past CAPTURED_REPAIR_ROWS (its lanes' rows together) the step runs eagerly, to
    the same tokens."""
    from ragcache.engine import graphs as graphs_module

    monkeypatch.setattr(graphs_module, "CAPTURED_REPAIR_ROWS", 4)
    plain, graphed = engine("llama", False), engine("llama", True)
    captured = []
    graphed.runner.graphs.capture = True  # on CPU: the capture itself stands in, the step runs eagerly
    monkeypatch.setattr(graphed.runner.graphs, "_capture", lambda pool, step: captured.append(step.lanes))
    widths = lambda i: (0, 3, 8)[i % 3]  # noqa: E731
    assert answers(graphed, repair=widths) == answers(plain, repair=widths)
    # lanes of 2 rows, several at once: the step's rows, all its lanes', are what is bounded
    narrow = lambda i: (0, 2, 2)[i % 3]  # noqa: E731
    assert answers(graphed, repair=narrow) == answers(plain, repair=narrow)
    assert captured and all(lanes * rows <= 4 for lanes, rows in captured), captured


def _fake_capture(monkeypatch, capturing) -> None:
    """torch.cuda's streams and graphs as a capture on CPU meets them: `capturing` stands for torch.cuda.graph, and
    every graph made is the string "graph"."""
    import contextlib
    from types import SimpleNamespace

    stream = SimpleNamespace(wait_stream=lambda other: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda priority=0: stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: "graph")
    monkeypatch.setattr(torch.cuda, "graph", capturing)


def test_two_engines_capture_their_graphs_one_at_a_time(monkeypatch):
    """torch.cuda.graph's entry empties the allocator's cache, which fails while another thread captures: an engine
    capturing while another engine's model thread did failed its step's requests."""
    import contextlib
    import threading
    from types import SimpleNamespace

    from ragcache.engine import graphs as graphs_module

    under_way, refused, inside, release = [0], [], threading.Event(), threading.Event()

    @contextlib.contextmanager
    def capturing(graph, stream=None, capture_error_mode=None):
        if under_way[0]:  # what torch.cuda.empty_cache() raises during another thread's capture
            refused.append(True)
            raise RuntimeError("empty_cache while a capture is under way")
        under_way[0] += 1
        try:
            yield
        finally:
            under_way[0] -= 1

    _fake_capture(monkeypatch, capturing)
    first, second = (graphs_module.DecodeGraphs(runner=None, capture=True) for _ in range(2))

    def slow(pool, step):  # the first engine's capture lasts until released
        if under_way[0]:
            inside.set()
            assert release.wait(10)
        return torch.zeros(1)

    first._forward, second._forward = slow, lambda pool, step: torch.zeros(1)
    steps = [SimpleNamespace(logits=None, graph=None) for _ in range(2)]
    threads = [threading.Thread(target=g._capture, args=(None, step)) for g, step in zip((first, second), steps)]
    threads[0].start()
    assert inside.wait(10)
    threads[1].start()
    threads[1].join(0.3)
    release.set()
    for thread in threads:
        thread.join(10)
    assert not refused and [step.graph for step in steps] == ["graph", "graph"]


def test_no_collection_runs_while_a_decode_graph_is_captured(monkeypatch):
    """A finalizer the collector ran during a capture (a store entry's, store/arena.py) recorded its CUDA event into
    the graph; that event's query then failed for good and took the memory tier down."""
    import contextlib
    import gc
    from types import SimpleNamespace

    rc = engine("llama", True)
    graphs = rc.runner.graphs
    seen = []

    @contextlib.contextmanager
    def capturing(graph, stream=None, capture_error_mode=None):
        seen.append(gc.isenabled())
        yield

    _fake_capture(monkeypatch, capturing)
    monkeypatch.setattr(graphs, "_forward", lambda pool, step: torch.zeros(1))
    step = SimpleNamespace(logits=None, graph=None)
    graphs._capture(None, step)
    assert seen == [False] and gc.isenabled() and step.graph == "graph"

    def failing(pool, step):
        if len(seen) == 2:
            raise RuntimeError("capture failed")
        return torch.zeros(1)

    monkeypatch.setattr(graphs, "_forward", failing)
    with pytest.raises(RuntimeError, match="capture failed"):
        graphs._capture(None, SimpleNamespace(logits=None, graph=None))
    assert gc.isenabled()  # given back on the way out of a failed capture too
