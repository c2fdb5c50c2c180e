"""Step inputs from the scheduling rank to another rank on the same host (issue 20): ridge's
shared-memory ring (ridge/runner/step_ring.py) against torch.distributed's broadcast (gloo) of the
same bytes. A decode step's inputs at batch B: token ids, positions and slots (int64), lengths
(int32) and page tables (int32, B x pages for --context tokens of 16-token pages).

Timed as a round trip, per step: rank 0 sends the step, rank 1 takes it (decoding the arrays)
and acknowledges; for the ring the acknowledgement is rank 1's own "taken" counter, for the
broadcast a one-element broadcast back. Median over --steps after warm-up; JSON to --json.

    python benchmarks/engine/step_ring.py --batches 1 256 --json step_ring.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root
from ridge.bench.common import device_name, format_table, write_json  # noqa: E402
from ridge.runner.step_ring import StepRing, decode_arrays, encode_arrays  # noqa: E402


def step_arrays(batch: int, pages: int, rng) -> list[np.ndarray]:
    return [rng.integers(3, 128000, batch, dtype=np.int64), rng.integers(0, 4096, batch, dtype=np.int64),
            rng.integers(0, 1 << 20, batch, dtype=np.int64), rng.integers(1, 4096, batch, dtype=np.int32),
            rng.integers(0, 1 << 16, batch * pages, dtype=np.int32)]


def _ring_consumer(name: str, slots: int, slot_bytes: int, steps: int) -> None:
    ring = StepRing.attach(name, slots, slot_bytes, 1)
    for _ in range(steps):
        decode_arrays(ring.consume(0, timeout=60))
    ring.close()


def ring_round_trips(messages: list[bytes], steps: int) -> list[float]:
    slot_bytes = max(len(m) for m in messages)
    ring = StepRing.create(4, slot_bytes, 1)
    p = mp.get_context("spawn").Process(target=_ring_consumer, args=(ring.name, 4, slot_bytes, steps))
    p.start()
    times = []
    try:
        for i in range(steps):
            t0 = time.perf_counter()
            seq = ring.publish(messages[i % len(messages)], timeout=60)
            while ring.taken(0) < seq:
                pass
            times.append(time.perf_counter() - t0)
    finally:
        p.join(60)
        ring.close()
    return times


def _broadcast_rank(rank: int, port: int, nbytes: int, steps: int, payloads, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buf, ack = torch.empty(nbytes, dtype=torch.uint8), torch.zeros(1, dtype=torch.int64)
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        if rank == 0:
            buf.copy_(torch.frombuffer(bytearray(payloads[i % len(payloads)]), dtype=torch.uint8))
        dist.broadcast(buf, src=0)
        if rank == 1:
            decode_arrays(buf.numpy().tobytes())
        dist.broadcast(ack, src=1)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def broadcast_round_trips(messages: list[bytes], steps: int) -> list[float]:
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=_broadcast_rank, args=(r, port, len(messages[0]), steps, messages, out))
             for r in (0, 1)]
    for p in procs:
        p.start()
    times = out.get(timeout=300)
    for p in procs:
        p.join(60)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 256])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    rows = []
    for b in a.batches:
        messages = [encode_arrays(1, step_arrays(b, -(-a.context // 16), rng)) for _ in range(8)]
        ring = ring_round_trips(messages, a.steps + a.warmup)[a.warmup:]
        bcast = broadcast_round_trips(messages, a.steps + a.warmup)[a.warmup:]
        rows.append(dict(batch=b, payload_bytes=len(messages[0]), ring_us=statistics.median(ring) * 1e6,
                         ring_p99_us=float(np.percentile(ring, 99)) * 1e6, broadcast_us=statistics.median(bcast) * 1e6,
                         broadcast_p99_us=float(np.percentile(bcast, 99)) * 1e6))
        rows[-1]["speedup"] = rows[-1]["broadcast_us"] / rows[-1]["ring_us"]
        print(f"  batch {b}: {len(messages[0])} B, ring {rows[-1]['ring_us']:.1f} us, broadcast "
              f"{rows[-1]['broadcast_us']:.1f} us", flush=True)
    r = dict(device=device_name(torch.device("cpu")), steps=a.steps, context=a.context, rows=rows)
    if a.json:
        write_json(a.json, r)
    print(format_table(["batch", "bytes", "ring us (p99)", "gloo broadcast us (p99)", "ring speedup"],
                       [[x["batch"], x["payload_bytes"], f"{x['ring_us']:.1f} ({x['ring_p99_us']:.1f})",
                         f"{x['broadcast_us']:.1f} ({x['broadcast_p99_us']:.1f})", f"{x['speedup']:.1f}x"]
                        for x in rows],
                       title=f"step inputs to a second rank, round trip, {r['device']}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
