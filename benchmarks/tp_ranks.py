"""The ranks of benchmarks/tp.py's comm and prefill measurements: one spawned process a GPU joins
the group, builds the engine's runner of its share (dummy weights), and can swap every collective
for a local no-op of the same shape (the same kernels, nothing exchanged)."""
from __future__ import annotations

import os

import torch


class _NoWait:
    def wait(self):
        return True


def no_comm(tp):
    """tp with every collective a local op of the same shape: the same kernels, nothing exchanged."""
    import dataclasses

    from ridge.parallel import TensorParallel

    @dataclasses.dataclass(frozen=True)
    class NoComm(TensorParallel):
        def all_reduce(self, x):
            return x

        def all_reduce_async(self, x):
            return _NoWait()

        def all_gather(self, x):
            return x.repeat(*([1] * (x.dim() - 1)), self.size)

        def broadcast(self, x, src=0):
            return x

    return NoComm(tp.rank, tp.size, tp.group, tp.host_group)


def use_group(model, group) -> None:
    """Every module that holds the tensor-parallel group gets `group` instead."""
    from ridge.parallel import TensorParallel
    for m in model.modules():
        if isinstance(getattr(m, "tp", None), TensorParallel):
            m.tp = group


def join(rank: int, size: int, port: int):
    import datetime

    import torch.distributed as dist

    from ridge.parallel import init_tensor_parallel
    store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=300))
    return init_tensor_parallel(rank, size, torch.device("cuda", rank), store)


def rank_runner(path: str, tp, **settings):
    """The engine's runner of this rank, dummy weights, on cuda:rank."""
    import dataclasses

    from ridge.config import EngineConfig
    from ridge.runner.model_runner import ModelRunner
    cfg, model_cfg = EngineConfig(model=path, load_format="dummy", device="cuda", tensor_parallel_size=tp.size,
                                  **settings).resolve()
    return ModelRunner(dataclasses.replace(cfg, device=torch.device("cuda", tp.rank)), model_cfg,
                       show_progress=False, tp=tp)


def leave(tp, out, result: dict) -> None:
    """Rank 0 hands the results over; every rank leaves the group."""
    import torch.distributed as dist
    if tp.rank == 0:
        out.put(result)
    dist.barrier(group=tp.host_group)
    dist.destroy_process_group()


def run_ranks(target, size: int, args: tuple, timeout: float) -> dict | None:
    """target(rank, size, port, *args, queue) in one spawned process a GPU; rank 0's results. None
    (and said so) where the GPUs are too few."""
    import torch.multiprocessing as mp
    if size < 2 or size > torch.cuda.device_count():
        print(f"  TP={size}: skipped ({torch.cuda.device_count()} GPUs)", flush=True)
        return None
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), 29600 + os.getpid() % 1000
    procs = [ctx.Process(target=target, args=(r, size, port, *args, out)) for r in range(size)]
    for p in procs:
        p.start()
    times = out.get(timeout=timeout)
    for p in procs:
        p.join(60)
    return times
