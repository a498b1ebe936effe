"""Repair during decode (LinkParams.repair, issue 65): a linked sequence's stale rows are recomputed in causal order
with its decode steps, and once every row is repaired its cache is the one `full` computes for the same tokens."""

from __future__ import annotations

import pytest
import torch

from ragcache import agreement, linker
from ragcache.kernels import torch_ref
from ragcache.engine.sampling import Decoding, Step
from ragcache.engine.sequence import Repair
from ragcache.facade import RagCache
from ragcache.settings import EngineConfig
from ragcache.store.memory import MemoryStore
from tests import tiny

QUESTION = "Which mountain is the highest?"
NOT_CUT_INVARIANT = (
    "this CPU's GEMM rounds an attention row by the call's row count, and the start-up check "
    "(invariant.cuts_alike) turned cut invariance off: what this test holds does not exist here "
    "(test_a_cpu_whose_gemm_rounds_a_row_by_its_piece_is_not_called_cut_invariant tests that case)"
)
DOCS = [text * 3 for text in tiny.CORPUS[:4]]


def engine(family: str = "llama", **config) -> RagCache:
    return RagCache(tiny.make(family), MemoryStore(), EngineConfig(chunk_tokens=40, kv_codec="fp32", **config))


def caches_at_release(rc: RagCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The K/V each sequence's cache holds when it ends (the driver releases it, on the model thread)."""
    held, release = [], rc.runner.release

    def keep(cache):
        held.append((cache.keys[:, :, : cache.length].clone(), cache.values[:, :, : cache.length].clone()))
        release(cache)

    rc.runner.release = keep
    return held


def full_cache(rc: RagCache, ids: list, answer: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`full`'s K/V over the prompt and the answer's tokens fed after it (all but the last, never fed)."""
    full = rc.link(QUESTION, ids, algorithm="full", max_new_tokens=len(answer))
    rc.with_runner(agreement.teacher_forced, full, answer)  # writes the answer's rows into full's cache
    length = full.cache.length + len(answer) - 1
    return full.cache.keys[:, :, :length], full.cache.values[:, :, :length]


@pytest.mark.parametrize("family,invariant", [("llama", True), ("gemma3", True), ("llama", False)])
@pytest.mark.parametrize("algorithm,knobs", [("naive", {}), ("focus", {"ratio": 0.25}), ("legolink", {"k": 4})])
def test_once_every_row_is_repaired_the_cache_is_fulls(family, invariant, algorithm, knobs):
    """gemma3: sliding windows and two rope tables; without batch invariance decode rows share one pooled call."""
    rc = engine(family, batch_invariant=invariant)
    ids = rc.compile(DOCS)
    held = caches_at_release(rc)
    answer = rc.query(QUESTION, ids, algorithm=algorithm, repair=40, max_new_tokens=24, **knobs)
    assert len(answer.token_ids) == 24 and len(held) == 1  # random weights: no EOS before the limit
    keys, values = held[0]
    want_keys, want_values = full_cache(rc, ids, answer.token_ids)
    assert keys.shape == want_keys.shape  # the prompt and 23 fed tokens: 40 rows a step caught up with them
    assert answer.stats.repair_caught_up and 0 < answer.stats.repaired_tokens < keys.shape[2]
    torch.testing.assert_close(keys, want_keys, atol=2e-5, rtol=2e-4)
    torch.testing.assert_close(values, want_values, atol=2e-5, rtol=2e-4)
    rc.close()


def test_without_repair_or_with_a_row_skipped_the_cache_is_not_fulls(monkeypatch):
    """The comparison above has teeth: a link's stale rows differ from full's, and a repair that starts late, past
    rows of the second chunk (its rows attend to stale ones), leaves the rows after them wrong, not only the skipped
    ones."""
    rc = engine()
    ids = rc.compile(DOCS)
    held = caches_at_release(rc)
    stale = rc.query(QUESTION, ids, algorithm="naive", max_new_tokens=24)
    keys = held[-1][0]  # (the `full` link below is released too)
    want_keys, _ = full_cache(rc, ids, stale.token_ids)
    assert keys.shape == want_keys.shape and not torch.allclose(keys, want_keys, atol=1e-3)
    from ragcache.engine import scheduler

    start = scheduler._repair

    def late(sequence):
        repair = start(sequence)
        if repair is not None:
            repair.next += 60
        return repair

    monkeypatch.setattr(scheduler, "_repair", late)
    skipped = rc.query(QUESTION, ids, algorithm="naive", repair=40, max_new_tokens=24)
    keys = held[-1][0]
    want_keys, _ = full_cache(rc, ids, skipped.token_ids)
    late = (keys - want_keys).abs().amax(dim=(0, 1, 3))  # the largest error at each position
    first = int((late > 1e-3).nonzero()[0])
    assert (late[first:] > 1e-4).float().mean() > 0.5  # the wrong row poisons the rows after it
    rc.close()


def test_the_first_token_is_the_links_own_and_repair_changes_only_what_follows():
    rc = engine()
    ids = rc.compile(DOCS)
    plain = rc.query(QUESTION, ids, algorithm="naive", max_new_tokens=8)
    repaired = rc.query(QUESTION, ids, algorithm="naive", repair=16, max_new_tokens=8)
    assert repaired.token_ids[0] == plain.token_ids[0]
    assert repaired.stats.ttft_s > 0 and repaired.stats.recomputed_tokens == plain.stats.recomputed_tokens
    # 16 rows in each of the 7 steps after the first token, still behind: the answer's stats say so
    assert (repaired.stats.repaired_tokens, repaired.stats.repair_caught_up) == (16 * 7, False)
    assert (plain.stats.repaired_tokens, plain.stats.repair_caught_up) == (0, False)
    rc.close()


def test_exact_links_have_nothing_to_repair():
    """`full` recomputes every row in a causal run from the start, `prefix` every row after the prefix a link
    computed: nothing stale, so a repair asked for never runs; a link over chunks repairs from row 0."""
    rc = engine()
    ids = rc.compile(DOCS)
    for name in ("full", "prefix", "prefix"):  # the second `prefix` reuses the first's rows
        exact = rc.query(QUESTION, ids, algorithm=name, repair=40, max_new_tokens=4).stats
        assert (exact.repaired_tokens, exact.repair_caught_up) == (0, False)
    linked = rc.query(QUESTION, ids, algorithm="naive", repair=4096, max_new_tokens=4).stats
    assert linked.repair_caught_up and linked.repaired_tokens == linked.prompt_tokens
    rc.close()
    repair = Repair(torch.tensor([5, 6, 7]), next=1, per_step=4)
    assert repair.size(3) == 2 and repair.size(10) == 4
    assert repair.token_ids(1, 6, [8, 9, 10]).tolist() == [6, 7, 8, 9, 10]  # the prompt, then the answer fed


def test_a_repair_of_one_row_a_step_is_refused_as_it_never_catches_up():
    from ragcache.errors import ParameterOutOfRange

    with pytest.raises(ParameterOutOfRange, match="at least 2"):
        linker.LinkParams("naive", repair=1).validate(2)
    linker.LinkParams("naive", repair=2).validate(2)


def test_repair_pieces_ride_every_decode_step_out_of_the_budget():
    """Each decode step of a repairing sequence carries its next rows, before any link piece, out of the budget: a
    link piece of another request gets what the decode rows leave of it."""
    from ragcache.engine.scheduler import Kind, Scheduler
    from tests.test_scheduler import run_plan, sequence

    scheduler = Scheduler(row_budget=16)
    a, b = sequence(tokens=8), sequence(tokens=2)
    scheduler.add(a)
    run_plan(scheduler, scheduler.schedule(), {a: (5,)})
    a.cache.length = 5  # its prompt's rows, placed
    plan = scheduler.schedule()
    a.params = linker.LinkParams("naive", repair=6)
    a.plan.token_ids, a.plan.exact_until = torch.arange(5), 1  # the rows after the first are stale
    run_plan(scheduler, plan, {})
    assert a.repair is not None and a.repair.next == 1
    scheduler.add(b)
    run_plan(scheduler, scheduler.schedule(), {b: (40,)})
    step = scheduler.schedule()  # what the cache holds
    kinds = [(w.kind, w.sequence, w.start, w.stop) for w in step.work]
    assert kinds[:2] == [(Kind.DECODE, a, 0, 0), (Kind.REPAIR, a, 1, 5)]
    assert kinds[2][1] is b and kinds[2][3] - kinds[2][2] == 15 and step.rows == 20  # the repair's 4 rows aside
    a.cache.length += 1  # the runner feeds a's token
    run_plan(scheduler, step, {})
    # caught up in that step: its decode row attended to exact rows only, and so will every row decoded after it
    assert a.repair is None and a.stats.repaired_tokens == 4 and a.stats.repair_caught_up
    a.cache.length += 1
    assert [w.kind for w in scheduler.schedule().work if w.sequence is a] == [Kind.DECODE]


@pytest.mark.parametrize("family", ["llama", "gemma3"])  # gemma3: sliding windows over the repair rows too
def test_repair_rows_ride_the_whole_pool_step_to_fulls_cache_and_the_packed_steps_tokens(family):
    """With decode graphs (on CPU the same fixed-shape step, run eagerly) a decode step's repair rows run in that
    step, R rows a slot beside the decode rows: the cache ends as `full`'s and the tokens are those of the
    ordinary packed steps."""
    rc = engine(family, batch_invariant=False, decode_graphs=True)
    ids = rc.compile(DOCS)
    widths, step = [], rc.runner.graphs.step
    rc.runner.graphs.step = lambda tokens, caches, repairs=(): widths.append(
        sum(run.stop - run.start for run in repairs)
    ) or step(tokens, caches, repairs)
    held = caches_at_release(rc)
    answer = rc.query(QUESTION, ids, algorithm="naive", repair=40, max_new_tokens=24)
    assert sum(w > 0 for w in widths) >= 2 and widths[-1] == 0  # repaired over several steps, then plain decode
    runs = [w for w in widths if w]
    assert runs[-1] < runs[0] and {r for _, r in rc.runner.graphs._steps if r} == {64}  # its last run: the same lane
    keys, values = held[0]
    want_keys, want_values = full_cache(rc, ids, answer.token_ids)
    torch.testing.assert_close(keys, want_keys, atol=2e-5, rtol=2e-4)
    torch.testing.assert_close(values, want_values, atol=2e-5, rtol=2e-4)
    packed = engine(family, batch_invariant=False)
    assert packed.query(QUESTION, packed.compile(DOCS), algorithm="naive", repair=40, max_new_tokens=24).token_ids == (
        answer.token_ids
    )
    rc.close()
    packed.close()


def test_repairs_take_the_row_budget_by_turns_each_with_its_decode_row():
    """Three sequences repairing 12 rows a step in a budget of 16: one repair a step, the longest left out first, the
    others sitting the step out with their decode rows (a step held all 36 of them); a stream that repairs nothing
    decodes every step. Each repair still runs 12 rows at a time, as it would alone (batch invariance)."""
    from ragcache.engine.scheduler import Kind, Scheduler
    from tests.test_scheduler import run_plan, sequence

    scheduler = Scheduler(row_budget=16)
    a, b, c, d = (sequence(tokens=20) for _ in range(4))
    for s in (a, b, c, d):
        scheduler.add(s)
    run_plan(scheduler, scheduler.schedule(), {s: (2,) for s in (a, b, c, d)})  # placed together
    for s in (a, b, c, d):
        s.cache.length = 40
    for s in (a, b, c):
        s.params = linker.LinkParams("naive", repair=12)
        s.plan.token_ids, s.plan.exact_until = torch.arange(40), 1
    run_plan(scheduler, scheduler.schedule(), {})  # their links' last rows: all four decode now
    turns = []
    for _ in range(4):
        step = scheduler.schedule()
        repairs = [(w.sequence, w.stop - w.start) for w in step.work if w.kind is Kind.REPAIR]
        decodes = [w.sequence for w in step.work if w.kind is Kind.DECODE]
        assert len(repairs) == 1 and repairs[0][1] == 12
        assert decodes == [s for s in (a, b, c, d) if s in (d, repairs[0][0])]  # in arrival order
        turns.append(repairs[0][0])
        for s in decodes:
            s.cache.length += 1
        run_plan(scheduler, step, {})
    assert turns == [a, b, c, a]  # by turns: in the fourth step a, left out twice, goes before b, left out once


def test_a_repair_lane_is_as_wide_as_its_rows_not_its_budget():
    """A repair past the prompt (repair=4096, the README's advice) with a few hundred stale rows: its lane was 4,096
    rows wide, 4,096 rows computed a slot in a graph of their own (on CUDA a capture and a memory pool for it)."""
    rc = engine("llama", batch_invariant=False, decode_graphs=True)
    ids = rc.compile(DOCS)
    answer = rc.query(QUESTION, ids, algorithm="naive", repair=4096, max_new_tokens=4)
    assert answer.stats.repair_caught_up
    widths = [r for _, r in rc.runner.graphs._steps if r]
    assert widths and max(widths) < 2 * answer.stats.repaired_tokens  # its rows, rounded up to a power of two
    rc.close()


def test_a_link_does_not_crawl_a_row_a_step_behind_repairs_that_take_the_budget():
    """Repairs are out of the row budget: a link beside them got what they left of it, at least one row, and a
    repair=4096 made another request's prompt advance a row a step."""
    from ragcache.engine.scheduler import Kind, Scheduler
    from tests.test_scheduler import run_plan, sequence

    scheduler = Scheduler(row_budget=16)
    a, b = sequence(tokens=8), sequence(tokens=2)
    scheduler.add(a)
    run_plan(scheduler, scheduler.schedule(), {a: (5,)})
    a.cache.length = 40  # a prompt of 40 rows, of which its link recomputes 5
    plan = scheduler.schedule()
    a.params = linker.LinkParams("naive", repair=32)
    a.plan.token_ids, a.plan.exact_until = torch.arange(40), 1
    run_plan(scheduler, plan, {})
    scheduler.add(b)
    run_plan(scheduler, scheduler.schedule(), {b: (40,)})
    step = scheduler.schedule()
    pieces = {w.kind: w.stop - w.start for w in step.work}
    assert pieces[Kind.REPAIR] == 32 and pieces[Kind.PIECE] == 15  # what a's decode row leaves of the budget
    run_plan(scheduler, step, {})
    a.cache.length += 1
    c = sequence(tokens=2)
    scheduler.add(c)
    run_plan(scheduler, scheduler.schedule(), {c: (40,)})
    # b's link ends (its last 25 rows are over the 15 left: 15 now, 10 next), c's takes the rest: not nothing
    step = scheduler.schedule()
    assert [(w.sequence, w.stop - w.start) for w in step.work if w.kind is Kind.PIECE] == [(b, 15)]
    run_plan(scheduler, step, {})
    a.cache.length += 1
    step = scheduler.schedule()
    assert [(w.sequence, w.stop - w.start) for w in step.work if w.kind is Kind.PIECE] == [(b, 10), (c, 5)]


@pytest.mark.parametrize("row_budget", [None, 40])
def test_three_sequences_repairing_in_one_graph_step_each_end_with_their_own_fulls_cache(row_budget):
    """Three repairs at once take three lanes of the captured step (rounded up to four, the fourth parked on slot
    0), R rows each for budgets that are not powers of two: no lane writes another's rows. Under a row budget of 40
    they take turns, at most two at once (13 + 21 rows), and a stream left out of a step leaves its slot as it was."""
    from tests.test_scheduler import Run, together

    rc = engine("llama", batch_invariant=False, decode_graphs=True, row_budget=row_budget)
    ids = rc.compile(DOCS)
    lanes, step = [], rc.runner.graphs.step
    rc.runner.graphs.step = lambda tokens, caches, repairs=(): lanes.append(len(repairs)) or step(
        tokens, caches, repairs
    )
    kept = caches_at_release(rc)
    asks = ((1, 13), (2, 21), (3, 40))  # documents, repair rows a step
    runs = together(rc, [
        Run(rc, question=QUESTION, docs=ids[:docs], algorithm="naive", repair=per_step, max_new_tokens=32)
        for docs, per_step in asks
    ])
    assert max(lanes) == (3 if row_budget is None else 2)  # side by side in one step
    by_length = {keys.shape[2]: (keys, values) for keys, values in kept}
    for (docs, _), run in zip(asks, runs):
        answer = run.stream.answer
        assert answer.stats.repair_caught_up
        want_keys, want_values = full_cache(rc, ids[:docs], answer.token_ids)
        keys, values = by_length[want_keys.shape[2]]
        torch.testing.assert_close(keys, want_keys, atol=2e-5, rtol=2e-4)
        torch.testing.assert_close(values, want_values, atol=2e-5, rtol=2e-4)
    rc.close()


@pytest.mark.parametrize("family", ["llama", "gemma3"])  # gemma3: sliding windows and two rope tables
@pytest.mark.parametrize("per_step", [4096, 40])
def test_a_cut_invariant_repair_holds_fulls_cache_bit_for_bit(family, per_step, monkeypatch):
    """On CPU (batch-invariant, so cut-invariant) a repair recomputes each row with the arithmetic `full` gave it,
    whatever pieces either ran in: a prompt row as `full`'s prefill (the system prefix placed from its entry, `full`'s
    only within rounding, included), a decoded row as the decode step did. So once caught up, in one step (4096) or
    over several (40), the cache is `full`'s for the same tokens bit for bit. Both answers are made `full`'s greedy
    tokens, so that a link's stale first steps cannot steer the answer elsewhere. `full`'s prompt runs in pieces of
    100 rows, a repair's in pieces of its own."""
    rc = engine(family, row_budget=100)
    if not rc.runner.cut_invariant:
        pytest.skip(NOT_CUT_INVARIANT)
    assert_a_repair_ends_with_fulls_cache_bit_for_bit(rc, per_step, monkeypatch)
    rc.close()


def assert_a_repair_ends_with_fulls_cache_bit_for_bit(
    rc: RagCache, per_step: int, monkeypatch, docs: list[str] = DOCS, new_tokens: int = 24, tokens=None
) -> None:
    """focus with `repair=per_step` on a cut-invariant engine, its answer and `full`'s forced to `full`'s greedy
    tokens (or to `tokens`): the repair catches up, and the cache it ends with is `full`'s, bit for bit."""
    ids = rc.compile(docs)
    if tokens is None:
        tokens = rc.query(QUESTION, ids, algorithm="full", max_new_tokens=new_tokens).token_ids

    def accept(self, logits, token=None):
        token = tokens[len(self.token_ids)]
        self.token_ids.append(token)
        return Step(token, self.assembler.push(token))

    monkeypatch.setattr(Decoding, "accept", accept)
    held = caches_at_release(rc)
    full = rc.query(QUESTION, ids, algorithm="full", max_new_tokens=new_tokens)
    repaired = rc.query(QUESTION, ids, algorithm="focus", ratio=0.25, repair=per_step, max_new_tokens=new_tokens)
    assert full.token_ids == repaired.token_ids == tokens
    prompt = full.stats.prompt_tokens
    assert repaired.stats.repair_caught_up and repaired.stats.repaired_tokens >= prompt  # its system prefix too
    if per_step > prompt:  # caught up in the first decode step: what was decoded after it is exact already
        assert repaired.stats.repaired_tokens == prompt
    (full_keys, full_values), (keys, values) = held
    assert torch.equal(keys, full_keys) and torch.equal(values, full_values)


def test_a_cpu_whose_gemm_rounds_a_row_by_its_piece_is_not_called_cut_invariant(monkeypatch, caplog):
    """The start-up check (invariant.cuts_alike) runs the attention on random rows cut two ways; where they differ
    (here SDPA stands in for such a CPU) the runner says so and its prompts attend as before, and a repair still
    catches up, within rounding."""
    assert "prompt rows" in engine().runner.invariance.how  # the check ran, whatever it found on this CPU
    monkeypatch.setattr(
        "ragcache.kernels.aligned_attention",
        lambda q, k, v, first, scale, window=None: torch_ref._contiguous_attention(q, k, v, first, scale, window),
    )
    with caplog.at_level("WARNING", logger="ragcache"):
        rc = engine()
    assert not rc.runner.cut_invariant and "prompt rows round by piece" in rc.runner.invariance.how
    assert "rounds an attention row by its piece" in caplog.text
    ids = rc.compile(DOCS)
    answer = rc.query(QUESTION, ids, algorithm="naive", repair=4096, max_new_tokens=4)
    assert answer.stats.repair_caught_up
    rc.close()


def test_without_a_pool_decode_rows_attend_alone_and_a_repair_still_ends_with_fulls_cache(monkeypatch):
    """CUDA's batch-invariant decode has no pool (kv.PerSegment): a decode row attends as its own segment, over the
    keys up to its position, in SDPA's one call (never the pooled path's masked call over a whole capacity), and a
    repair recomputes a decoded row with that same call, so it still ends with `full`'s cache bit for bit. Here on
    CPU, the strategy forced."""
    monkeypatch.setattr("ragcache.engine.runner.decode_strategy", lambda device, batch_invariant: "per-segment")
    rc = engine("llama", row_budget=100)
    assert rc.runner.decode == "per-segment"
    if not rc.cut_invariant:
        pytest.skip(NOT_CUT_INVARIANT)

    def pooled(*args):
        raise AssertionError("a decode row took the pooled path's call")

    monkeypatch.setattr("ragcache.kernels.stacked_decode_attention", pooled)
    assert_a_repair_ends_with_fulls_cache_bit_for_bit(rc, 40, monkeypatch, DOCS[:2], new_tokens=12)
    rc.close()


def test_the_step_counters_keep_repair_rows_apart_from_link_rows_and_decode_steps():
    """Repair rows were counted as link rows, and every step that carried some left the decode-only steps: the
    decode rate benchmarks read from them was the rate after the repair had caught up."""
    from ragcache.engine.driver import StepStats
    from ragcache.engine.scheduler import Kind, StepPlan, Work
    from tests.test_scheduler import sequence

    a, b = sequence(), sequence()
    stats = StepStats()
    stats.count(StepPlan(Kind.PIECE, [Work(a, Kind.DECODE), Work(a, Kind.REPAIR, 1, 33)]), 0.5)
    stats.count(StepPlan(Kind.PIECE, [Work(a, Kind.DECODE), Work(a, Kind.REPAIR, 33, 40), Work(b, Kind.PIECE, 0, 9)]),
                0.75)
    assert (stats.decode_rows, stats.repair_rows, stats.link_rows) == (2, 39, 9)
    assert (stats.decode_only_steps, stats.decode_only_rows, stats.decode_only_s) == (1, 1, 0.5)
