"""The one bridge from the thread a stream's events come from (the model thread, vLLM's loop) to its consumer: a
thread or a coroutine, events in order, errors raised, a consumer that leaves early cancelling the stream, and a
closed loop that the posting thread does not notice. No model: a stream here posts from a thread of its own."""

import asyncio
import threading
from contextlib import suppress

import pytest

from ragcache.engine import Aborted, Done, Failed, Inbox, Piece, apieces, pieces, wait


class Stream:
    """`open(listener)`/`cancel()` as an engine's stream: once opened, a thread of its own (the model thread's part)
    posts `events`; `post` sends more later, from another thread, and raises what that thread raised."""

    def __init__(self, *events):
        self.events, self.cancelled, self.listener = events, False, None
        self.poster: threading.Thread | None = None

    def open(self, listener) -> None:
        self.listener = listener
        self.poster = threading.Thread(target=self._post, args=self.events)
        self.poster.start()

    def cancel(self) -> None:
        self.cancelled = True

    def post(self, *events) -> None:
        errors = []

        def run():
            try:
                self._post(*events)
            except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
                errors.append(exc)

        poster = threading.Thread(target=run)
        poster.start()
        poster.join()
        if errors:
            raise errors[0]

    def _post(self, *events) -> None:
        for event in events:
            self.listener(event)


def test_a_thread_takes_the_events_another_thread_posts_in_order():
    stream = Stream(Piece("a"), Piece("b"), Done(None))
    inbox = Inbox(stream)
    inbox.open()
    assert [inbox.get(5), inbox.get(5)] == [Piece("a"), Piece("b")]
    assert not inbox.over
    assert inbox.get(5) == Done(None) and inbox.over
    inbox.close()  # after the last event: nothing to cancel
    assert not stream.cancelled and stream.poster is not threading.current_thread()


def test_a_thread_waits_at_most_its_timeout():
    inbox = Inbox(Stream())
    inbox.open()
    with pytest.raises(TimeoutError):
        inbox.get(0.05)


def test_pieces_gives_the_texts_and_raises_the_streams_error():
    assert list(pieces(Stream(Piece("a"), Piece("b"), Done(None)))) == ["a", "b"]
    texts = pieces(Stream(Piece("a"), Failed(ValueError("the engine failed"))))
    assert next(texts) == "a"
    with pytest.raises(ValueError, match="the engine failed"):
        next(texts)


def test_a_reader_that_stops_early_cancels_the_stream_and_one_that_reads_to_the_end_does_not():
    stream = Stream(Piece("a"), Piece("b"), Done(None))
    texts = pieces(stream)
    assert next(texts) == "a"
    texts.close()
    assert stream.cancelled
    failed = Stream(Failed(ValueError("x")))
    with pytest.raises(ValueError):
        list(pieces(failed))
    finished = Stream(Piece("a"), Aborted())
    assert list(pieces(finished)) == ["a"]
    assert not failed.cancelled and not finished.cancelled


def test_wait_skips_the_pieces_to_the_last_event_and_cancels_past_its_timeout():
    assert wait(Stream(Piece("a"), Piece("b"), Done(None)), 5) == Done(None)
    silent = Stream(Piece("a"))
    with pytest.raises(TimeoutError, match=r"within 0\.05 s"):
        wait(silent, 0.05)
    assert silent.cancelled


def test_a_coroutine_takes_the_events_on_its_loop_where_the_last_one_runs_on_last():
    async def main():
        arrived = []
        stream = Stream(Piece("a"), Done(None))
        loop = asyncio.get_running_loop()
        inbox = Inbox(stream, loop, on_last=lambda event: arrived.append((event, threading.current_thread())))
        await inbox.aopen()
        assert [await inbox.aget(), await inbox.aget()] == [Piece("a"), Done(None)]
        assert inbox.over and not stream.cancelled
        assert arrived == [(Done(None), threading.current_thread())]  # the loop's thread, not the poster's
        assert stream.poster is not threading.current_thread()

    asyncio.run(main())


def test_apieces_gives_the_texts_and_raises_the_streams_error():
    async def main():
        assert [text async for text in apieces(Stream(Piece("a"), Piece("b"), Done(None)))] == ["a", "b"]
        with pytest.raises(ValueError, match="the engine failed"):
            [text async for text in apieces(Stream(Piece("a"), Failed(ValueError("the engine failed"))))]

    asyncio.run(main())


def test_an_async_reader_that_leaves_or_whose_task_is_cancelled_cancels_the_stream():
    async def main():
        left = Stream(Piece("a"), Piece("b"), Done(None))
        texts = apieces(left)
        assert await anext(texts) == "a"
        await texts.aclose()
        assert left.cancelled

        endless = Stream(Piece("a"))
        first = asyncio.Event()

        async def read():
            async for _ in apieces(endless):
                first.set()

        task = asyncio.ensure_future(read())
        await asyncio.wait_for(first.wait(), 5)
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task
        assert endless.cancelled

    asyncio.run(main())


def test_events_posted_after_the_loop_closed_do_not_raise_on_the_posting_thread():
    stream = Stream()
    loop = asyncio.new_event_loop()

    async def open_inbox():
        await Inbox(stream, loop).aopen()

    loop.run_until_complete(open_inbox())
    loop.run_until_complete(loop.shutdown_default_executor())
    loop.close()
    stream.post(Piece("late"), Done(None))  # raises here what the posting thread raised
