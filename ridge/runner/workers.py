"""Tensor parallelism's processes. Rank 0 is the engine's own process: it schedules, runs its
share of every forward and samples. Ranks 1..N-1 are worker processes started here
(torch.multiprocessing, spawn), one a GPU (rank r on cuda:r) or, on a CPU, one a share of the host's
cores; each loads its share of the model and then runs, beside rank 0, every step rank 0 plans.
Under torchrun (distributed_executor_backend "external_launcher") the launcher started every
rank: rank 0's LLM joins them through torchrun's environment, and LLM(...) on a rank > 0 runs
`serve_launched` (the same loop) until rank 0 closes. Ranks on several hosts share no memory:
there a broadcast channel (ridge/runner/step_broadcast.py) carries the same messages.

How a step reaches them: rank 0 writes the step's plan (ridge/runner/step_message.py, a fixed
binary layout) into the next slot of a shared-memory ring (ridge/runner/step_ring.py: one
producer, a sequence counter per reader, no lock, no pickle) and runs the step itself; each worker
takes the plan from the ring and runs the same step, so every rank makes the same collectives in
the same order. Only rank 0 samples: the ids a step feeds the next come from the host in the next
plan, except in an overlapped decode, where one broadcast carries them from rank 0's device.

Faults. A thread of rank 0 waits on the workers' process sentinels: a worker that dies is known at
once, by rank, with its exit signal or code and the error it reported (each worker sends its last
error down a pipe). The step that was running fails with RankFailure naming them: a collective
with a dead peer errors out (gloo: the connection resets; NCCL: the thread aborts the
communicators), and a hung rank is caught by the collectives' timeout (distributed_timeout_seconds).
After a failure the ranks can no longer agree on what runs next, so the pool kills what is left of
it and removes the ring's segment; every later step raises the same error. A worker whose rank 0
is gone exits on its own (it checks its parent while it waits for a step). Under torchrun the
launcher watches the processes (it ends the job when one fails); rank 0 sees a dead or hung rank
through its collectives and the timeout, without a name for it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import signal
import threading
import time
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ridge.config import EngineConfig, ModelConfig
from ridge.parallel import (RankFailure, abort_tensor_parallel, destroy_tensor_parallel, init_tensor_parallel, launched,
                            meet_before_leaving, unguarded_main_hint)
from ridge.runner.step_broadcast import BroadcastChannel
from ridge.runner.step_message import (STOP, SETUP, encode_plan, encode_setup, encode_stop, max_message_bytes,
                                       read_message)
from ridge.runner.step_ring import StepRing

HOST = "127.0.0.1"
RING_SLOTS = 8              # steps rank 0 may run ahead of the slowest worker before it waits
POLL_S = 1.0                # an idle worker checks that its rank 0 still lives this often
STOP_JOIN_S = 30.0          # a stopped worker's time to leave its group and exit
NAME_BYTES = 64             # a shared-memory segment's name, broadcast to torchrun's ranks
CAUSE_WAIT_S = 2.0          # after a failed collective, how long to wait for a death to name it


def share_cores(device: torch.device, size: int) -> torch.device:
    """On a CPU the ranks share the host's cores, an equal number of compute threads each (rank 0's
    own count comes back when the pool closes): more would oversubscribe them, and an OpenMP thread
    spinning for work on a core another rank needs stalls both (steps many times slower). Returns
    the device."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    return device


def ring_slot_bytes(cfg: EngineConfig) -> int:
    spec = cfg.speculation
    return max_message_bytes(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len, cfg.page_size,
                             1 + (spec.num_speculative_tokens if spec is not None else 0))


class WorkerPool:
    """Ranks 1..N-1 of a tensor-parallel engine, seen from rank 0. `tp` is rank 0's place in the
    group; `pids` the workers' process ids; `ring_name` the shared-memory segment."""

    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig):
        size, timeout = cfg.tensor_parallel_size, cfg.distributed_timeout_seconds
        self.timeout, self.failure, self.closed = timeout, None, False
        self._threads = torch.get_num_threads()          # given back when the pool closes
        self.on_failure: list = []                       # callback(message), from the watcher thread
        self.before_leaving: list = []                   # callback(), in the engine's thread, before the group goes
        self._leaving = threading.Lock()                 # the watcher's abort and the engine's leave, one at a time
        self._died = threading.Event()
        self._waiting_since: float | None = None        # rank 0 blocked on the device since (host_tokens)
        # (an event recorded after rank 0 queued its last step, when): on a GPU, the step's device work
        self._in_flight: tuple | None = None
        self._cuda = cfg.device.type == "cuda"
        self.procs, self.pipes, self.pids, self.ring, self.tp = [], [], [], None, None
        try:
            if cfg.distributed_executor_backend == "external_launcher":
                job = launched()                         # torchrun started every rank: join them
                self.tp = init_tensor_parallel(0, size, rank_device(cfg, 0, job.local_size), None, timeout)
                self.ring = open_channel(self.tp, job.one_host, ring_slot_bytes(cfg))
            else:
                self._spawn(cfg, model_cfg)
        except BaseException:
            self._kill()
            self._release()
            raise
        self.ring_name = self.ring.name
        self._watcher = threading.Thread(target=self._watch, name="ridge-tp-watch", daemon=True)
        self._watcher.start()

    def _spawn(self, cfg: EngineConfig, model_cfg: ModelConfig) -> None:
        """Start ranks 1.. on this host, each told the group's store and the ring's segment."""
        size, timeout = cfg.tensor_parallel_size, cfg.distributed_timeout_seconds
        self._store = store = dist.TCPStore(HOST, 0, size, is_master=True, wait_for_workers=False,
                                            timeout=datetime.timedelta(seconds=timeout))
        slot_bytes = ring_slot_bytes(cfg)
        self.ring = StepRing.create(RING_SLOTS, slot_bytes, size - 1)
        ctx = mp.get_context("spawn")
        for rank in range(1, size):
            receive, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=worker_main, name=f"ridge-tp-rank{rank}", daemon=True,
                            args=(rank, cfg, model_cfg, store.port, self.ring.name, slot_bytes, os.getpid(), send))
            p.start()
            send.close()
            self.procs.append(p)
            self.pipes.append(receive)
        self.pids = [p.pid for p in self.procs]
        self._await_joining()
        self.tp = init_tensor_parallel(0, size, rank_device(cfg, 0, size), store, timeout)

    def _await_joining(self) -> None:
        """Wait until every worker is about to join the group (it says so down its pipe) or has
        died, so a worker that fails to start is an error now, not a wait for the group's timeout."""
        pending = set(range(1, len(self.procs) + 1))
        while pending:
            pipes = {self.pipes[r - 1]: r for r in pending}
            sentinels = {self.procs[r - 1].sentinel: r for r in pending}
            for ready in wait([*pipes, *sentinels]):
                r = pipes.get(ready) if not isinstance(ready, int) else sentinels[ready]
                if r not in pending:
                    continue
                try:
                    said = None if isinstance(ready, int) else ready.recv_bytes()
                except (EOFError, OSError):
                    said = None
                if said != b"":                      # an error, or the process ended before it joined
                    raise RankFailure(self._describe(r, said.decode(errors="replace") if said else ""))
                pending.discard(r)

    def _describe(self, rank: int, error: str = "") -> str:
        """Why rank `rank`'s process ended: its signal or exit code, and the error it sent."""
        p, pipe = self.procs[rank - 1], self.pipes[rank - 1]
        p.join(5)
        code = p.exitcode
        while pipe.poll():
            try:
                error = pipe.recv_bytes().decode(errors="replace") or error
            except (EOFError, OSError):
                break
        how = (f"was killed by signal {signal.Signals(-code).name}" if code is not None and code < 0 else
               f"exited with code {code}" if code is not None else "stopped answering")
        why = error or (unguarded_main_hint() if code == 1 else "")
        return f"tensor-parallel rank {rank} (pid {p.pid}) {how}" + (f": {why}" if why else "")

    def _watch(self) -> None:
        """Wait for a worker to die, or for rank 0's step to outlast the timeout: its host inside
        the step, or its device on the last step queued (under NCCL a hung rank stalls the GPU,
        not a host call that could time out)."""
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs, 1)}
        while not self.closed:
            ready = wait(list(sentinels), timeout=POLL_S)
            since, flight, now = self._waiting_since, self._in_flight, time.monotonic()
            if ready or (since is not None and now - since > self.timeout) or (
                    flight is not None and now - flight[1] > self.timeout and not flight[0].query()):
                break
        if self.closed:
            return
        self.failure = self._describe(sentinels[ready[0]]) if ready else self._hung()
        self._died.set()
        for callback in self.on_failure:
            callback(self.failure)
        # NCCL work waiting on the dead or hung rank returns at once (the abort flag); the abort
        # itself then waits for rank 0's CUDA graphs to go, which the engine's thread releases (_fail)
        self.tp.failed.append(self.failure)     # rank 0's thread raises at its next collective
        with self._leaving:
            abort_tensor_parallel(self.tp)

    @contextlib.contextmanager
    def device_wait(self):
        """Rank 0 blocks on its device inside (a step, a readback; nested, the outermost counts):
        the watcher fails the pool if that lasts longer than distributed_timeout_seconds."""
        outer, self._waiting_since = self._waiting_since, self._waiting_since or time.monotonic()
        try:
            yield
        finally:
            self._waiting_since = outer

    def check(self) -> None:
        """RankFailure once a rank has failed (the pool is then released, here in the engine's
        thread, which is the one using the ring)."""
        if self.failure is not None:
            if not self.closed:
                self._fail()
            raise RankFailure(self.failure)
        if self.closed:
            raise RankFailure("the tensor-parallel engine was closed")

    def setup(self, num_pages: int, use_graphs: bool, verify_queries: int, verify_max_bs: int) -> None:
        self.check()
        self._publish(encode_setup(num_pages, use_graphs, verify_queries, verify_max_bs))

    def step(self, plan, run):
        """Send the plan to the workers, then `run()` it here; a failure on any rank, here or
        there, during the step is a RankFailure (and the end of the pool)."""
        self.check()
        message = encode_plan(plan)
        try:
            self._publish(message)
            with self.device_wait():     # a hung peer can stall the host too (launch queue full)
                out = run()
            if self._cuda:               # or the device only, while the host blocks elsewhere (sampling)
                done = torch.cuda.Event()
                done.record()
                self._in_flight = (done, time.monotonic())
            return out
        except Exception as e:
            if not isinstance(e, RankFailure):
                self._died.wait(CAUSE_WAIT_S)
            self.failure = self.failure or (str(e) if isinstance(e, RankFailure) else self._unexplained(e))
            self._fail()
            raise RankFailure(self.failure) from e
        except BaseException:
            self.failure = self.failure or "rank 0 was interrupted during a step: the ranks no longer agree"
            self._fail()
            raise

    def _behind(self) -> tuple[int, list[int]]:
        """(the last step published, the ranks that have not taken it from the ring)."""
        seq = self.ring.published()
        return seq, [c + 1 for c in range(len(self.procs)) if self.ring.taken(c) < seq]

    def _hung(self) -> str:
        seq, behind = self._behind()
        if behind:
            return (f"tensor-parallel rank{'s' * (len(behind) > 1)} {', '.join(map(str, behind))} hung: step {seq} "
                    f"not taken within distributed_timeout_seconds ({self.timeout:g} s)")
        return (f"tensor-parallel step {seq} did not finish within distributed_timeout_seconds ({self.timeout:g} s): "
                f"a rank hung inside it")

    def _unexplained(self, e: Exception) -> str:
        """A failed step no death explains: a hung rank (the collectives timed out waiting for it),
        or rank 0's own error."""
        seq, behind = self._behind()
        if behind:
            return f"{self._hung()}; rank 0 saw {type(e).__name__}: {e}"
        return f"tensor-parallel step {seq} failed on rank 0: {type(e).__name__}: {e}"

    def _publish(self, message: bytes) -> None:
        try:
            self.ring.publish(message, timeout=self.timeout)
        except TimeoutError as e:
            raise RankFailure(f"tensor-parallel ranks stopped taking steps: {e}") from None

    def _fail(self) -> None:
        self.closed = True
        self._kill()
        self._release(failed=True)

    def close(self) -> None:
        """Stop the workers (each leaves the group and exits), remove the ring; idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            self.ring.publish(encode_stop(), timeout=5)
        except TimeoutError:
            pass
        deadline = time.monotonic() + STOP_JOIN_S
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        if not self.procs and self.failure is None:      # torchrun's ranks leave the group together
            meet_before_leaving(self.tp, STOP_JOIN_S)
        self._kill()
        self._release(failed=self.failure is not None)
        if threading.current_thread() is not self._watcher:     # it sees `closed` within a poll
            self._watcher.join()

    def _kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join()

    def _release(self, failed: bool = False) -> None:
        """Give back the threads and the ring, then leave the group: rank 0's CUDA graphs first
        (before_leaving), since NCCL waits for every graph that captured its collectives before it
        tears a communicator down; after a failure the communicators are aborted (a dead peer
        cannot take part in an orderly teardown)."""
        torch.set_num_threads(self._threads)
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        for callback in self.before_leaving:
            callback()
        # the callbacks hold the runner (which holds this pool): new lists, as the watcher may be calling the old
        self.before_leaving, self.on_failure = [], []
        if self.tp is not None:
            with self._leaving:
                if failed:
                    abort_tensor_parallel(self.tp)
                destroy_tensor_parallel(self.tp)     # nothing left to do once aborted


def rank_device(cfg: EngineConfig, local_rank: int, local_size: int) -> torch.device:
    """A rank's device: cuda:<its rank on this host>, or the CPU with its share of the cores."""
    return torch.device("cuda", local_rank) if cfg.device.type == "cuda" else share_cores(cfg.device, local_size)


def open_channel(tp, one_host: bool, slot_bytes: int):
    """Every rank of a torchrun job: the step ring when all ranks share this host (rank 0 makes
    it and broadcasts its name), else a broadcast channel (ridge/runner/step_broadcast.py)."""
    if not one_host:
        return BroadcastChannel(tp.rank)
    name, ring = torch.zeros(NAME_BYTES, dtype=torch.uint8), None
    if tp.rank == 0:
        ring = StepRing.create(RING_SLOTS, slot_bytes, tp.size - 1)
        name[:len(ring.name)] = torch.tensor(list(ring.name.encode()), dtype=torch.uint8)
    dist.broadcast(name, src=0, group=tp.host_group or tp.group)
    return ring or StepRing.attach(bytes(name.tolist()).rstrip(b"\0").decode(), RING_SLOTS, slot_bytes, tp.size - 1)


def worker_main(rank: int, cfg: EngineConfig, model_cfg: ModelConfig, store_port: int, ring_name: str,
                slot_bytes: int, parent_pid: int, errors) -> None:
    """A spawned rank's process: join the group, attach the ring, then serve_steps; its last
    error goes down `errors` for rank 0 to name."""
    size, tp, ring = cfg.tensor_parallel_size, None, None
    try:
        device = rank_device(cfg, rank, size)
        store = dist.TCPStore(HOST, store_port, size, is_master=False,
                              timeout=datetime.timedelta(seconds=cfg.distributed_timeout_seconds))
        errors.send_bytes(b"")                   # joining the group now
        tp = init_tensor_parallel(rank, size, device, store, cfg.distributed_timeout_seconds)
        ring = StepRing.attach(ring_name, RING_SLOTS, slot_bytes, size - 1)
        serve_steps(dataclasses.replace(cfg, device=device), model_cfg, tp, ring, parent_pid)
    except BaseException as e:
        try:
            errors.send_bytes(f"{type(e).__name__}: {e}".encode()[:4096])
        except OSError:
            pass
        raise
    finally:
        if ring is not None:
            ring.close()
        if tp is not None:
            destroy_tensor_parallel(tp)


def serve_launched(cfg: EngineConfig, model_cfg: ModelConfig) -> None:
    """A rank > 0 of a torchrun job (distributed_executor_backend external_launcher): join the
    group through torchrun's environment, open the channel rank 0 opens, then serve_steps."""
    job = launched()
    device = rank_device(cfg, job.local_rank, job.local_size)
    tp = init_tensor_parallel(job.rank, job.size, device, None, cfg.distributed_timeout_seconds)
    try:
        channel = open_channel(tp, job.one_host, ring_slot_bytes(cfg))
        try:
            serve_steps(dataclasses.replace(cfg, device=device), model_cfg, tp, channel, None)
            meet_before_leaving(tp, STOP_JOIN_S)     # rank 0 stopped it: leave the group with rank 0
        finally:
            channel.close()
    finally:
        destroy_tensor_parallel(tp)


def serve_steps(cfg: EngineConfig, model_cfg: ModelConfig, tp, channel, parent_pid: int | None) -> None:
    """Load this rank's share of the model, size the KV pool with the other ranks, then run each
    plan from the channel until told to stop (or, with parent_pid, until rank 0's process is gone)."""
    from ridge.runner.model_runner import ModelRunner

    runner = ModelRunner(cfg, model_cfg, show_progress=False, tp=tp)
    runner.pages_fitting()
    try:
        while True:
            message = _next_message(channel, tp.rank - 1, parent_pid)
            if message is None:
                return                           # rank 0 is gone
            kind, content = read_message(message)
            if kind == STOP:
                return
            if kind == SETUP:
                runner.start(*content)
            else:
                runner.run(content)
    finally:
        runner.release_graphs()                  # before the caller leaves the group (NCCL waits for them)


def _next_message(channel, consumer: int, parent_pid: int | None) -> bytes | None:
    while True:
        try:
            return channel.consume(consumer, timeout=POLL_S)
        except TimeoutError:
            if parent_pid is not None and os.getppid() != parent_pid:
                return None
