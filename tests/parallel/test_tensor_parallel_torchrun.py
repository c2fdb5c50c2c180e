"""Tensor parallelism under torchrun (distributed_executor_backend "external_launcher"), on the CPU
over gloo: the ranks are torchrun's processes, rank 0 is the engine and LLM(...) on rank 1 serves
it until it closes. One host: the step ring (its name broadcast from rank 0); two "nodes" (two
torchrun launches on loopback): the broadcast channel. Both give one rank's tokens, through the
Python API and through `ridge generate`."""
import json
import os
import subprocess
import sys

import pytest

from ridge import LLM, SamplingParams
from tests.tests_support import free_port, leaked_step_rings


SCRIPT = """
import json, sys
from ridge import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(sys.argv[1], device="cpu", show_progress=False, max_model_len=256, tensor_parallel_size=2,
              distributed_executor_backend="external_launcher")
    out = llm.generate(json.loads(sys.argv[3]), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                       use_tqdm=False)
    channel = type(llm.engine.runner.workers.ring).__name__
    llm.close()
    json.dump(dict(tokens=[o.outputs[0].token_ids for o in out], channel=channel), open(sys.argv[2], "w"))
"""
PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(20, 60))]
ENV = dict(os.environ, PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1")


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


@pytest.fixture(scope="module")
def want(checkpoints):
    llm = LLM(checkpoints("llama"), device="cpu", show_progress=False, max_model_len=256)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16,
                                                                                 ignore_eos=True), use_tqdm=False)]


def test_one_host_takes_the_ring(checkpoints, tmp_path, want):
    script, out = tmp_path / "run.py", tmp_path / "out.json"
    script.write_text(SCRIPT)
    subprocess.run(torchrun("--nproc-per-node", "2", "--master-port", str(free_port()), str(script),
                            checkpoints("llama"), str(out), json.dumps(PROMPTS)), env=ENV, check=True, timeout=300)
    assert json.loads(out.read_text()) == dict(tokens=want, channel="StepRing")
    assert not leaked_step_rings()                           # the ring's segment is gone with the job


def test_two_nodes_take_the_broadcast_channel(checkpoints, tmp_path, want):
    script, out, port = tmp_path / "run.py", tmp_path / "out.json", str(free_port())
    script.write_text(SCRIPT)
    nodes = [subprocess.Popen(torchrun("--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "1",
                                       "--master-addr", "127.0.0.1", "--master-port", port, str(script),
                                       checkpoints("llama"), str(out), json.dumps(PROMPTS)), env=ENV)
             for n in (0, 1)]
    assert [p.wait(300) for p in nodes] == [0, 0]
    assert json.loads(out.read_text()) == dict(tokens=want, channel="BroadcastChannel")


def test_ridge_generate_under_torchrun(checkpoints):
    path = checkpoints("llama")
    one = LLM(path, device="cpu", show_progress=False, max_model_len=256).generate(
        "def fib(n):", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0].text
    run = subprocess.run(torchrun("--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "ridge", "generate",
                                  "--model", path, "--device", "cpu", "--max-model-len", "256", "--max-tokens", "8",
                                  "--tensor-parallel-size", "2", "--distributed-executor-backend", "external_launcher",
                                  "def fib(n):"),
                         env=ENV, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout == one + "\n"


def test_external_launcher_outside_torchrun_is_refused(checkpoints, monkeypatch):
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="^distributed_executor_backend: 'external_launcher' runs in processes"):
        LLM(checkpoints("llama"), device="cpu", tensor_parallel_size=2,
            distributed_executor_backend="external_launcher")
