"""The request routers of this process, by deployment. Ray Serve ships a custom router's module
by value (a copy per handle), so this registry lives in a module of its own, shared by reference:
the ingress reads the replicas its handle's router knows, with their reported stats, from here."""
from __future__ import annotations

ROUTERS: dict[tuple[str, str], object] = {}


def router_of(app_name: str, deployment_name: str):
    """The router this process's handles use for that deployment (None before a first call)."""
    return ROUTERS.get((app_name, deployment_name))
