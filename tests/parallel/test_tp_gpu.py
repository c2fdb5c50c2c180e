"""Tensor parallelism on two GPUs (NCCL; needs 2 GPUs: the device tool's nvidia-h100-x2). Float32
with the torch attention backend: TP = 2 gives TP = 1's and transformers' greedy tokens. bf16 with
the Triton kernels, decode CUDA graphs (all-reduces captured inside) and overlapped steps: close
to TP = 1 and graphs on both ranks. A killed worker under NCCL: RankFailure naming it, in bounded
time (the watcher aborts the communicators a dead rank left waiting), nothing left behind."""
import os
import signal
import time

import pytest
import torch

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")          # NVLink multicast off (the device tool's rule)

from ridge import LLM, SamplingParams  # noqa: E402
from ridge.parallel import RankFailure  # noqa: E402
from tests.tests_support import prompt_of  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]
SHAPE = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=1000, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from ridge.utils.random_checkpoint import make_random_checkpoint
    root = tmp_path_factory.mktemp("tpgpu")
    return {"llama": make_random_checkpoint(str(root / "llama"), **SHAPE),
            "qwen3moe": make_random_checkpoint(str(root / "qwen3moe"), arch="qwen3moe", moe_intermediate_size=256,
                                               **SHAPE)}


@pytest.fixture
def model(models):
    return models["llama"]


def released(pool) -> bool:
    for pid in pool.pids:
        try:
            os.kill(pid, 0)
            return False
        except ProcessLookupError:
            pass
    return not os.path.exists(f"/dev/shm/{pool.ring_name.lstrip('/')}")


def test_float32_greedy_matches_one_gpu_and_transformers(model):
    from transformers import AutoModelForCausalLM
    from tests.models.test_hf_parity import hf_greedy

    prompts = [prompt_of(n, salt=i, vocab=1000) for i, n in enumerate((5, 40, 17))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(dtype="float32", attention_backend="torch", max_model_len=256, show_progress=False)
    one = [o.outputs[0].token_ids for o in LLM(model, **kw).generate(prompts, params, use_tqdm=False)]
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with LLM(model, tensor_parallel_size=2, **kw) as llm:
        two = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        pool = llm.engine.runner.workers
    assert two == one
    assert two == [hf_greedy(hf, p, 24) for p in prompts]
    assert released(pool)


@pytest.mark.parametrize("name", ["llama", "qwen3moe"])
def test_bf16_graphs_and_overlap_on_both_ranks(models, name):
    model = models[name]
    prompts = [prompt_of(n, salt=i, vocab=1000) for i, n in enumerate((5, 40, 17, 9))]
    kw = dict(max_model_len=256, max_num_seqs=8, show_progress=False)
    one = LLM(model, **kw)
    first = SamplingParams(temperature=0, max_tokens=1)
    with LLM(model, tensor_parallel_size=2, **kw) as llm:
        engine = llm.engine
        assert engine.runner.decode_graphs.graphs                      # captured, collectives inside
        logits = []
        for e in (one.engine, engine):
            for p in prompts:
                e.add_request(p, first)
            logits.append(e.runner.execute(e.scheduler.schedule()).logits)
            for rid in list(e.requests):
                e.abort(rid)
        rel = ((logits[1] - logits[0]).norm(dim=-1) / logits[0].norm(dim=-1)).max().item()
        assert rel < 2e-2, rel
        params = SamplingParams(temperature=0.8, seed=3, max_tokens=32, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 32 for o in outs)
        st = engine.stats()
        assert st.num_decode_steps > 0 and st.num_overlapped_steps > 0
        pool = engine.runner.workers
    assert released(pool)


def test_killed_worker_under_nccl_fails_in_bounded_time(model):
    llm = LLM(model, tensor_parallel_size=2, max_model_len=512, show_progress=False)
    pool, engine = llm.engine.runner.workers, llm.engine
    for n in (5, 12):
        engine.add_request(prompt_of(n, vocab=1000), SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    for _ in range(3):
        engine.step()
    os.kill(pool.pids[0], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 .* was killed by signal SIGKILL"):
        for _ in range(400):
            engine.step()
    assert time.monotonic() - t0 < 60
    llm.close()
    assert released(pool)


def test_hung_worker_under_nccl_fails_after_the_timeout(model):
    """A stopped worker stalls rank 0 on its GPU (the collective never completes): the watcher
    fails the pool once the device wait outlasts distributed_timeout_seconds."""
    llm = LLM(model, tensor_parallel_size=2, max_model_len=512, show_progress=False, distributed_timeout_seconds=5)
    pool = llm.engine.runner.workers
    llm.generate([prompt_of(5, vocab=1000)], SamplingParams(max_tokens=4), use_tqdm=False)
    os.kill(pool.pids[0], signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 hung|did not finish"):
        llm.generate([prompt_of(9, vocab=1000)], SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)
    assert time.monotonic() - t0 < 60
    llm.close()
    assert released(pool)


def test_ridge_generate_under_torchrun_on_two_gpus(model):
    """torchrun starts both ranks (external_launcher): NCCL through env://, the ring on one host."""
    import subprocess
    import sys

    from tests.tests_support import free_port

    kw = dict(dtype="float32", attention_backend="torch", max_model_len=256, show_progress=False)
    want = LLM(model, **kw).generate("def fib(n):", SamplingParams(temperature=0, max_tokens=12),
                                     use_tqdm=False)[0].outputs[0].text
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          str(free_port()), "-m", "ridge", "generate", "--model", model, "--dtype", "float32",
                          "--attention-backend", "torch", "--max-model-len", "256", "--max-tokens", "12",
                          "--tensor-parallel-size", "2", "--distributed-executor-backend", "external_launcher",
                          "def fib(n):"], env=dict(os.environ, PYTHONPATH=os.getcwd()), capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout == want + "\n"

