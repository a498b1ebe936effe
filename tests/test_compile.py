"""A chunk's compile is scheduled work (ragcache/engine/scheduler.py): its pieces pack with other compiles and with
requests in the engine's steps. What that must keep: entries equal to a chunk compiled alone, a decoding stream's
row in every step, a failure confined to its own request, and every compiled entry stored, through a bounded
writer whose failure stops `compile_documents`."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from ragcache.catalog import Writer
from ragcache.engine.scheduler import Kind
from ragcache.errors import CompileFailed, StoreError
from ragcache.facade import RagCache
from ragcache.settings import EngineConfig
from ragcache.store.keys import document_id
from ragcache.store.memory import MemoryStore
from tests import tiny

TEXTS = [f"{text} {text}" for text in tiny.CORPUS]


def engine(store=None, **config) -> RagCache:
    return RagCache(tiny.make("llama"), store or MemoryStore(), EngineConfig(chunk_tokens=16, **config))


def recorded_steps(rc) -> list:
    """Every plan the runner executes from now on, in order."""
    plans, execute = [], rc.runner.execute

    def record(plan):
        plans.append(plan)
        return execute(plan)

    rc.runner.execute = record
    return plans


@pytest.mark.parametrize("invariant", [True, False])
def test_packed_compiles_give_the_entries_of_each_chunk_compiled_alone(invariant):
    """Every missing chunk of a call is compiled in the same steps (one piece each, as many as the budget takes);
    batch-invariant, each entry is the very bits of that chunk compiled alone, else equal within rounding."""
    import ragcache.kernels as kernels

    rc = engine(batch_invariant=invariant, row_budget=512)
    plans, joined, fresh_attention = recorded_steps(rc), [], kernels.fresh_attention
    kernels.fresh_attention = lambda query, *rest: joined.append(query.shape[0]) or fresh_attention(query, *rest)
    try:
        report = rc.compile_documents(TEXTS)
    finally:
        kernels.fresh_attention = fresh_attention
    assert joined and max(joined) >= 2  # chunks of one length attended in one call
    chunks = [ids for doc_id in report.ids for ids in rc.document_chunks(doc_id)]
    assert report.compiled_chunks == len({tuple(c) for c in chunks}) >= 6
    pieces = [p for p in plans if p.kind is Kind.PIECE]
    assert len(pieces) < report.compiled_chunks and max(len(p.work) for p in pieces) >= 4  # packed
    layout = rc.layouts["default"]
    for ids in chunks:
        stored = rc.store.get_many([rc.compiler.key(ids, layout)])[0]
        alone = rc.compiler.compile(ids, layout)
        for mine, theirs in ((stored.keys, alone.keys), (stored.values, alone.values)):
            assert torch.equal(mine, theirs) if invariant else torch.allclose(mine, theirs, atol=1e-5)
    rc.close()


def test_compiles_handed_over_slowly_still_share_their_first_step(monkeypatch):
    """The caller opens a call's compiles inside the driver's `together`: the model thread takes them in at once,
    however slowly they are handed over (a loaded machine), instead of stepping the first ones alone."""
    from ragcache.engine import Sequence

    rc = engine(row_budget=512)
    plans, open_ = recorded_steps(rc), Sequence.open
    monkeypatch.setattr(Sequence, "open", lambda self, listener: time.sleep(0.02) or open_(self, listener))
    try:
        report = rc.compile_documents(TEXTS)
        pieces = [p for p in plans if p.kind is Kind.PIECE]
        assert report.compiled_chunks >= 6 and len(pieces[0].work) == report.compiled_chunks
    finally:
        rc.close()


def test_a_decoding_stream_has_its_row_in_every_step_a_compile_runs_beside_it():
    """A compile beside a decoding stream takes no step of its own: each forward step carries the stream's decode
    row with the compile's pieces, so the stream waits at most one budgeted step for a token."""
    rc = engine(row_budget=24)
    doc = rc.compile(TEXTS[:1])
    plans = recorded_steps(rc)
    started, tokens = threading.Event(), []
    stream = rc.stream("Where is it?", doc, max_new_tokens=400, temperature=1.0, seed=0, algorithm="naive")

    def decode():
        for piece in stream:
            tokens.append(piece)
            started.set()

    reader = threading.Thread(target=decode, daemon=True)
    reader.start()
    assert started.wait(60)
    decoding = stream
    report = rc.compile_documents(TEXTS[1:])
    still = reader.is_alive()
    stream.cancel()
    reader.join(60)
    assert still, "the stream ended before the compile: no test"
    assert report.compiled_chunks >= 4
    forward = [p for p in plans if p.kind is Kind.PIECE and any(w.sequence.compile for w in p.work)]
    assert forward and all(any(w.sequence is decoding and w.kind is Kind.DECODE for w in p.work) for p in forward)
    assert all(p.rows <= 24 + 1 for p in forward)  # the budget, and at most one row per decoding stream past it
    rc.close()


def test_a_chunk_that_fails_to_compile_fails_its_own_request_only():
    rc = engine()
    entry, bad = rc.compiler.entry, {tuple(rc.catalog.draft(TEXTS[0]).chunks[0])}

    def failing(keys, values, token_ids, layout):
        if tuple(token_ids) in bad:
            raise ValueError("this chunk cannot be encoded")
        return entry(keys, values, token_ids, layout)

    rc.compiler.entry = failing
    outcomes = {}

    def ask(name, text):
        try:
            outcomes[name] = rc.query("Where is it?", [{"text": text}], max_new_tokens=2).text
        except Exception as exc:  # noqa: BLE001 - the test reads it
            outcomes[name] = exc

    threads = [threading.Thread(target=ask, args=(n, t)) for n, t in (("bad", TEXTS[0]), ("good", TEXTS[1]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert isinstance(outcomes["bad"], CompileFailed) and isinstance(outcomes["good"], str)
    assert isinstance(outcomes["bad"].__cause__, ValueError) and "cannot be encoded" in str(outcomes["bad"])
    rc.close()


def test_compiles_that_finished_are_stored_when_another_of_the_call_fails():
    """`finish_all` takes the streams' ends in order: a failure of the first must not drop the entries of those
    after it that had finished (shortest first, they end before it), or a resumed compile pays them again."""
    rc = engine(row_budget=16)
    short = [ids for text in TEXTS[:3] for ids in rc.catalog.draft(text).chunks]
    order = [[i for ids in short for i in ids], *short]  # a long chunk that fails first, then the short ones
    entry, bad = rc.compiler.entry, {tuple(order[0])}

    def failing(keys, values, token_ids, layout):
        if tuple(token_ids) in bad:
            raise ValueError("this chunk cannot be encoded")
        return entry(keys, values, token_ids, layout)

    rc.compiler.entry = failing
    with pytest.raises(CompileFailed, match="ValueError: this chunk cannot be encoded"):
        rc._ensure(order, rc.layouts["default"])
    keys = [rc.compiler.key(ids, rc.layouts["default"]) for ids in order[1:]]
    assert all(rc.store.contains_many(keys))
    rc.close()


def test_compiles_that_finished_are_stored_when_ctrl_c_comes_during_the_wait():
    """Ctrl-C in `ragcache compile` while the first (longest) compile of a batch is waited for: the others, which had
    ended, were dropped and compiled again by the resumed run; they are kept as where one fails."""
    from ragcache.engine.sequence import Inbox

    rc = engine(row_budget=16)
    short = [ids for text in TEXTS[:3] for ids in rc.catalog.draft(text).chunks]
    order = [[i for ids in short for i in ids], *short]
    get, interrupted = Inbox.get, []

    def ctrl_c(self, timeout=None):
        if not interrupted:  # the first wait: once every compile has ended, the interrupt
            interrupted.append(True)
            deadline = time.monotonic() + 60
            while not rc.driver.stats.steps or rc.scheduler.has_work():  # they arrive together, at one pass
                assert time.monotonic() < deadline
                time.sleep(0.01)
            raise KeyboardInterrupt
        return get(self, timeout)

    Inbox.get = ctrl_c
    try:
        with pytest.raises(KeyboardInterrupt):
            rc._ensure(order, rc.layouts["default"])
    finally:
        Inbox.get = get
    assert all(rc.store.contains_many([rc.compiler.key(ids, rc.layouts["default"]) for ids in order]))
    rc.close()


def test_metadata_not_one_a_text_is_refused_before_anything_compiles():
    from ragcache.errors import ParameterOutOfRange

    rc = engine()
    with pytest.raises(ParameterOutOfRange, match="one dict a text: 1 for 2 texts"):
        rc.compile_documents(TEXTS[:2], [{}])
    assert not list(rc.store.keys())
    rc.close()


class FailingStore(MemoryStore):
    """A memory store whose put_many fails once `fail` is set."""

    fail = False

    def put_many(self, entries):
        if self.fail:
            raise StoreError("the disk is full")
        super().put_many(entries)


def test_a_failed_write_stops_compile_documents_and_the_next_run_resumes():
    store = FailingStore()
    rc = engine(store=store, row_budget=16)
    rc.compile_documents(TEXTS[:2])
    kept = set(store.keys())
    store.fail = True
    with pytest.raises(StoreError, match="the disk is full"):
        rc.compile_documents(TEXTS[2:])
    assert set(store.keys()) == kept  # nothing half written, nothing of the failed run claimed
    store.fail = False
    again = rc.compile_documents(TEXTS)
    assert again.skipped == 2 and again.compiled_chunks > 0
    assert all(
        store.contains_many([rc.compiler.key(ids, rc.layouts["default"]) for ids in rc.document_chunks(document_id(t))])
        for t in TEXTS
    )
    rc.close()


class SlowStore:
    """put_many waits until `go` is set."""

    takes_device_entries = True  # what it is handed goes to put_many as it is

    def __init__(self):
        self.go, self.calls, self.kept = threading.Event(), 0, []

    def put_many(self, entries):
        self.calls += 1
        assert self.go.wait(60)
        self.kept.extend(entries)


def _fed(writer: Writer, device: str) -> tuple[threading.Thread, list]:
    """A thread putting five one-entry batches (stand-ins with their keys on `device`) into `writer`; the numbers
    it has handed over."""
    handed: list = []

    def feed():
        for n in range(5):
            writer.put({f"k{n}": SimpleNamespace(keys=torch.zeros(1, device=device), nbytes=4)})
            handed.append(n)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    return feeder, handed


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_ctrl_c_while_the_writer_is_full_still_stores_the_batch_it_was_handing_over(device):
    store = SlowStore()
    store.go.set()
    writer, queued = Writer(store), []
    put = writer._batches.put

    def interrupted_once(item, *args, **kwargs):
        if not queued:
            queued.append(item)
            raise KeyboardInterrupt  # as if Ctrl-C came while put waited for room
        put(item, *args, **kwargs)

    writer._batches.put = interrupted_once
    with pytest.raises(KeyboardInterrupt):
        writer.put({"k0": SimpleNamespace(keys=torch.zeros(1, device=device), nbytes=4)})
    writer.flush()
    assert store.kept == ["k0"]


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_the_writer_holds_at_most_its_depth_so_a_slow_store_slows_the_compile(device):
    """In host memory: one batch being written, two waiting, and the fourth put waits. Still on a GPU (meta tensors
    stand in): one being written, and the next put waits for it, as device memory holds what waits."""
    store = SlowStore()
    writer = Writer(store, depth=2)
    feeder, handed = _fed(writer, device)
    while store.calls < 1:  # the writer thread holds the first batch in put_many
        threading.Event().wait(0.01)
    feeder.join(0.5)
    assert feeder.is_alive() and handed == ([0, 1, 2] if device == "cpu" else [0])
    store.go.set()
    feeder.join(60)
    writer.flush()
    assert handed == [0, 1, 2, 3, 4] and writer.written == 5 and store.kept == [f"k{n}" for n in range(5)]


def test_ctrl_c_while_flush_waits_for_the_store_says_how_many_batches_it_gave_up():
    """The writer thread is a daemon: what it has not stored when a second Ctrl-C ends the wait dies with the
    process, so flush must not return as if it were stored (the CLI said "finished chunks are stored")."""
    from ragcache.errors import WritesAbandoned

    store = SlowStore()
    writer = Writer(store, depth=2)
    writer.put({"k0": SimpleNamespace(keys=torch.zeros(1), nbytes=4)})
    writer.put({"k1": SimpleNamespace(keys=torch.zeros(1), nbytes=4)})
    while store.calls < 1:  # k0 is being written, k1 waits
        threading.Event().wait(0.01)

    def join(timeout=None):
        raise KeyboardInterrupt

    writer._thread.join = join
    with pytest.raises(WritesAbandoned) as caught:
        writer.flush()
    assert caught.value.batches == 2 and isinstance(caught.value, KeyboardInterrupt)
    store.go.set()  # the batch under way ends; the one waiting is dropped, not written behind the caller's back
    writer._thread.join = type(writer._thread).join.__get__(writer._thread)
    writer._thread.join(30)
    assert store.kept == ["k0"] and not writer._thread.is_alive()


class Dies(BaseException):
    """What no `except Exception` catches."""


class DyingStore:
    """A store whose write kills the writer thread."""

    takes_device_entries = True

    def put_many(self, entries):
        raise Dies


def _fed_until_it_fails(depth: int, device: str, flush: bool) -> list:
    """Put one-entry batches into a writer over a DyingStore (and flush) on a thread; what it raised, within 30 s."""
    writer, outcome = Writer(DyingStore(), depth=depth), []

    def feed():
        try:
            for n in range(depth + 2):
                writer.put({f"k{n}": SimpleNamespace(keys=torch.zeros(1, device=device), nbytes=4)})
            if flush:
                writer.flush()
            outcome.append("returned")
        except StoreError as exc:
            outcome.append(exc)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    feeder.join(30)
    assert not feeder.is_alive(), "a put or flush waits for a writer thread that is gone"
    return outcome


def test_a_writer_thread_that_died_fails_the_puts_and_flush_instead_of_hanging_or_claiming_them_stored():
    outcome = _fed_until_it_fails(depth=1, device="cpu", flush=True)
    assert isinstance(outcome[0], StoreError) and "stopped" in str(outcome[0])


def test_a_writer_thread_that_died_fails_a_device_batch_waiting_for_its_turn():
    """A batch still on a GPU waits for the one before it to be stored: with the thread dead, that wait never
    ended (meta tensors stand in for the GPU's)."""
    outcome = _fed_until_it_fails(depth=2, device="meta", flush=False)
    assert isinstance(outcome[0], StoreError) and "stopped" in str(outcome[0])


def test_a_callback_that_raises_does_not_stop_the_writes_behind_it():
    store = SlowStore()
    store.go.set()
    writer = Writer(store)
    writer.put({"k0": SimpleNamespace(keys=torch.zeros(1), nbytes=4)}, then=lambda: 1 / 0)
    writer.put({"k1": SimpleNamespace(keys=torch.zeros(1), nbytes=4)})
    writer.flush()
    assert store.kept == ["k0", "k1"] and writer.written == 2


def test_progress_reports_the_bytes_stored_and_ends_with_all_of_them():
    rc = engine()
    seen = []
    report = rc.compile_documents(TEXTS[:3], progress=lambda r: seen.append(r.stored_bytes))
    assert seen == sorted(seen) and seen[-1] == report.stored_bytes == report.bytes > 0
    rc.close()


def _two_callers(rc, chunks, first_kwargs=None, second_kwargs=None):
    """`rc._ensure` of the same chunks on two threads, the second reading the store while the first is about to
    compile (its first compile sequence waits for that read): (reports or errors, by name)."""
    reads, second_read, lock = [], threading.Event(), threading.Lock()
    read, make = rc.catalog.read, rc._compile_sequence

    def counted_read(*args, **kwargs):
        found = read(*args, **kwargs)
        with lock:
            reads.append(threading.current_thread().name)
            if len(reads) == 2:
                second_read.set()
        return found

    def held_make(*args, **kwargs):
        if threading.current_thread().name == "first":
            assert second_read.wait(60)
        return make(*args, **kwargs)

    rc.catalog.read, rc._compile_sequence = counted_read, held_make
    out = {}

    def ensure(name, kwargs):
        try:
            out[name] = rc._ensure(chunks, rc.layouts["default"], **kwargs)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out[name] = exc

    first = threading.Thread(target=ensure, args=("first", first_kwargs or {}), name="first")
    first.start()
    while not reads:
        time.sleep(0.005)
    second = threading.Thread(target=ensure, args=("second", second_kwargs or {}), name="second")
    second.start()
    for t in (first, second):
        t.join(120)
    return out


def test_two_requests_missing_the_same_chunks_compile_them_once():
    """Concurrent queries over one new document: the second takes the first's compiles (Flights) instead of
    running every chunk through the model again, and both get the entries a compile alone gives."""
    rc = engine()
    chunks = rc.catalog.draft(TEXTS[0]).chunks
    out = _two_callers(rc, chunks)
    (entries, first), (taken, second) = out["first"], out["second"]
    assert first.compiled == len(chunks) and second.compiled == 0 and second.shared == len(chunks)
    for mine, theirs in zip(entries, taken):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
    assert all(rc.store.contains_many([rc.compiler.key(ids, rc.layouts["default"]) for ids in chunks]))
    rc.close()


def test_a_chunk_in_the_writers_hands_is_taken_by_a_query_not_compiled_again():
    """A compile's claims were let go once its batch was handed to the writer, before it was stored: a query missing
    the chunk then (not in the store yet, nobody compiling it) compiled it again."""

    class Slow(MemoryStore):
        def __init__(self):
            super().__init__()
            self.go, self.writing = threading.Event(), threading.Event()

        def put_many(self, items):
            self.writing.set()
            assert self.go.wait(60)
            super().put_many(items)

    store = Slow()
    rc = engine(store)
    calls, entry = [], rc.compiler.entry
    rc.compiler.entry = lambda *args: (calls.append(threading.current_thread().name), entry(*args))[1]
    upload = threading.Thread(target=rc.compile_documents, args=([TEXTS[0]],), name="upload")
    upload.start()
    assert store.writing.wait(60)  # compiled, in the writer's hands
    compiled = len(calls)
    answer = rc.query("Where is it?", [{"text": TEXTS[0]}], max_new_tokens=1)
    store.go.set()
    upload.join(60)
    assert len(calls) == compiled and answer.stats.compiled_chunks == 0  # taken from the upload's compile
    rc.close()


def test_a_compile_another_request_waited_for_that_fails_is_compiled_by_the_waiter():
    rc = engine()
    chunks = rc.catalog.draft(TEXTS[1]).chunks[:1]
    entry, calls, wait, waiting = rc.compiler.entry, [], rc.catalog.flights.wait, threading.Event()

    def fails_first(keys, values, token_ids, layout):
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            assert waiting.wait(60)  # the second caller waits for this compile
            raise ValueError("this chunk cannot be encoded")
        return entry(keys, values, token_ids, layout)

    def signalled_wait(theirs, *args):
        if theirs:
            waiting.set()
        return wait(theirs, *args)

    rc.compiler.entry, rc.catalog.flights.wait = fails_first, signalled_wait
    out = _two_callers(rc, chunks)
    assert isinstance(out["first"], CompileFailed) and isinstance(out["first"].__cause__, ValueError)
    entries, report = out["second"]
    assert report.compiled == 1 and report.shared == 0 and len(calls) == 2
    other = engine()
    alone = other._ensure(chunks, other.layouts["default"])[0][0]
    assert torch.equal(entries[0].keys, alone.keys) and torch.equal(entries[0].values, alone.values)
    rc.close()
    other.close()


def test_progress_counts_a_document_ready_once_its_chunks_are_compiled():
    """`ragcache compile`'s bar counts documents whose chunks are compiled, not documents taken in: those wait for a
    batch of COMPILE_STEPS steps' rows, so a bar of documents taken in was full before anything was compiled."""
    rc = engine()
    seen = []
    rc.compile_documents(TEXTS[:3], progress=lambda r: seen.append((r.documents, r.ready, r.compiled_chunks)))
    assert all(ready == 0 for _, ready, compiled in seen if compiled == 0) and seen[-1][:2] == (3, 3)
    again = []
    rc.compile_documents(TEXTS[:3], progress=lambda r: again.append((r.documents, r.ready)))
    assert all(documents == ready for documents, ready in again)  # all compiled before: ready as taken in
    rc.close()


def test_a_document_longer_than_a_batch_is_compiled_and_stored_a_batch_at_a_time():
    """Batches were cut between documents only: a book's every chunk was one batch, its entries held (in memory, on
    a GPU) until the last was compiled, and a crash before that stored none of them; its progress stood still."""
    rc = engine(row_budget=16)
    groups, compile_group = [], rc._compile

    def record(chunks, layout, writer=None):
        groups.append(sum(map(len, chunks)))
        return compile_group(chunks, layout, writer)

    rc._compile = record
    book = " ".join(TEXTS * 4)
    report = rc.compile_documents([book])
    chunks = rc.document_chunks(document_id(book))
    assert report.compiled_tokens > 4 * rc._compile_rows() and len(groups) > 4
    assert max(groups) < rc._compile_rows() + max(map(len, chunks))  # a batch ends at the chunk that fills it
    assert all(rc.store.contains_many([rc.compiler.key(ids, rc.layouts["default"]) for ids in chunks]))
    assert report.ready == 1
    rc.close()


def test_a_compile_stores_the_chunks_it_took_from_a_query_whose_write_failed():
    """Storing is a compile's job: chunks it took from a query's compile (Flights) whose store write failed, logged
    and left to a later request, are written by the compile's own writer."""
    rc = engine()
    chunks = rc.catalog.draft(TEXTS[2]).chunks
    put_many, failed = rc.store.put_many, []

    def refuses_once(items):
        if not failed:
            failed.append(len(items))
            raise StoreError("the store blinked")
        return put_many(items)

    rc.store.put_many = refuses_once
    writer = Writer(rc.store)
    out = _two_callers(rc, chunks, second_kwargs={"writer": writer})
    writer.flush()
    assert out["first"][1].unstored is not None and out["second"][1].shared == len(chunks)
    assert all(rc.store.contains_many([rc.compiler.key(ids, rc.layouts["default"]) for ids in chunks]))
    rc.close()


def test_a_failed_write_is_still_reported_when_a_later_write_of_the_same_call_succeeds():
    """A call may keep entries in several batches (its own compiles, then one it took over from a failed flight):
    the first batch's failed write must not be overwritten by the next one's success, or a compile reports
    entries stored that are not."""
    from ragcache.catalog import Catalog, EnsureReport
    from tests.test_store import make_entry

    store = MemoryStore()
    put_many, calls = store.put_many, []

    def refuses_first(items):
        calls.append(len(items))
        if len(calls) == 1:
            raise StoreError("the store blinked")
        return put_many(items)

    store.put_many = refuses_first
    catalog, report = Catalog(store, tiny.tokenizer(), "t" * 64, 8), EnsureReport()
    first, second = (dict([make_entry(seed, layers=2, tokens=4)]) for seed in (1, 2))
    catalog.keep(first, report)
    catalog.keep(second, report)
    assert calls == [1, 1] and isinstance(report.unstored, StoreError) and report.compiled == 2


def test_one_text_given_for_a_list_of_documents_is_refused():
    """`compile_documents("some text")` compiled each character as a document (or failed on a space as empty)."""
    from ragcache.errors import BadRequest

    rc = engine()
    for texts in ("hello", b"hello", {"a": "b"}):
        with pytest.raises(BadRequest, match="list of texts"):
            rc.compile_documents(texts)
    assert rc.store.record_names() == []
    by_name = {"a": "The bridge is old. It was built of stone."}
    assert rc.compile_documents(by_name.values()).documents == 1  # any collection of texts, a dict's values too
    rc.close()
