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
  scale   issue 22's scaling table (benchmarks/engine/tp_scale.py): per TP size TTFT of a 4,096-token prompt,
          batch-1 ITL and tok/s, batch-64 tok/s, the exposed communication a step (comm), beside each
          the roofline's prediction at that TP (the link measured among N GPUs), and the scaling
          efficiency from TP = 1 (8B) or TP = 2 (70B); --budget-s skips a size that would not fit.
  ring    a decode step's plan (ridge/runner/step_message.py's layout, batch B at a context of
          --context tokens) handed to a second process through the shared-memory step ring
          against a gloo broadcast of the same bytes (benchmarks/engine/step_ring.py's round trips).

    python benchmarks/engine/tp.py decode --shapes llama3-8b llama3-70b --tp 1 2 --batches 1 64 --json tp_decode.json
    python benchmarks/engine/tp.py comm --shape llama3-8b --tp 2 --batches 1 64 --json tp_comm.json
    python benchmarks/engine/tp.py ring --batches 1 256 --json tp_ring.json
    python benchmarks/engine/tp.py scale --shapes llama3-70b --tp 4 8 --budget-s 520 --json tp_scale.json

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
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root
from ridge.bench.common import device_name, format_table, write_json  # noqa: E402
from ridge.utils.graph_timing import elapsed_ms  # noqa: E402
from benchmarks.engine import tp_scale  # noqa: E402


def shape_dir(preset: str) -> str:
    """A config-only checkpoint of the preset (written once under /tmp)."""
    from ridge.utils.random_checkpoint import make_random_checkpoint
    path = os.path.join(tempfile.gettempdir(), f"ridge-{preset}-config")
    if not os.path.isfile(os.path.join(path, "config.json")):
        make_random_checkpoint(path, preset=preset, dtype=torch.bfloat16, config_only=True)
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
    import dataclasses
    import datetime

    import torch.distributed as dist

    from ridge.config import EngineConfig
    from ridge.parallel import TensorParallel, init_tensor_parallel
    from ridge.runner.model_runner import ModelRunner

    @dataclasses.dataclass(frozen=True)
    class NoComm(TensorParallel):
        """Every collective a local op of the same shape: the same kernels, nothing exchanged."""
        def all_reduce(self, x):
            return x

        def all_gather(self, x):
            return x.repeat(*([1] * (x.dim() - 1)), self.size)

        def broadcast(self, x, src=0):
            return x

    device = torch.device("cuda", rank)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=300))
    tp = init_tensor_parallel(rank, size, device, store)
    cfg, model_cfg = EngineConfig(model=path, load_format="dummy", device="cuda", max_model_len=1024,
                                  max_num_seqs=max(batches), tensor_parallel_size=size).resolve()
    cfg = dataclasses.replace(cfg, device=device)
    runner = ModelRunner(cfg, model_cfg, show_progress=False, tp=tp)
    runner.allocate_kv_cache(max(batches) * 1024 // cfg.page_size + 1)
    result = {}
    for label, group in (("with_comm", tp), ("no_comm", NoComm(rank, size, tp.group))):
        for m in runner.model.modules():
            if isinstance(getattr(m, "tp", None), TensorParallel):
                m.tp = group
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
                times.append(elapsed_ms(lambda: [graph.replay() for _ in range(10)]) / 10 / 1e3)
            result[(label, b)] = statistics.median(times)
    if rank == 0:
        out.put({f"{k[0]}:{k[1]}": v for k, v in result.items()})
    dist.barrier(group=tp.host_group)
    dist.destroy_process_group()


def comm(a) -> dict:
    import torch.multiprocessing as mp

    from ridge.model_config import ModelConfig

    path = shape_dir(a.shape)
    rows = []
    for size in a.tp:
        if size < 2 or size > torch.cuda.device_count():
            print(f"  TP={size}: skipped ({torch.cuda.device_count()} GPUs)", flush=True)
            continue
        ctx = mp.get_context("spawn")
        out, port = ctx.Queue(), 29600 + os.getpid() % 1000
        procs = [ctx.Process(target=_comm_rank, args=(r, size, port, path, a.batches, a.reps, out))
                 for r in range(size)]
        for p in procs:
            p.start()
        times = out.get(timeout=a.run_timeout)
        for p in procs:
            p.join(60)
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


# -- ring: a decode step's plan, ring vs broadcast ---------------------------------------------------------
def ring(a) -> dict:
    from ridge.runner.cuda_graphs import DecodeInputs
    from ridge.runner.step_message import DECODE, StepPlan, encode_plan
    from benchmarks.engine.step_ring import broadcast_round_trips, ring_round_trips

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
    ap.add_argument("what", choices=["decode", "comm", "ring", "scale", "decode-one", "scale-one"])
    ap.add_argument("--shapes", nargs="+", default=["llama3-8b", "llama3-70b"])
    ap.add_argument("--shape", default="llama3-8b", help="comm: the model shape")
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tp", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--batches", nargs="+", type=int, default=None)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--kv-gb", type=float, default=4.0, help="decode: KV pool a GPU, GiB")
    ap.add_argument("--reps", type=int, default=20, help="comm: timed repetitions of 10 replays")
    ap.add_argument("--context", type=int, default=4096, help="ring: the context of the step's page tables")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--run-timeout", type=int, default=900)
    ap.add_argument("--ttft-len", type=int, default=4096, help="scale: the TTFT prompt's tokens")
    ap.add_argument("--budget-s", type=float, default=1e9, help="scale: seconds for all sizes (a size that "
                    "would not fit in what is left is skipped)")
    ap.add_argument("--min-run-s", type=float, default=120, help="scale: the least one size is assumed to take")
    ap.add_argument("--baseline", nargs="*", default=[], help="scale: tp_scale.json files of earlier runs whose "
                    "smaller TP sizes the efficiency may start from")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    a.batches = a.batches or ([1, 256] if a.what == "ring" else [1, 64])
    if a.what == "decode-one":
        decode_one(a)
        return 0
    if a.what == "scale-one":
        write_json(a.json, tp_scale.scale_one(a))
        return 0
    r = tp_scale.scale(a, shape_dir, weight_bytes, comm, HERE) if a.what == "scale" else \
        {"decode": decode, "comm": comm, "ring": ring}[a.what](a)
    r["device"] = device_name(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    r["gpus"] = torch.cuda.device_count()
    if a.json:
        write_json(a.json, r)
    print(tp_scale.table(r, format_table) if a.what == "scale" else
          {"decode": decode_table, "comm": comm_table, "ring": ring_table}[a.what](r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
