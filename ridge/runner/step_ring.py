"""A ring of fixed slots in shared memory, one producer and N consumers: how the scheduling rank
hands each step's inputs to the other ranks of its host (the LMAX Disruptor's pattern).

Why not a collective: a step's inputs are a few KB (token ids, positions, slots, page tables),
and a broadcast through torch.distributed costs a rendezvous of every rank per step on top of the
copy. Here the producer writes the step into the next slot and publishes it by advancing one
counter; each consumer polls the counter, copies the slot out and advances its own counter. No
lock, no syscall and no allocation on the hot path, and no serialisation beyond the fixed binary
layout of `encode_arrays` (no pickle anywhere).

Layout of the segment (every counter on its own 64-byte line, so that one process's writes do
not invalidate the line another polls):
    [published: int64] [taken by consumer 0: int64] ... [taken by consumer N-1: int64]
    slot i (i = sequence % slots): [sequence: int64, payload bytes: int64] [payload, slot_bytes]
Sequences start at 1; a counter holds the last sequence published / taken. The producer waits
while the slowest consumer is a whole ring behind (a full ring never overwrites an unread slot);
a consumer waits while nothing new is published. Waiting spins first (a step is microseconds
away), then yields, then sleeps in short naps, and in longer ones once nothing has come for a
while (an idle engine: a millisecond more latency on its next step, almost no CPU meanwhile); it
gives up after its timeout with an error that names who is stalled.

Ordering: the producer stores the payload, then the slot's header, then the published counter;
the consumer reads the counter, then the slot. Each is an aligned 8-byte store or load through
numpy, and x86-64 (total store order: stores are seen in program order, loads are not reordered
with loads) keeps that order across processes. Weakly ordered CPUs (aarch64) would need fences
that Python cannot issue, so the ring refuses to run there.
"""
from __future__ import annotations

import os
import platform
import secrets
import struct
import time
from multiprocessing import resource_tracker, shared_memory

import numpy as np

LINE = 64
_SPIN, _YIELD = 2000, 200             # polls before yielding, yields before napping
_NAP_S, _SHORT_NAPS, _IDLE_NAP_S = 50e-6, 2000, 1e-3
_DTYPES = [np.dtype(t) for t in ("int32", "int64", "float32", "uint8")]


SEGMENT_PREFIX = "ridge_ring_"


def _pad(n: int) -> int:
    return -(-n // LINE) * LINE


class StepRing:
    """`StepRing.create(slots, slot_bytes, consumers)` in the producer; `StepRing.attach(name,
    slots, slot_bytes, consumers)` in each consumer process (the same numbers)."""

    def __init__(self, shm: shared_memory.SharedMemory, slots: int, slot_bytes: int, consumers: int, owner: bool):
        if platform.machine().lower() not in ("x86_64", "amd64"):
            shm.close()
            raise RuntimeError(f"StepRing relies on x86-64's store order; this machine is {platform.machine()}")
        self.shm, self.slots, self.slot_bytes, self.consumers, self.owner = shm, slots, slot_bytes, consumers, owner
        self.name = shm.name
        self._counters = [np.ndarray((1,), np.int64, shm.buf, i * LINE) for i in range(consumers + 1)]
        self._stride = LINE + _pad(slot_bytes)
        base = (consumers + 1) * LINE
        self._heads = [np.ndarray((2,), np.int64, shm.buf, base + i * self._stride) for i in range(slots)]
        self._bodies = [base + i * self._stride + LINE for i in range(slots)]

    @staticmethod
    def size(slots: int, slot_bytes: int, consumers: int) -> int:
        return (consumers + 1) * LINE + slots * (LINE + _pad(slot_bytes))

    @classmethod
    def create(cls, slots: int, slot_bytes: int, consumers: int, name: str | None = None) -> "StepRing":
        if slots < 1 or slot_bytes < 1 or consumers < 1:
            raise ValueError(f"StepRing: slots, slot_bytes and consumers must be >= 1, got {slots}, {slot_bytes}, "
                             f"{consumers}")
        # a new segment reads as zeros: nothing published, nothing taken. Its default name carries the
        # creator's pid (ridge_ring_<pid>_<random>): a segment a killed process left behind says whose it was
        name = name or f"{SEGMENT_PREFIX}{os.getpid()}_{secrets.token_hex(4)}"
        shm = shared_memory.SharedMemory(name=name, create=True, size=cls.size(slots, slot_bytes, consumers))
        return cls(shm, slots, slot_bytes, consumers, owner=True)

    @classmethod
    def attach(cls, name: str, slots: int, slot_bytes: int, consumers: int) -> "StepRing":
        try:
            shm = shared_memory.SharedMemory(name=name, track=False)          # Python >= 3.13
        except TypeError:
            # older Pythons register every attach with the resource tracker, which would remove
            # the producer's segment when this process exits: attach unregistered
            register, resource_tracker.register = resource_tracker.register, lambda *args, **kwargs: None
            try:
                shm = shared_memory.SharedMemory(name=name)
            finally:
                resource_tracker.register = register
        if shm.size < cls.size(slots, slot_bytes, consumers):
            shm.close()
            raise ValueError(f"StepRing: segment {name!r} is {shm.size} bytes, smaller than a ring of {slots} slots "
                             f"of {slot_bytes} bytes for {consumers} consumers")
        return cls(shm, slots, slot_bytes, consumers, owner=False)

    def published(self) -> int:
        return int(self._counters[0][0])

    def taken(self, consumer: int) -> int:
        return int(self._counters[1 + consumer][0])

    def publish(self, payload: bytes | memoryview, timeout: float = 10.0) -> int:
        """Write one message into the next slot; returns its sequence. Waits while the ring is
        full (the slowest consumer a whole ring behind)."""
        n = len(payload)
        if n > self.slot_bytes:
            raise ValueError(f"StepRing: a message of {n} bytes does not fit a slot of {self.slot_bytes} bytes")
        seq = self.published() + 1
        _wait(lambda: min(self.taken(c) for c in range(self.consumers)) > seq - 1 - self.slots, timeout,
              lambda: f"StepRing: ring full for {timeout} s: consumer "
                      f"{min(range(self.consumers), key=self.taken)} has not taken sequence {seq - self.slots}")
        i = seq % self.slots
        self.shm.buf[self._bodies[i]:self._bodies[i] + n] = payload
        self._heads[i][1] = n
        self._heads[i][0] = seq
        self._counters[0][0] = seq                        # the publish: after the slot's bytes
        return seq

    def consume(self, consumer: int, timeout: float = 10.0) -> bytes:
        """The next message for this consumer (a copy; the slot is free once this returns)."""
        seq = self.taken(consumer) + 1
        _wait(lambda: self.published() >= seq, timeout,
              lambda: f"StepRing: consumer {consumer} waited {timeout} s for sequence {seq}; the producer "
                      f"published up to {self.published()}")
        i = seq % self.slots
        if int(self._heads[i][0]) != seq:
            raise RuntimeError(f"StepRing: slot {i} holds sequence {int(self._heads[i][0])}, expected {seq}")
        n = int(self._heads[i][1])
        out = bytes(self.shm.buf[self._bodies[i]:self._bodies[i] + n])
        self._counters[1 + consumer][0] = seq
        return out

    def close(self) -> None:
        """Detach (and, in the process that created it, remove the segment)."""
        self._counters = self._heads = []
        self.shm.close()
        if self.owner:
            self.shm.unlink()


def _wait(ready, timeout: float, message) -> None:
    if ready():
        return
    for _ in range(_SPIN):
        if ready():
            return
    deadline = time.monotonic() + timeout
    polls = 0
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(message())
        polls += 1
        time.sleep(0 if polls < _YIELD else _NAP_S if polls < _YIELD + _SHORT_NAPS else _IDLE_NAP_S)


def encode_arrays(kind: int, arrays: list[np.ndarray]) -> bytes:
    """A step message: kind (uint32), the number of arrays, per array its dtype code and length,
    then the arrays' bytes, little-endian (int32, int64, float32 or uint8 arrays, 1-D)."""
    head = struct.pack("<II", kind, len(arrays))
    parts = []
    for a in arrays:
        a = np.ascontiguousarray(a)
        if a.ndim != 1 or a.dtype not in _DTYPES:
            raise ValueError(f"encode_arrays: 1-D arrays of {', '.join(map(str, _DTYPES))} only, got {a.dtype} "
                             f"with shape {a.shape}")
        head += struct.pack("<BI", _DTYPES.index(a.dtype), a.size)
        parts.append(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes())
    return head + b"".join(parts)


def decode_arrays(message: bytes) -> tuple[int, list[np.ndarray]]:
    """encode_arrays' inverse: (kind, arrays)."""
    kind, count = struct.unpack_from("<II", message)
    at, specs = 8, []
    for _ in range(count):
        code, size = struct.unpack_from("<BI", message, at)
        specs.append((_DTYPES[code].newbyteorder("<"), size))
        at += 5
    arrays = []
    for dtype, size in specs:
        arrays.append(np.frombuffer(message, dtype, size, at).astype(dtype.newbyteorder("="), copy=True))
        at += size * dtype.itemsize
    if at != len(message):
        raise ValueError(f"decode_arrays: message of {len(message)} bytes, its header describes {at}")
    return kind, arrays
