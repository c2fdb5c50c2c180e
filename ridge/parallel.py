"""Tensor parallelism's ranks and collectives, on torch.distributed: NCCL between GPUs, gloo
between CPU processes. `TensorParallel` names this process's rank, the group's size and the
process group, and is handed explicitly to every layer that splits its weights or reduces its
outputs (ridge/layers/linear.py, embedding.py); `SINGLE` is one rank and no collectives at all, so
a model built for one device runs exactly the code it ran before tensor parallelism existed.

Why Megatron's split: a column-parallel projection (QKV, gate/up) gives each rank whole heads or
whole intermediate columns, so attention and the activation run on local data; the row-parallel
projection after it (o_proj, down_proj) produces partial sums that one all-reduce adds. Two
all-reduces a layer, each of one [tokens, hidden] activation, are the only traffic of a decoder
layer; the vocabulary-split embedding adds one, and the LM head one all-gather of the logits.

Under torchrun (distributed_executor_backend "external_launcher") every rank's process is the
launcher's, and `launched()` reads where this one sits from the environment torchrun's rendezvous
gives it (torch's env:// protocol).

This module sits below the layers (as ridge.config does) and imports nothing from ridge.
"""
from __future__ import annotations

import ast
import datetime
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


class RankFailure(RuntimeError):
    """A tensor-parallel rank died, hung or failed: the engine cannot go on (its ranks no longer
    agree on what runs next). The message names the rank and the cause."""


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: object = None            # the torch.distributed process group (None: one rank)
    # NCCL reduces only device tensors: small host-side values go through a gloo group beside it
    host_group: object = None
    # set (with the reason) once the group is being aborted: no collective may start after it
    # (NCCL's abort holds the communicator while it waits for the CUDA graphs to go, so a collective
    # entered then would wait on it for ever, in the thread that must release those graphs)
    failed: list = field(default_factory=list, compare=False)

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor parallel: rank {self.rank} is not in [0, {self.size})")

    def split(self, size: int, what: str) -> tuple[int, int]:
        """(first index, count) of this rank's even share of `size` things; ValueError naming
        `what` when the ranks cannot share them evenly."""
        if size % self.size:
            raise ValueError(f"tensor_parallel_size: {what} ({size}) must be divisible by the tensor-parallel "
                             f"size ({self.size})")
        share = size // self.size
        return self.rank * share, share

    def padded_split(self, size: int) -> tuple[int, int, int]:
        """(first index, count of real rows, rows held) of a table split into equal shares, the
        last share padded: a vocabulary need not divide by the rank count."""
        share = -(-size // self.size)
        start = min(self.rank * share, size)
        return start, min(share, size - start), share

    def _check(self) -> None:
        if self.failed:
            raise RankFailure(self.failed[0])

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place."""
        if self.size > 1:
            self._check()
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, n] on each rank -> [rows, size * n], the ranks' columns side by side in rank order."""
        if self.size == 1:
            return x
        self._check()
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather_single(out, x.contiguous(), group=self.group)
        return out.view(self.size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank src's x on every rank, in place."""
        if self.size > 1:
            self._check()
            dist.broadcast(x, src=src, group=self.group)
        return x

    def min_over_ranks(self, value: int) -> int:
        """The smallest of the ranks' values (e.g. the KV pages each rank's memory holds)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.host_group or self.group)
        return int(t.item())


@dataclass(frozen=True)
class Launch:
    """This process's place in a job torchrun started (its rendezvous gives every process RANK,
    LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE in its environment)."""
    rank: int
    local_rank: int
    size: int
    local_size: int

    @property
    def one_host(self) -> bool:
        return self.local_size == self.size


def launched() -> Launch:
    """The torchrun job this process belongs to; ValueError when it was not started by torchrun."""
    env = os.environ
    try:
        return Launch(int(env["RANK"]), int(env["LOCAL_RANK"]), int(env["WORLD_SIZE"]),
                      int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])))
    except (KeyError, ValueError) as e:
        raise ValueError(f"distributed_executor_backend: 'external_launcher' runs in processes torchrun started, "
                         f"and this one's environment lacks {e} (torchrun --nproc-per-node N ...)") from None


SINGLE = TensorParallel()
# the ranks' tensors stacked along dim 0 into one output (torch >= 2.12 renamed it)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def init_tensor_parallel(rank: int, size: int, device: torch.device, store: dist.Store | None = None,
                         timeout_s: float = 300.0) -> TensorParallel:
    """Join the tensor-parallel group as `rank` of `size`: over `store` (a TCPStore the first rank
    serves), or with store None from torchrun's environment (init_method env://). NCCL on CUDA,
    gloo on a CPU; a collective that waits longer than timeout_s fails (a hung rank)."""
    if size == 1:
        return SINGLE
    if dist.is_initialized():
        raise RuntimeError("tensor parallel: this process already belongs to a torch.distributed group (one "
                           "tensor-parallel engine a process; close the other one first)")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    # under NCCL a hung rank stalls the device, and rank 0's watcher names it after timeout_s;
    # torch's own NCCL watchdog would end the process (SIGABRT) at its timeout, so it comes later
    collective_timeout = timeout * 2 + datetime.timedelta(seconds=10) if backend == "nccl" else timeout
    kwargs = dict(store=store) if store is not None else dict(init_method="env://")
    dist.init_process_group(backend, rank=rank, world_size=size, timeout=collective_timeout, **kwargs)
    host = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else None
    return TensorParallel(rank, size, dist.group.WORLD, host)


def unguarded_main_hint() -> str:
    """Why a spawned rank died at start-up when this process's main script has no `if __name__ ==
    "__main__":` guard (else ""): spawn runs the main module again in each new process, so an
    unguarded LLM(tensor_parallel_size=N) at its top level starts ranks again inside the rank,
    which multiprocessing refuses (its message is in the rank's own stderr)."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    try:
        with open(path or "", encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return ""
    for node in tree.body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) and "__name__" in ast.unparse(node.test):
            return ""
    return (f"{path} has no `if __name__ == \"__main__\":` guard; the ranks are started with multiprocessing's "
            f"spawn, which runs the main script again in each of them, so put the script's work (the LLM(...) "
            f"and what uses it) under that guard")


def destroy_tensor_parallel(tp: TensorParallel) -> None:
    """Leave the group (after which this process may join another)."""
    if tp.size > 1 and dist.is_initialized():
        dist.destroy_process_group()


def meet_before_leaving(tp: TensorParallel, timeout_s: float) -> bool:
    """Wait (at most timeout_s) until every rank is here, on the group's host (gloo) side: ranks
    that torchrun started exit on their own, and one that tears its group down while a peer is
    still connected can take that peer's gloo threads down with it. False when a rank never came."""
    if tp.size == 1 or not dist.is_initialized():
        return True
    try:
        dist.monitored_barrier(group=tp.host_group or tp.group, timeout=datetime.timedelta(seconds=timeout_s))
        return True
    except RuntimeError:
        return False


def abort_tensor_parallel(tp: TensorParallel) -> None:
    """Abort the group's communicators from another thread, so that work waiting on a rank that
    died (an NCCL kernel spinning on the GPU) returns with an error instead of hanging."""
    if tp.size > 1 and dist.is_initialized() and dist.get_backend(tp.group) == "nccl":
        from torch.distributed.distributed_c10d import _abort_process_group
        _abort_process_group(tp.group)
