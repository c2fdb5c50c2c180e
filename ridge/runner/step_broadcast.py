"""The step ring's interface over a torch.distributed broadcast, for tensor-parallel ranks on other
hosts (torchrun across nodes), where no memory is shared: rank 0 broadcasts each message's length,
then its bytes (the same fixed binary layout, no pickle), over a gloo group of its own.

The group's timeout is long: a worker waits in the broadcast for the next step, and an engine
may idle for days. A dead rank 0 still ends the wait at once (its connections close); a dead
worker is seen by rank 0's next collective, as with the ring.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

IDLE_TIMEOUT = datetime.timedelta(days=365)


class BroadcastChannel:
    """publish() on rank 0, consume() on the others; every rank makes one (a collective)."""

    def __init__(self, rank: int):
        self.rank, self.count = rank, 0
        self.group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self.name = None

    def publish(self, message: bytes, timeout: float | None = None) -> int:
        dist.broadcast(torch.tensor([len(message)], dtype=torch.int64), src=0, group=self.group)
        dist.broadcast(torch.frombuffer(bytearray(message), dtype=torch.uint8), src=0, group=self.group)
        self.count += 1
        return self.count

    def consume(self, consumer: int, timeout: float | None = None) -> bytes:
        n = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(n, src=0, group=self.group)
        body = torch.empty(int(n), dtype=torch.uint8)
        dist.broadcast(body, src=0, group=self.group)
        self.count += 1
        return body.numpy().tobytes()

    def published(self) -> int:
        return self.count

    def taken(self, consumer: int) -> int:
        """A broadcast returns on rank 0 once it is sent, so who has read a step is not known: every
        step published counts as taken."""
        return self.count

    def close(self) -> None:
        pass
