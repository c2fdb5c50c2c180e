"""The EAGLE-3 head bundled for the demo model (ridge/assets/demo-code-12m-eagle3, trained by
scripts/train_eagle_head.py): it loads by name from any directory and keeps plain decoding's greedy
tokens while its drafts are verified; and the training script, on a tiny budget, writes a head in
the public layout that ridge loads, having opened no held-out file."""
from __future__ import annotations

import json
import os
import sys

import pytest

from ridge import LLM, SamplingParams
from tests.tests_support import REPO

HEAD = "demo-code-12m-eagle3"
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\nclass Config:\n    def __init__(self"]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def engine(spec=None) -> LLM:
    return LLM("demo-code-12m", device="cpu", show_progress=False, max_model_len=128, speculative_config=spec)


def drafting_every_step(llm: LLM) -> LLM:
    """The step clock forced on, so the test's few steps all draft (the benchmark's "forced")."""
    clock = llm.engine.speculator.clock
    clock.pays, clock.overhead = (lambda batch: True), (lambda batch, draft_cost=0.0: None)
    return llm


@pytest.fixture(scope="module")
def plain_tokens():
    with engine() as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_the_bundled_head_by_name_keeps_greedy_tokens(plain_tokens, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                 # a name, not a path: found beside ridge's files
    spec = {"method": "eagle3", "model": HEAD, "num_speculative_tokens": 4}
    with drafting_every_step(engine(spec)) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        stats = llm.engine.stats()
    assert [o.outputs[0].token_ids for o in outs] == plain_tokens
    assert stats.spec_num_drafts > 0
    assert stats.spec_num_accepted_tokens > stats.spec_num_draft_tokens / 4      # a trained head, not noise


def test_the_training_script_writes_a_head_ridge_loads(plain_tokens, tmp_path, monkeypatch):
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    try:
        import demo_data
        import train_eagle_head
    finally:
        sys.path.pop(0)
    opened = []
    read = demo_data.read_files
    monkeypatch.setattr(demo_data, "read_files", lambda root, paths: (opened.extend(paths), read(root, paths))[1])
    out = str(tmp_path / "head")
    argv = ["--out", out, "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--ttt", "2", "--max-files", "3",
            "--draft-vocab", "512", "--intermediate-size", "64", "--device", "cpu", "--log-every", "1"]
    assert train_eagle_head.main(argv) == 0
    assert opened and not any(map(demo_data.is_heldout, opened))
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 512
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5] and cfg["num_hidden_layers"] == 1
    info = json.load(open(os.path.join(out, "training_info.json")))
    assert info["steps"] == 2 and info["ttt_steps"] == 2 and len(info["loss_curve"]) == 2
    spec = {"method": "eagle3", "model": out, "num_speculative_tokens": 2}
    with drafting_every_step(engine(spec)) as llm:
        outs = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
        assert llm.engine.stats().spec_num_drafts > 0
    assert outs[0].outputs[0].token_ids == plain_tokens[0]


def test_under_a_grammar_the_head_drafts_for_greedy_requests_only():
    """The head draws its drafts from q on the device without the grammar's masks: greedy requests
    under a grammar take its drafts (greedy acceptance reads no q) and keep plain decoding's tokens;
    sampling ones take none (a cut draw from an unmasked q would bias rejection sampling)."""
    regex = {"regex": r"(def|class) [a-z_]{3,12}\(self(, [a-z]{1,6}){0,3}\):"}
    greedy = SamplingParams(max_tokens=24, temperature=0, structured_outputs=regex)
    sampled = SamplingParams(max_tokens=24, temperature=1.0, seed=5, structured_outputs=regex)
    with engine() as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    spec = {"method": "eagle3", "model": HEAD, "num_speculative_tokens": 4}
    with drafting_every_step(engine(spec)) as llm:
        outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert sum(o.metrics.num_drafts for o in outs) > 0
        out = llm.generate(PROMPTS[0], sampled, use_tqdm=False)[0]
        assert out.metrics.num_drafts == 0 and out.outputs[0].finish_reason == "stop"
