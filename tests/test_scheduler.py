"""The scheduler batches requests without changing any of them: a request batched with others gives the same
greedy text and the same last-token logits (fp32 tolerance) as the same request alone.

Batches are made deterministic by holding the model thread (tests/hold.py): requests are opened while it runs a
call of the test's, so they are all taken in at its next pass; joins and cancellations happen from a request's own
listener, on the model thread, at a known token. The scheduler's own policy is tested without any thread at the
end of this file."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ragcache import errors, kernels
from ragcache.facade import RagCache
from ragcache.settings import EngineConfig
from ragcache.engine.sampling import Decoding, QueryStats, Sampling
from ragcache.kernels import torch_ref
from ragcache.linker import ALGORITHMS, LinkInput, LinkParams
from ragcache.engine.scheduler import Kind, Scheduler, StepResult
from ragcache.engine.sequence import Aborted, Done, Failed, Piece, Sequence, Status
from ragcache.store.memory import MemoryStore
from tests import tiny
from tests.hold import held

DOCS = [
    "The Eiffel Tower is in Paris. It was completed in 1889 and is 330 metres tall. Rivers flow to the sea.",
    "Mount Everest is the highest mountain on Earth. It lies in the Himalayas! Rain falls on hills.",
    "Python is a programming language. It was first released in 1991? Yes. The water returns.",
]
QUESTIONS = ["Which mountain is the highest?", "When was Python released?", "How tall is the tower?",
             "Where do rivers flow?"]
ATOL = 2e-4
PARAMS = {"cacheblend": {"ratio": 0.3}, "legolink": {"k": 4}}


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def rc(request):
    # a small row budget so that `full`/`prefix` links run in several pieces, interleaved with other requests
    rc = RagCache(tiny.make(request.param), MemoryStore(), EngineConfig(chunk_tokens=24, row_budget=16))
    rc.doc_ids = rc.compile(DOCS)
    return rc


class Run:
    """One sequence opened on the engine, with the kinds of the events it received (on the model thread)."""

    def __init__(self, rc: RagCache, on_event=None, **kwargs):
        self.stream = rc.stream(**kwargs)
        self.kinds: list[type] = []
        self.finished = threading.Event()
        self.on_event = on_event

    def open(self) -> "Run":
        self.stream.open(self._event)
        return self

    def _event(self, event) -> None:
        self.kinds.append(type(event))
        if self.on_event is not None:
            self.on_event(self, type(event))
        if not isinstance(event, Piece):
            self.error = event.error if isinstance(event, Failed) else None
            self.finished.set()

    def wait(self) -> "Run":
        assert self.finished.wait(300), "the engine did not finish the request"
        return self

    @property
    def text(self) -> str:
        return self.stream.answer.text

    @property
    def logits(self) -> torch.Tensor:
        return self.stream.answer.first_logits


def ask(rc: RagCache, algorithm: str = "legolink", question: int = 0, docs: slice = slice(None), **kwargs) -> dict:
    return {"question": QUESTIONS[question], "docs": rc.doc_ids[docs], "algorithm": algorithm, "max_new_tokens": 6,
            **PARAMS.get(algorithm, {}), **kwargs}


def together(rc: RagCache, runs: list[Run]) -> list[Run]:
    """Open every run while the model thread is held, so they are admitted at the same step; then let it go.
    (Their chunks must be in the store already: compiling is model work, held too.)"""
    with held(rc):
        for run in runs:
            run.open()
    return [run.wait() for run in runs]


def alone(rc: RagCache, **kwargs) -> Run:
    """The request by itself (ungated: it may compile what it misses, and later batched runs find it stored)."""
    return Run(rc, **kwargs).open().wait()


def assert_same(batched: Run, single: Run) -> None:
    assert batched.kinds[-1] is Done and single.kinds[-1] is Done
    assert batched.stream.answer.token_ids == single.stream.answer.token_ids
    assert batched.text == single.text
    torch.testing.assert_close(batched.logits, single.logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_batched_equals_alone_for_each_algorithm(rc, algorithm):
    others = [ask(rc, "full", 1, slice(0, 2)), ask(rc, "naive", 2, slice(1, 3))]
    steps = rc.driver.stats.steps
    singles = [alone(rc, **ask(rc, algorithm))] + [alone(rc, **kw) for kw in others]
    steps_alone, steps = rc.driver.stats.steps - steps, rc.driver.stats.steps
    batched = together(rc, [Run(rc, **ask(rc, algorithm))] + [Run(rc, **kw) for kw in others])
    assert rc.driver.stats.steps - steps < steps_alone  # they did share steps
    for b, s in zip(batched, singles):
        assert_same(b, s)


def test_mixed_batch(rc):
    """Algorithms, prompt lengths and sampling settings in one batch."""
    asks = [ask(rc, "full", 0, slice(0, 3), max_new_tokens=8),
            ask(rc, "legolink", 1, slice(0, 1), temperature=0.8, seed=3),
            ask(rc, "cacheblend", 2, slice(1, 3), temperature=1.2, top_p=0.9, seed=11),
            ask(rc, "prefix", 3, slice(2, 3), max_new_tokens=3),
            ask(rc, "legolink0", 0, slice(0, 2), stop=["e"]),
            ask(rc, "naive", 1, slice(0, 3), temperature=0.5, seed=5, max_new_tokens=10)]
    singles = [alone(rc, **kw) for kw in asks]
    for b, s in zip(together(rc, [Run(rc, **kw) for kw in asks]), singles):
        assert_same(b, s)


def test_repairing_requests_batched_equal_alone(rc, monkeypatch):
    """Repair pieces ride their sequence's decode steps, cut as it alone cuts them, and two that do not fit the row
    budget together (16) take turns, each with its decode row: with batch invariance the answers are the same
    packed with others as alone."""
    kwargs = [ask(rc, "naive", 0, repair=8, max_new_tokens=12), ask(rc, "focus", 1, slice(0, 2), repair=12),
              ask(rc, "full", 2, slice(1, 3))]
    singles = [alone(rc, **k) for k in kwargs]
    left_out, decodes = [], Scheduler._decodes

    def spy(self, decoding):
        work = decodes(self, decoding)
        left_out.append(len(decoding) - sum(w.kind is Kind.DECODE for w in work))
        return work

    monkeypatch.setattr(Scheduler, "_decodes", spy)
    for batched, single in zip(together(rc, [Run(rc, **k) for k in kwargs]), singles):
        assert_same(batched, single)
    assert max(left_out) == 1  # a repair sat a step out


def test_a_request_joins_while_another_decodes(rc):
    first, second = ask(rc, "full", 0, slice(0, 3), max_new_tokens=12), ask(rc, "legolink", 2, slice(0, 2))
    single_first, single_second = alone(rc, **first), alone(rc, **second)
    tokens_first = len(single_first.stream.answer.token_ids)
    assert tokens_first >= 3, "the test needs a first request that decodes a few tokens"
    joiner = Run(rc, **second)

    def join_at_second_token(run: Run, kind: str) -> None:
        if kind is Piece and len(run.stream.decoding.token_ids) >= 2 and not joiner.kinds:
            joiner.kinds.append("opened")
            joiner.open()  # on the model thread: admitted at the next step, while `run` is decoding

    decoding = Run(rc, on_event=join_at_second_token, **first).open().wait()
    joiner.wait()
    assert joiner.kinds and Done in joiner.kinds
    assert_same(decoding, single_first)
    assert_same(joiner, single_second)


def test_a_task_queued_while_another_runs_waits_for_the_next_step(rc):
    """Two callers running task after task (calibration's passes, a benchmark's timings) always have one queued while
    one runs. Tasks and the requests' steps take turns, so a decoding stream goes on between them instead of waiting
    for both."""
    seen = []

    def task_like(runner, left: int) -> None:  # as if another caller queued its next task meanwhile
        seen.append(len(run.stream.decoding.token_ids))
        if left:
            queue_task(left - 1)

    def queue_task(left: int) -> None:  # from the model thread: taken in at its next pass
        Sequence(rc.driver, lambda stats, cancelled: (None, None, None), None,
                 task=lambda runner: task_like(runner, left)).open(lambda event: None)

    def start_at_first_token(run: Run, kind: str) -> None:
        if kind is Piece and not seen:
            queue_task(3)

    run = Run(rc, on_event=start_at_first_token, **ask(rc, "full", 0, slice(0, 3), max_new_tokens=12))
    run.open().wait()
    assert len(run.stream.answer.token_ids) >= 5, "the test needs a request that decodes through the tasks"
    assert len(seen) == 4 and seen == sorted(seen) and len(set(seen)) == 4, (seen, run.kinds)  # a step between every two


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_each_algorithm_joins_while_others_decode(rc, algorithm):
    """Every algorithm admitted while three requests decode (cacheblend links in a NARROW step of its own)."""
    decoders = [ask(rc, "naive", 0, slice(0, 3), max_new_tokens=24), ask(rc, "full", 1, slice(0, 2), max_new_tokens=24),
                ask(rc, "legolink", 3, slice(0, 3), max_new_tokens=24)]
    joining = ask(rc, algorithm, 2, slice(1, 3), max_new_tokens=6)
    singles = [alone(rc, **kw) for kw in decoders]
    single_joiner = alone(rc, **joining)
    joiner = Run(rc, **joining)

    def join_when_three_decode(run: Run, kind: str) -> None:
        decoding = sum(r.status is Status.DECODING for r in rc.scheduler.running)
        if kind is Piece and decoding == 3 and not joiner.kinds:
            joiner.kinds.append("opened")
            joiner.open()  # on the model thread: admitted at the next step, while the others decode

    runs = together(rc, [Run(rc, on_event=join_when_three_decode, **kw) for kw in decoders])
    assert joiner.kinds, "the three requests never decoded at the same time"
    joiner.wait()
    assert joiner.kinds[-1] is Done, getattr(joiner, "error", None)
    assert_same(joiner, single_joiner)
    for run, single in zip(runs, singles):
        assert_same(run, single)


def test_a_request_cancelled_in_the_middle_of_a_batch(rc):
    asks = [ask(rc, "legolink", 0, max_new_tokens=10), ask(rc, "full", 1, max_new_tokens=10), ask(rc, "naive", 2)]
    singles = [alone(rc, **kw) for kw in asks]
    assert len(singles[1].stream.answer.token_ids) >= 3, "the test needs a middle request that decodes"

    def cancel_at_second_token(run: Run, kind: str) -> None:
        if kind is Piece and len(run.stream.decoding.token_ids) >= 2:
            run.stream.cancel()

    runs = [Run(rc, **asks[0]), Run(rc, on_event=cancel_at_second_token, **asks[1]), Run(rc, **asks[2])]
    together(rc, runs)
    tokens = len(runs[1].stream.decoding.token_ids)
    assert runs[1].kinds[-1] is Aborted and 2 <= tokens < len(singles[1].stream.answer.token_ids) + 1
    assert_same(runs[0], singles[0])
    assert_same(runs[2], singles[2])
    assert not rc.scheduler.running and not rc.scheduler.waiting


def fail_once(monkeypatch, owner, name: str, message: str) -> list:
    """`owner.name` raises RuntimeError(message) on its first call and works after it; the calls, as they come."""
    method, calls = getattr(owner, name), []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError(message)
        return method(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)
    return calls


def test_a_failed_step_fails_only_the_requests_in_it(rc, monkeypatch):
    """Two links admitted together, the row budget spent on the first one's piece: a step that fails (out of
    memory, say) fails the request whose rows it held; the other, whose cache it never touched, goes on."""
    asks = [ask(rc, "full", 0, slice(0, 3)), ask(rc, "full", 1, slice(0, 3))]
    single = alone(rc, **asks[1])
    fail_once(monkeypatch, rc.runner, "forward", "out of memory in this step")
    first, second = together(rc, [Run(rc, **asks[0]), Run(rc, **asks[1])])
    assert first.kinds == [Failed] and "out of memory" in str(first.error)
    assert_same(second, single)


def test_a_step_whose_inputs_fail_fails_only_the_requests_in_it(rc, monkeypatch):
    """As a failed forward: a decode row whose cache cannot join the pool (out of memory as the pool grows) fails
    the step's requests, never one the step passed over."""
    asks = [ask(rc, "naive", 0, slice(0, 1), max_new_tokens=6), ask(rc, "full", 1, slice(0, 3)),
            ask(rc, "full", 2, slice(0, 3))]
    singles = [alone(rc, **kw) for kw in asks[1:]]
    fail_once(monkeypatch, rc.runner, "adopt", "out of memory growing the pool")
    first, *links = together(rc, [Run(rc, **kw) for kw in asks])
    assert first.kinds[-1] is Failed and "growing the pool" in str(first.error)
    survived = [(run, single) for run, single in zip(links, singles) if run.kinds[-1] is not Failed]
    assert survived  # the link piece the step passed over (the budget was spent) goes on
    for run, single in survived:
        assert_same(run, single)


def test_a_cache_that_fails_to_be_released_still_lets_every_request_end(rc, monkeypatch):
    """Requests that end in one step: a release that raises for the first must not keep the others' last events
    (their callers would wait forever)."""
    asks = [ask(rc, "naive", q, slice(0, 2), max_new_tokens=3) for q in range(2)]
    calls = fail_once(monkeypatch, rc.runner, "release", "release failed")
    runs = [Run(rc, **kw) for kw in asks]
    with held(rc):  # admitted together, they end in the same step
        for run in runs:
            run.open()
    assert all(run.finished.wait(60) for run in runs), "a request never got its last event"
    assert calls and all(run.kinds[-1] is Done for run in runs)


def test_a_decoding_request_lets_go_of_what_it_read_from_the_store(rc):
    """Once linked, the chunks' K/V are in the request's cache: the entries it read are not held for its decode."""
    held = []

    def at_first_token(run: Run, kind: str) -> None:
        if kind is Piece and not held:
            held.append((run.stream.parts, run.stream.plan))

    run = Run(rc, on_event=at_first_token, **ask(rc, "naive", 0, slice(0, 3), max_new_tokens=4))
    run.open().wait()
    assert held == [(None, None)]


def test_sixteen_threads_query_at_once(rc):
    asks = [ask(rc, ALGORITHMS[i % len(ALGORITHMS)], i % len(QUESTIONS), slice(i % 3, 3)) for i in range(16)]
    expected = [rc.query(**kw).text for kw in asks]
    barrier = threading.Barrier(16)

    def query(kw: dict) -> str:
        barrier.wait()
        return rc.query(**kw).text

    with ThreadPoolExecutor(16) as pool:
        assert list(pool.map(query, asks)) == expected


def test_a_bad_request_fails_alone(rc):
    good = [ask(rc, "legolink", 0), ask(rc, "full", 1)]
    singles = [alone(rc, **kw) for kw in good]
    runs = [Run(rc, **good[0]), Run(rc, **good[1])]
    failed: list = []
    # a sequence the engine rejects when it admits it (past the one check before the queue, ragcache.request)
    parts, _, prefix_cache = rc._prepare(rc.validate(QUESTIONS[2], rc.doc_ids, link=rc.params("legolink")), 4, QueryStats())
    decoding = Decoding(Sampling(4), rc.tokenizer, rc.stop_ids, rc.runner.device)
    bad = Sequence(rc.driver, lambda stats, cancelled: (parts, LinkParams("magic"), prefix_cache), decoding)
    with held(rc):
        runs[0].open()
        bad.open(failed.append)
        runs[1].open()
    for run, single in zip(runs, singles):
        assert_same(run.wait(), single)
    assert len(failed) == 1 and isinstance(failed[0], Failed) and bad.status is Status.FAILED
    assert isinstance(failed[0].error, errors.UnknownAlgorithm)
    # a prompt of no tokens (a caller of Sequence that built it by hand) had no row to run: it stayed linking for
    # ever, and the model thread spun on a step it could never plan
    empty = Sequence(rc.driver, lambda stats, cancelled: (LinkInput([], [], []), LinkParams("full"), None), decoding)
    empty.open(failed.append)
    deadline = time.monotonic() + 30
    while len(failed) < 2:
        assert time.monotonic() < deadline, empty.status
        time.sleep(0.01)
    assert isinstance(failed[1].error, errors.EmptyInput) and empty.status is Status.FAILED

    with ThreadPoolExecutor(3) as pool:  # through the public API: an unknown document fails only its own query
        futures = [pool.submit(rc.query, **good[0]), pool.submit(rc.query, QUESTIONS[0], ["0" * 32]),
                   pool.submit(rc.query, **good[1])]
        with pytest.raises(errors.UnknownDocument):
            futures[1].result()
        assert [futures[0].result().text, futures[2].result().text] == [s.text for s in singles]


@pytest.mark.parametrize("window", [None, 1, 5, 40])
def test_pooled_decode_attention_equals_each_request_alone(window):
    """One call over a pool of caches of different lengths (free slots in between) == each row over its own cache."""
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, capacity = 6, 2, 16, 48
    keys = torch.randn(5, kv_heads, capacity, dim, generator=generator)
    values = torch.randn(5, kv_heads, capacity, dim, generator=generator)
    slots, lengths = torch.tensor([3, 0, 4]), [31, 7, 46]  # slots 1 and 2 are free
    positions = torch.tensor([n - 1 for n in lengths])
    query = torch.randn(heads, len(lengths), dim, generator=generator)
    first_key = 0 if window is None else max(int(positions.min()) - window + 1, 0)
    end = int(positions.max()) + 1
    pooled = kernels.pooled_decode_attention(query, keys[:, :, first_key:end], values[:, :, first_key:end], slots,
                                             positions, 0.25, window, first_key)
    to_capacity = kernels.pooled_decode_attention(query, keys[:, :, first_key:], values[:, :, first_key:], slots,
                                                  positions, 0.25, window, first_key, end_key=end)
    torch.testing.assert_close(to_capacity, pooled, atol=1e-6, rtol=0)
    for i, (slot, length) in enumerate(zip(slots.tolist(), lengths)):
        own_keys, own_values = keys[slot, :, :length], values[slot, :, :length]
        row, at = query[:, i : i + 1], positions[i : i + 1]
        alone = kernels.selected_attention(row, own_keys, own_values, at, 0.25, window, contiguous_from=length - 1)
        torch.testing.assert_close(pooled[i : i + 1], alone, atol=1e-5, rtol=0)
        torch.testing.assert_close(pooled[i : i + 1], torch_ref.reference_attention(row, own_keys, own_values, at, 0.25,
                                                                                    window), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_pooled_decode_attention_in_half_precision_is_within_its_tolerance(dtype):
    """The reduced-precision path (eager math on CPU) against the fp32 reference over each row's own cache."""
    generator = torch.Generator().manual_seed(1)
    keys, values = (torch.randn(4, 2, 48, 16, generator=generator) for _ in range(2))
    slots, positions = torch.tensor([2, 0, 3]), torch.tensor([39, 5, 20])
    query = torch.randn(6, 3, 16, generator=generator)
    for end_key in (None, 40):  # the block as passed, or the pool's whole capacity with the last key to read
        pooled = kernels.pooled_decode_attention(query.to(dtype), keys.to(dtype), values.to(dtype), slots, positions,
                                                 0.25, end_key=end_key)
        assert pooled.dtype == dtype
        for i, (slot, at) in enumerate(zip(slots.tolist(), positions.tolist())):
            expected = torch_ref.reference_attention(query[:, i : i + 1], keys[slot, :, : at + 1],
                                                     values[slot, :, : at + 1], positions[i : i + 1], 0.25)
            torch.testing.assert_close(pooled[i : i + 1].float(), expected, atol=3e-2, rtol=0)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_pooled_bf16_step_equals_each_row_over_its_own_cache(family, monkeypatch):
    """The bf16 decode step through the runner (the pool read to its capacity, eager attention on CPU) against
    each row alone over a private copy of its cache, at the bf16 tolerance of tests/test_invariants.py."""
    from ragcache.engine.runner import Runner

    calls = []
    pooled_attention = kernels.pooled_decode_attention
    monkeypatch.setattr(kernels, "pooled_decode_attention",
                        lambda *a: calls.append(a[0].shape[1]) or pooled_attention(*a))

    runner = Runner(tiny.make(family, dtype=torch.bfloat16), batch_invariant=False)
    generator = torch.Generator().manual_seed(2)
    lengths, tokens = [7, 30, 19], torch.tensor([5, 11, 17])
    pooled, alone = [], []
    for length in lengths:
        cache = runner.new_cache(length + 1)
        cache.keys.copy_(torch.randn(cache.keys.shape, generator=generator))
        cache.values.copy_(torch.randn(cache.values.shape, generator=generator))
        cache.length = length + 1
        twin = runner.new_cache(length + 1)
        twin.keys.copy_(cache.keys), twin.values.copy_(cache.values)
        twin.length = length + 1
        runner.pool.adopt(cache)
        pooled.append(cache), alone.append(twin)
    with torch.inference_mode():
        together = runner.logits(runner.forward(tokens, [(c, torch.tensor([n])) for c, n in zip(pooled, lengths)])[0])
        each = [runner.logits(runner.forward_rows(tokens[i : i + 1], torch.tensor([n]), alone[i])[0])[0]
                for i, n in enumerate(lengths)]
    for cache in pooled:
        runner.pool.release(cache)
    assert calls and max(calls) == len(lengths), "the rows were not attended in one pooled call"
    for got, expected in zip(together, each):
        assert int(got.argmax()) == int(expected.argmax())
        torch.testing.assert_close(got, expected, atol=0.03 * float(expected.abs().max()), rtol=0)


def test_pooled_decode_equals_a_decode_loop_over_private_caches(rc, monkeypatch):
    """Streams of different prompt lengths decoding together in the pool (one attention call per layer for their
    rows; gemma3's sliding layers included) give the tokens of a greedy loop over each request's own cache."""
    from ragcache.engine.kv import KVPool

    monkeypatch.setattr(rc.runner, "batch_invariant", False)  # the shared pool serves the opted-out path
    monkeypatch.setattr(rc.runner, "pool", KVPool(rc.runner.shape, rc.runner.device))
    asks = [ask(rc, "legolink", 0, slice(0, 3), max_new_tokens=8), ask(rc, "naive", 1, slice(1, 3), max_new_tokens=8),
            ask(rc, "legolink0", 2, slice(0, 2), max_new_tokens=8)]
    expected = [greedy_loop(rc, kw) for kw in asks]  # first: it also compiles what the batch needs (held there)
    calls = []
    pooled = kernels.pooled_decode_attention
    monkeypatch.setattr(kernels, "pooled_decode_attention", lambda *a: calls.append(a[0].shape[1]) or pooled(*a))
    runs = together(rc, [Run(rc, **kw) for kw in asks])
    assert calls and max(calls) == len(asks), "the decode rows were not attended in one call"
    assert not rc.runner.pool.members and rc.runner.pool.keys is None  # every slot freed, the pool with them
    for run, tokens in zip(runs, expected):
        answer = run.stream.answer.token_ids
        assert len(answer) >= 3 and answer == tokens[: len(answer)]


def greedy_loop(rc: RagCache, kw: dict) -> list[int]:
    """Greedy tokens of a request linked alone (its cache never enters the pool), one forward per token."""
    linked = rc.link(kw["question"], kw["docs"], algorithm=kw["algorithm"], max_new_tokens=kw["max_new_tokens"],
                     **PARAMS.get(kw["algorithm"], {}))
    cache, tokens = linked.cache, [int(linked.last_logits.argmax())]
    with torch.inference_mode():
        while len(tokens) < kw["max_new_tokens"]:
            cache.length += 1
            hidden = rc.runner.forward_rows(torch.tensor(tokens[-1:]), torch.tensor([cache.length - 1]), cache)
            tokens.append(int(rc.runner.logits(hidden[0, -1:])[0].argmax()))
    return tokens


def test_reduced_precision_matmuls_run_at_a_bounded_set_of_row_counts(monkeypatch):
    """On CPU in bf16 torch keeps a compiled kernel per matmul row count with no bound, and every packed step has its
    own count: not batch-invariant, the runner's Linears run at bucketed counts (at most 12.5% padding), and give the
    rows' own results (batch-invariant, at its few row tiles: test_batch_invariance)."""
    from ragcache.engine.invariant import row_bucket
    from ragcache.engine.runner import Runner

    assert [row_bucket(n) for n in (1, 32, 33, 100, 137, 512, 513)] == [1, 32, 36, 104, 144, 512, 576]
    assert len({row_bucket(n) for n in range(1, 4097)}) == 88
    assert all(n <= row_bucket(n) <= 1.125 * n for n in range(1, 4097))
    lm = tiny.make("llama", dtype=torch.bfloat16)
    weight = lm.model.model.layers[0].mlp.up_proj.weight.detach().clone()
    Runner(lm, batch_invariant=False), Runner(lm, batch_invariant=False)  # a second runner does not wrap again
    seen = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, *a, **k: seen.append(x.shape[-2]) or linear(x, *a, **k))
    x = torch.randn(1, 45, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        got = lm.model.model.layers[0].mlp.up_proj(x)
        torch.testing.assert_close(got, linear(x, weight))  # bf16 tolerance: the GEMM may block by rows
    assert got.shape == (1, 45, 128) and seen == [48]


def test_a_spent_cache_does_not_keep_the_pool_alive():
    """A cache released from the pool holds nothing of it: a caller may keep a spent cache (its Linked result, a
    stream its client left), and a view would keep the whole pool's memory after the pool moved on (a server's
    memory grew by the pool's size every time it was reallocated)."""
    from ragcache.engine.runner import Runner

    runner = Runner(tiny.make("llama"), batch_invariant=False)
    caches = [runner.new_cache(8) for _ in range(3)]
    for cache in caches:
        cache.length = 5
        runner.pool.adopt(cache)
    pool_storage = runner.pool.keys.untyped_storage().data_ptr()
    for cache in caches:
        runner.pool.release(cache)
    assert runner.pool.keys is None
    for cache in caches:
        assert cache.length == 0 and cache.keys.shape == (4, 2, 0, 16) and cache.values.shape == (4, 2, 0, 16)
        assert cache.keys._base is None and cache.values._base is None
        assert pool_storage not in (cache.keys.untyped_storage().data_ptr(), cache.values.untyped_storage().data_ptr())


def test_a_reused_pool_slot_holds_nothing_of_its_last_tenant():
    """A slot's next tenant reads its whole capacity (masked past its length): whatever the last tenant left there,
    a NaN from an fp16 overflow included, must not reach the new request's attention."""
    from ragcache.engine.runner import Runner

    runner = Runner(tiny.make("llama"), batch_invariant=False)
    first, keeper = runner.new_cache(40), runner.new_cache(40)
    first.length = keeper.length = 30
    runner.pool.adopt(first)
    runner.pool.adopt(keeper)  # the pool stays allocated after `first` leaves
    runner.pool.keys[:, first.slot].fill_(float("nan"))
    runner.pool.values[:, first.slot].fill_(float("nan"))
    runner.pool.release(first)
    second = runner.new_cache(40)
    second.keys.normal_()
    second.values.normal_()
    second.length = 3
    runner.pool.adopt(second)
    assert second.slot == 0
    assert torch.isfinite(runner.pool.keys[:, 0]).all() and torch.isfinite(runner.pool.values[:, 0]).all()
    query = torch.randn(4, 1, 16)
    out = kernels.pooled_decode_attention(query, runner.pool.keys[0], runner.pool.values[0], torch.tensor([0]),
                                          torch.tensor([2]), 0.25, end_key=runner.pool.keys.shape[3])
    assert torch.isfinite(out).all()


def test_stop_fails_what_is_queued_and_refuses_what_comes_after():
    """A driver that stops fails the tasks and requests it had not finished with ShuttingDown (a 503), and
    refuses new ones: before, they waited forever on a thread that was gone."""
    import time

    rc, held, release = busy_engine()
    driver = rc.driver
    queued_task = in_daemon(rc.with_runner, lambda runner: "ran")
    queued_query = in_daemon(rc.query, QUESTIONS[0], [{"text": DOCS[0]}])  # its document's compile queues too
    deadline = time.monotonic() + 30
    while len(driver.arrivals) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(driver.arrivals) >= 2
    stopping = in_daemon(driver.stop, 60)
    while not driver._stopping:
        time.sleep(0.01)
    release.set()
    assert held.result(60) == "held"  # the task in progress finishes
    stopping.result(60)
    with pytest.raises(errors.ShuttingDown):
        queued_task.result(60)
    with pytest.raises(errors.ShuttingDown):
        queued_query.result(60)
    with pytest.raises(errors.ShuttingDown):
        rc.with_runner(lambda runner: "late")
    with pytest.raises(errors.ShuttingDown):
        rc.query(QUESTIONS[1], [{"text": DOCS[1]}])


def test_a_stop_that_gives_up_waiting_still_fails_what_was_queued():
    """`stop` waits a while for the step in progress; past that it returns, and the model thread, once the step
    ends, fails what was queued itself (ShuttingDown) instead of leaving its callers waiting."""
    rc, held, release = busy_engine()
    driver = rc.driver
    queued = in_daemon(rc.with_runner, lambda runner: "ran")
    while len(driver.arrivals) < 1:
        threading.Event().wait(0.01)
    driver.stop(timeout=0.1)  # the held task is still running: stop gives up waiting
    assert not queued.done()
    release.set()
    held.result(60)
    with pytest.raises(errors.ShuttingDown):
        queued.result(30)


def test_a_stop_just_after_the_thread_ended_idle_fails_what_is_left_once():
    """The thread ending idle and a `stop` landing before it has left: one of them fails what is left, not both
    (two `fail_all`s of the scheduler from two threads at once)."""
    rc = RagCache(tiny.make("llama"), MemoryStore(), EngineConfig(chunk_tokens=24))
    driver, calls, ended = rc.driver, [], threading.Event()
    wait_for_work, fail_unfinished = driver._wait_for_work, driver._fail_unfinished

    def idle_then_stopped():
        state = wait_for_work()
        if state not in (True, "work"):  # ended idle: the stop comes in before the thread reads why
            driver.stop()
            ended.set()
        return state

    driver._wait_for_work = idle_then_stopped
    driver._fail_unfinished = lambda: calls.append(threading.current_thread().name) or fail_unfinished()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("ragcache.engine.driver.IDLE_EXIT_S", 0.05)
        assert rc.with_runner(lambda runner: "ran") == "ran"
        assert ended.wait(30)
        while driver._thread is not None or len(calls) < 1:
            threading.Event().wait(0.01)
        threading.Event().wait(0.2)
    assert len(calls) == 1


def test_two_stops_failing_what_is_left_at_once_fail_each_sequence_once():
    """The thread that stopped and a second `stop` (two closes, a close and atexit) both fail what is left: each
    sequence hears one last event, not one from each (their cache given back twice)."""
    import time
    from types import SimpleNamespace

    from ragcache.engine.sequence import Output, Status

    rc = RagCache(tiny.make("llama"), MemoryStore(), EngineConfig(chunk_tokens=24))
    scheduler, heard = rc.driver.scheduler, []
    left = [SimpleNamespace(cache=None, receive=lambda out, i=i: heard.append(i)) for i in range(3)]
    scheduler.waiting.extend(left)
    fail_all = scheduler.fail_all

    def slowly(error):  # the queues read, then a moment before they are emptied
        held = list(scheduler.waiting)
        time.sleep(0.1)
        fail_all(error)
        return [(s, Output(status=Status.FAILED, error=error)) for s in held]

    scheduler.fail_all = slowly
    both = [threading.Thread(target=rc.driver._fail_unfinished) for _ in range(2)]
    for t in both:
        t.start()
    for t in both:
        t.join(30)
    assert sorted(heard) == [0, 1, 2]
    rc.close()


def in_daemon(fn, *args):
    """fn(*args) on a daemon thread, as a Future: a caller a regression leaves waiting must not hang the test run."""
    from concurrent.futures import Future

    future = Future()

    def run():
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            future.set_exception(exc)

    threading.Thread(target=run, daemon=True).start()
    return future


def busy_engine():
    """(an engine, the Future of the task its model thread is running, the Event that ends that task)."""
    rc = RagCache(tiny.make("llama"), MemoryStore(), EngineConfig(chunk_tokens=24))
    entered, release = threading.Event(), threading.Event()

    def hold(runner):
        entered.set()
        release.wait(60)
        return "held"

    held = in_daemon(rc.with_runner, hold)
    assert entered.wait(60)
    return rc, held, release


# -- the scheduler alone: plain sequences, no model, no thread ----------------------------------------------------
class FakePlan:
    """What the scheduler reads of a link plan: its rows, whether it narrows, its cache."""

    def __init__(self, rows: int, narrow=None):
        self.rows, self.narrow, self.cache = torch.arange(rows), narrow, FakeCache()


class FakeCache:
    length, capacity = 0, 1 << 20


class FakeDecoding:
    def __init__(self, tokens: int):
        self.sampling, self.token_ids = Sampling(tokens), []

    @property
    def finished(self) -> bool:
        return len(self.token_ids) >= self.sampling.max_new_tokens


def sequence(tokens: int | None = 4, background: bool = False, **kinds) -> Sequence:
    return Sequence(None, None, FakeDecoding(tokens) if tokens else None, background=background, **kinds)


def run_plan(scheduler: Scheduler, plan, link_rows: dict, fail=()) -> list:
    """Execute a plan as the runner would, without a model: PLACE gives each sequence a plan of `link_rows[seq]`
    rows, a row that needs logits samples token 7 (counted on its FakeDecoding)."""
    from ragcache.engine.sampling import Step

    results = []
    for work in plan.work:
        seq = work.sequence
        if seq in fail:
            results.append(StepResult(error=RuntimeError("failed")))
        elif work.kind is Kind.PLACE:
            results.append(StepResult(plan=FakePlan(*link_rows[seq])))
        elif work.kind is Kind.TASK:
            results.append(StepResult(result=seq.task(None)))
        elif work.ends_link and seq.compile is not None:
            results.append(StepResult(result=seq.compile(seq.plan.cache)))
        elif work.needs_logits:
            if seq.decoding is not None:
                seq.decoding.token_ids.append(7)
            results.append(StepResult(linked="linked" if work.ends_link else None,
                                      step=Step(7, "x") if seq.decoding is not None else None))
        else:
            results.append(StepResult())
    return scheduler.update(plan, results)


def shape(plan) -> list:
    return [(w.kind.value, w.start, w.stop) for w in plan.work]


def test_schedule_places_first_then_packs_decode_rows_before_link_pieces_in_the_budget():
    scheduler = Scheduler(row_budget=16)
    a, b, c = sequence(), sequence(), sequence(tokens=None)
    for s in (a, b, c):
        scheduler.add(s)
    rows = {a: (3,), b: (40,), c: (10,)}
    place = scheduler.schedule()
    assert place.kind is Kind.PLACE and [w.sequence for w in place.work] == [a, b, c]
    assert run_plan(scheduler, place, rows) == [] and all(s.status is Status.LINKING for s in (a, b, c))
    first = scheduler.schedule()
    # the fewest pending rows first: a and c whole, b the rest of the budget
    assert [(w.sequence, w.start, w.stop) for w in first.work] == [(a, 0, 3), (c, 0, 10), (b, 0, 3)]
    outputs = run_plan(scheduler, first, rows)
    assert [(s, o.linked) for s, o in outputs] == [(a, "linked"), (c, "linked")] and a.status is Status.DECODING
    assert outputs[0][1].step.token_id == 7 and c not in scheduler.running  # c decodes nothing: it is done
    second = scheduler.schedule()
    assert shape(second) == [("decode", 0, 0), ("piece", 3, 18)]  # a's decode row first, 15 rows left for b
    run_plan(scheduler, second, rows)
    third = scheduler.schedule()
    assert shape(third) == [("decode", 0, 0), ("piece", 18, 33)]
    outputs = run_plan(scheduler, third, rows)
    assert [s for s, o in outputs] == [a] and b.pending_rows == 7


def test_while_nothing_waits_on_the_step_a_link_takes_the_link_row_budget():
    """Nothing waits on a step's length until a stream decodes or a link has ended in it: then no more rows join
    past the row budget. A short request queued behind a long link goes first and has its first token after a row
    budget's step."""
    scheduler = Scheduler(row_budget=16, link_row_budget=64)
    a, b = sequence(tokens=3), sequence()
    for s in (a, b):
        scheduler.add(s)
    rows = {a: (3,), b: (100,)}
    run_plan(scheduler, scheduler.schedule(), rows)
    first = scheduler.schedule()
    assert shape(first) == [("piece", 0, 3), ("piece", 0, 13)]  # a's link ends here: b only to the row budget
    run_plan(scheduler, first, rows)
    assert shape(scheduler.schedule()) == [("decode", 0, 0), ("piece", 13, 28)]  # a decodes: 15 rows left for b
    alone = Scheduler(row_budget=16, link_row_budget=64)
    c = sequence()
    alone.add(c)
    run_plan(alone, alone.schedule(), {c: (100,)})
    first = alone.schedule()
    assert shape(first) == [("piece", 0, 64)]  # the step ends no link: c takes the whole link budget
    run_plan(alone, first, {c: (100,)})
    d = sequence()  # a short request arrives behind c's long link
    alone.add(d)
    run_plan(alone, alone.schedule(), {d: (3,)})  # its PLACE step
    second = alone.schedule()
    assert [(w.sequence, w.start, w.stop) for w in second.work] == [(d, 0, 3), (c, 64, 77)]  # d first; the step
    assert second.rows <= 16  # ends a link, so it holds no more than the row budget: d's first token after it
    assert [s for s, o in run_plan(alone, second, {})] == [d]
    assert Scheduler(row_budget=16, batch_invariant=True, link_row_budget=64).link_row_budget == 16


def test_a_stream_of_short_links_never_starves_a_long_one():
    """Shortest first, but a link passed over MAX_PASSED_OVER steps in a row goes first in the next: a bulk compile
    keeping two budgets of one-chunk compiles in flight (each shorter than any query's link) does not starve a
    query's link, and no compile waits long either."""
    scheduler = Scheduler(row_budget=16)
    query = sequence(tokens=None)
    scheduler.add(query)
    run_plan(scheduler, scheduler.schedule(), {query: (100,)})
    run_plan(scheduler, scheduler.schedule(), {})  # its first piece, before any compile arrives
    ran, in_flight, waited = [], {}, []
    for step in range(15):
        arriving = [sequence(tokens=None) for _ in range(4 - len(in_flight))]  # topped up to 32 rows of compiles
        for s in arriving:
            scheduler.add(s)
            in_flight[s] = step
        if arriving:
            run_plan(scheduler, scheduler.schedule(), {s: (8,) for s in arriving})
        plan = scheduler.schedule()
        assert plan.rows <= 16
        ran.append(any(w.sequence is query for w in plan.work))
        for s, _ in run_plan(scheduler, plan, {}):
            waited.append(step - in_flight.pop(s))
    assert all(any(ran[i : i + 3]) for i in range(len(ran) - 2)), ran  # the query's link: at least every third step
    assert not any(ran[:2]) and max(waited) <= 3  # (the compiles, shorter, first); none waits more than 3 steps


def test_batch_invariant_pieces_are_cut_where_the_sequence_alone_would_cut_them():
    scheduler = Scheduler(row_budget=16, batch_invariant=True)
    a, b = sequence(tokens=8), sequence()
    for s in (a, b):
        scheduler.add(s)
    rows = {a: (2,), b: (40,)}
    run_plan(scheduler, scheduler.schedule(), rows)
    run_plan(scheduler, scheduler.schedule(), rows)  # a's 2 rows; b's first whole piece of 16 is not cut to 14
    assert (a.status, b.linked_rows) == (Status.DECODING, 0)
    step = scheduler.schedule()
    assert shape(step) == [("decode", 0, 0), ("piece", 0, 16)]  # the first piece goes past the budget by a row


def test_a_narrowing_link_runs_in_a_step_of_its_own():
    scheduler = Scheduler(row_budget=16)
    a, b = sequence(), sequence()
    for s in (a, b):
        scheduler.add(s)
    run_plan(scheduler, scheduler.schedule(), {a: (5, "narrow"), b: (5,)})
    first = scheduler.schedule()  # after a PLACE, a forward step: b's rows, never a's (they wait for their NARROW)
    assert shape(first) == [("piece", 0, 5)] and first.work[0].sequence is b
    run_plan(scheduler, first, {})
    narrow = scheduler.schedule()
    assert narrow.kind is Kind.NARROW and shape(narrow) == [("narrow", 0, 0)] and narrow.work[0].sequence is a
    outputs = run_plan(scheduler, narrow, {})
    assert outputs[0][1].linked == "linked" and a.plan is None and a.status is Status.DECODING
    assert shape(scheduler.schedule()) == [("decode", 0, 0), ("decode", 0, 0)]


def kinds_beside(scheduler: Scheduler, stream: Sequence, steps: int, arrive_every: int) -> list[str]:
    """What the next `steps` steps are ("decode" where the stream has its row), a narrowing link arriving every
    `arrive_every` steps (and linked by its NARROW step)."""
    kinds, narrowing = [], {}
    for step in range(steps):
        if step % arrive_every == 0:
            newcomer = sequence(tokens=None)
            scheduler.add(newcomer)
            narrowing[newcomer] = (5, "narrow")
        plan = scheduler.schedule()
        kinds.append("decode" if any(w.sequence is stream for w in plan.work) else plan.kind.value)
        run_plan(scheduler, plan, narrowing)
    return kinds


def test_narrowing_links_take_turns_with_a_decoding_stream():
    """Each NARROW step runs every chunk row of its prompt: a stream decoding beside narrowing links placed
    together, or arriving every second step, waits for one such step at a time, and the narrowing links and the
    arrivals take turns too."""
    scheduler, stream = decoding_beside(Scheduler(row_budget=16))
    placed = [sequence(tokens=None) for _ in range(3)]
    for s in placed:
        scheduler.add(s)
    run_plan(scheduler, scheduler.schedule(), dict.fromkeys(placed, (5, "narrow")))
    kinds = [scheduler.schedule() for _ in range(6)]
    for plan in kinds:
        run_plan(scheduler, plan, {})
    names = ["decode" if any(w.sequence is stream for w in p.work) else p.kind.value for p in kinds]
    assert names == ["decode", "narrow", "decode", "narrow", "decode", "narrow"]

    scheduler, stream = decoding_beside(Scheduler(row_budget=16), tokens=64)
    kinds = kinds_beside(scheduler, stream, steps=12, arrive_every=2)
    assert all(kinds[i] == "decode" or kinds[i + 1] == "decode" for i in range(len(kinds) - 1)), kinds
    assert kinds.count("narrow") >= 2 and kinds.count("place") >= 2, kinds


def test_background_sequences_wait_for_a_step_no_user_needs_and_run_on_the_base_weights():
    scheduler = Scheduler(row_budget=16)
    user, guard = sequence(tokens=2), sequence(tokens=None, background=True)
    scheduler.add(guard)
    scheduler.add(user)
    place = scheduler.schedule()
    assert [w.sequence for w in place.work] == [user] and not place.base_weights
    rows = {user: (4,), guard: (4,)}
    run_plan(scheduler, place, rows)
    while user.status is not Status.FINISHED:
        plan = scheduler.schedule()
        assert all(w.sequence is user for w in plan.work)
        for seq, output in run_plan(scheduler, plan, rows):
            if output.status is not None:
                seq.status = output.status  # as the sequence does when the driver hands it its output
    place = scheduler.schedule()
    assert [w.sequence for w in place.work] == [guard] and place.base_weights
    run_plan(scheduler, place, rows)
    link = scheduler.schedule()
    assert shape(link) == [("piece", 0, 4)] and link.base_weights
    assert [(s, o.status) for s, o in run_plan(scheduler, link, rows)] == [(guard, Status.FINISHED)]
    assert not scheduler.has_work()


def test_a_failed_work_or_an_abort_takes_out_only_its_own_sequence():
    scheduler = Scheduler(row_budget=16)
    a, b, c = sequence(), sequence(), sequence()
    for s in (a, b, c):
        scheduler.add(s)
    outputs = run_plan(scheduler, scheduler.schedule(), {a: (3,), b: (3,), c: (3,)}, fail=(b,))
    assert [(s, o.status, type(o.error)) for s, o in outputs] == [(b, Status.FAILED, RuntimeError)]
    assert [(s, o.status) for s, o in scheduler.abort(c)] == [(c, Status.ABORTED)]
    assert scheduler.abort(c) == []  # over already: nothing to take out
    assert scheduler.running == [a] and shape(scheduler.schedule()) == [("piece", 0, 3)]


def test_a_compile_packs_with_the_others_and_ends_with_its_entry_and_no_logits():
    scheduler = Scheduler(row_budget=16)
    user, compile = sequence(tokens=3), sequence(tokens=None, compile=lambda cache: "entry")
    for s in (user, compile):
        scheduler.add(s)
    rows = {user: (4,), compile: (20,)}
    run_plan(scheduler, scheduler.schedule(), rows)
    first = scheduler.schedule()
    assert shape(first) == [("piece", 0, 4), ("piece", 0, 12)]  # packed: the user's link ends, 12 rows left
    assert [w.needs_logits for w in first.work] == [True, False]
    run_plan(scheduler, first, rows)
    last = scheduler.schedule()
    assert shape(last) == [("decode", 0, 0), ("piece", 12, 20)] and not last.work[1].needs_logits
    outputs = run_plan(scheduler, last, rows)
    assert [(s, o.status, o.result) for s, o in outputs if s is compile] == [(compile, Status.FINISHED, "entry")]
    assert scheduler.running == [user]


def test_rows_on_the_base_weights_take_turns_with_the_others():
    """A compile on an adapted model runs the base weights: never in a step with adapted rows. While a stream
    decodes (or an adapted link waits) the two kinds of step alternate, so the stream waits one step of compile
    rows at a time and the compile is never starved."""
    scheduler = Scheduler(row_budget=16)
    user, compile = sequence(tokens=20), sequence(tokens=None, compile=lambda cache: "entry", base_weights=True)
    for s in (user, compile):
        scheduler.add(s)
    rows = {user: (2,), compile: (40,)}
    run_plan(scheduler, scheduler.schedule(), rows)
    kinds = []
    while compile.status is not Status.FINISHED:
        plan = scheduler.schedule()
        assert len({w.sequence.base_weights for w in plan.work}) == 1
        assert plan.base_weights == plan.work[0].sequence.base_weights
        kinds.append("base" if plan.base_weights else "user")
        for seq, output in run_plan(scheduler, plan, rows):
            if output.status is not None:
                seq.status = output.status
    assert kinds == ["user", "base", "user", "base", "user", "base"], kinds  # 16 + 16 + 8 compile rows
    alone = Scheduler(row_budget=16)
    only = sequence(tokens=None, compile=lambda cache: "entry", base_weights=True)
    alone.add(only)
    run_plan(alone, alone.schedule(), {only: (10,)})
    assert alone.schedule().base_weights  # nothing else waits: its step at once


def test_tasks_take_turns_with_the_requests_steps():
    scheduler = Scheduler(row_budget=16)
    user = sequence(tokens=10)
    scheduler.add(user)
    run_plan(scheduler, scheduler.schedule(), {user: (2,)})
    ran = []
    for n in range(3):
        scheduler.add(sequence(tokens=None, task=lambda runner, n=n: ran.append(n) or n))
    kinds = []
    for _ in range(6):
        plan = scheduler.schedule()
        kinds.append(plan.kind.value)
        outputs = run_plan(scheduler, plan, {})
        if plan.kind is Kind.TASK:
            assert [(o.status, o.result) for _, o in outputs] == [(Status.FINISHED, ran[-1])]
    assert kinds == ["task", "piece", "task", "piece", "task", "piece"] and ran == [0, 1, 2]
    assert scheduler.abort(user) and not scheduler.has_work()


def decoding_beside(scheduler: Scheduler, tokens: int = 8) -> tuple[Scheduler, Sequence]:
    """The scheduler with one stream placed, linked and decoding (`tokens` long)."""
    stream = sequence(tokens=tokens)
    scheduler.add(stream)
    run_plan(scheduler, scheduler.schedule(), {stream: (2,)})
    run_plan(scheduler, scheduler.schedule(), {})
    assert stream.status is Status.DECODING
    return scheduler, stream


def test_arrivals_faster_than_steps_take_turns_with_a_decoding_stream():
    """A request arriving during every step: each is placed, but never two PLACE steps in a row while a stream
    decodes, or the stream would wait for as long as the arrivals keep coming."""
    scheduler, stream = decoding_beside(Scheduler(row_budget=16))
    kinds, arrived = [], {}
    for _ in range(6):
        newcomer = sequence(tokens=None)
        scheduler.add(newcomer)
        arrived[newcomer] = (1,)
        plan = scheduler.schedule()
        kinds.append((plan.kind.value, any(w.sequence is stream for w in plan.work)))
        run_plan(scheduler, plan, arrived)
    assert kinds == [("place", False), ("piece", True)] * 3


def test_a_longer_cache_grows_the_pools_capacity_not_its_slot_count():
    """Slots double when a join finds none free; a cache longer than the pool's capacity that fits a free slot
    keeps the count (it doubled too: twice the memory, and on CUDA twice the rows of every graph-replayed step)."""
    from ragcache.engine.kv import JoinedCache, KVPool, ModelShape

    pool = KVPool(ModelShape(2, 1, 4, torch.float32), torch.device("cpu"))

    def joined(capacity):
        cache = JoinedCache(2, 1, 4, capacity, torch.float32, "cpu")
        cache.length = 3
        pool.adopt(cache)
        return cache

    caches = [joined(64) for _ in range(3)]
    assert pool.keys.shape[1] == 4
    pool.release(caches[1])
    joined(5000)
    assert pool.keys.shape[1] == 4 and pool.keys.shape[3] >= 5000
    joined(64)
    joined(64)  # no slot free: doubled
    assert pool.keys.shape[1] == 8


def test_a_sequence_runs_once_and_a_second_iteration_is_an_error_not_a_hang(rc):
    """Iterating a finished stream again re-ran it over its first run's rows and tokens: the scheduler found no row
    pending, never stepped it, and the caller waited forever. It is an error that says to ask again."""
    stream = rc.stream(QUESTIONS[0], rc.doc_ids[:1], max_new_tokens=2)
    assert "".join(stream)
    with pytest.raises(RuntimeError, match="opened already"):
        list(stream)


def test_a_task_or_a_listener_that_raises_system_exit_fails_alone_and_the_engine_goes_on():
    """A SystemExit (or asyncio's CancelledError) got past every handler on the model thread: the thread ended,
    the driver still named it, and every later request waited forever."""
    import sys

    rc = RagCache(tiny.make("llama"), MemoryStore(), EngineConfig(chunk_tokens=24))
    with pytest.raises(SystemExit):
        rc.with_runner(lambda runner: sys.exit(3))
    stream = rc.stream(QUESTIONS[0], [{"text": DOCS[0]}], max_new_tokens=2)

    def listener(event):
        raise SystemExit(4)

    stream.open(listener)
    assert rc.with_runner(lambda runner: "still here") == "still here"
    assert rc.query(QUESTIONS[1], [{"text": DOCS[1]}], max_new_tokens=2).text is not None
    rc.close()


def test_a_listener_that_raises_on_the_last_piece_still_hears_the_end_and_a_refused_submit_fails():
    """One step's output may carry the last token and the end: a listener raising on its piece skipped the end (the
    sequence stayed DECODING, its caller never heard Done)."""
    from ragcache.engine.sequence import Done, Piece, Status

    rc = RagCache(tiny.make("llama"), MemoryStore(), EngineConfig(chunk_tokens=24))
    events, ended = [], threading.Event()

    def listener(event):
        events.append(type(event))
        if isinstance(event, Piece):
            raise ValueError("a caller's bug")
        ended.set()

    stream = rc.stream(QUESTIONS[0], [{"text": DOCS[0]}], max_new_tokens=1)
    stream.open(listener)
    assert ended.wait(60) and events[-1] is Done and stream.status is Status.FINISHED, events
    assert Piece in events  # the listener did raise (a token decoding to no text would send no piece)

    refused = rc.stream(QUESTIONS[0], [{"text": DOCS[0]}], max_new_tokens=1)

    def stopping(sequence):
        raise RuntimeError("the engine is stopping")

    rc.driver.submit = stopping
    with pytest.raises(RuntimeError, match="stopping"):
        refused.open(lambda event: None)
    assert refused.status is Status.FAILED  # not WAITING, for a request never handed over
    del rc.driver.submit
    rc.close()


def _three_streams_together(rc, ids, draw=None):
    """Two greedy streams and a seeded sampling one, opened together so that their rows share steps; each with its
    last event as `last`."""
    from ragcache.engine.sequence import Piece
    from tests.hold import held

    streams = [rc.stream(q, ids[i : i + 1], max_new_tokens=6) for i, q in enumerate(QUESTIONS[:2])]
    streams.append(rc.stream(QUESTIONS[2], ids[2:3], max_new_tokens=6, temperature=1.0, seed=3))
    ended = [threading.Event() for _ in streams]

    def listener(stream, end):
        return lambda event: isinstance(event, Piece) or (setattr(stream, "last", event), end.set())

    with held(rc):
        for stream, end in zip(streams, ended):
            stream.open(listener(stream, end))
    assert all(end.wait(120) for end in ended)
    return streams


def test_a_steps_tokens_reach_the_host_in_one_copy(monkeypatch):
    """On a GPU each stream's own int(...) waited for the device in turn: a step's greedy rows are reduced together
    and its sampling streams' draws stay on the device until the step copies every token at once. Each stream's
    tokens are still its own alone, the seeded sampling stream's included."""
    from ragcache.engine import sampling

    rc = RagCache(tiny.make("llama"), MemoryStore(), EngineConfig(chunk_tokens=24))
    ids = rc.compile(DOCS[:3])
    alone = [rc.query(q, ids[i : i + 1], max_new_tokens=6).token_ids for i, q in enumerate(QUESTIONS[:2])]
    alone.append(rc.query(QUESTIONS[2], ids[2:3], max_new_tokens=6, temperature=1.0, seed=3).token_ids)
    waits, draws, sample, draw = [], [], sampling.sample, sampling.Decoding.draw
    monkeypatch.setattr(sampling, "sample", lambda logits, s, g: waits.append(s.temperature) or sample(logits, s, g))
    monkeypatch.setattr(sampling.Decoding, "draw", lambda self, logits: draws.append(1) or draw(self, logits))
    streams = _three_streams_together(rc, ids)
    assert [stream.answer.token_ids for stream in streams] == alone
    assert len(draws) >= 5 and len(waits) <= 1  # decode steps drew on the device; at most a link's first token alone
    rc.close()


def test_a_steps_tokens_are_one_copy_to_the_host(monkeypatch):
    """`_tokens` over a step's rows: none read back on their own (an int() or item() a stream waits for the device
    on a GPU), one tolist for all; each token the one its sequence would have taken alone."""
    from types import SimpleNamespace

    from ragcache.engine.runner import _tokens
    from ragcache.engine.sampling import Decoding, Sampling, sample

    rows = torch.randn(5, 50)
    asks = [None, {}, dict(temperature=1.0, seed=1), dict(temperature=0.7, top_p=0.9, seed=2), {}]
    sequences = [
        SimpleNamespace(decoding=None if ask is None else Decoding(Sampling(**ask), None, set(), torch.device("cpu")))
        for ask in asks
    ]
    expected = [None] + [
        sample(row, Sampling(**ask), torch.Generator().manual_seed(ask["seed"]) if "seed" in ask else None)
        for row, ask in zip(rows[1:], asks[1:])
    ]
    reads = []
    for name in ("tolist", "item", "__int__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, real=real, name=name: reads.append(name) or real(self, *a))
    tokens = _tokens(rows, sequences)
    monkeypatch.undo()
    assert reads == ["tolist"] and tokens == expected
    only_sampled = [sequences[2]]
    sequences[2].decoding.generator.manual_seed(1)
    assert _tokens(rows[2:3], only_sampled) == [expected[2]]  # no argmax where no stream is greedy


def test_a_draw_that_raises_fails_its_own_stream_only(monkeypatch):
    from ragcache.engine import sampling
    from ragcache.engine.sequence import Status

    rc = RagCache(tiny.make("llama"), MemoryStore(), EngineConfig(chunk_tokens=24))
    ids = rc.compile(DOCS[:3])

    def broken(self, logits):
        raise RuntimeError("invalid multinomial distribution")

    monkeypatch.setattr(sampling.Decoding, "draw", broken)
    monkeypatch.setattr(sampling, "sample", lambda logits, s, g: broken(None, logits))
    streams = _three_streams_together(rc, ids)
    assert [s.status for s in streams] == [Status.FINISHED, Status.FINISHED, Status.FAILED]
    assert all(len(s.answer.token_ids) == 6 for s in streams[:2])
    rc.close()


def test_logits_that_make_no_distribution_fail_their_own_stream_without_drawing_from_them(monkeypatch):
    """NaN or infinity in a sampled stream's logits (a float16 model overflowing): on CUDA multinomial's check of them
    is a device-side assert that ends every stream after it, so the draw never reaches it; that stream fails with
    NonFiniteLogits (a 500 naming the cause), the others finish."""
    from ragcache.engine import sampling
    from ragcache.engine.sequence import Status
    from ragcache.errors import NonFiniteLogits

    seen, multinomial = [], torch.multinomial
    monkeypatch.setattr(torch, "multinomial", lambda p, *a, **k: seen.append(bool(p.isfinite().all())) or multinomial(p, *a, **k))
    hot = sampling.Sampling(temperature=1.0, top_p=0.9)
    for bad in (float("nan"), float("inf")):
        logits = torch.zeros(50)
        logits[7] = bad
        assert int(sampling.draw(logits, hot, torch.Generator().manual_seed(0))) == sampling.NOT_DRAWN
    fine = torch.randn(50)
    assert int(sampling.draw(fine, hot, torch.Generator().manual_seed(0))) == int(
        sampling.draw(fine, hot, torch.Generator().manual_seed(0))) != sampling.NOT_DRAWN
    assert all(seen)
    rc = RagCache(tiny.make("llama"), MemoryStore(), EngineConfig(chunk_tokens=24))
    ids = rc.compile(DOCS[:3])
    draw = sampling.Decoding.draw
    monkeypatch.setattr(sampling.Decoding, "draw", lambda self, logits: draw(self, logits.fill_(float("nan"))))
    sample = sampling.sample
    monkeypatch.setattr(sampling, "sample", lambda logits, s, g: sample(logits.clone().fill_(float("nan")), s, g))
    streams = _three_streams_together(rc, ids)
    assert [s.status for s in streams] == [Status.FINISHED, Status.FINISHED, Status.FAILED]
    assert isinstance(streams[2].last.error, NonFiniteLogits) and all(seen)
    rc.close()


def test_greedy_logits_with_nan_or_infinity_fail_their_own_stream_too():
    """A greedy stream took the argmax of a NaN row (NaN's index) and streamed garbage where a sampled one failed."""
    from types import SimpleNamespace

    from ragcache.engine.runner import _tokens
    from ragcache.errors import NonFiniteLogits

    rows = torch.zeros(4, 50)
    rows[:, 4] = 1.0
    rows[1, 7], rows[2, 9] = float("nan"), float("inf")
    greedy = [SimpleNamespace(decoding=SimpleNamespace(greedy=True)) for _ in range(3)]
    tokens = _tokens(rows, [*greedy, SimpleNamespace(decoding=None)])
    assert tokens[0] == 4 and tokens[3] is None
    assert isinstance(tokens[1], NonFiniteLogits) and isinstance(tokens[2], NonFiniteLogits)
    # a link's first token (a NARROW step's, an exact prefix-cache hit's) is drawn alone, the same way
    from ragcache.engine import sampling

    greedy_alone = sampling.Sampling(temperature=0.0)
    assert sampling.sample(rows[0], greedy_alone, None) == 4
    with pytest.raises(NonFiniteLogits):
        sampling.sample(rows[1], greedy_alone, None)


def test_a_step_out_of_device_memory_fails_its_requests_with_a_retryable_error_and_the_engine_goes_on(monkeypatch):
    """torch's OutOfMemoryError (a long link beside many streams on a GPU) was a 500 for every request of the step:
    it is OutOfDeviceMemory, a 503 with Retry-After, and the next request is answered."""
    from ragcache.api.errors import describe
    from ragcache.engine.sequence import Status
    from ragcache.errors import OutOfDeviceMemory

    rc = RagCache(tiny.make("llama"), MemoryStore(), EngineConfig(chunk_tokens=24))
    ids = rc.compile(DOCS[:3])
    forward, calls = rc.runner.forward, []

    def out_of_memory(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # a step some way in, streams decoding
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return forward(*args, **kwargs)

    monkeypatch.setattr(rc.runner, "forward", out_of_memory)
    streams = _three_streams_together(rc, ids)
    failed = [s.last.error for s in streams if s.status is Status.FAILED]
    assert failed and all(isinstance(e, OutOfDeviceMemory) for e in failed)
    assert describe(failed[0])[0] == 503 and "retry" in describe(failed[0])[1]["error"]["message"]
    tb = failed[0].__cause__.__traceback__  # torch's error: its frames let go of the step's tensors
    while tb.tb_next is not None:
        tb = tb.tb_next
    assert tb.tb_frame.f_code.co_name == "out_of_memory" and not tb.tb_frame.f_locals
    monkeypatch.undo()
    assert len(rc.query(QUESTIONS[0], ids[:1], max_new_tokens=3).token_ids) == 3
    rc.close()


def test_a_link_that_runs_a_step_out_of_device_memory_fails_alone_and_the_streams_beside_it_decode_on(
    rc, monkeypatch
):
    """A request arriving while another decodes, its link rows packed with the decode row, and the step out of
    device memory: the link fails with OutOfDeviceMemory (503), and the decode row runs again without it, so the
    stream goes on with the tokens it has alone."""
    from ragcache.errors import OutOfDeviceMemory

    first, second = ask(rc, "full", 0, slice(0, 3), max_new_tokens=12), ask(rc, "full", 2, slice(0, 2))
    single = alone(rc, **first)
    forward, armed, raised = rc.runner.forward, [], []

    def out_of_memory(token_ids, parts, *args, **kwargs):
        if armed and not raised and len(parts) > 1:  # the step holding both: the decode row and the link's
            raised.append(len(parts))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return forward(token_ids, parts, *args, **kwargs)

    monkeypatch.setattr(rc.runner, "forward", out_of_memory)
    joiner = Run(rc, **second)

    def join_at_second_token(run: Run, kind: str) -> None:
        if kind is Piece and len(run.stream.decoding.token_ids) >= 2 and not joiner.kinds:
            joiner.kinds.append("opened")
            armed.append(1)
            joiner.open()

    decoding = Run(rc, on_event=join_at_second_token, **first).open().wait()
    joiner.wait()
    assert raised and joiner.kinds[-1] is Failed and isinstance(joiner.error, OutOfDeviceMemory)
    assert_same(decoding, single)


def test_a_prefix_link_under_way_when_the_budget_changes_stays_out_of_the_cleared_cache(monkeypatch):
    """set_row_budgets clears the prefix cache to cut at the new budget from then on: a `prefix` link placed before
    it, its pieces cut at the old one, must not put its K/V and logits into the cleared cache (a later exact repeat
    would take logits no cold run at the new budget gives)."""
    from ragcache import linker

    rc = RagCache(tiny.make("llama"), MemoryStore(), EngineConfig(chunk_tokens=24))
    ask = dict(algorithm="prefix", max_new_tokens=1)
    rc.query(QUESTIONS[0], [{"text": DOCS[0]}], **ask)
    assert len(rc.prefix_cache._prompts) == 1  # a link the budget did not change under is kept
    plan = linker.plan

    def budget_changed_after_placing(*args, **kwargs):
        placed = plan(*args, **kwargs)
        rc.prefix_cache.clear()  # what set_row_budgets does, between this link's steps
        return placed

    monkeypatch.setattr(linker, "plan", budget_changed_after_placing)
    rc.query(QUESTIONS[1], [{"text": DOCS[1]}], **ask)
    assert len(rc.prefix_cache._prompts) == 0
    rc.close()


def test_a_place_step_runs_no_more_pre_pass_rows_than_the_budget_holds():
    """Focus's question pre-pass runs the model in the PLACE step: arrivals are placed in order while their
    pre-pass rows fit the budget (one at least), so a burst of them never holds a decoding stream for longer
    than a budgeted step; algorithms without a pre-pass (naive here, a chunk's compile) are placed together."""
    from ragcache.linker import LinkInput, LinkParams

    def arrival(algorithm: str, question: int) -> Sequence:
        s = sequence(tokens=None)
        s.parts = LinkInput([], [[1, 2, 3]], list(range(question)))
        s.params = LinkParams(algorithm=algorithm)
        return s

    scheduler, _ = decoding_beside(Scheduler(row_budget=16))
    focus = [arrival("focus", 6) for _ in range(3)] + [arrival("focus", 20)]
    naive = [arrival("naive", 20) for _ in range(3)]
    for s in (*focus, *naive):
        scheduler.add(s)
    assert [s.place_rows for s in (focus[0], focus[3], naive[0])] == [6, 20, 0]
    placed = []
    for _ in range(10):
        plan = scheduler.schedule()
        if plan.kind is Kind.PLACE:
            placed.append([w.sequence for w in plan.work])
        run_plan(scheduler, plan, {s: (1,) for s in (*focus, *naive)})
    # 6 + 6 fit 16, a third would not; 20 alone is past the budget yet goes (one at least), and what costs nothing
    # more goes with it (a chunk's compile, a naive link: their placing runs no model rows)
    assert placed == [focus[:2], [focus[2]], [focus[3], *naive]]


def test_a_requests_wait_for_the_engine_is_the_time_from_its_hand_over_to_its_first_step():
    """QueryStats.wait_s, which the API reports as queue_s and ragcache_queue_wait_seconds: here the model thread
    is held by a task for half a second after the query is handed over. (The API measured the wait for an
    admission slot, which is granted or refused at once: it read about 0 under any load.)"""
    import time

    from api.native import query_response

    rc = RagCache(tiny.make("llama"), MemoryStore(), EngineConfig(chunk_tokens=24))
    rc.query(QUESTIONS[0], [])  # its system prefix compiled: the next one waits for nothing but the engine
    entered, release = threading.Event(), threading.Event()
    in_daemon(rc.with_runner, lambda runner: entered.set() or release.wait(60))
    assert entered.wait(60)
    queued = in_daemon(rc.query, QUESTIONS[0], [])
    deadline = time.monotonic() + 30
    while len(rc.driver.arrivals) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.5)
    release.set()
    waited = queued.result(60)
    assert 0.5 <= waited.stats.wait_s <= waited.stats.ttft_s
    assert query_response(waited).timings.queue_s == waited.stats.wait_s
    assert rc.query(QUESTIONS[0], []).stats.wait_s < 0.5  # nothing ahead of it
    rc.close()


def test_a_run_of_tasks_does_not_give_the_heap_back_at_every_step(monkeypatch):
    """Tasks are not counted as the requests' steps: the heap's trim, every TRIM_EVERY_STEPS steps, counts them
    apart (a calibration's tasks once each paid a trim while the requests' count sat at a multiple of it)."""
    from ragcache.engine import driver

    trims: list[int] = []
    monkeypatch.setattr(driver, "return_free_memory", lambda: trims.append(1))
    rc = RagCache(tiny.make("llama"), MemoryStore(), EngineConfig(chunk_tokens=24))
    try:
        for _ in range(10):
            rc.with_runner(lambda runner: None)
    finally:
        rc.close()
    assert len(trims) <= 2  # the model thread's idle exit and its stop, at most


def test_the_step_after_a_place_runs_the_decoding_streams_even_on_the_base_weights_turn():
    """A compile on an adapted model takes turns with the adapted rows; the step owed to a decoding stream after
    a PLACE, or after the base weights' turn, is never that turn, or the stream would wait for two steps in a row;
    an arrival waits for a turn due."""
    scheduler, stream = decoding_beside(Scheduler(row_budget=16), tokens=64)
    compile = sequence(tokens=None, compile=lambda cache: "entry", base_weights=True)
    scheduler.add(compile)
    rows = {compile: (64,)}
    place = scheduler.schedule()  # the compile placed
    assert place.kind is Kind.PLACE
    run_plan(scheduler, place, rows)
    owed = scheduler.schedule()  # the stream's step, the base weights' turn next
    assert not owed.base_weights and any(w.sequence is stream for w in owed.work)
    run_plan(scheduler, owed, rows)
    assert scheduler.base_turn
    scheduler.add(newcomer := sequence(tokens=None))
    rows[newcomer] = (1,)
    kinds = []
    for _ in range(6):
        plan = scheduler.schedule()
        kinds.append("base" if plan.base_weights else plan.kind.name.lower())
        assert plan.base_weights or plan.kind is not Kind.PIECE or any(w.sequence is stream for w in plan.work)
        run_plan(scheduler, plan, rows)
    assert kinds == ["base", "piece", "place", "piece", "base", "piece"]


def test_arrivals_every_other_step_do_not_keep_the_base_weights_turn_from_coming():
    """Each arrival's PLACE step owes the decoding stream the next step, and that step was never the base weights'
    turn: with a request arriving every other step, a compile on an adapted model never ran. The turn put off
    comes before the next PLACE instead."""
    scheduler, stream = decoding_beside(Scheduler(row_budget=16), tokens=400)
    compile = sequence(tokens=None, compile=lambda cache: "entry", base_weights=True)
    scheduler.add(compile)
    rows = {compile: (64,)}
    kinds = []
    for _ in range(12):
        scheduler.add(newcomer := sequence(tokens=None))  # a request whose placing runs no rows, every round
        rows[newcomer] = (1,)
        plan = scheduler.schedule()
        kinds.append("base" if plan.base_weights else plan.kind.name.lower())
        run_plan(scheduler, plan, rows)
    # the arrivals' steps and the compile's take turns, and the stream never waits for two steps in a row
    assert kinds == ["place", "piece", "base", "piece"] * 3, kinds


def test_with_nothing_decoding_an_arrival_waits_one_base_weights_step_not_two():
    """The step after a base weights' step is owed to the decoding streams; with none, it was a second base step
    before the arrival's PLACE."""
    scheduler = Scheduler(row_budget=16)
    compile = sequence(tokens=None, compile=lambda cache: "entry", base_weights=True)
    scheduler.add(compile)
    rows = {compile: (64,)}
    run_plan(scheduler, scheduler.schedule(), rows)  # the compile placed
    for _ in range(2):  # the step owed after the PLACE, then one of its own
        base = scheduler.schedule()
        assert base.base_weights
        run_plan(scheduler, base, rows)
    scheduler.add(newcomer := sequence(tokens=None))
    rows[newcomer] = (1,)
    assert scheduler.schedule().kind is Kind.PLACE


def test_a_background_narrowing_link_waits_while_users_run():
    """Its rows need the base weights, which no step runs while a user sequence runs."""
    scheduler, stream = decoding_beside(Scheduler(row_budget=16), tokens=64)
    scheduler.running.append(guard := sequence(tokens=None, background=True))
    guard.status, guard.plan = Status.LINKING, FakePlan(5, "narrow")
    for _ in range(4):
        plan = scheduler.schedule()
        assert plan.kind is not Kind.NARROW and all(w.sequence is stream for w in plan.work)
        run_plan(scheduler, plan, {})
