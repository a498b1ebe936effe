"""The README's "On vLLM" section runs as written: its Python block in this process, and vLLM's OpenAI server with its
exact flags in a subprocess (vLLM's engine then runs in processes of its own: the plugin and the connector load
there from the entry point, as for any user)."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.redis_server import free_port
from tests.test_readme import README, python_blocks

# How long a script of the README's or a server may take to start vLLM and answer before the test counts it hung: a
# bound on a wait, ended as soon as the work is. About a minute here with one test worker; the suite runs two workers
# on two cores, under load too, so the bound is ten times that (still inside pytest's 900 s per test).
SERVE_TIMEOUT_S = 600


def test_the_python_block_answers_from_linked_caches(tmp_path):
    """As a user runs it: a script of its own (vLLM keeps one KV connector per process)."""
    script = tmp_path / "block.py"
    script.write_text(python_blocks()["On vLLM"])
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # vLLM's default: its engine in a process of its own
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=SERVE_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = re.search(r"^(.*27 kilometres.*) (\d+)$", done.stdout, flags=re.M)  # vLLM logs to stdout too
    assert printed, done.stdout[-3000:]
    assert int(printed.group(2)) >= 40  # the system prefix and both documents were linked


def section_blocks(language: str) -> list[str]:
    section = README.read_text().split("## On vLLM", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


def serve_command(program: str = "vllm.entrypoints") -> str:
    """The README's command that runs `program`, without its comments (the test appends flags to its end)."""
    block = next(block for block in section_blocks("bash") if program in block)
    return "\n".join(line for line in (line.split("#", 1)[0].rstrip() for line in block.splitlines()) if line.strip())


def wait_healthy(server: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + SERVE_TIMEOUT_S
    while time.monotonic() < deadline:
        assert server.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    pytest.fail("the server did not start: " + log.read_text()[-3000:])


def stop(server: subprocess.Popen) -> None:
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)


def test_the_engine_block_answers_on_vllm(tmp_path):
    """`RagCache.open(..., engine="vllm")` as the README's first block runs it, as a script of its own. In vLLM's CI
    mode (conftest) the first forward fixes the graph vLLM runs every later step with, and this block's first is
    the compile of its document."""
    script = tmp_path / "engine.py"
    script.write_text(section_blocks("python")[0])
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=SERVE_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"^.*41 (metres|meters).*$", done.stdout, flags=re.M), done.stdout[-3000:]
    logged = done.stdout + done.stderr  # vLLM logs to both
    for noise in ("EngineDeadError", "Traceback", "Exception ignored"):  # rc.close() stops vLLM quietly
        assert noise not in logged, logged[-3000:]


def test_ragcache_serve_on_vllm_with_the_readme_flags(tmp_path, engine):
    """`ragcache serve --engine vllm` as the README writes it: upload, then a linked query over REST, answered as
    ragcache's own engine answers it."""
    port = free_port()
    command = serve_command("ragcache serve").replace("disk:./.ragcache", f"disk:{tmp_path / 'store'}")
    command = command.replace(".venv-vllm/bin/ragcache", shlex.quote(str(Path(sys.executable).parent / "ragcache")))
    command += f" --port {port} --dtype float32"
    log = tmp_path / "serve.log"
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
           "HOME": os.environ.get("HOME", "/root"), "VLLM_CPU_CI_ENV": os.environ["VLLM_CPU_CI_ENV"]}
    server = subprocess.Popen(["bash", "-c", command], stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                              cwd=tmp_path, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(server, url, log)
        text = "The Amber Line railway is 27 kilometres long and has nine stations."
        uploaded = httpx.post(f"{url}/v1/documents", json={"documents": [{"text": text}]}, timeout=300)
        assert uploaded.status_code == 201, uploaded.text
        ids = uploaded.json()["ids"]
        question = "How long is the Amber Line railway?"
        reply = httpx.post(f"{url}/v1/query", json={"question": question, "documents": ids, "max_tokens": 12},
                           timeout=300)
        assert reply.status_code == 200, reply.text
        assert reply.json()["answer"] == engine.query(question, [{"text": text}], max_new_tokens=12).text
        kill_engine_core(server)
        assert wait_status(f"{url}/health", 503).json()["error"]["message"].startswith("vLLM's engine core has stopped")
    finally:
        stop(server)


def linked_tokens(url: str) -> float:
    """The connector's count of prompt tokens linked, from vLLM's server's metrics."""
    scraped = httpx.get(f"{url}/metrics").text
    return sum(float(m) for m in re.findall(r"^vllm:ragcache_linked_tokens_total\{.*\} (\S+)$", scraped, flags=re.M))


def wait_for(condition, what: str, log: Path, timeout_s: float = 120) -> None:
    """vLLM's stat logger publishes a step's counters after the step: poll until they show (a wait that ends as soon
    as they do; its bound only ends a hang, and a loaded machine's server publishes late)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: " + log.read_text()[-3000:]
        time.sleep(0.2)


def kill_engine_core(server: subprocess.Popen) -> None:
    """SIGKILL the server's vLLM engine core process (its own process, in the server's session)."""
    import psutil

    cores = [p for p in psutil.Process(server.pid).children(recursive=True) if "EngineCore" in " ".join(
        [p.name(), *p.cmdline()])]
    assert cores, [p.cmdline() for p in psutil.Process(server.pid).children(recursive=True)]
    for core in cores:
        core.kill()


def wait_status(url: str, status: int, timeout_s: float = 120) -> httpx.Response:
    """Poll `url` until it answers `status`. A request that times out is asked again within the deadline (a 5 s read
    timeout, which a loaded machine's server can pass on its way to the answer, would fail the test outright)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            reply = httpx.get(url, timeout=30)
        except httpx.TimeoutException:
            assert time.monotonic() < deadline, f"{url} did not answer"
            continue
        if reply.status_code == status or time.monotonic() > deadline:
            assert reply.status_code == status, reply.text
            return reply
        time.sleep(0.5)


def test_vllms_server_with_the_readme_flags_links(tmp_path, engine, doc_ids):
    """The README's command, with its flags for a link adapter as vLLM's LoRA: a request naming the adapter is
    answered as ragcache's engine answers with it (the connector adding the LoRA on the rows it recomputes), and one
    that does not as the base model, from one server."""
    import torch
    from safetensors.torch import load_file, save_file

    from bench.adapter import random_adapter
    from ragcache import models
    from ragcache.facade import RagCache
    from ragcache.integrations.vllm.spec import link_request

    torch.manual_seed(0)
    adapter = random_adapter(engine.lm, tmp_path / "adapter", rank=4)
    tensors = load_file(adapter / "adapter_model.safetensors")  # stronger, so that its term on the rows a link
    save_file({k: 4 * t if "lora_B" in k else t for k, t in tensors.items()}, adapter / "adapter_model.safetensors")
    port = free_port()
    store = engine.store.root
    command = serve_command().replace("disk:./.ragcache", f"disk:{store}")
    command = command.replace(".venv-vllm/bin/python", shlex.quote(sys.executable)) + f" --port {port}"
    command += f" --dtype float32 --enable-lora --lora-modules link={shlex.quote(str(adapter))}"
    log = tmp_path / "serve.log"
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
           "VLLM_CPU_CI_ENV": os.environ["VLLM_CPU_CI_ENV"]}
    server = subprocess.Popen(["bash", "-c", command], stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                              cwd=tmp_path, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(server, url, log)
        model = next(m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"] if m["id"] != "link")
        question = "What do bees make, and where do they keep it?"
        adapted = RagCache(models.load("smollm2-135m", dtype="float32", adapter=adapter, merge=False), engine.store)
        for served, rc, algorithm in ((model, engine, "naive"), ("link", adapted, "naive"), ("link", adapted, "focus")):
            request = link_request(rc, question, doc_ids, algorithm=algorithm)
            body = {"model": served, "prompt": request["prompt_token_ids"], "cache_salt": request["cache_salt"],
                    "kv_transfer_params": request["kv_transfer_params"], "max_tokens": 8, "temperature": 0}
            before = linked_tokens(url)
            reply = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
            assert reply.status_code == 200, reply.text
            expected = rc.query(question, doc_ids, algorithm=algorithm, max_new_tokens=8).text
            assert reply.json()["choices"][0]["text"].strip() == expected.strip(), (served, json.dumps(reply.json()))
            wait_for(lambda: linked_tokens(url) > before, f"{served} {algorithm} was not linked", log)
            did = reply.json()["kv_transfer_params"]["ragcache_link"]  # the connector's, for this request
            assert did["hits"] >= len(doc_ids) and did["misses"] == did["compiled"] == 0 and did["fetch_s"] > 0, did
        assert "vllm:ragcache_link_fallbacks_total{" not in httpx.get(f"{url}/metrics").text
        assert expected != engine.query(question, doc_ids, algorithm="focus", max_new_tokens=8).text  # it mattered
    finally:
        stop(server)
