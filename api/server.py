"""Serve the API with uvicorn: `ragcache serve` calls run(settings, workers=N).

One worker process owns one engine (model + store). With workers > 1 uvicorn imports `factory` in every worker,
which reads the settings from the environment and loads its own engine; share documents between workers with a
disk or Redis store (memory: and gpu tiers are per process). Each process bounds its client connections
(api/connections.py: deadlines on a request's head and body, a cap below its open-file limit)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile

import uvicorn
from fastapi import FastAPI
from prometheus_client import multiprocess
from uvicorn.config import STARTUP_FAILURE
from uvicorn.supervisors import Multiprocess

from ragcache import linker
from ragcache.engine import map_large_blocks
from ragcache.errors import CannotListen, EngineDown, ParameterOutOfRange
from ragcache.facade import RagCache
from ragcache.front import Front
from ragcache.settings import Settings, refuse_another_gpu, resolve_device
from ragcache.store import check_url, per_process, shown

from .app import create_app, is_loopback
from .connections import Config, Limits
from .metrics import MULTIPROC_ENV, WORKERS_ENV

SETTINGS_ENV = "RAGCACHE_API_SETTINGS_JSON"
SUPERVISOR_ENV = "RAGCACHE_API_SUPERVISOR_PID"  # the `serve --workers` process its workers may ask to stop
WORKER_HEALTHCHECK_S = 300
GRACEFUL_SHUTDOWN_S = 10  # then open streams are cancelled (their generations stop at the next token)
log = logging.getLogger("ragcache.api")


def open_engine(settings: Settings) -> Front:
    map_large_blocks()  # a server runs for days: freed K/V caches go back to the system (allocator.map_large_blocks)
    rc = RagCache.from_settings(settings)
    rc.warmup()
    return rc


def factory() -> FastAPI:
    """App factory for multi-worker serving (uvicorn --factory): one engine per worker process, which its app closes
    when the worker ends. A worker that cannot start exits with uvicorn's startup failure, which stops the
    supervisor instead of starting it again every half second."""
    settings = Settings.model_validate_json(os.environ[SETTINGS_ENV])
    log_info()  # a worker is a process of its own
    # (no SIGTERM handler here: this runs inside uvicorn's serve, whose own handler it would replace; the app's
    # lifespan closes the engine on SIGTERM instead)
    rc = None
    try:
        rc = open_engine(settings)
        return create_app(rc, settings, owns_engine=True)  # it refuses defaults no request could run
    except Exception:
        log.exception("this worker cannot start its engine")
        if rc is not None:
            with contextlib.suppress(Exception):
                rc.close()
        logging.shutdown()
        sys.stderr.flush()
        # the supervisor would see the exit code and stop, unless its health check pinged this worker just before it
        # died: that ping waits out the check's timeout (minutes). So it is asked to stop now (it counts the code)
        if os.environ.get(SUPERVISOR_ENV) == str(os.getppid()):
            os.kill(os.getppid(), signal.SIGTERM)
        os._exit(STARTUP_FAILURE)


def terminate_by_exit():
    """SIGTERM as SystemExit: uvicorn stops serving on it and then raises the signal again under the handler it
    found, which by default ends the process on the spot, before `finally` blocks close the engine (the store's
    write-behind, vLLM's engine core). Under this handler the engine closes and the exit status is still 143. The
    handler it replaces, to put back."""
    return signal.signal(signal.SIGTERM, _exit_on_term)


def _exit_on_term(signum, frame) -> None:
    raise SystemExit(128 + signum)


def config(app, settings: Settings, **kwargs) -> Config:
    """uvicorn's config for `app` (an app, or an import string with workers) under the settings' connection limits."""
    return Config(
        app,
        Limits.of(settings),
        host=settings.host,
        port=settings.port,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        **kwargs,
    )


def log_info() -> None:
    """ragcache's INFO lines (what loaded, on which device and why, the connection cap, refusals) on the server's
    output: `ragcache`'s entry point configures the root logger at WARNING before `serve` runs, and a second
    basicConfig does nothing, so the level is set on ragcache's own logger."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("ragcache").setLevel(logging.INFO)


def run(settings: Settings, workers: int = 1) -> None:
    log_info()
    if settings.algorithm is not None:  # a misspelt default would refuse every request; said before the model loads
        linker.algorithm(settings.algorithm)
    if settings.engine == "ragcache":  # before the port is taken and minutes of loading (or workers start)
        refuse_another_gpu(resolve_device(settings.device)[0])
    if workers > 1 and settings.engine == "vllm":
        raise ParameterOutOfRange(
            "one worker with --engine vllm: vLLM batches every request in one engine (and each "
            "worker would start its own)"
        )
    Limits.of(settings).cap()  # an open-file limit with no room for connections fails now, before the model loads
    if settings.api_key is None and not is_loopback(settings.host):
        log.warning(
            "no api_key, listening on %s: whoever reaches this address can upload, read, query and delete "
            "documents (set RAGCACHE_API_KEY)",
            settings.host,
        )
    if isinstance(settings.store, str):  # bad input before the port is taken and the model loads (or workers start)
        check_url(settings.store)
    # before the model loads: a taken port is said now, not minutes on
    sock = listening(settings.host, settings.port, inheritable=workers > 1)
    try:
        if workers > 1:
            _serve_workers(settings, workers, sock)
        else:
            _serve_one(settings, sock)
    finally:
        sock.close()


def _serve_workers(settings: Settings, workers: int, sock: socket.socket) -> None:
    if per_process(settings.store):
        log.warning("store %s is per process: with %d workers each one has its own documents", settings.store, workers)
    os.environ[SETTINGS_ENV] = settings.model_dump_json()
    os.environ[SUPERVISOR_ENV] = str(os.getpid())
    # the workers' metrics, added up by whichever answers a scrape (api/metrics.py); a folder of this run's only, as
    # files left by another run would add its counts
    if os.environ.get(MULTIPROC_ENV):
        log.warning("%s is set: the workers' metrics go to a folder of this run's instead", MULTIPROC_ENV)
    folder = tempfile.mkdtemp(prefix="ragcache-metrics-")
    os.environ[MULTIPROC_ENV] = os.environ[WORKERS_ENV] = folder
    try:
        _supervise(settings, workers, sock)
    finally:
        del os.environ[WORKERS_ENV], os.environ[MULTIPROC_ENV]
        shutil.rmtree(folder, ignore_errors=True)


def _supervise(settings: Settings, workers: int, sock: socket.socket) -> None:
    # a worker loading its model answers the supervisor's pings slowly: don't kill it for that
    served = config(
        "ragcache.api.server:factory",
        settings,
        factory=True,
        workers=workers,
        timeout_worker_healthcheck=WORKER_HEALTHCHECK_S,
    )
    supervisor = Supervisor(served, sockets=[sock])
    supervisor.run()
    failed = sum(p.exitcode == STARTUP_FAILURE for p in supervisor.processes)
    if failed:
        raise EngineDown(f"{failed} worker(s) could not start their engine; their log lines say why")
    if supervisor.terminated:  # as one process ends on it (terminate_by_exit): a service manager reads the same code
        raise SystemExit(128 + signal.SIGTERM)


class Supervisor(Multiprocess):
    """uvicorn's, which handles SIGTERM itself (it stops the workers and returns), remembering that it did, and
    which sees a worker that died during a health check at once."""

    terminated = False

    def handle_term(self) -> None:
        self.terminated = True
        super().handle_term()

    def init_processes(self) -> None:
        super().init_processes()
        self._let_go_of_child_ends()
        self._workers = self._pids()

    def keep_subprocess_alive(self) -> None:
        super().keep_subprocess_alive()
        self._let_go_of_child_ends()  # a worker started again
        # a worker gone (dead and started again, or ended by SIGHUP's restart or SIGTTOU): its gauges leave /metrics
        workers = self._pids()
        for pid in self._workers - workers:
            multiprocess.mark_process_dead(pid)
        self._workers = workers

    def _pids(self) -> set[int]:
        return {process.pid for process in self.processes if process.pid is not None}

    def _let_go_of_child_ends(self) -> None:
        # uvicorn keeps the worker's end of each health-check pipe open here too, so a ping sent just before a
        # worker died waited out the whole check (minutes: WORKER_HEALTHCHECK_S) before anyone saw it gone, the
        # SIGTERM its failing worker sent queued behind it; closed here, the worker's death ends the wait
        for process in self.processes:
            if process.process.pid is not None and not process.child_conn.closed:
                process.child_conn.close()


def _serve_one(settings: Settings, sock: socket.socket) -> None:
    previous = terminate_by_exit()
    try:
        log.info("loading %s and opening %s", settings.model, shown(settings.store))
        rc = open_engine(settings)
        try:
            served = config(create_app(rc, settings), settings)
            uvicorn.Server(served).run(sockets=[sock])  # the loop listens on it through a Listener
        finally:
            rc.close()
    finally:
        signal.signal(signal.SIGTERM, previous)


def listening(host: str, port: int, inheritable: bool = False) -> socket.socket:
    """A socket bound to the server's address, as uvicorn binds one (SO_REUSEADDR; not listening yet, so a client
    is refused while the model loads; an IPv6 address takes IPv4 too); CannotListen when another process holds it
    or the address is not this host's (uvicorn logs and exits with the code the CLI keeps for bad input).
    `inheritable`: for workers, which take it over from this process."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise CannotListen(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}; pick another --port (or --host), or stop what "
            "holds it"
        ) from exc
    sock.set_inheritable(inheritable)
    return sock
