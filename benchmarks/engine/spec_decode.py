"""Speculative decoding benchmarks (issue 17), four parts; JSON to --json, a table last.

  demo    the demo model's proposers (the EAGLE-3 head demo-code-12m-eagle3, the draft model
          demo-code-3m, n-gram lookup) on held-out stdlib prompts: acceptance rate and mean accepted
          length per k, the cost of a draft token, tokens/s with and without speculation, batch 1
          (requests one after another; spec_demo.py).
  agent   an agent-style workload for suffix decoding: turns of edits of the same held-out files
          (turn t: the file's first --prompt-len tokens with t one-token edits in its second half),
          requests one after another; plain decoding, suffix decoding and n-gram lookup, each on a
          fresh engine warmed up on another file: tokens/s, acceptance, mean accepted length, and
          whether the greedy tokens equal plain decoding's.
  verify  the target alone (e.g. the 8B shape, --load-format dummy): the time of a verify step
          (k + 1 tokens a sequence through the paged attention kernels, eager) against a plain decode
          step (the CUDA-graph replay), k = 1..8, at several batch sizes.
  oracle  end to end with a proposer whose acceptance rate is set: it replays the target's own
          recorded greedy continuation, corrupting each position with probability 1 - alpha, so a
          draft is accepted with probability alpha; tokens/s against plain decoding per alpha, k
          and batch, beside seed 002's model (1 - alpha^(k+1)) / (1 - alpha). Adaptation stays on.

    python benchmarks/engine/spec_decode.py demo --json spec_demo.json
    python benchmarks/engine/spec_decode.py agent --prompts 8 --turns 4 --json spec_agent.json
    python benchmarks/engine/spec_decode.py verify --model /tmp/8b-config --load-format dummy --json spec_verify.json
    python benchmarks/engine/spec_decode.py oracle --model /tmp/8b-config --load-format dummy --json spec_oracle.json

Timings: wall time per generate call (demo, oracle) after a warm-up call; medians of CUDA-event
times after warm-up (verify). Prompts are drawn fresh (random ids, or held-out files).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root

from ridge import LLM, SamplingParams  # noqa: E402
from ridge.assets import demo_model_path  # noqa: E402
from ridge.bench.common import speculation  # noqa: E402
from ridge.engine.scheduler import ScheduledSeq, SchedulerOutput  # noqa: E402
from ridge.engine.spec.clock import StepClock  # noqa: E402
from ridge.runner.cuda_graphs import DecodeGraphs  # noqa: E402
from ridge.engine.spec.proposer import Proposal  # noqa: E402
from ridge.utils.graph_timing import elapsed_ms  # noqa: E402
from benchmarks.engine.spec_demo import METHODS, heldout_prompts, run_demo, timed_generate  # noqa: E402


def agent_prompts(model: str, files: int, turns: int, length: int) -> list[list[int]]:
    """Per file, `turns` prompts: turn t carries t one-token edits (a token copied from elsewhere in
    the file) in the second half of the file's first `length` tokens."""
    rng, out = random.Random(0), []
    for ids in heldout_prompts(model, files, length):
        edited = list(ids)
        for _ in range(turns):
            out.append(list(edited))
            edited[rng.randrange(len(edited) // 2, len(edited))] = edited[rng.randrange(len(edited))]
    return out


class StepAccount:
    """Where an engine's decode time goes: each engine step's wall time by kind (a verify step, a
    plain step that computed, a step that only committed ids an overlapped step left on the
    device), through wrappers on this engine's own objects. The proposer's time is the engine's
    own counter (EngineStats.spec_propose_seconds)."""

    def __init__(self, engine):
        self.steps = {"verify": [], "plain": [], "commit-only": []}
        self.calls = {"verify": 0, "execute": 0}
        self._wrap(engine.runner, "execute", "execute")
        if engine.speculator is not None:
            self._wrap(engine.speculator, "verify", "verify")
        step = engine.step

        def timed_step(*args, **kw):
            before = dict(self.calls)
            t0 = time.perf_counter()
            out = step(*args, **kw)
            seconds = time.perf_counter() - t0
            kind = "verify" if self.calls["verify"] > before["verify"] else \
                "plain" if self.calls["execute"] > before["execute"] else "commit-only"
            self.steps[kind].append(seconds)
            return out
        engine.step = timed_step

    def _wrap(self, obj, name, key):
        fn = getattr(obj, name)

        def counted(*args, **kw):
            self.calls[key] += 1
            return fn(*args, **kw)
        setattr(obj, name, counted)

    def reset(self):
        for v in self.steps.values():
            v.clear()

    def summary(self) -> dict:
        med = lambda v: round(1e6 * statistics.median(v), 1) if v else None     # noqa: E731
        return {**{f"{k}_steps": len(v) for k, v in self.steps.items()},
                **{f"{k}_step_us": med(v) for k, v in self.steps.items()},
                **{f"{k}_total_ms": round(1e3 * sum(v), 1) for k, v in self.steps.items()}}


def run_agent(a) -> dict:
    target = demo_model_path()
    prompts = agent_prompts(target, a.prompts, a.turns, a.prompt_len)
    params = SamplingParams(max_tokens=a.output_len, temperature=0, ignore_eos=True)
    configs = {"plain": None, "suffix": {"method": "suffix", "num_speculative_tokens": a.suffix_k},
               "ngram": {"method": "ngram", "num_speculative_tokens": 4}}
    rows, plain_s, want = [], None, None
    warm = heldout_prompts(target, a.prompts + 1, a.prompt_len)[-1]
    for name, cfg in configs.items():
        llm = LLM(target, show_progress=False, max_model_len=1024, speculative_config=cfg)
        account = StepAccount(llm.engine)
        timed_generate(llm, [warm], params)       # warm-up on another file (its output is all the cache holds)
        account.reset()
        s0 = llm.engine.stats()
        secs, outs = 0.0, []
        for p in prompts:
            dt, o = timed_generate(llm, [p], params)
            secs, outs = secs + dt, outs + o
        s1 = llm.engine.stats()
        got = [o.outputs[0].token_ids for o in outs]
        want = got if want is None else want
        spec = speculation(s0, s1)
        plain_s = secs if plain_s is None else plain_s
        rows.append(dict(method=name, tokens_per_s=len(prompts) * a.output_len / secs, speedup=plain_s / secs,
                         acceptance_rate=spec["spec_acceptance_rate"],
                         mean_accepted_length=spec["spec_mean_accepted_length"], drafts=spec["spec_num_drafts"],
                         same_tokens_as_plain=got == want, **account.summary(),
                         propose_ms=1e3 * spec["spec_propose_s"],
                         propose_us_per_draft_token=spec["spec_propose_us_per_draft_token"]))
        del llm
    return dict(part="agent", files=a.prompts, turns=a.turns, prompt_len=a.prompt_len, output_len=a.output_len, rows=rows)


def running_sequences(llm, batch: int, prompt_len: int) -> list:
    """`batch` sequences whose prompts are computed and that now decode (the engine stepped to there)."""
    engine = llm.engine
    vocab = engine.model_cfg.vocab_size
    rng = random.Random(0)
    for _ in range(batch):
        engine.add_request([rng.randrange(3, vocab) for _ in range(prompt_len)],
                           SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) \
            or len(engine.scheduler.running) < batch:
        engine.step()
    return list(engine.scheduler.running)


def event_time(fn, reps: int) -> float:
    """Median seconds of fn() after 3 warm-up calls: CUDA events on a GPU, the host clock on a CPU."""
    if not torch.cuda.is_available():
        times = []
        for i in range(reps + 3):
            t0 = time.perf_counter()
            fn()
            if i >= 3:
                times.append(time.perf_counter() - t0)
        return statistics.median(times)
    times = [elapsed_ms(fn) / 1e3 for _ in range(reps + 3)]
    return statistics.median(times[3:])


def precision(a) -> dict:
    """The engine settings --quantization / --kv-cache-dtype give (none: the checkpoint's own)."""
    return {k: v for k, v in (("quantization", a.quantization), ("kv_cache_dtype", a.kv_cache_dtype)) if v}


def run_verify(a) -> dict:
    """Per batch and k: the plain decode step (its CUDA graph), and the verify step of k + 1 tokens a
    sequence both as a replayed verify graph (captured here for that batch and k alone) and eagerly."""
    llm = LLM(a.model, load_format=a.load_format, max_num_seqs=max(a.batches), max_model_len=a.prompt_len + 64,
              show_progress=False, async_scheduling=False, **precision(a))
    engine, runner, rows = llm.engine, llm.engine.runner, []
    cfg, vocab, graphs = engine.cfg, engine.model_cfg.vocab_size, torch.cuda.is_available()
    for batch in a.batches:
        seqs = running_sequences(llm, batch, a.prompt_len)
        base = None
        for k in [0, *range(1, 9)]:
            for s in seqs:
                s.draft_token_ids = [random.randrange(3, vocab) for _ in range(k)]
                engine.pages.allocate(s, k + 1)
            sched = SchedulerOutput([ScheduledSeq(s, k + 1, k) for s in seqs])
            row = dict(batch=batch, k=k)
            if k == 0:
                row["graph_s"] = base = event_time(lambda: runner.execute(sched), a.reps)
            elif graphs:                # the verify graphs need the Triton backend (a GPU)
                g = DecodeGraphs(runner.model, runner.layer_caches, batch, cfg.max_model_len, cfg.page_size,
                                 runner.device, queries=k + 1)
                g.buckets = [batch]
                g.fill_idle()
                g.capture()
                runner.verify_graphs = g
                row["graph_s"] = event_time(lambda: runner.execute(sched), a.reps)
                runner.verify_graphs = None
                del g
            if k:
                row["eager_s"] = event_time(lambda: runner.execute(sched), a.reps)
                row["eager_vs_plain"] = row["eager_s"] / base
            if "graph_s" in row:
                row["graph_vs_plain"] = row["graph_s"] / base
            rows.append(row)
        for s in seqs:
            s.draft_token_ids = []
            llm.abort(s.request.request_id)
    return dict(part="verify", prompt_len=a.prompt_len, rows=rows)


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class Oracle:
    """Proposes the target's recorded greedy continuation, each position corrupted with probability
    1 - alpha (a fixed random stream): a draft is then accepted with probability alpha."""

    def __init__(self, records: dict, alpha: float, vocab: int, seed: int = 0):
        self.records, self.alpha, self.vocab, self.rng = records, alpha, vocab, random.Random(seed)

    def propose(self, seqs, limits) -> Proposal:
        out = []
        for s, lim in zip(seqs, limits):
            full = self.records[tuple(s.token_ids[:s.num_prompt_tokens])]
            nxt = full[s.num_output_tokens:s.num_output_tokens + lim]
            out.append([t if self.rng.random() < self.alpha else (t + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
                        for t in nxt])
        return Proposal(out)

    def release(self, seq_ids) -> None:
        pass


@torch.no_grad()
def without_near_ties(llm) -> None:
    """Dummy weights, reshaped so greedy decoding has a wide margin: random weights leave the top two
    logits of the 8B shape ~0.1-0.3 apart, and bf16 differences between the verify and the decode
    kernels (up to ~0.3 there) flip such ties, after which a recorded continuation is stale. With
    the LM head tied to the embedding and the residual branches scaled by 1e-3 (not zeroed: zeros
    can run faster), the residual stream stays at the last token's embedding, whose own logit wins
    by far: greedy decoding repeats the last prompt token. Same shapes, kernels and bytes: the
    timing is unchanged."""
    model = llm.engine.runner.model
    if hasattr(model, "lm_head"):                  # (a tied model reads the embedding already)
        model.lm_head.weight.copy_(model.model.embed_tokens.weight)
    for layer in model.model.layers:
        scale_projection(layer.self_attn.o_proj, 1e-3)
        scale_projection(layer.mlp.down_proj, 1e-3)


def scale_projection(linear, factor: float) -> None:
    """Multiply a projection's weights by `factor` in whatever form it holds them: the float weight,
    FP8 blocks (their scales; and a bf16 copy the dispatch kept), INT4 groups (their scales)."""
    weight = getattr(linear, "weight", None)
    if weight is not None and weight.is_floating_point():       # (an INT4 format may name its words "weight")
        weight.mul_(factor)
    if getattr(linear, "weight_scale_inv", None) is not None:
        linear.weight_scale_inv.mul_(factor)
    elif linear.quant_method is not None and hasattr(linear.quant_method, "table"):
        linear.quant_method.table(linear, "scales").mul_(factor)


def run_oracle(a) -> dict:
    rows = []
    for batch in a.batches:
        llm = LLM(a.model, load_format=a.load_format, max_num_seqs=batch, max_model_len=a.prompt_len + a.output_len + 16,
                  **precision(a),
                  show_progress=False, speculative_config={"method": "ngram", "num_speculative_tokens": max(a.ks)})
        engine, spec = llm.engine, llm.engine.speculator
        if a.load_format == "dummy":
            without_near_ties(llm)
        vocab = engine.model_cfg.vocab_size
        rng = random.Random(batch)
        prompts = [[rng.randrange(3, vocab) for _ in range(a.prompt_len)] for _ in range(batch)]
        params = SamplingParams(max_tokens=a.output_len, temperature=0, ignore_eos=True)
        engine.speculator = None                                   # plain decoding, the same engine
        timed_generate(llm, prompts, params)
        runs = [timed_generate(llm, prompts, params) for _ in range(3)]
        plain_s, outs = statistics.median(r[0] for r in runs), runs[0][1]     # the baseline of every ratio
        records = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, outs)}
        engine.speculator = spec
        for k in a.ks:
            spec.k = k
            for alpha in a.alphas:
                spec.proposer, spec.acceptance, spec.clock = Oracle(records, alpha, vocab), {}, StepClock()
                timed_generate(llm, prompts, params)
                spec.proposer, spec.acceptance, spec.clock = Oracle(records, alpha, vocab, seed=1), {}, StepClock()
                s0 = engine.stats()
                secs, outs = timed_generate(llm, prompts, params)
                s1 = engine.stats()
                # in bf16 a verify step's logits come from other kernels than a decode step's: where
                # random weights leave a near-tie, greedy may flip, and the record is stale after it
                agree = [_common_prefix(o.outputs[0].token_ids, records[tuple(p)]) / a.output_len
                         for p, o in zip(prompts, outs)]
                proposed = s1.spec_num_draft_tokens - s0.spec_num_draft_tokens
                accepted = s1.spec_num_accepted_tokens - s0.spec_num_accepted_tokens
                model = k + 1 if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
                rows.append(dict(batch=batch, k=k, alpha=alpha, cutoff=spec.cutoff, speedup=plain_s / secs,
                                 tokens_per_s=batch * a.output_len / secs, plain_tokens_per_s=batch * a.output_len / plain_s,
                                 measured_acceptance=accepted / proposed if proposed else None,
                                 drafts=s1.spec_num_drafts - s0.spec_num_drafts, model_tokens_per_step=model,
                                 record_agreement=statistics.mean(agree)))
        del llm, engine, spec
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return dict(part="oracle", prompt_len=a.prompt_len, output_len=a.output_len, rows=rows)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=("demo", "agent", "verify", "oracle"))
    p.add_argument("--model", default=None)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS, help="demo: the proposers")
    p.add_argument("--head", default=None, help="demo: the EAGLE-3 head (default: the bundled demo-code-12m-eagle3)")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    p.add_argument("--quantization", default=None, choices=("int4", "fp8"), help="verify / oracle: the weights' precision")
    p.add_argument("--kv-cache-dtype", default=None, choices=("auto", "fp8"), help="verify / oracle: the KV cache's")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 6])
    p.add_argument("--alphas", type=float, nargs="+", default=[0.0, 0.5, 0.8, 0.9])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--turns", type=int, default=4, help="agent: turns a file")
    p.add_argument("--suffix-k", type=int, default=16, help="agent: suffix decoding's num_speculative_tokens")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    result = {"demo": run_demo, "agent": run_agent, "verify": run_verify, "oracle": run_oracle}[a.part](a)
    result.update(device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                  date=time.strftime("%Y-%m-%d"), argv=sys.argv[1:])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    keys = list(dict.fromkeys(k for r in result["rows"] for k in r))
    print(" ".join(f"{k:>14}" for k in keys))
    for r in result["rows"]:
        print(" ".join(f"{v:>14.4g}" if isinstance(v, float) else f"{str(v):>14}" for v in (r.get(k) for k in keys)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
