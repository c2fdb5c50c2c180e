"""The bundled demo model: transformers loads it, and ridge's greedy continuations of 10
prompts cut from held-out stdlib files are identical to transformers' (float32, CPU)."""
import os
import sysconfig

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ridge import LLM, SamplingParams
from ridge.assets import ASSETS, demo_model_path

DRAFT = os.path.join(ASSETS, "demo-code-3m")


def heldout_prompts(path, tokenizer, count=10, length=48):
    stdlib = sysconfig.get_paths()["stdlib"]
    prompts = []
    for rel in open(os.path.join(path, "heldout_files.txt")).read().split():
        file = os.path.join(stdlib, rel)
        if os.path.isfile(file):
            ids = tokenizer(open(file, encoding="utf-8").read())["input_ids"][:length]
            if len(ids) == length:
                prompts.append(ids)
        if len(prompts) == count:
            return prompts
    pytest.skip("fewer than 10 held-out files exist in this Python's stdlib")


@pytest.mark.parametrize("path", [demo_model_path(), DRAFT], ids=["main", "draft"])
def test_bundled_model_matches_transformers(path):
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = heldout_prompts(path, tok)
    llm = LLM(path, device="cpu", dtype="float32", show_progress=False, max_model_len=256)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)[0, len(p):]
        assert o.outputs[0].token_ids == ref.tolist()


def test_draft_shares_the_tokenizer():
    a = open(os.path.join(demo_model_path(), "tokenizer.json"), "rb").read()
    assert a == open(os.path.join(DRAFT, "tokenizer.json"), "rb").read()


def test_eval_ppl_matches_transformers(tmp_path):
    """ridge eval-ppl's number equals the same windows scored by transformers."""
    import json
    import math
    import subprocess
    import sys

    from ridge.eval_ppl import heldout_files, token_stream
    path = demo_model_path()
    files = heldout_files(path)[:2]
    out = tmp_path / "ppl.json"
    r = subprocess.run([sys.executable, "-m", "ridge.cli", "eval-ppl", "--device", "cpu", "--seq-len", "128",
                        "--files", *files, "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    got = json.loads(out.read_text())
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    stream = torch.tensor(token_stream(tok, files))
    n = (len(stream) - 1) // 128
    idx = torch.arange(n)[:, None] * 128 + torch.arange(129)
    x, y = stream[idx][:, :-1], stream[idx][:, 1:].clone()
    y[y == tok.bos_token_id] = -100
    with torch.no_grad():
        logits = hf(input_ids=x).logits
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100)
    assert got["tokens"] == int((y != -100).sum())
    assert math.isclose(got["nll_per_token"], nll.item(), rel_tol=1e-4)
