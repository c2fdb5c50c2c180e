"""`ridge roofline`: the command (registered by `ridge.cli.build_parser`)."""
from __future__ import annotations

import argparse
import shlex
import sys

from ridge import settings
from ridge.config import EngineConfig

# seats and token budget default to what the steps need (decode graphs are captured per seat count)
ROOFLINE_DEFAULTS = {"max_num_seqs": (None, "what the steps need"),
                     "max_num_batched_tokens": (None, "what the steps need")}


def add_roofline_parser(sub) -> argparse.ArgumentParser:
    r = sub.add_parser("roofline", help="measured ceilings, per-op roofline diagnosis, MFU/MBU, predictions, plots",
                       description="Measure this device's ceilings (cached per device), time the ops of a real "
                                   "prefill step and decode steps, and say what bounds each op and what to do.")
    settings.add_arguments(r, EngineConfig, title="engine", defaults=ROOFLINE_DEFAULTS)
    r.add_argument("--batch", type=int, nargs="+", default=[1], help="decode batch sizes (one step each)")
    r.add_argument("--context", type=int, default=None,
                   help="tokens of context per decode sequence, the new one included (default: 1024, or less "
                        "if the model's context is shorter)")
    r.add_argument("--prefill-len", type=int, default=None,
                   help="prompt tokens per prefill sequence; 0 skips the prefill step (default as --context)")
    r.add_argument("--prefill-batch", type=int, default=1, help="sequences in the prefill step")
    r.add_argument("--no-decode", action="store_true", help="time only the prefill step")
    r.add_argument("--sampling", default="greedy", choices=["greedy", "random"],
                   help="greedy: argmax; random: temperature 0.8, top-p 0.95 (the sorting path)")
    r.add_argument("--reps", type=int, default=5, help="timed repetitions of each step (medians reported)")
    r.add_argument("--warmup", type=int, default=2)
    r.add_argument("--out", default=None, help="write report.md, report.json, roofline.png and roofline.svg here")
    r.add_argument("--remeasure", action="store_true", help="measure the ceilings again instead of using the cache")
    r.add_argument("--ceilings-only", action="store_true", help="measure (or load) and print the ceilings, then stop")
    r.add_argument("--predict", action="store_true",
                   help="predict prefill/decode time, tokens/s and max batch for a grid of shapes and precisions "
                        "(the one mode at --tensor-parallel-size N > 1: a step of N ranks, its collectives at the "
                        "link's measured roof)")
    r.add_argument("--predict-batches", type=int, nargs="+", default=None)
    r.add_argument("--predict-contexts", type=int, nargs="+", default=None)
    r.add_argument("--precisions", nargs="+", default=None,
                   help="of bf16 fp16 fp32 fp8 int4 fp8-kv int4+fp8-kv (default: bf16 fp8 int4 fp8-kv)")
    r.add_argument("--kv-budget-gb", type=float, default=None,
                   help="KV-cache memory for --predict's max batch (default: 90%% of GPU memory minus the "
                        "weights; the engine's CPU pool on a CPU)")
    r.set_defaults(func=cmd_roofline)
    return r


def _command_line() -> str | None:
    """The command as typed, for the report (None when not called from the command line)."""
    args = sys.argv[1:]
    return "ridge " + " ".join(shlex.quote(x) for x in args) if args[:1] == ["roofline"] else None


def cmd_roofline(a: argparse.Namespace) -> int:
    import torch

    from ridge.utils.ceilings import cache_path, load_ceilings
    from ridge.roofline.predict import DEFAULT_BATCHES, DEFAULT_PRECISIONS
    from ridge.roofline.report import ceilings_line, datasheet_line, format_terminal
    from ridge.roofline.api import run_roofline

    kw = settings.values(EngineConfig, a)
    # validated here, before anything loads; the two left to the steps are filled by run_roofline
    engine = EngineConfig.from_kwargs(**{k: v for k, v in kw.items() if v is not None or k not in ROOFLINE_DEFAULTS})
    # --num-cpu-threads (--threads) is the engine's setting; the ceilings, measured before any engine
    # is built and cached per thread count, are measured with it too
    if engine.num_cpu_threads is not None:
        torch.set_num_threads(engine.num_cpu_threads)
    if a.ceilings_only:
        if a.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device: 'cuda' was asked for but no CUDA device is available")
        dev = torch.device("cuda" if a.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu")
        ranks = a.tensor_parallel_size or 1
        c = load_ceilings(dev, remeasure=a.remeasure, ranks=ranks)
        print(f"{c.name} ({c.device}), measured {c.measured_at}, cached at {cache_path(dev)}")
        print(ceilings_line(c))
        if ranks > 1:
            print(c.link(ranks).describe())
        ds = datasheet_line(c)
        if ds:
            print(ds)
        return 0
    tp = kw.pop("tensor_parallel_size", None) or 1
    if tp > 1 and not a.predict:
        raise ValueError("tensor_parallel_size: ridge roofline times one process's kernels; at N > 1 it only "
                         "predicts (add --predict): one rank's share of the model plus its collectives at the "
                         "link's roof (measured among N ranks where this machine has them)")
    model, device, dtype = kw.pop("model"), kw.pop("device"), kw.pop("dtype")
    rep = run_roofline(model, device=device, dtype=dtype, batches=[] if a.no_decode else a.batch,
                       context=a.context, prefill_len=a.prefill_len, prefill_batch=a.prefill_batch, reps=a.reps,
                       warmup=a.warmup, sampling=a.sampling, predict=a.predict,
                       predict_batches=a.predict_batches or DEFAULT_BATCHES, predict_contexts=a.predict_contexts,
                       precisions=a.precisions or DEFAULT_PRECISIONS,
                       kv_budget=a.kv_budget_gb * 1e9 if a.kv_budget_gb is not None else None,
                       remeasure=a.remeasure, out=a.out, engine_kwargs=kw,
                       command=_command_line(), tensor_parallel_size=tp)
    print(format_terminal(rep))
    if a.out:
        print(f"\nwrote {a.out}/report.md, report.json, roofline.png, roofline.svg")
    return 0
