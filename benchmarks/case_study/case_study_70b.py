"""Issue 21's case study: a Llama-3-70B shape on one GPU, measured round by round; and its story.

    python benchmarks/case_study/case_study_70b.py round --round 0 --model /tmp/llama3-70b --out docs/case-study-70b/round-0
    python benchmarks/case_study/case_study_70b.py round --round 0 --smoke --out /tmp/cs-smoke    # the demo model, CPU-sized
    python benchmarks/case_study/case_study_70b.py story --rounds docs/case-study-70b           # table + plot in the doc

A round is its engine flags (ROUNDS; --engine-args adds more, e.g. round 2's lever) on dummy weights
(--model is written with random_checkpoint --preset llama3-70b --config-only when it has no
config.json). It runs two processes, one engine each, one after the other (one 70B fits a GPU):
  1. `measure` (this file, a child): one LLM; `ridge bench latency`'s run_latency at batch 1 and 64
     (1,024-token prompts, 128 new tokens: TTFT, ITL, MBU), then `ridge roofline`'s run_roofline on
     the same engine (prefill of 1,024 tokens, decode at batch 1 and 64, --predict) -> report.md,
     report.json, roofline.png; round 3 adds the controlled-acceptance proposer of
     benchmarks/engine/spec_decode.py (acceptance ALPHA, k = K) at batch 1 beside n-gram's run;
  2. `ridge serve` with the same flags, then `ridge bench serve` (1,024 -> 256 tokens, Poisson) at
     rates from --rates, bisected (a rate that keeps p99 TTFT < 500 ms and p99 ITL < 50 ms sends the
     search up, one that does not down), each run bounded by what is left of --budget-s.
summary.json: each figure, its target, met or not, and the roofline's prediction of the same step
(`predicted_launches_s` of the report's step: every op at its roof plus one launch floor a kernel)
with the gap, flagged beyond 15%. Nothing is estimated here that a ridge command did not measure.
ITL is decode time per output token (1 / decode tokens/s: with speculation a step emits several);
goodput is the output tokens/s of the requests meeting TTFT <= 500 ms and TPOT <= 50 ms at the
highest rate that keeps p99 TTFT < 500 ms and p99 ITL < 50 ms (no roofline prediction of it).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from benchmarks.case_study import case_study_serve as serve_part  # noqa: E402

ALPHA, K = 0.78, 5                           # seed 002's speculation round
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
ROUNDS = {
    0: ("FP8 weights, bf16 KV", ["--quantization", "fp8"]),
    1: ("INT4 weights, FP8 KV", ["--quantization", "int4", "--kv-cache-dtype", "fp8"]),
    2: ("round 1 + the lever round 1's roofline named (--engine-args)", ["--quantization", "int4", "--kv-cache-dtype", "fp8"]),
    3: ("round 2 + speculation (controlled acceptance 0.78, k = 5; n-gram)",
        ["--quantization", "int4", "--kv-cache-dtype", "fp8", "--speculative-config", json.dumps(NGRAM)]),
}
TARGETS = {  # name: (target, "<=" or ">=", unit, what)
    "ttft_b1_ms": (300.0, "<=", "ms", "TTFT, batch 1, 1,024-token prompt"),
    "itl_b1_ms": (12.0, "<=", "ms", "ITL, batch 1, no speculation"),
    "itl_b1_spec_ms": (6.0, "<=", "ms", f"ITL, batch 1, speculation (acceptance {ALPHA}, k = {K})"),
    "itl_b1_ngram_ms": (None, None, "ms", "ITL, batch 1, n-gram speculation (random prompts)"),
    "goodput_tok_s": (2500.0, ">=", "tok/s", "serve goodput (p99 TTFT < 500 ms, p99 ITL < 50 ms)"),
    "step_b64_ms": (None, None, "ms", "decode step, batch 64"),
    "decode_b64_tok_s": (None, None, "tok/s", "decode tokens/s, batch 64"),
}
TOLERANCE = 0.15
FULL = dict(input=1024, output=128, batches=(1, 64), serve_in=1024, serve_out=256, prompts=80, rates=(2, 4, 6, 8, 12, 16),
            iters=3, warmup=1, reps=5, batched_tokens=4096)
SMOKE = dict(input=16, output=4, batches=(1, 4), serve_in=16, serve_out=4, prompts=3, rates=(8,), iters=1, warmup=0,
             reps=1, batched_tokens=128)


def engine_flags(a, batched_tokens: int | None = None) -> list[str]:
    flags = list(ROUNDS[a.round][1]) + shlex.split(a.engine_args or "")
    if not a.smoke:
        flags += ["--load-format", "dummy"]
    budget = batched_tokens or (SMOKE if a.smoke else FULL)["batched_tokens"]
    return ["--model", a.model] + flags + ["--max-num-batched-tokens", str(budget)]


# ----------------------------------------------------------------------------- 1. one engine, in a child
def measure(a) -> int:
    import torch

    from ridge import LLM, settings
    from ridge.bench.common import write_json
    from ridge.bench.latency import measure_ceilings_first, run_latency
    from ridge.config import EngineConfig
    from ridge.roofline import run_roofline

    p = argparse.ArgumentParser()
    settings.add_arguments(p, EngineConfig)
    # no prefix caching: the roofline's prompts could share a prefix with the latency runs' (both seeded)
    engine = settings.from_args(EngineConfig, p.parse_args(engine_flags(a) + ["--no-enable-prefix-caching"]))
    L = (SMOKE if a.smoke else FULL)
    measure_ceilings_first(engine.device)            # the ceilings' buffers before the weights and KV pool
    llm = LLM(show_progress=False, **engine.as_kwargs())
    spec = llm.engine.speculator
    llm.engine.speculator = None if spec is not None and a.round == 3 else spec
    runs = {}
    for b in L["batches"]:
        runs[f"latency_b{b}"] = run_latency(llm, b, L["input"], L["output"], num_iters=L["iters"] if b == 1 else 1,
                                            warmup_iters=L["warmup"], progress=False)
    if spec is not None:
        llm.engine.speculator = spec
        runs["latency_b1_ngram"] = run_latency(llm, 1, L["input"], L["output"], num_iters=L["iters"],
                                               warmup_iters=L["warmup"], progress=False)
        runs["latency_b1_spec"] = controlled_acceptance(llm, spec, L, a.smoke)
    for name, r in runs.items():
        write_json(os.path.join(a.out, name + ".json"), r)
    rep = run_roofline(llm=llm, batches=list(L["batches"]), context=L["input"] + L["output"] // 2,
                       prefill_len=L["input"], predict=True, out=a.out, reps=L["reps"], warmup=min(L["reps"], 2),
                       precisions=("bf16", "fp8", "int4", "fp8-kv", "int4+fp8-kv"),
                       command="benchmarks/case_study/case_study_70b.py " + " ".join(shlex.quote(x) for x in sys.argv[1:]))
    write_json(os.path.join(a.out, "measure_extra.json"), dict(
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        spec_itl_predicted_s=predicted_spec_itl(llm, rep, L) if spec is not None else None))
    return 0


def controlled_acceptance(llm, spec, L: dict, smoke: bool) -> dict:
    """Batch 1 with benchmarks/engine/spec_decode.py's Oracle: it proposes the target's own greedy
    continuation, each token corrupted with probability 1 - ALPHA, for exactly the prompts
    run_latency draws (the same seeded RandomPrompts stream)."""
    from benchmarks.engine.spec_decode import Oracle, without_near_ties

    from ridge import SamplingParams
    from ridge.bench.datasets import RandomPrompts, special_token_ids
    from ridge.bench.latency import run_latency
    from ridge.engine.spec.clock import StepClock

    engine = llm.engine
    if not smoke:                                     # dummy weights: greedy without near-ties (see there)
        without_near_ties(llm)
    iters, warmup = L["iters"], L["warmup"]
    draw = RandomPrompts(engine.model_cfg.vocab_size, special_token_ids(engine.model_cfg, engine.tokenizer), 0)
    prompts = [draw.draw(L["input"]) for _ in range(iters + warmup)]
    engine.speculator = None
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=L["output"], ignore_eos=True), use_tqdm=False)
    engine.speculator = spec
    spec.k = K
    spec.proposer = Oracle({tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, outs)}, ALPHA,
                           engine.model_cfg.vocab_size)
    spec.acceptance, spec.clock = {}, StepClock()
    r = run_latency(llm, 1, L["input"], L["output"], num_iters=iters, warmup_iters=warmup, seed=0, progress=False)
    r["config"].update(proposer="controlled acceptance (benchmarks/engine/spec_decode.py Oracle)", alpha=ALPHA, k=K)
    return r


def predicted_spec_itl(llm, rep, L: dict) -> float:
    """The roofline's floor of a batch-1 verify step (k + 1 tokens, ops at their roofs plus one launch
    floor a kernel) over the tokens a step emits at acceptance ALPHA: (1 - a^(k+1)) / (1 - a)."""
    from ridge.layers.cost import StepShape
    from ridge.roofline.predict import predicted_step_s

    ctx = L["input"] + L["output"] // 2
    shape = StepShape((K + 1,), (ctx + K + 1,), dtype=llm.engine.cfg.dtype,
                      kv_bytes=llm.engine.runner.kv_element_bytes())
    step = predicted_step_s(llm.engine.runner.model, rep.ceilings, shape, with_launches=True)
    return step / ((1 - ALPHA ** (K + 1)) / (1 - ALPHA))


# ----------------------------------------------------------------------------- 3. summary.json
def figure(name: str, measured, predicted=None, source: str = "") -> dict:
    target, op, unit, what = TARGETS[name]
    met = None if measured is None or target is None else (measured <= target if op == "<=" else measured >= target)
    gap = None if measured in (None, 0) or predicted is None else (measured - predicted) / measured
    return dict(name=name, what=what, unit=unit, target=target, comparison=op, measured=measured, met=met,
                predicted=predicted, prediction_gap=gap,
                prediction_flag=None if gap is None else ("within 15%" if abs(gap) <= TOLERANCE else
                                                         "off by more than 15%: explain"), source=source)


def summarize_round(a, serve: dict | None) -> dict:
    def load(name):
        path = os.path.join(a.out, name)
        return json.load(open(path)) if os.path.exists(path) else None
    rep, extra = load("report.json"), load("measure_extra.json") or {}
    steps = {s["title"]: s for s in (rep or {}).get("steps", [])}
    L = (SMOKE if a.smoke else FULL)
    ms = lambda v: None if v is None else v * 1e3  # noqa: E731

    def pred(title):
        s = steps.get(title)
        return s and s["summary"].get("predicted_launches_s")

    b1, bN = load("latency_b1.json"), load(f"latency_b{L['batches'][-1]}.json")
    ctx = L["input"] + L["output"] // 2
    p_prefill, p_b1, p_bN = (pred(f"prefill batch 1 x {L['input']} tokens"), pred(f"decode batch 1, context {ctx}"),
                             pred(f"decode batch {L['batches'][-1]}, context {ctx}"))
    per_token = lambda r: r and r["decode_tokens_per_s"] and 1e3 / r["decode_tokens_per_s"]  # noqa: E731
    figs = [figure("ttft_b1_ms", b1 and ms(b1["ttft_s"]["median"]), ms(p_prefill), "latency_b1.json ttft_s.median"),
            figure("itl_b1_ms", per_token(b1), ms(p_b1), "latency_b1.json 1 / decode_tokens_per_s"),
            figure("step_b64_ms", bN and ms(bN["itl_s"]["median"]), ms(p_bN), f"latency_b{L['batches'][-1]}.json"),
            figure("decode_b64_tok_s", bN and bN["decode_tokens_per_s"],
                   p_bN and L["batches"][-1] / p_bN, "decode_tokens_per_s")]
    if a.round == 3:
        figs += [figure("itl_b1_spec_ms", per_token(load("latency_b1_spec.json")), ms(extra.get("spec_itl_predicted_s")),
                        "latency_b1_spec.json; predicted: verify-step floor / (1 - a^(k+1)) / (1 - a)"),
                 figure("itl_b1_ngram_ms", per_token(load("latency_b1_ngram.json")), None, "latency_b1_ngram.json")]
    figs.append(figure("goodput_tok_s", serve and serve["goodput_tok_s"], None, "serve_sweep.json (no roofline "
                       "prediction of a serving goodput)"))
    first = {s["title"]: s["first_target"] for s in (rep or {}).get("steps", [])}
    return dict(round=a.round, about=ROUNDS[a.round][0], smoke=a.smoke, flags=engine_flags(a)[2:],
                device=extra.get("device"), date=(rep or {}).get("created", time.strftime("%Y-%m-%d"))[:10], figures=figs,
                roofline_first_target=first, spec=dict(alpha=ALPHA, k=K, **{
                    f"{n}_acceptance_rate": (load(f"latency_b1_{n}.json") or {}).get("spec_acceptance_rate")
                    for n in ("spec", "ngram")}) if a.round == 3 else None,
                serve=serve and {k: serve.get(k) for k in ("device", "max_num_batched_tokens", "budget_from", "chosen_rate", "note",
                                                             "probes")})


def model_setup(a) -> None:
    """The round's --model: a bundled demo model with --smoke, else the config-only 70B (written if missing)."""
    if a.smoke:     # a CI-sized run: the 3M draft model, or the 12M demo where INT4 needs 128-wide groups
        from ridge.assets import demo_model_path
        a.model = a.model or (demo_model_path() if "int4" in engine_flags(a) else
                              os.path.join(os.path.dirname(demo_model_path()), "demo-code-3m"))
    elif not os.path.exists(os.path.join(a.model, "config.json")):
        subprocess.run([sys.executable, "-m", "ridge.utils.random_checkpoint", a.model, "--arch", "llama",
                        "--preset", "llama3-70b", "--config-only"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def measure_in_child(a) -> int:
    """The round's one-engine part (`measure`) in a child process; its exit status."""
    model_setup(a)
    child = [sys.executable, os.path.abspath(__file__), "measure", "--round", str(a.round), "--model", a.model,
             "--out", a.out, "--engine-args", a.engine_args or ""] + (["--smoke"] if a.smoke else [])
    return subprocess.run(child, cwd=ROOT).returncode


def run_round(a) -> int:
    from ridge.bench.common import write_json

    t0 = time.monotonic()
    os.makedirs(a.out, exist_ok=True)
    if a.serve_only:            # the measured files stay; the server needs the model and sizes its chunk from them
        model_setup(a)
    rc = 0 if a.summarize_only or a.serve_only else measure_in_child(a)
    serve, t1 = None, time.monotonic()
    if rc == 0 and not (a.no_serve or a.summarize_only):
        try:
            L = SMOKE if a.smoke else FULL
            serve = serve_part.serve_sweep(a.out, L, sorted(a.rates or L["rates"]), a.num_prompts or L["prompts"],
                                           lambda tokens: engine_flags(a, tokens), a.start_timeout_s, t0 + a.budget_s)
        except RuntimeError as e:        # the server did not start: the measured part is kept
            serve = dict(max_num_batched_tokens=None, budget_from=None, chosen_rate=None, goodput_tok_s=None,
                         probes=[], note=f"not measured: {str(e)[-1500:]}")
        write_json(os.path.join(a.out, "serve_sweep.json"), serve)
    elif a.summarize_only and os.path.exists(os.path.join(a.out, "serve_sweep.json")):
        serve = json.load(open(os.path.join(a.out, "serve_sweep.json")))
    summary, path = summarize_round(a, serve), os.path.join(a.out, "summary.json")
    summary.update(measure_rc=rc, measure_s=t1 - t0, serve_s=time.monotonic() - t1)
    not_run = ((("measure_rc", "measure_s") if a.summarize_only or a.serve_only else ())
               + (("serve_s",) if a.summarize_only else ()))     # these keep the earlier summary's figures
    old = json.load(open(path)) if not_run and os.path.exists(path) else {}
    summary.update({k: old.get(k) for k in not_run})
    write_json(path, summary)
    for f in summary["figures"]:
        verdict = {True: "met", False: "NOT met", None: "not measured"}[f["met"]]
        print(f"{f['name']:<18} measured {fmt(f['measured'])} predicted {fmt(f['predicted'])}"
              + ("" if f["target"] is None else f" (target {f['comparison']} {f['target']:g}: {verdict})"))
    return rc


fmt = lambda v: "-" if v is None else f"{v:,.4g}"  # noqa: E731


def story(a) -> int:
    from benchmarks.case_study.case_study_story import write_story
    return write_story(a.rounds, a.doc)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("round", "measure"):
        r = sub.add_parser(name, help="run one round" if name == "round" else "(internal) the one-engine part")
        r.add_argument("--round", type=int, required=True, choices=sorted(ROUNDS))
        r.add_argument("--model", default=None, help="config-only 70B directory (written if missing)")
        r.add_argument("--out", required=True)
        r.add_argument("--smoke", action="store_true", help="a bundled demo model on this machine, tiny lengths")
        r.add_argument("--engine-args", default="", help="more engine flags for every engine of the round (quoted)")
        r.add_argument("--budget-s", type=float, default=540, help="the round's wall budget; bounds the serve sweep")
        r.add_argument("--rates", type=float, nargs="+", default=None, help="request-rate ladder (req/s)")
        r.add_argument("--num-prompts", type=int, default=None, help="requests per serve probe")
        r.add_argument("--start-timeout-s", type=float, default=300, help="for ridge serve's engine to be ready")
        r.add_argument("--no-serve", action="store_true", help="skip the serve sweep")
        r.add_argument("--serve-only", action="store_true",
                       help="only the serve sweep, sized from the batch-1 latency run already in --out")
        r.add_argument("--summarize-only", action="store_true",
                       help="measure nothing: write summary.json from the files already in --out")
    s = sub.add_parser("story", help="the figures table of docs/case-study-70b.md and the plot, from summary.json")
    s.add_argument("--rounds", default=os.path.join(ROOT, "docs", "case-study-70b"))
    s.add_argument("--doc", default=None, help="default: case-study-70b.md beside --rounds")
    a = ap.parse_args(argv)
    if a.cmd != "story" and not a.smoke and not a.model:
        ap.error("--model is required without --smoke")
    return {"round": run_round, "measure": measure, "story": story}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
