"""spec_decode.py's demo part: the bundled proposers on the demo model, held-out stdlib prompts, batch 1.

Per proposer (the EAGLE-3 head demo-code-12m-eagle3, the 3M draft model demo-code-3m, n-gram
lookup) and k: acceptance rate, mean accepted length (tokens a verify step emits), acceptance at
each draft position, tokens/s against plain decoding in the same run, and the cost of drafting:
the host time of proposing plus, for the head, of writing its cache from the target's states
after each forward (the runner's sink), a draft token, synchronized on a GPU; beside it the draft's
parameter bytes over the target's (the engine's draft_cost). Each proposer runs twice: drafting
every step (the step clock forced on: acceptance at k, and what drafting costs) and as the
engine's step clock decides (adaptive). Prompts are the first --prompt-len tokens of the
target's held-out files (heldout_files.txt), never a training file.
"""
from __future__ import annotations

import os
import time

import torch

from ridge import LLM, SamplingParams
from ridge.assets import bundled_model_path, demo_model_path
from ridge.bench.common import speculation

METHODS = ("eagle3", "draft_model", "ngram")
HEAD, DRAFT = "demo-code-12m-eagle3", "demo-code-3m"


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_generate(llm, prompts, params) -> tuple[float, list]:
    sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    return time.perf_counter() - t0, outs


def heldout_prompts(model: str, n: int, length: int) -> list[list[int]]:
    from ridge.engine.llm import load_tokenizer
    from ridge.eval_ppl import heldout_files
    llm_tok = load_tokenizer(model)
    prompts = []
    for path in heldout_files(model)[:n]:
        with open(path, encoding="utf-8", errors="replace") as f:
            ids = llm_tok.encode(f.read())
        if len(ids) > length:
            prompts.append(ids[:length])
    return prompts


class SinkTimer:
    """Times the EAGLE-3 proposer's cache writes (the target runner's hidden sink), synchronized."""

    def __init__(self, llm):
        self.seconds, runner = 0.0, llm.engine.runner
        sink = runner.hidden_sink
        if sink is None:
            return

        def timed(*args):
            sync()
            t0 = time.perf_counter()
            sink(*args)
            sync()
            self.seconds += time.perf_counter() - t0
        runner.hidden_sink = timed


def spec_config(method: str, k: int, head: str, draft: str) -> dict:
    model = {"eagle3": head, "draft_model": draft}.get(method)
    return {"method": method, "num_speculative_tokens": k, **({"model": model} if model else {})}


def run_demo(a) -> dict:
    target = demo_model_path()
    head = a.head or bundled_model_path(HEAD) or HEAD
    draft = bundled_model_path(DRAFT)
    prompts = heldout_prompts(target, a.prompts, a.prompt_len)
    params = SamplingParams(max_tokens=a.output_len, temperature=0, ignore_eos=True)
    rows = []
    plain = LLM(target, show_progress=False, max_model_len=1024)
    timed_generate(plain, prompts[:1], params)
    plain_s, plain_outs = 0.0, []
    for p in prompts:
        dt, o = timed_generate(plain, [p], params)
        plain_s, plain_outs = plain_s + dt, plain_outs + o
    want = [o.outputs[0].token_ids for o in plain_outs]
    del plain
    for method in a.methods:
        for k in a.ks:
            for forced in (True, False):      # drafts every step / as the engine's step clock decides
                llm = LLM(target, show_progress=False, max_model_len=1024,
                          speculative_config=spec_config(method, k, head, draft))
                spec = llm.engine.speculator
                if forced:              # every step, k from acceptance at the model's overhead
                    spec.clock.pays, spec.clock.overhead = (lambda batch: True), (lambda batch, draft_cost=0.0: None)
                timed_generate(llm, prompts[:1], params)
                sink = SinkTimer(llm)
                s0, secs, got = llm.engine.stats(), 0.0, []
                for p in prompts:
                    dt, o = timed_generate(llm, [p], params)
                    secs, got = secs + dt, got + [o[0].outputs[0].token_ids]
                m = speculation(s0, llm.engine.stats())
                proposed = m["spec_num_draft_tokens"]
                rows.append(dict(method=method, k=k, clock="forced" if forced else "adaptive",
                                 acceptance_rate=m["spec_acceptance_rate"],
                                 mean_accepted_length=m["spec_mean_accepted_length"], drafts=m["spec_num_drafts"],
                                 acceptance_per_pos=[round(x, 4) for x in m["spec_acceptance_per_pos"]],
                                 tokens_per_s=len(prompts) * a.output_len / secs,
                                 plain_tokens_per_s=len(prompts) * a.output_len / plain_s, speedup=plain_s / secs,
                                 us_per_draft_token=1e6 * (m["spec_propose_s"] + sink.seconds) / proposed
                                 if proposed else None,
                                 sink_us_per_draft_token=1e6 * sink.seconds / proposed if proposed else None,
                                 draft_cost=round(spec.draft_cost, 4), same_tokens_as_plain=got == want))
                del llm
    return dict(part="demo", prompts=len(prompts), prompt_len=a.prompt_len, output_len=a.output_len,
                head=os.path.basename(os.path.normpath(head)), draft=DRAFT, rows=rows)
