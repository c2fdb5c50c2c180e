"""The overlapped all-reduce (ridge/models/overlap.py) in the engine, TP = 2 on the CPU over gloo:
greedy tokens equal one rank's and transformers' with the step's tokens cut into two micro-batches -
by whole sequences, a single prompt in token halves, and chunked prefill (a chunk in halves over a
cached prefix). The test models' steps are far below OVERLAP_MIN_TOKENS, so the script lowers it on
every rank before the engine starts; the ranks are torchrun's, so each runs the script (the
engine's spawned workers would not), and every rank must cut alike or their collectives differ."""
import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from ridge import LLM, SamplingParams
from conftest import prompt_of
from test_hf_parity import hf_greedy
from tests_support import free_port

SCRIPT = """
import json, sys
import ridge.models.llama as llama
import ridge.models.overlap as overlap
from ridge import LLM, SamplingParams
if __name__ == "__main__":
    overlap.OVERLAP_MIN_TOKENS = 16
    cuts, run = [], llama.run_overlapped

    def recorded(layers, kv_caches, tp, positions, x, meta, cut):
        cuts.append((meta.query_start_loc_cpu, cut))
        return run(layers, kv_caches, tp, positions, x, meta, cut)
    llama.run_overlapped = recorded
    llm = LLM(sys.argv[1], device="cpu", show_progress=False, max_model_len=256, tensor_parallel_size=2,
              max_num_batched_tokens=64, distributed_executor_backend="external_launcher")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = [[o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
              for prompts in json.loads(sys.argv[3])]
    llm.close()
    json.dump(dict(tokens=tokens, cuts=cuts), open(sys.argv[2], "w"))
"""
# several sequences a step (chunks of the long one among them), one 60-token prompt alone (its
# halves), one of 150 tokens alone (chunks of 64, each in halves over the cached prefix)
BATCHES = [[prompt_of(n, salt=i) for i, n in enumerate((3, 21, 7, 16, 40))], [prompt_of(60, salt=8)],
           [prompt_of(150, salt=9)]]


@pytest.mark.parametrize("name", ["llama", "qwen2moe"])
def test_overlapped_prefill_gives_one_rank_and_transformers_tokens(checkpoints, tmp_path, name):
    path = checkpoints(name)
    script, out = tmp_path / "run.py", tmp_path / "out.json"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                    str(free_port()), str(script), path, str(out), json.dumps(BATCHES)],
                   env=env, check=True, timeout=300)
    got = json.loads(out.read_text())
    one = LLM(path, device="cpu", show_progress=False, max_model_len=256, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [[o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)] for prompts in BATCHES]
    assert got["tokens"] == want
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert want == [[hf_greedy(hf, p, 12) for p in prompts] for prompts in BATCHES]
    cuts = [(starts, cut) for starts, cut in got["cuts"]]
    assert any(len(s) > 2 and cut in s for s, cut in cuts)                  # by whole sequences
    assert ([0, 60], 30) in [(s, c) for s, c in cuts]                       # one prompt in halves
    assert sum(s == [0, 64] and c == 32 for s, c in cuts) >= 2              # the 150-token prompt's chunks
    assert sum(s == [0, 22] for s, c in cuts) == 1                          # and its last one
