"""`benchmarks/engine/tp.py scale` (imported by tp.py, not run): tensor-parallel scaling (issue 22).

Per shape and TP size, in a process of its own (`scale_one`): TTFT of a --ttft-len (4,096) token
prompt, batch-1 ITL and tokens/s, batch-64 tokens/s, each ridge's latency benchmark
(ridge.bench.latency.run_latency) with dummy weights; then tp.py's comm measurement at that size
(the decode step's CUDA graph replayed with and without its collectives: the exposed
communication a step). Last, with every engine gone, the roofline's prediction for each size
(ridge.roofline.predict at tensor_parallel_size N against this machine's ceilings, the link
measured among N GPUs: ridge/utils/collectives.py) and the scaling efficiency from the smallest
size measured (TP = 1 for the 8B shape, TP = 2 for 70B, or one from --baseline files of earlier
runs): tokens/s at N over (N / base) x tokens/s at base.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

import torch


def scale_one(a) -> dict:
    """The child: one engine at TP = a.tp[0]; TTFT, batch 1 and batch 64."""
    from ridge import LLM
    from ridge.bench.latency import run_latency

    b64 = max(a.batches)
    llm = LLM(model=a.model, load_format="dummy", tensor_parallel_size=a.tp[0],
              max_model_len=max(a.ttft_len + 8, a.input_len + a.output_len), max_num_seqs=b64,
              max_num_batched_tokens=max(a.ttft_len, 2048), kv_cache_memory=int(a.kv_gb * 2**30), show_progress=False)
    try:
        ttft = run_latency(llm, 1, a.ttft_len, 4, num_iters=a.iters, warmup_iters=1, progress=False)
        out = dict(tp=a.tp[0], ttft_s=ttft["ttft_s"]["median"])
        for b in sorted(set(a.batches)):
            r = run_latency(llm, b, a.input_len, a.output_len, num_iters=a.iters, warmup_iters=1, progress=False)
            out[f"b{b}"] = dict(itl_s=r["itl_s"]["median"], tok_s=r["decode_tokens_per_s"], mbu_per_gpu=r.get("mbu"))
    finally:
        llm.close()
    return out


def _predict(path: str, n: int, a) -> dict:
    from ridge.config import ModelConfig
    from ridge.roofline.predict import predict
    from ridge.utils.ceilings import load_ceilings

    cfg = ModelConfig.from_dir(path)
    c = load_ceilings("cuda" if torch.cuda.is_available() else "cpu", ranks=n)
    kw = dict(precisions=("bf16",), tensor_parallel_size=n)
    pre, = predict(cfg, c, batches=(1,), contexts=(a.ttft_len,), **kw)
    rows = {r.batch: r for r in predict(cfg, c, batches=tuple(sorted(set(a.batches))),
                                        contexts=(a.input_len + a.output_len // 2,), **kw)}
    out = dict(ttft_s=pre.prefill_s, link=c.link(n).describe() if n > 1 else None,
               link_measured=c.link(n).measured if n > 1 else None)
    for b, r in rows.items():
        out[f"b{b}"] = dict(itl_s=r.decode_launches_s, floor_s=r.decode_s, comm_s=r.decode_comm_s,
                            tok_s=b / r.decode_launches_s, bound=r.decode_bound)
    return out


def scale(a, shape_dir, weight_bytes, comm, here: str) -> dict:
    start, gpus = time.monotonic(), torch.cuda.device_count()
    memory = torch.cuda.get_device_properties(0).total_memory if gpus else 0
    entries, slowest = [], 0.0
    for preset in a.shapes:
        path = shape_dir(preset)
        for n in a.tp:
            e, t0 = dict(shape=preset, tp=n), time.monotonic()
            need, left = weight_bytes(path) / n, a.budget_s - (t0 - start)
            if n > gpus or need > 0.9 * memory:
                e["skipped"] = f"{need / 2**30:.0f} GiB of weights a GPU on {n} GPUs; {gpus} GPUs of " \
                               f"{memory / 2**30:.0f} GiB"
            elif left < max(slowest * 1.2, a.min_run_s):
                e["skipped"] = f"{left:.0f} s of --budget-s left, a run took up to {slowest:.0f} s"
            if "skipped" in e:
                print(f"  {preset} TP={n}: skipped ({e['skipped']})", flush=True)
                entries.append(e)
                continue
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                cmd = [sys.executable, f"{here}/tp.py", "scale-one", "--model", path, "--tp", str(n), "--batches",
                       *map(str, a.batches), "--input-len", str(a.input_len), "--output-len", str(a.output_len),
                       "--ttft-len", str(a.ttft_len), "--iters", str(a.iters), "--kv-gb", str(a.kv_gb),
                       "--json", f.name]
                rc = subprocess.run(cmd, timeout=a.run_timeout).returncode
                e.update(json.load(open(f.name)) if rc == 0 else dict(error=f"exit code {rc}"))
            if n > 1 and "error" not in e:
                c = comm(argparse.Namespace(shape=preset, tp=[n], batches=a.batches, reps=a.reps,
                                            run_timeout=a.run_timeout))
                e["comm"] = {f"b{r['batch']}": r for r in c["comm"]["rows"]}
            slowest = max(slowest, time.monotonic() - t0)
            entries.append(e)
            print(f"  {preset} TP={n}: {summary(e)} ({time.monotonic() - t0:.0f} s)", flush=True)
    for e in entries:                       # every engine is gone: the ceilings and links measure alone
        if "skipped" not in e and "error" not in e:
            e["predicted"] = _predict(shape_dir(e["shape"]), e["tp"], a)
    efficiency(entries, [x for f in a.baseline for x in json.load(open(f)).get("scale", [])])
    return dict(scale=entries, budget_s=a.budget_s)


def summary(e: dict) -> str:
    if "error" in e:
        return e["error"]
    return (f"TTFT {e['ttft_s'] * 1e3:.1f} ms, b1 ITL {e['b1']['itl_s'] * 1e3:.2f} ms ({e['b1']['tok_s']:.1f} tok/s)"
            + "".join(f", b{k[1:]} {v['tok_s']:.0f} tok/s" for k, v in e.items() if k.startswith("b") and k != "b1"))


def efficiency(entries: list[dict], baseline: list[dict]) -> None:
    """Each measured entry's scaling efficiency per batch from the smallest TP of its shape (this
    run's, else the baseline files'): tok/s at N / ((N / base) x tok/s at base); TTFT likewise."""
    for e in entries:
        if "ttft_s" not in e:
            continue
        pool = [x for x in entries + baseline if x["shape"] == e["shape"] and "ttft_s" in x]
        base = min(pool, key=lambda x: x["tp"])
        e["efficiency_from"] = dict(tp=base["tp"], this_run=base in entries)
        for k in [k for k in e if k.startswith("b") and k[1:].isdigit() and k in base]:
            e[k]["efficiency"] = e[k]["tok_s"] / (e["tp"] / base["tp"] * base[k]["tok_s"])
        e["ttft_efficiency"] = base["ttft_s"] / (e["tp"] / base["tp"] * e["ttft_s"])


def table(r: dict, format_table) -> str:
    def ms(v):
        return "-" if v is None else f"{v * 1e3:.2f}"
    rows = []
    for e in r["scale"]:
        if "ttft_s" not in e:
            rows.append([e["shape"], e["tp"], e.get("skipped", e.get("error", "")), *["-"] * 7])
            continue
        p, c = e.get("predicted", {}), e.get("comm", {})
        b64 = max((k for k in e if k.startswith("b") and k[1:].isdigit()), key=lambda k: int(k[1:]))
        step_comm = " / ".join(f"{c[k]['exposed_comm_s'] * 1e6:.0f}" if k in c else "-" for k in ("b1", b64))
        pred_comm = " / ".join(f"{p[k]['comm_s'] * 1e6:.0f}" if k in p else "-" for k in ("b1", b64))
        eff = " / ".join(f"{e[k].get('efficiency', float('nan')):.0%}" for k in ("b1", b64))
        rows.append([e["shape"], e["tp"], f"{ms(e['ttft_s'])} ({ms(p.get('ttft_s'))})",
                     f"{ms(e['b1']['itl_s'])} ({ms(p.get('b1', {}).get('itl_s'))})", f"{e['b1']['tok_s']:.1f}",
                     f"{e[b64]['tok_s']:,.0f} ({p.get(b64, {}).get('tok_s', 0):,.0f})", f"{step_comm} ({pred_comm})",
                     f"{e.get('ttft_efficiency', float('nan')):.0%}", f"{eff} from TP={e['efficiency_from']['tp']}"])
    return format_table(["shape", "TP", "TTFT ms (pred)", "b1 ITL ms (pred)", "b1 tok/s", "b64 tok/s (pred)",
                         "exposed comm us b1/b64 (pred)", "TTFT eff", "tok/s eff b1/b64"], rows,
                        title="tensor-parallel scaling (measured; roofline prediction at TP = N in brackets)")
