"""Which rows a linking algorithm recomputes: CacheBlend by K or by V deviation, and the bench's row-choice
prototypes. Tiny random-weight models; the reference selections are computed independently of the linker's path."""

from __future__ import annotations

import math

import pytest
import torch

from bench import agreement
from research import rows as proto
from ragcache import linker
from ragcache.errors import ParameterOutOfRange
from ragcache.linker import LinkParams, link
from tests.test_bench import _tiny_parts


def _kept_rows(runner, parts, params: LinkParams) -> set[int]:
    """The chunk rows a cacheblend link keeps after its check layer (from the linker's own recompute)."""
    plan = linker.plan(runner, parts, params)
    with torch.inference_mode():
        _, rows = linker.recompute(runner, plan.token_ids, plan.rows, plan.cache, plan.narrow)
    question = set(range(parts.token_ids.numel() - len(parts.question_ids), parts.token_ids.numel()))
    return set(rows.tolist()) - question


def _expected_rows(runner, parts, check_layer: int, ratio: float, tensor: str) -> set[int]:
    """Top `ratio` chunk rows by squared deviation of the fresh K or V at `check_layer` from the placed one: the
    fresh values come from recomputing every row (cacheblend at ratio 1), the placed ones from naive."""
    every = link(runner, parts, LinkParams("cacheblend", ratio=1.0, check_layer=check_layer))
    placed = link(runner, parts, LinkParams("naive"))
    rows = proto.all_chunk_rows(parts)
    fresh = getattr(every.cache, tensor)[check_layer][:, rows].float()
    old = getattr(placed.cache, tensor)[check_layer][:, rows].float()
    deviation = ((fresh - old) ** 2).sum((0, 2))
    count = math.ceil(round(ratio * rows.numel(), 9))
    return set(rows[torch.topk(deviation, count).indices].tolist())


@pytest.mark.parametrize("family", ["qwen2", "llama"])  # on tiny gemma3 the two sets coincide
def test_cacheblend_keeps_the_rows_that_deviate_most_by_the_chosen_tensor(family):
    runner, parts = _tiny_parts(family)
    ratio, layer = 0.25, 1
    by_key = _expected_rows(runner, parts, layer, ratio, "keys")
    by_value = _expected_rows(runner, parts, layer, ratio, "values")
    assert by_key != by_value  # otherwise this input could not tell the two choices apart
    assert _kept_rows(runner, parts, LinkParams("cacheblend", ratio=ratio, check_layer=layer)) == by_key
    assert _kept_rows(runner, parts, LinkParams("cacheblend", ratio=ratio, check_layer=layer,
                                                deviation="value")) == by_value


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_cacheblend_by_value_at_ratio_one_equals_full(family):
    runner, parts = _tiny_parts(family)
    full = link(runner, parts, LinkParams("full"))
    everything = link(runner, parts, LinkParams("cacheblend", ratio=1.0, deviation="value"))
    top1, kl = agreement.first_token(full.last_logits, everything.last_logits)
    assert top1 == 1.0 and kl < 1e-9


def test_an_unknown_deviation_is_refused():
    with pytest.raises(ParameterOutOfRange):
        LinkParams("cacheblend", deviation="query").validate(4)


def test_chunk_first_rows_spend_the_budget_on_the_most_attended_chunk():
    runner, parts = _tiny_parts("qwen2")
    spans = proto.chunk_spans(parts)
    scores = torch.zeros(parts.token_ids.numel())
    a, b = spans[1]
    scores[a:b] = 1.0  # the question reads the second chunk
    count = 4 * len(spans) + 5
    rows = proto.chunk_first_rows(parts, scores, count)
    assert rows.numel() == count
    for start, end in spans:  # every chunk's sink rows
        assert set(range(start, min(end, start + 4))) <= set(rows.tolist())
    assert set(range(a + 4, a + 9)) <= set(rows.tolist())  # the rest: the attended chunk, from its start


def test_a_two_question_answer_is_scored_per_question():
    from research.diagnose import score

    record = {"answers": ["Paris"], "answers2": ["1889", "in 1889"]}
    assert score("Paris; 1889", record) == {"f1": 1.0, "em": 1.0}
    assert score("Paris", record) == {"f1": 0.5, "em": 0.5}  # the second answer is missing
    assert score("Paris", {"answers": ["Paris"]}) == {"f1": 1.0, "em": 1.0}


def test_the_engine_passes_deviation_to_the_linker():
    """RagCache.link(deviation=...) reaches the linker: same budget, other logits; a bad name is a bad request."""
    from ragcache.facade import RagCache
    from ragcache.settings import EngineConfig
    from ragcache.store.memory import MemoryStore
    from tests import tiny

    rc = RagCache(tiny.make("qwen2"), MemoryStore(), EngineConfig(chunk_tokens=24, kv_codec="fp32"))
    ids = rc.compile(list(tiny.CORPUS[:3]))
    by_key = rc.link("where?", ids, algorithm="cacheblend", ratio=0.3)
    by_value = rc.link("where?", ids, algorithm="cacheblend", ratio=0.3, deviation="value")
    assert by_key.recomputed_tokens == by_value.recomputed_tokens
    assert not torch.equal(by_key.last_logits, by_value.last_logits)  # other rows were recomputed
    with pytest.raises(ParameterOutOfRange, match="deviation"):
        rc.link("where?", ids, algorithm="cacheblend", deviation="v")


def test_focus_on_short_chunks_gives_every_chunk_its_first_row_before_any_its_second():
    """Ten chunks of 12 tokens: a budget of 25 against 40 sink rows. Cut in prompt order, the last chunks got none
    (and the scored pre-pass chose nothing); every chunk's first row comes first, then every second, then the
    best-scored third rows."""
    parts = linker.LinkInput([1, 2], [list(range(10, 22)) for _ in range(10)], [3, 4, 5])
    starts = parts.chunk_starts()
    scores = torch.zeros(parts.token_ids.numel())
    scores[[s + 2 for s in starts[5:]]] = 1.0
    rows = set(linker.focus_rows(parts, 25 / 120, scores).tolist())
    assert len(rows) == 25
    assert set(starts) | {s + 1 for s in starts} <= rows  # 20 rows: every chunk's first two
    assert {s + 2 for s in starts[5:]} <= rows and not {s + 3 for s in starts} & rows
    scores[[s + 2 for s in starts[:5]]] = 2.0  # the first five's third rows the most attended now
    rows = set(linker.focus_rows(parts, 25 / 120, scores).tolist())
    assert {s + 2 for s in starts[:5]} <= rows and not {s + 2 for s in starts[5:]} & rows
