"""The model thread is the only long-lived thread whose torch ops run in parallel (ragcache.engine.threads): a thread
that ran one parallel op on CPU keeps an OpenMP team while it lives, and with more team workers than cores every
model step ran 1.7-1.8x slower. Each test runs in a fresh interpreter (a shared test process starts and ends threads
of its own, which would blur the count), at two torch threads (the suite may run at one, where no team forms): a
caller on a new thread does the work, and the process's native threads are counted around it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

HARNESS = """
import os, threading, time
import torch

torch.set_num_threads(2)


def native():
    return len(os.listdir("/proc/self/task"))


def parallel_op():
    torch.randn(1 << 20).abs().sum()  # well past torch's grain of 32,768 elements


def on_a_fresh_thread(job):
    out = []

    def caller():
        before = native()
        result = job()
        deadline = time.monotonic() + 5  # a passing thread's workers leave as it ends
        while native() > before and time.monotonic() < deadline:
            time.sleep(0.05)
        out.extend([before, native(), result])

    thread = threading.Thread(target=caller)
    thread.start()
    thread.join()
    return out
"""


def run(check: str) -> None:
    script = HARNESS + textwrap.dedent(check)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_parallel_op_on_a_fresh_thread_leaves_a_team():
    """The premise: were it not so, the tests below could not fail."""
    run("""
        before, after, _ = on_a_fresh_thread(parallel_op)
        assert after > before, (before, after)
    """)


def test_the_probe_leaves_no_team_on_the_callers_thread():
    """The row-tile probe runs on a thread that ends with it; it fails if the probe runs on the caller's."""
    run("""
        from ragcache.engine import invariant

        def install():
            layers = torch.nn.Sequential(torch.nn.Linear(576, 1536, bias=False), torch.nn.Linear(1536, 576))
            invariant.install(layers, torch.device("cpu"), batch_invariant=True)

        before, after, _ = on_a_fresh_thread(install)
        assert after == before, (before, after)
    """)


def test_a_runner_starts_without_a_team_on_the_callers_thread():
    """A runner's start-up checks (the row tiles, and whether its attention is cut-invariant) run on threads that
    end with them; it fails if either runs on the caller's."""
    run("""
        from ragcache.engine.runner import Runner
        from tests import tiny

        lm = tiny.make("llama")
        before, after, runner = on_a_fresh_thread(lambda: Runner(lm))
        assert "prompt rows" in runner.invariance.how and after == before, (before, after)  # the check ran
    """)


def test_preparing_a_request_runs_inline_and_gives_the_caller_its_count_back():
    """A request is prepared on its caller's thread (entries read from the store, checked, decoded): inline, then
    the thread's own count back. It fails if preparing runs at the caller's thread count."""
    run("""
        from ragcache.engine import Sequence

        class Driver:
            def submit(self, sequence):
                pass

        seen = []

        def prepare(stats, cancelled):
            seen.append(torch.get_num_threads())
            parallel_op()
            return None, None, None

        def open_one():
            Sequence(Driver(), prepare, None).open(lambda output: None)
            return torch.get_num_threads()

        before, after, count = on_a_fresh_thread(open_one)
        assert seen == [1] and count == 2, (seen, count)
        assert after == before, (before, after)
    """)


def test_compute_inline_keeps_a_thread_from_forming_a_team_and_the_others_their_count():
    run("""
        from ragcache.engine import compute_inline

        def inline():
            compute_inline()
            parallel_op()
            return torch.get_num_threads()

        before, after, count = on_a_fresh_thread(inline)
        assert count == 1 and after == before, (count, before, after)
        assert on_a_fresh_thread(torch.get_num_threads)[2] == 2
    """)
