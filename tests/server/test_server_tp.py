"""`ridge serve --tensor-parallel-size 2` as a process on the CPU: it answers the official openai
client with the tokens one rank gives; a worker that dies fails the requests in flight and the
server then answers 503 (health and requests), and on SIGTERM it exits leaving no process and no
shared-memory segment behind."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from ridge import LLM, SamplingParams
from tests.tests_support import leaked_step_rings

KEY, MODEL = "tp-key", "tiny"


def children(pid: int) -> list[int]:
    """Process ids whose parent is pid (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


def cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


def test_serve_tensor_parallel_answers_openai_then_503_after_a_worker_dies(checkpoints, tmp_path):
    model = checkpoints("llama")
    prompt = "def fib(n):"
    want = LLM(model, device="cpu", show_progress=False, max_model_len=256).generate(
        prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ridge", "serve", "--model", model, "--served-model-name", MODEL, "--api-key", KEY,
             "--device", "cpu", "--port", "0", "--max-model-len", "1024", "--kv-cache-memory", "4000000",
             "--tensor-parallel-size", "2"],
            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    try:
        deadline, url = time.monotonic() + 120, None
        while url is None:
            text = log_path.read_text()
            assert proc.poll() is None, text[-3000:]
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", text)
            if m and "engine ready" in text:
                url = m.group(1)
            assert time.monotonic() < deadline, text[-3000:]
            time.sleep(0.1)
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == want and r.usage.completion_tokens == 12
        chunks = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=6, stream=True)
        assert len([c for c in chunks if c.choices and c.choices[0].delta.content is not None]) >= 1

        workers = [p for p in children(proc.pid) if "spawn_main" in cmdline(p) and "resource_tracker" not in cmdline(p)]
        assert len(workers) == 1
        failed, streaming = [], threading.Event()

        def long_stream():
            try:
                for _ in client.completions.create(model=MODEL, prompt=prompt, max_tokens=1000, stream=True,
                                                   extra_body={"ignore_eos": True}):
                    streaming.set()
            except openai.APIError as e:
                failed.append(str(e))

        t = threading.Thread(target=long_stream)
        t.start()
        assert streaming.wait(30)
        os.kill(workers[0], signal.SIGKILL)
        t.join(30)
        assert not t.is_alive() and failed and "rank 1" in failed[0] and "SIGKILL" in failed[0]
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 503 and "rank 1" in health.text
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        assert e.value.status_code == 503

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert not children(proc.pid)
    assert not leaked_step_rings()           # the server's ring went with it (a killed worker's too)
    assert "was killed by signal SIGKILL" in log_path.read_text()
