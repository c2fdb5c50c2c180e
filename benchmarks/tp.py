"""Tensor parallelism on GPUs (issue 20), three measurements, each with its peer in the same run:

  decode  TP = 1 against TP = N decode of model shapes (config only, --load-format dummy weights):
          per (shape, TP size) one engine, in a process of its own, timed by ridge's own latency
          benchmark (ridge.bench.latency.run_latency) at each batch; a TP size whose weights do not
          fit a GPU is skipped and said so.
  comm    the collectives' share of a decode step: N ranks (one a GPU) build the shape's model
          with the engine's runner and capture its decode CUDA graphs, then replay them as they
          are and again with every collective replaced by a local no-op of the same shape (the
          same kernels, no communication). The difference is the exposed communication time of a
          step; divided by the layers, a layer's (its two all-reduces); over the step, the share.
  prefill the collectives' exposed time in an eager prefill step of T tokens (one sequence; shapes
          cut to --layers layers, config only + dummy weights: a layer's time does not depend on
          how many there are, and the 70B shape's share then fits any GPU), N ranks (one a GPU):
          run whole and as two overlapped micro-batches (ridge/models/overlap.py), each with and
          without communication (every collective a local no-op of the same shape, as in comm).
          Exposed a layer: (with - without collectives, run whole) / layers, before; (overlapped
          - whole without collectives) / layers, after (the split's own cost counted against it).
  ring    a decode step's plan (ridge/runner/step_message.py's layout, batch B at a context of
          --context tokens) handed to a second process through the shared-memory step ring
          against a gloo broadcast of the same bytes (benchmarks/step_ring.py's round trips).

    python benchmarks/tp.py decode --shapes llama3-8b llama3-70b --tp 1 2 --batches 1 64 --json tp_decode.json
    python benchmarks/tp.py comm --shape llama3-8b --tp 2 --batches 1 64 --json tp_comm.json
    python benchmarks/tp.py prefill --shapes llama3-8b llama3-70b --tp 2 --tokens 512 1024 2048 4096 \
        --json tp_prefill.json
    python benchmarks/tp.py ring --batches 1 256 --json tp_ring.json

NVLink multicast (NCCL's NVLS) stays off: NCCL_NVLS_ENABLE=0 is set for this process and its
children unless the environment says otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
from ridge.bench.common import device_name, format_table, write_json  # noqa: E402
from tp_ranks import join, leave, no_comm, rank_runner, run_ranks, use_group  # noqa: E402


def shape_dir(preset: str, layers: int | None = None) -> str:
    """A config-only checkpoint of the preset, optionally of its first `layers` layers (written once
    under /tmp)."""
    from ridge.utils.random_checkpoint import make_random_checkpoint
    cut = dict(num_hidden_layers=layers) if layers else {}
    path = os.path.join(tempfile.gettempdir(), f"ridge-{preset}{f'-{layers}l' if layers else ''}-config")
    if not os.path.isfile(os.path.join(path, "config.json")):
        make_random_checkpoint(path, preset=preset, dtype=torch.bfloat16, config_only=True, **cut)
    return path


def weight_bytes(path: str) -> int:
    """bf16 bytes of the shape's parameters (embedding and LM head included)."""
    from ridge.model_config import ModelConfig
    m = ModelConfig.from_dir(path)
    layer = m.hidden_size * (2 * m.q_size + 2 * m.kv_size + 3 * m.intermediate_size)
    return 2 * (m.num_layers * layer + m.vocab_size * m.hidden_size * (1 if m.tie_word_embeddings else 2))


# -- decode: TP = 1 vs TP = N, one engine a process ----------------------------------------------------
def decode_one(a) -> None:
    """The child: one engine, every batch, JSON to a.json."""
    from ridge import LLM
    from ridge.bench.latency import run_latency

    llm = LLM(model=a.model, load_format="dummy", tensor_parallel_size=a.tp[0],
              max_model_len=a.input_len + a.output_len, max_num_seqs=max(a.batches), kv_cache_memory=int(a.kv_gb * 2**30), show_progress=False)
    try:
        rows = []
        for b in a.batches:
            r = run_latency(llm, b, a.input_len, a.output_len, num_iters=a.iters, warmup_iters=1, progress=False)
            rows.append(dict(batch=b, itl_median_s=r["itl_s"]["median"], decode_tokens_per_s=r["decode_tokens_per_s"],
                             mbu_per_gpu=r.get("mbu"), overlap_fraction=r.get("overlap_fraction")))
    finally:
        llm.close()
    write_json(a.json, dict(tp=a.tp[0], rows=rows))


def decode(a) -> dict:
    gpus, memory = torch.cuda.device_count(), torch.cuda.mem_get_info(0)[1] if torch.cuda.is_available() else 0
    out = []
    for preset in a.shapes:
        path = shape_dir(preset)
        for tp in a.tp:
            entry = dict(shape=preset, tp=tp)
            need = weight_bytes(path) / tp
            if tp > gpus or need > 0.9 * memory:
                entry["skipped"] = f"{need / 2**30:.0f} GiB of weights a GPU, {tp} GPUs needed; {gpus} GPUs of " \
                                   f"{memory / 2**30:.0f} GiB"
                out.append(entry)
                print(f"  {preset} TP={tp}: skipped ({entry['skipped']})", flush=True)
                continue
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                cmd = [sys.executable, __file__, "decode-one", "--model", path, "--tp", str(tp), "--batches",
                       *map(str, a.batches), "--input-len", str(a.input_len), "--output-len", str(a.output_len),
                       "--iters", str(a.iters), "--kv-gb", str(a.kv_gb), "--json", f.name]
                rc = subprocess.run(cmd, timeout=a.run_timeout).returncode
                entry.update(json.load(open(f.name)) if rc == 0 else dict(error=f"exit code {rc}"))
            out.append(entry)
            for r in entry.get("rows", []):
                print(f"  {preset} TP={tp} batch {r['batch']}: ITL {r['itl_median_s'] * 1e3:.2f} ms, "
                      f"{r['decode_tokens_per_s']:.1f} tok/s", flush=True)
    return dict(decode=out)


def decode_table(r: dict) -> str:
    base = {(e["shape"], row["batch"]): row["itl_median_s"] for e in r["decode"] if e["tp"] == 1
            for row in e.get("rows", [])}
    rows = []
    for e in r["decode"]:
        for row in e.get("rows", []) or [dict(batch="-", itl_median_s=None, decode_tokens_per_s=None)]:
            b1 = base.get((e["shape"], row["batch"]))
            speed = f"{b1 / row['itl_median_s']:.2f}x" if b1 and row["itl_median_s"] else "-"
            itl = f"{row['itl_median_s'] * 1e3:.2f}" if row["itl_median_s"] else e.get("skipped", e.get("error"))
            rows.append([e["shape"], e["tp"], row["batch"], itl,
                         f"{row['decode_tokens_per_s']:.1f}" if row["decode_tokens_per_s"] else "-", speed])
    return format_table(["shape", "TP", "batch", "ITL ms (median)", "decode tok/s", "vs TP=1"], rows,
                        title="decode, TP = 1 vs TP = N")


# -- comm: the collectives' share of a decode step --------------------------------------------------------
def _comm_rank(rank: int, size: int, port: int, path: str, batches: list[int], reps: int, out) -> None:
    import torch.distributed as dist

    tp = join(rank, size, port)
    runner = rank_runner(path, tp, max_model_len=1024, max_num_seqs=max(batches))
    runner.allocate_kv_cache(max(batches) * 1024 // runner.cfg.page_size + 1)
    result = {}
    for label, group in (("with_comm", tp), ("no_comm", no_comm(tp))):
        use_group(runner.model, group)
        runner.decode_graphs = None
        torch.cuda.empty_cache()
        runner.setup_decode(use_graphs=True)
        g = runner.decode_graphs
        g.slots.fill_(-1)                       # no cache writes; every row reads a 1-token context
        for b in batches:
            graph = g.graphs[g.bucket_for(b)]
            times = []
            for _ in range(reps):
                dist.barrier(group=tp.host_group)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(10):
                    graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 10 / 1e3)
            result[(label, b)] = statistics.median(times)
    leave(tp, out, {f"{k[0]}:{k[1]}": v for k, v in result.items()})


def comm(a) -> dict:
    from ridge.model_config import ModelConfig

    path = shape_dir(a.shape)
    rows = []
    for size in a.tp:
        times = run_ranks(_comm_rank, size, (path, a.batches, a.reps), a.run_timeout)
        if times is None:
            continue
        layers = ModelConfig.from_dir(path).num_layers
        for b in a.batches:
            real, local = times[f"with_comm:{b}"], times[f"no_comm:{b}"]
            exposed = max(real - local, 0.0)
            rows.append(dict(tp=size, batch=b, step_s=real, step_no_comm_s=local, exposed_comm_s=exposed,
                             exposed_comm_per_layer_s=exposed / layers, comm_share=exposed / real))
            print(f"  TP={size} batch {b}: step {real * 1e3:.3f} ms, without collectives {local * 1e3:.3f} ms, "
                  f"exposed {exposed / layers * 1e6:.1f} us a layer ({exposed / real:.1%})", flush=True)
    return dict(comm=dict(shape=a.shape, rows=rows))


def comm_table(r: dict) -> str:
    c = r["comm"]
    return format_table(["TP", "batch", "step ms", "no-comm ms", "exposed us/layer", "share"],
                        [[x["tp"], x["batch"], f"{x['step_s'] * 1e3:.3f}", f"{x['step_no_comm_s'] * 1e3:.3f}",
                          f"{x['exposed_comm_per_layer_s'] * 1e6:.1f}", f"{x['comm_share']:.1%}"] for x in c["rows"]],
                        title=f"collectives in a decode step (CUDA graph replay), {c['shape']}")


# -- prefill: the collectives' exposed time in an eager prefill step, whole and overlapped ----------------
PREFILL_MODES = ("whole", "whole_no_comm", "overlap", "overlap_no_comm")


def _prefill_rank(rank: int, size: int, port: int, paths: dict, tokens: list[int], reps: int, out) -> None:
    """Overlapped modes cut every step (the threshold set to 1 token), so the table shows where the
    overlap pays; `on` in it says where OVERLAP_MIN_TOKENS turns it on."""
    import torch.distributed as dist

    import ridge.models.overlap as overlap

    tp, result, threshold = join(rank, size, port), {}, overlap.OVERLAP_MIN_TOKENS
    for shape, path in paths.items():
        T = max(tokens)
        runner = rank_runner(path, tp, max_model_len=T, max_num_batched_tokens=T, max_num_seqs=1)
        page = runner.cfg.page_size
        runner.allocate_kv_cache(T // page + 1)
        runner.warm_up_prefill()            # the engine's: the prefill kernels tuned on a 2048-token chunk
        for n in tokens:
            ids = torch.randint(0, runner.model_cfg.vocab_size, (n,), device=runner.device)
            positions = torch.arange(n, device=runner.device)
            meta = runner.metadata(list(range(n)), [0, n], [n], [list(range(-(-n // page)))])
            hidden = {}
            for mode in PREFILL_MODES:
                use_group(runner.model, no_comm(tp) if mode.endswith("no_comm") else tp)
                # every rank alike, or their collectives would differ
                overlap.OVERLAP_MIN_TOKENS = 1 if mode.startswith("overlap") else n + 1
                with torch.inference_mode():
                    for _ in range(2):
                        hidden[mode] = runner.model(ids, positions, runner.layer_caches, meta)
                    times = []
                    for _ in range(reps):
                        dist.barrier(group=tp.host_group)
                        torch.cuda.synchronize()
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                        runner.model(ids, positions, runner.layer_caches, meta)
                        end.record()
                        end.synchronize()
                        times.append(start.elapsed_time(end) / 1e3)
                result[f"{shape}:{n}:{mode}"] = statistics.median(times)
            w, o = hidden["whole"].float(), hidden["overlap"].float()
            result[f"{shape}:{n}:difference"] = ((o - w).abs().max() / w.abs().max()).item()
        del runner
        torch.cuda.empty_cache()
    overlap.OVERLAP_MIN_TOKENS = threshold
    leave(tp, out, result)


def prefill(a) -> dict:
    from ridge.model_config import ModelConfig
    from ridge.models.overlap import OVERLAP_MIN_TOKENS

    paths = {s: shape_dir(s, a.layers) for s in a.shapes}
    rows = []
    for size in a.tp:
        times = run_ranks(_prefill_rank, size, (paths, a.tokens, a.reps), a.run_timeout)
        if times is None:
            continue
        for shape, path in paths.items():
            layers = ModelConfig.from_dir(path).num_layers
            for n in a.tokens:
                t = {m: times[f"{shape}:{n}:{m}"] for m in PREFILL_MODES}
                before, after = t["whole"] - t["whole_no_comm"], t["overlap"] - t["whole_no_comm"]
                rows.append(dict(shape=shape, layers=layers, tp=size, tokens=n, on=n >= OVERLAP_MIN_TOKENS,
                                 **{f"{m}_s": v for m, v in t.items()}, exposed_before_per_layer_s=before / layers,
                                 exposed_after_per_layer_s=after / layers,
                                 split_cost_per_layer_s=(t["overlap_no_comm"] - t["whole_no_comm"]) / layers,
                                 speedup=t["whole"] / t["overlap"],
                                 max_difference=times[f"{shape}:{n}:difference"]))
                print(f"  {shape} TP={size} T={n}: whole {t['whole'] * 1e3:.2f} ms (no comm "
                      f"{t['whole_no_comm'] * 1e3:.2f}), overlapped {t['overlap'] * 1e3:.2f} ms (no comm "
                      f"{t['overlap_no_comm'] * 1e3:.2f}); exposed a layer {before / layers * 1e6:.1f} -> "
                      f"{after / layers * 1e6:.1f} us; hidden states differ by {rows[-1]['max_difference']:.1e} "
                      f"of their largest", flush=True)
    return dict(prefill=dict(threshold=OVERLAP_MIN_TOKENS, rows=rows))


def prefill_table(r: dict) -> str:
    rows, ms, us = r["prefill"]["rows"], lambda s: f"{s * 1e3:.2f}", lambda s: f"{s * 1e6:.1f}"  # noqa: E731
    return format_table(
        ["shape", "TP", "tokens", "on", "whole ms", "overlapped ms", "no-comm ms", "exposed us/layer", "overlapped",
         "split cost us/layer", "speedup"],
        [[x["shape"], x["tp"], x["tokens"], "yes" if x["on"] else "no", ms(x["whole_s"]), ms(x["overlap_s"]),
          ms(x["whole_no_comm_s"]), us(x["exposed_before_per_layer_s"]), us(x["exposed_after_per_layer_s"]),
          us(x["split_cost_per_layer_s"]), f"{x['speedup']:.3f}x"] for x in rows],
        title=f"collectives in an eager prefill step of one sequence ({rows[0]['layers'] if rows else '-'} layers), "
              f"whole vs two overlapped micro-batches (on: tokens >= OVERLAP_MIN_TOKENS)")


# -- ring: a decode step's plan, ring vs broadcast ---------------------------------------------------------
def ring(a) -> dict:
    from ridge.runner.cuda_graphs import DecodeInputs
    from ridge.runner.step_message import DECODE, StepPlan, encode_plan
    from step_ring import broadcast_round_trips, ring_round_trips

    rng = np.random.default_rng(0)
    pages = -(-a.context // 16)
    rows = []
    for b in a.batches:
        messages = []
        for _ in range(8):
            ids = rng.integers(3, 128000, b).tolist()
            tables = rng.integers(0, 1 << 16, (b, pages)).tolist()
            plan = StepPlan(DECODE, DecodeInputs(ids, [a.context - 1] * b, rng.integers(0, 1 << 20, b).tolist(),
                                                 [a.context] * b, tables))
            messages.append(encode_plan(plan))
        size = max(map(len, messages))
        messages = [m.ljust(size, b"\0") for m in messages]     # the broadcast sends one fixed size
        ring_t = ring_round_trips(messages, a.steps + a.warmup)[a.warmup:]
        bcast_t = broadcast_round_trips(messages, a.steps + a.warmup)[a.warmup:]
        rows.append(dict(batch=b, payload_bytes=size, ring_us=statistics.median(ring_t) * 1e6,
                         broadcast_us=statistics.median(bcast_t) * 1e6))
        print(f"  batch {b}: {size} B, ring {rows[-1]['ring_us']:.1f} us, broadcast {rows[-1]['broadcast_us']:.1f} us",
              flush=True)
    return dict(ring=dict(context=a.context, rows=rows))


def ring_table(r: dict) -> str:
    return format_table(["batch", "bytes", "ring us", "gloo broadcast us", "ring speedup"],
                        [[x["batch"], x["payload_bytes"], f"{x['ring_us']:.1f}", f"{x['broadcast_us']:.1f}",
                          f"{x['broadcast_us'] / x['ring_us']:.1f}x"] for x in r["ring"]["rows"]],
                        title=f"a decode step's plan to rank 1, round trip (context {r['ring']['context']})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["decode", "comm", "prefill", "ring", "decode-one"])
    ap.add_argument("--shapes", nargs="+", default=["llama3-8b", "llama3-70b"])
    ap.add_argument("--shape", default="llama3-8b", help="comm: the model shape")
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tp", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--batches", nargs="+", type=int, default=None)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--kv-gb", type=float, default=4.0, help="decode: KV pool a GPU, GiB")
    ap.add_argument("--reps", type=int, default=20, help="comm: timed repetitions of 10 replays; prefill: of a step")
    ap.add_argument("--tokens", nargs="+", type=int, default=[512, 1024, 2048, 4096],
                    help="prefill: tokens in the step")
    ap.add_argument("--layers", type=int, default=8, help="prefill: the shapes' first LAYERS layers")
    ap.add_argument("--context", type=int, default=4096, help="ring: the context of the step's page tables")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--run-timeout", type=int, default=900)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    a.batches = a.batches or ([1, 256] if a.what == "ring" else [1, 64])
    if a.what == "decode-one":
        decode_one(a)
        return 0
    r = {"decode": decode, "comm": comm, "prefill": prefill, "ring": ring}[a.what](a)
    r["device"] = device_name(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    r["gpus"] = torch.cuda.device_count()
    if a.json:
        write_json(a.json, r)
    print({"decode": decode_table, "comm": comm_table, "prefill": prefill_table, "ring": ring_table}[a.what](r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
