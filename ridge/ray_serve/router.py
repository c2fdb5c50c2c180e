"""Ray Serve's request router for the engine replicas: prefix affinity, else the least loaded.

Ray Serve builds one router per deployment handle, in the process that holds the handle (the
OpenAI ingress), and asks it to rank the replicas for each request (`choose_replicas`). The
request's arguments are there: `generate(request_id, prompt, params)` carries the prompt's token
ids (the ingress tokenizes), from which ridge.ray_serve.affinity picks the replica. A replica's
load is the requests this router has in flight on it (routed, not yet completed): with one
ingress that is each replica's queue exactly. The first rank holds the chosen replica alone, the
second every candidate, so a chosen replica that refuses (its max_ongoing_requests reached) lets
Ray Serve fall back to the least loaded one that accepts.

Each router registers itself under its deployment in this process (ridge.ray_serve.routers): the
ingress reads the replicas the router currently knows and their last reported engine stats
(`record_routing_stats`, which Ray Serve polls) from it.
"""
from __future__ import annotations

from collections import Counter

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from ridge.ray_serve import routers
from ridge.ray_serve.affinity import PrefixAffinity


def prompt_ids(pending: PendingRequest | None) -> list[int] | None:
    """The prompt token ids of a `generate` call, else None."""
    if pending is None or pending.metadata.call_method != "generate" or len(pending.args) < 2:
        return None
    prompt = pending.args[1]
    return getattr(prompt, "token_ids", prompt) if not isinstance(prompt, str) else None


class PrefixAwareRouter(RequestRouter):
    def initialize_state(self, page_size: int = 16, imbalance: int = 8, capacity: int = 1 << 16):
        self.affinity = PrefixAffinity(page_size, imbalance, capacity)
        self.in_flight: Counter[ReplicaID] = Counter()
        self._routed: dict[str, ReplicaID] = {}
        routers.ROUTERS[(self._deployment_id.app_name, self._deployment_id.name)] = self

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True   # all refused: wait, do not spin
        if not candidate_replicas:
            return []
        by_id = {r.replica_id: r for r in candidate_replicas}
        chosen = self.affinity.choose(prompt_ids(pending_request), {rid: self.in_flight[rid] for rid in by_id})
        return [[by_id[chosen]], candidate_replicas]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self.in_flight[replica_id] += 1
        self._routed[pending_request.metadata.internal_request_id] = replica_id
        ids = prompt_ids(pending_request)
        if ids:
            self.affinity.record(ids, replica_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._routed.pop(internal_request_id, None) is not None and self.in_flight[replica_id] > 0:
            self.in_flight[replica_id] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.affinity.forget(replica_id)
        self.in_flight.pop(replica_id, None)
