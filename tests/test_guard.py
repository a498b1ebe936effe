"""The accuracy guard's comparison and bookkeeping (the server wiring is tested in test_api.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from ragcache.guard import Check, Guard, compare
from ragcache.errors import ParameterOutOfRange
from ragcache.engine.sequence import Done
from tests.hold import hold_model_thread


def test_compare_identical_and_different_distributions():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    same = compare("legolink", logits, logits.clone())
    assert same.top1_agrees and same.kl == pytest.approx(0.0, abs=1e-12)
    moved = logits.clone()
    moved[int(logits.argmin())] = float(logits.max()) + 5
    other = compare("legolink", logits, moved)
    assert not other.top1_agrees and other.kl > 0.1


def test_a_token_full_gives_no_mass_adds_nothing_to_the_kl():
    full = torch.tensor([0.0, 1.0, -float("inf")])
    assert compare("naive", full, full).kl == 0.0
    assert compare("naive", full, torch.tensor([0.0, 1.0, 5.0])).kl > 0.0


def test_rate_zero_never_and_one_always_and_exact_algorithms_never():
    assert not any(Guard(0.0, "m").wants("legolink") for _ in range(100))
    always = Guard(1.0, "m")
    assert all(always.wants("legolink") for _ in range(100))
    assert not always.wants("full") and not always.wants("prefix")
    half = Guard(0.5, "m", seed=1)
    assert 30 < sum(half.wants("naive") for _ in range(100)) < 70
    with pytest.raises(ParameterOutOfRange, match="rate"):
        Guard(1.5, "m")
    with pytest.raises(ParameterOutOfRange, match="window"):
        Guard(0.5, "m", window=0)


def test_agreement_window_and_one_warning_below_target(caplog):
    guard = Guard(1.0, "tiny", target=0.9, window=20)
    with caplog.at_level(logging.WARNING, logger="ragcache"):
        for i in range(40):
            guard.record(Check("legolink", i % 2 == 0, 0.1))
    assert guard.agreement()["legolink"] == (0.5, 20)
    warnings = [r for r in caplog.records if "accuracy guard" in r.getMessage()]
    assert len(warnings) == 1 and "legolink" in warnings[0].getMessage()


def test_rc_check_on_a_tiny_model():
    from ragcache.facade import RagCache
    from ragcache.settings import EngineConfig
    from ragcache.store import open_store
    from tests import tiny

    rc = RagCache(tiny.make("llama"), open_store("memory:"), EngineConfig(chunk_tokens=16))
    ids = rc.compile([t * 2 for t in tiny.CORPUS[:3]])
    exact = rc.check("Where is the tower?", ids, algorithm="legolink", k=10_000)
    assert exact.top1_agrees and exact.kl < 1e-9
    naive = rc.check("Where is the tower?", ids, algorithm="naive")
    assert naive.kl > 0.0


def test_background_links_wait_until_no_user_request_runs():
    """A background link (the guard's `full`) is admitted only once the engine serves no user request, even when it
    was sent first."""
    import threading

    from ragcache.facade import RagCache
    from ragcache.settings import EngineConfig
    from ragcache.store import open_store
    from tests import tiny

    rc = RagCache(tiny.make("llama"), open_store("memory:"), EngineConfig(chunk_tokens=16))
    ids = rc.compile(tiny.CORPUS[:2])
    order: list[str] = []
    release = hold_model_thread(rc)
    background = threading.Thread(target=lambda: (rc.link("Where?", ids, algorithm="full", background=True),
                                                  order.append("background")))
    background.start()
    while not rc.driver.arrivals:  # the background link waits for the model thread
        threading.Event().wait(0.01)
    stream = rc.stream("Where?", ids, max_new_tokens=6, algorithm="naive")
    stream.open(lambda event: order.append("user") if isinstance(event, Done) else None)  # sent after it
    release.set()
    background.join(120)
    assert order == ["user", "background"]


def test_a_guard_check_that_finds_no_quiet_step_is_withdrawn_and_skipped():
    """Under constant user load the guard's `full` link never gets a step: past its deadline it is withdrawn from
    the queue (it held its chunks' entries there) and the check counts as skipped, so the next one can run. Before,
    it waited forever and every later check was skipped."""
    import threading

    from ragcache.facade import RagCache
    from ragcache.settings import EngineConfig
    from ragcache.guard import BackgroundGuard
    from ragcache.request import Query
    from ragcache.store import open_store
    from tests import tiny

    rc = RagCache(tiny.make("llama"), open_store("memory:"), EngineConfig(chunk_tokens=16))
    ids = rc.compile(tiny.CORPUS[:2])
    release = hold_model_thread(rc)  # a step that never comes: users hold the model
    stream = rc.stream("Where?", ids, max_new_tokens=6, algorithm="naive")
    stream.open(lambda event: None)
    skipped, checked = [], []
    guard = BackgroundGuard(rc, 1.0, on_skip=skipped.append, on_check=lambda c, a: checked.append(c))
    guard.deadline = 0.5
    query = rc.validate("Where?", ids, link=rc.params("naive"))
    guard._running.acquire()  # as after_answer does before it starts the check's thread
    guard._check(query, torch.zeros(1))  # the answer's logits: never compared, the full link does not end
    assert skipped == ["naive"] and not checked and guard.in_flight == 0
    assert not any(s.background for s in rc.driver.arrivals)  # withdrawn, not left holding its entries
    release.set()
    guard.deadline = 120.0
    guard._running.acquire()
    guard._check(query, rc.link("Where?", ids, algorithm="naive").last_logits)
    assert len(checked) == 1 and checked[0].algorithm == "naive"


def test_a_guard_check_whose_thread_cannot_start_is_skipped_and_the_next_can_run(monkeypatch):
    """A thread limit at the moment a check is drawn: the answer stands (the error escaped into the caller's finish
    before), the check counts as skipped, and the guard is not left holding its one check forever."""
    import threading
    from types import SimpleNamespace

    from ragcache.facade import RagCache
    from ragcache.guard import BackgroundGuard
    from ragcache.settings import EngineConfig
    from ragcache.store import open_store
    from tests import tiny

    rc = RagCache(tiny.make("llama"), open_store("memory:"), EngineConfig(chunk_tokens=16))
    ids = rc.compile(tiny.CORPUS[:2])
    skipped = []
    guard = BackgroundGuard(rc, 1.0, on_skip=skipped.append)
    query = rc.validate("Where?", ids, link=rc.params("naive"))

    def no_thread(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    guard.after_answer(SimpleNamespace(first_logits=None), query)
    assert skipped == ["naive"] and guard.in_flight == 0
    rc.close()


def test_the_guard_draws_only_answers_linked_as_the_server_links_by_default(monkeypatch):
    """One client's own k (legolink with k=0 beside a server default of 16) pulled the algorithm's window and its
    "consider a larger k" warning, and a huge one hid a regression: those answers are not drawn; a failed check
    is counted as skipped, as a timed-out one is."""
    import threading
    from types import SimpleNamespace

    from ragcache.facade import RagCache
    from ragcache.guard import BackgroundGuard
    from ragcache.settings import EngineConfig, LinkKnobs
    from ragcache.store import open_store
    from tests import tiny

    rc = RagCache(tiny.make("llama"), open_store("memory:"), EngineConfig(chunk_tokens=16))
    ids = rc.compile(tiny.CORPUS[:2])
    started, skipped = [], []
    monkeypatch.setattr(threading.Thread, "start", lambda self: started.append(self))
    guard = BackgroundGuard(rc, 1.0, on_skip=skipped.append, defaults=LinkKnobs.of(k=16))
    answer = SimpleNamespace(first_logits=None)
    guard.after_answer(answer, rc.validate("Where?", ids, link=rc.params("legolink", 0)))
    assert not started  # a client's own k: not drawn
    guard.after_answer(answer, rc.validate("Where?", ids, link=rc.params("legolink", 16)))
    assert len(started) == 1  # the server's default link: drawn
    monkeypatch.undo()
    monkeypatch.setattr(rc, "compare_with_full", lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("gone")))
    guard._check(rc.validate("Where?", ids, link=rc.params("legolink", 16)), None)  # as the thread runs it
    assert skipped == ["legolink"] and guard.in_flight == 0
    rc.close()


def test_a_check_of_an_answer_whose_raw_document_was_deleted_meanwhile_does_not_store_it_again(monkeypatch):
    """The check's `full` link runs later, in the background: given the query's raw texts, it drafted and wrote the
    document again after a client had deleted it. It links by id, and a deleted document skips the check."""
    import threading
    from types import SimpleNamespace

    from ragcache.documents import document_id
    from ragcache.facade import RagCache
    from ragcache.guard import BackgroundGuard
    from ragcache.settings import EngineConfig
    from ragcache.store import open_store
    from tests import tiny

    rc = RagCache(tiny.make("llama"), open_store("memory:"), EngineConfig(chunk_tokens=16))
    text = tiny.CORPUS[3]
    query = rc.validate("Where?", [{"text": text}], link=rc.params("naive"))
    answer = rc.query("Where?", [{"text": text}], algorithm="naive", max_new_tokens=2)
    started, skipped = [], []
    monkeypatch.setattr(threading.Thread, "start", lambda self: started.append(self))
    guard = BackgroundGuard(rc, 1.0, on_skip=skipped.append)
    guard.after_answer(SimpleNamespace(first_logits=answer.first_logits), query)
    monkeypatch.undo()
    rc.delete_document(document_id(text))
    started[0].run()  # the check's thread, after the delete
    assert skipped == ["naive"] and rc.document(document_id(text)) is None
    rc.close()
