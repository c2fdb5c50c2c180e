"""The shared-memory step ring (ridge/runner/step_ring.py): order, wrap-around, a full ring, a
slow consumer in another process, the fixed binary layout, and no segment left behind."""
import multiprocessing as mp
import os
import time
import zlib

import numpy as np
import pytest

from ridge.runner.step_ring import StepRing, decode_arrays, encode_arrays



def message(i: int) -> bytes:
    return encode_arrays(i % 3, [np.arange(i % 40, dtype=np.int32) + i, np.full(i % 7, i, dtype=np.int64),
                                 np.linspace(0, 1, i % 5, dtype=np.float32)])


def test_messages_arrive_in_order_through_many_wraps():
    ring = StepRing.create(slots=4, slot_bytes=512, consumers=2)
    try:
        for i in range(50):                          # consumers a slot or two behind: wrap after wrap
            ring.publish(message(i))
            if i >= 1:
                for c in (0, 1):
                    assert ring.consume(c) == message(i - 1)
        for c in (0, 1):
            assert ring.consume(c) == message(49)
        assert ring.published() == 50 and ring.taken(0) == ring.taken(1) == 50
    finally:
        ring.close()


def test_a_full_ring_waits_and_never_overwrites():
    ring = StepRing.create(slots=3, slot_bytes=64, consumers=2)
    try:
        for i in range(3):
            ring.publish(bytes([i]) * 8)
        assert ring.consume(0) == bytes([0]) * 8     # consumer 1 has taken nothing: still full
        with pytest.raises(TimeoutError, match="consumer 1 has not taken sequence 1"):
            ring.publish(b"late", timeout=0.05)
        assert ring.consume(1) == bytes([0]) * 8
        ring.publish(b"now")
        assert [ring.consume(1) for _ in range(3)] == [bytes([1]) * 8, bytes([2]) * 8, b"now"]
        with pytest.raises(TimeoutError, match="consumer 1 waited"):
            ring.consume(1, timeout=0.05)
        with pytest.raises(ValueError, match="does not fit a slot of 64 bytes"):
            ring.publish(bytes(65))
    finally:
        ring.close()


def _consumer(name: str, index: int, count: int, slow: bool, out) -> None:
    ring = StepRing.attach(name, slots=8, slot_bytes=2048, consumers=2)
    crc = 0
    for i in range(count):
        m = ring.consume(index, timeout=20)
        kind, arrays = decode_arrays(m)
        assert kind == i % 3 and np.array_equal(arrays[0], np.arange(i % 40, dtype=np.int32) + i)
        crc = zlib.crc32(m, crc)
        if slow and i % 50 == 0:
            time.sleep(0.02)
    ring.close()
    out.put((index, crc))


def test_two_processes_one_of_them_slow_see_every_message_in_order():
    ctx = mp.get_context("spawn")
    ring = StepRing.create(slots=8, slot_bytes=2048, consumers=2)
    out = ctx.Queue()
    count = 600
    procs = [ctx.Process(target=_consumer, args=(ring.name, c, count, c == 1, out)) for c in (0, 1)]
    try:
        for p in procs:
            p.start()
        want = 0
        for i in range(count):
            m = message(i)
            ring.publish(m, timeout=20)
            want = zlib.crc32(m, want)
            assert ring.published() - min(ring.taken(0), ring.taken(1)) <= 8
        got = dict(out.get(timeout=60) for _ in procs)
        assert got == {0: want, 1: want}
    finally:
        for p in procs:
            p.join(timeout=30)
        ring.close()
    assert all(p.exitcode == 0 for p in procs)
    with pytest.raises(FileNotFoundError):            # the creator removed the segment
        StepRing.attach(ring.name, 8, 2048, 2)


def test_binary_layout_round_trips_and_refuses_what_it_cannot_carry():
    arrays = [np.array([1, -2, 3], dtype=np.int32), np.array([2 ** 40], dtype=np.int64),
              np.array([0.5], dtype=np.float32), np.array([], dtype=np.uint8)]
    kind, back = decode_arrays(encode_arrays(7, arrays))
    assert kind == 7 and all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(arrays, back))
    assert len(encode_arrays(0, [np.zeros(3, np.int32)])) == 8 + 5 + 12          # no padding, no pickle
    with pytest.raises(ValueError, match="1-D arrays"):
        encode_arrays(0, [np.zeros((2, 2), np.int32)])
    with pytest.raises(ValueError, match="1-D arrays"):
        encode_arrays(0, [np.zeros(2, np.float64)])
    with pytest.raises(ValueError, match="header describes"):
        decode_arrays(encode_arrays(0, arrays) + b"x")


def test_a_rings_name_says_whose_it_is_and_a_dead_creators_segment_counts_as_leaked():
    import subprocess
    import sys
    from multiprocessing import shared_memory

    from tests.tests_support import leaked_step_rings
    ring = StepRing.create(2, 64, 1)
    assert ring.name.lstrip("/").startswith(f"ridge_ring_{os.getpid()}_")
    assert ring.name.lstrip("/") not in leaked_step_rings()                     # its creator is alive
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = shared_memory.SharedMemory(name=f"ridge_ring_{int(gone.stdout)}_test", create=True, size=64)
    try:
        assert orphan.name.lstrip("/") in leaked_step_rings()
    finally:
        orphan.close()
        orphan.unlink()
    ring.close()
