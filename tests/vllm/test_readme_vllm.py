"""The README's "On vLLM" section runs as written: its Python block in this process, and vLLM's OpenAI server with its
exact flags in a subprocess (vLLM's engine then runs in processes of its own: the plugin and the connector load
there from the entry point, as for any user)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.redis_server import free_port
from tests.test_readme import README, python_blocks

SERVE_TIMEOUT_S = 240


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


def serve_command() -> str:
    section = README.read_text().split("## On vLLM", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    return "\n".join(line for line in block.splitlines() if not line.lstrip().startswith("#"))


def test_vllms_server_with_the_readme_flags_links(tmp_path, engine, doc_ids):
    from ragcache.integrations.vllm.spec import link_request

    port = free_port()
    store = engine.store.root
    command = serve_command().replace("disk:./.ragcache", f"disk:{store}")
    command = command.replace("python -", f"{shlex.quote(sys.executable)} -") + f" --port {port}"
    command += ' --dtype float32'
    log = (tmp_path / "serve.log").open("w")
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
    server = subprocess.Popen(["bash", "-c", command], stdout=log, stderr=subprocess.STDOUT, env=env,
                              cwd=tmp_path, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVE_TIMEOUT_S
        while time.monotonic() < deadline:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        else:
            pytest.fail("vllm serve did not start: " + (tmp_path / "serve.log").read_text()[-3000:])
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        question = "What do bees make, and where do they keep it?"
        request = link_request(engine, question, doc_ids, algorithm="naive")
        body = {"model": model, "prompt": request["prompt_token_ids"], "cache_salt": request["cache_salt"],
                "kv_transfer_params": request["kv_transfer_params"], "max_tokens": 8, "temperature": 0}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
        assert reply.status_code == 200, reply.text
        expected = engine.query(question, doc_ids, algorithm="naive", max_new_tokens=8).text
        assert reply.json()["choices"][0]["text"].strip() == expected.strip(), json.dumps(reply.json())
    finally:
        import signal

        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
