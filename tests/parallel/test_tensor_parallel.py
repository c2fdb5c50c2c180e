"""Tensor parallelism on the CPU: two processes over gloo (rank 1 spawned by the engine, each step's
plan through the shared-memory step ring). TP = 2 gives TP = 1's tokens and transformers' greedy
ones; seeded sampling, n > 1 (copy-on-write pages), prefix caching, chunked prefill, preemption,
prompt scoring and speculation's draft rows run the same on both ranks; a dead or hung worker
is an error naming its rank, with no process or shared memory left behind."""
import gc
import os
import signal
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from ridge import LLM, SamplingParams
from ridge.parallel import RankFailure, TensorParallel
from tests.tests_support import PROMPT_LENGTHS, prompt_of
from tests.models.test_hf_parity import assert_first_step_logits_match, hf_greedy


TP2 = dict(device="cpu", show_progress=False, max_model_len=256, tensor_parallel_size=2)


def token_ids(llm, prompts, params):
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_released(llm) -> None:
    """Closed: the workers have exited and the ring's segment is gone."""
    pool = llm.engine.runner.workers
    llm.close()
    for pid in pool.pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not os.path.exists(f"/dev/shm/{pool.ring_name.lstrip('/')}")


@pytest.mark.parametrize("name", ["llama", "llama-mqa", "qwen3", "qwen2moe", "qwen3moe"])
def test_greedy_tokens_match_one_rank_and_transformers(checkpoints, name):
    """GQA (2 KV heads, one a rank), MQA (the one KV head copied onto both ranks), Qwen3 (q/k
    norms, tied embeddings: the shared table split by vocabulary), and mixture-of-experts models
    (each expert split by its intermediate columns; Qwen2-MoE's shared expert and q/k/v biases)."""
    path = checkpoints(name)
    prompts = [prompt_of(n, salt=i) for i, n in enumerate(PROMPT_LENGTHS)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    one = token_ids(LLM(path, device="cpu", show_progress=False, max_model_len=256), prompts, params)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, **TP2)
    try:
        runner = llm.engine.runner
        assert runner.model.model.layers[0].self_attn.heads == 2 and runner.cache_row[1] == 1
        engine = llm.engine
        assert_first_step_logits_match(engine, hf, prompts, name)
        two = token_ids(llm, prompts, params)
        assert two == one
        assert [t[0] for t in two] == [hf_greedy(hf, p, 24) for p in prompts]
        assert engine.pages.num_free_pages == engine.cfg.num_pages
    finally:
        assert_released(llm)


def test_speculative_drafts_run_on_both_ranks(checkpoints):
    """n-gram speculation: steps carry draft rows (the eager verify path) to the worker too."""
    path = checkpoints("llama")
    spec = dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 8})
    prompts = [[7, 8, 9, 10] * 6, prompt_of(20, salt=9) * 2]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = token_ids(LLM(path, device="cpu", show_progress=False, max_model_len=256), prompts, params)
    llm = LLM(path, **TP2, **spec)
    try:
        assert token_ids(llm, prompts, params) == want
        assert llm.engine.stats().spec_num_drafts > 0
    finally:
        assert_released(llm)


@pytest.mark.slow
def test_static_decode_and_overlapped_steps_under_tensor_parallel(checkpoints):
    """The Triton backend's padded decode path (what CUDA graphs replay) through the interpreter,
    async scheduling on: overlapped decode steps take their input ids from rank 0's device by
    broadcast. One decoder layer: each token is interpreted kernel programs in every layer on
    every rank, and the broadcast ids feed the first layer."""
    path = checkpoints("llama-1layer")
    prompts = [[5, 9, 13], [7] * 20, [8, 8]]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)]
    kw = dict(device="cpu", show_progress=False, max_model_len=64, max_num_seqs=4, attention_backend="triton")
    want = token_ids(LLM(path, **kw), prompts, params)
    llm = LLM(path, **kw, tensor_parallel_size=2)
    try:
        assert token_ids(llm, prompts, params) == want
        st = llm.engine.stats()
        assert st.num_overlapped_steps > 0 and st.num_decode_steps > st.num_overlapped_steps
    finally:
        assert_released(llm)


@pytest.mark.parametrize("how", ["close", "failure"])
def test_rank_zero_destroys_its_graphs_before_leaving_the_group(checkpoints, monkeypatch, how):
    """NCCL waits, forever, for every CUDA graph that captured its collectives before it tears a
    communicator down (or aborts it): rank 0 destroys its decode graphs first, on close and after
    a worker's death."""
    import ridge.runner.workers as workers
    from ridge.runner.model_runner import ModelRunner
    order, leave, release = [], workers.destroy_tensor_parallel, ModelRunner.release_graphs
    monkeypatch.setattr(workers, "destroy_tensor_parallel", lambda tp: (order.append("leave"), leave(tp)))
    monkeypatch.setattr(ModelRunner, "release_graphs", lambda self: (order.append("graphs"), release(self)))
    llm = LLM(checkpoints("llama"), device="cpu", show_progress=False, max_model_len=64, max_num_seqs=2,
              attention_backend="triton", tensor_parallel_size=2)
    llm.generate([[5, 9, 13]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert llm.engine.runner.decode_graphs is not None and order == []
    if how == "failure":
        os.kill(llm.engine.runner.workers.pids[0], signal.SIGKILL)
        with pytest.raises(RankFailure, match="rank 1"):
            llm.generate([[5, 9, 13]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert_released(llm)
    assert order == ["graphs", "leave"]


def test_a_killed_worker_fails_the_engine_naming_the_rank(checkpoints):
    llm = LLM(checkpoints("llama"), **TP2)
    pool = llm.engine.runner.workers
    engine = llm.engine
    for n in (5, 12):
        engine.add_request(prompt_of(n), SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(3):
        engine.step()
    told = threading.Event()
    llm.on_failure(lambda message: told.set() if "rank 1" in message else None)
    os.kill(pool.pids[0], signal.SIGKILL)
    t0 = time.monotonic()
    assert told.wait(10)                                  # known at once, before any step runs
    with pytest.raises(RankFailure, match=rf"rank 1 \(pid {pool.pids[0]}\) was killed by signal SIGKILL"):
        for _ in range(50):
            engine.step()
    assert time.monotonic() - t0 < 10
    assert not os.path.exists(f"/dev/shm/{pool.ring_name.lstrip('/')}")          # released at once
    with pytest.raises(RankFailure, match="rank 1"):
        llm.generate([prompt_of(4)], SamplingParams(max_tokens=2), use_tqdm=False)
    assert_released(llm)


def test_a_hung_worker_fails_the_engine_after_the_timeout(checkpoints):
    llm = LLM(checkpoints("llama"), **TP2, distributed_timeout_seconds=2)
    pool = llm.engine.runner.workers
    llm.generate([prompt_of(4)], SamplingParams(max_tokens=2), use_tqdm=False)
    os.kill(pool.pids[0], signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 hung: step \d+ not taken within distributed_timeout_seconds"):
        llm.generate([prompt_of(6)], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert time.monotonic() - t0 < 20
    assert_released(llm)                                  # the stopped process is killed too


def watched_engine(checkpoints):
    """A TP = 2 engine with a 1 s timeout, warmed by one request: (llm, its pool, an event the
    failure callback sets)."""
    llm = LLM(checkpoints("llama"), **TP2, distributed_timeout_seconds=1)
    llm.generate([prompt_of(4)], SamplingParams(max_tokens=2), use_tqdm=False)
    told = threading.Event()
    llm.on_failure(lambda message: told.set())
    return llm, llm.engine.runner.workers, told


def assert_failed_by_the_timeout(llm, pool) -> None:
    """The watcher failed the pool for a step that outlasted the timeout: named so, every later
    request refused, everything released."""
    assert "did not finish within distributed_timeout_seconds (1 s)" in pool.failure
    with pytest.raises(RankFailure, match="did not finish"):
        llm.generate([prompt_of(4)], SamplingParams(max_tokens=2), use_tqdm=False)
    assert_released(llm)


def test_a_device_wait_past_the_timeout_fails_the_engine(checkpoints):
    """Under NCCL a hung rank stalls rank 0 on its device (the token readback), not in a host call
    that could time out: the watcher fails the pool once that wait outlasts the timeout. Here the
    wait is rank 0's own, held open, with the worker stopped."""
    llm, pool, told = watched_engine(checkpoints)
    with pool.device_wait():
        assert told.wait(10)
    assert_failed_by_the_timeout(llm, pool)


def test_device_work_past_the_timeout_fails_the_engine(checkpoints):
    """On a GPU the watcher also times rank 0's device: an event recorded after each step is
    queued (the host may block outside the step, in sampling's readback). Work done long ago is
    no hang; work still running past the timeout is. Here the event is a stand-in that reports
    done or not."""
    class Event:
        def __init__(self, done: bool):
            self.done = done

        def query(self) -> bool:
            return self.done

    llm, pool, told = watched_engine(checkpoints)
    pool._in_flight = (Event(done=True), time.monotonic() - 60)
    assert not told.wait(3) and pool.failure is None
    pool._in_flight = (Event(done=False), time.monotonic())
    assert told.wait(10)
    assert_failed_by_the_timeout(llm, pool)


def test_a_dropped_llm_stops_its_workers(checkpoints):
    """The finaliser: an LLM that is dropped without close() stops its workers."""
    llm = LLM(checkpoints("llama"), **TP2)
    pool = llm.engine.runner.workers
    del llm
    gc.collect()
    for pid in pool.pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not os.path.exists(f"/dev/shm/{pool.ring_name.lstrip('/')}")


@pytest.mark.parametrize("name, size, why", [
    ("llama", 3, "the number of attention heads \\(4\\) must be divisible"),
    ("deepseekv2", 2, "latent attention"),
])
def test_unsupported_splits_are_refused_before_loading(checkpoints, name, size, why):
    with pytest.raises(ValueError, match=f"^tensor_parallel_size: .*{why}"):
        LLM(checkpoints(name), device="cpu", show_progress=False, tensor_parallel_size=size)


def test_expert_widths_must_split():
    from ridge.config import EngineConfig, ModelConfig
    m = ModelConfig.from_dict(dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=100, hidden_size=64,
                                   intermediate_size=128, num_hidden_layers=1, num_attention_heads=8,
                                   num_key_value_heads=8, moe_intermediate_size=60, num_experts=4,
                                   num_experts_per_tok=2))
    with pytest.raises(ValueError, match=r"each expert's intermediate size \(60\) must be divisible by it, got 8"):
        EngineConfig(tensor_parallel_size=8)._check_tensor_parallel(m, torch.device("cpu"))


def test_rank_shares():
    from ridge.layers.attention import rank_heads
    assert [rank_heads(8, 2, TensorParallel(r, 4)) for r in range(4)] == [(2, 1, 0, 0), (2, 1, 2, 0), (2, 1, 4, 1),
                                                                          (2, 1, 6, 1)]
    assert rank_heads(8, 4, TensorParallel(1, 2)) == (4, 2, 4, 2)
    assert [TensorParallel(r, 3).padded_split(10) for r in range(3)] == [(0, 4, 4), (4, 4, 4), (8, 2, 4)]
    with pytest.raises(ValueError, match="must be a multiple of the KV heads"):
        rank_heads(12, 2, TensorParallel(0, 3))


def test_no_collective_starts_once_the_group_is_aborted():
    """NCCL's abort holds the communicator while it waits for rank 0's CUDA graphs: a collective
    entered then would wait for ever, so each one refuses first (no group is touched here)."""
    tp = TensorParallel(0, 2)
    tp.failed.append("tensor-parallel rank 1 hung")
    for collective in (tp.all_reduce, tp.all_gather, tp.broadcast):
        with pytest.raises(RankFailure, match="rank 1 hung"):
            collective(torch.ones(2, 3))


def test_single_process_tools_refuse_tensor_parallel(checkpoints, tmp_path, capsys):
    """roofline, quantize and eval-ppl --compare read one process's model: refused before loading."""
    from ridge.cli import main
    path = checkpoints("llama")
    for argv in (["roofline", "--model", path, "--device", "cpu"],
                 ["quantize", "--model", path, "--out", str(tmp_path / "q"), "--method", "rtn", "--device", "cpu"],
                 ["eval-ppl", "--model", path, "--compare", path, "--device", "cpu"]):
        assert main(argv + ["--tensor-parallel-size", "2"]) == 2
        assert "tensor_parallel_size: " in capsys.readouterr().err


@pytest.fixture(scope="module")
def llama_pair(checkpoints):
    """The tiny Llama at TP = 1 and TP = 2, with a small pool (preemption) and token budget (chunks).
    A process belongs to one tensor-parallel group at a time: the tests using this pair come last."""
    path = checkpoints("llama")
    page = 2 * 2 * 16 * 2 * 16 * 4          # K and V, 2 layers, 16 tokens, 2 KV heads of 16, float32
    kw = dict(max_num_batched_tokens=32, max_num_seqs=8)
    one = LLM(path, device="cpu", show_progress=False, max_model_len=256, kv_cache_memory=16 * page, **kw)
    two = LLM(path, **TP2, kv_cache_memory=16 * page // 2, **kw)       # a rank holds half of each page
    assert one.engine.cfg.num_pages == two.engine.cfg.num_pages == 16
    yield one, two
    assert_released(two)


def test_seeded_sampling_forks_and_penalties_match_one_rank(llama_pair):
    one, two = llama_pair
    prompts = [prompt_of(n, salt=7 + i) for i, n in enumerate((5, 30, 12))]
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True, n=3),
              SamplingParams(temperature=1.0, top_k=20, seed=5, max_tokens=16, ignore_eos=True,
                             presence_penalty=0.5, repetition_penalty=1.2, logprobs=3),
              SamplingParams(temperature=0.6, min_p=0.05, seed=2, max_tokens=12, ignore_eos=True, min_tokens=4)]
    outs = [one.generate(prompts, params, use_tqdm=False), two.generate(prompts, params, use_tqdm=False)]
    for a, b in zip(*outs):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    lp = [[{t: v.logprob for t, v in step.items()} for step in o[1].outputs[0].logprobs] for o in outs]
    assert [list(step) for step in lp[0]] == [list(step) for step in lp[1]]
    assert [v for step in lp[0] for v in step.values()] == pytest.approx([v for step in lp[1] for v in step.values()],
                                                                           abs=1e-4)


def test_chunked_prefill_preemption_prefix_hits_and_scoring_match_one_rank(llama_pair):
    """A 32-token budget cuts the prompts into chunks; the small pool preempts; the repeated
    prefix hits the cache; prompt log-probabilities span chunks."""
    one, two = llama_pair
    shared = prompt_of(48, salt=3)
    prompts = [shared + prompt_of(n, salt=20 + n) for n in (4, 9, 17)] + \
        [prompt_of(n, salt=40 + n) for n in (6, 60, 23)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    before = two.engine.stats().num_preemptions
    assert token_ids(two, prompts, params) == token_ids(one, prompts, params)
    assert two.engine.stats().num_preemptions > before
    scoring = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    a, b = (llm.generate(prompts[:2], scoring, use_tqdm=False) for llm in (one, two))
    for x, y in zip(a, b):
        assert x.prompt_logprobs[0] is None and y.prompt_logprobs[0] is None
        assert len(x.prompt_logprobs) == len(y.prompt_logprobs) == len(x.prompt_token_ids)
        for dx, dy in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:]):
            assert dx.keys() == dy.keys()
            assert all(abs(dx[t].logprob - dy[t].logprob) < 1e-4 for t in dx)
    st = two.engine.stats()
    assert st.num_free_pages == st.num_pages


def test_unguarded_script_is_named_as_the_cause(checkpoints, tmp_path, monkeypatch):
    """A script that builds a tensor-parallel LLM at its top level, with no `if __name__ ==
    "__main__":` guard, fails in its spawned ranks (spawn runs the main script again there): the
    error says so and names the fix, as multiprocessing's own message does, instead of only
    'rank 1 exited with code 1'."""
    import subprocess
    import sys
    import types

    from ridge.parallel import unguarded_main_hint
    body = (f"from ridge import LLM\nLLM({checkpoints('llama')!r}, device='cpu', tensor_parallel_size=2, "
            f"max_model_len=64, show_progress=False)\n")
    unguarded, guarded = tmp_path / "unguarded.py", tmp_path / "guarded.py"
    unguarded.write_text(body)
    guarded.write_text("if __name__ == '__main__':\n" + "".join("    " + line + "\n" for line in body.splitlines()))
    for script, hinted in ((unguarded, True), (guarded, False)):
        monkeypatch.setitem(sys.modules, "__main__", types.SimpleNamespace(__file__=str(script)))
        assert bool(unguarded_main_hint()) is hinted, script
    monkeypatch.setitem(sys.modules, "__main__", types.SimpleNamespace())       # an interactive session
    assert unguarded_main_hint() == ""
    r = subprocess.run([sys.executable, str(unguarded)], capture_output=True, text=True, timeout=180,
                       env=dict(os.environ, PYTHONPATH=os.getcwd()))
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and last.startswith("ridge.parallel.RankFailure: tensor-parallel rank 1"), r.stderr[-3000:]
    assert f'{unguarded} has no `if __name__ == "__main__":` guard' in last and "spawn" in last
