"""ridge on Ray Serve: engine replicas behind ridge's own OpenAI app.

    ridge serve --ray --model MODEL --num-replicas 2 [--max-replicas 4] [engine and server flags]
    serve run ridge.ray_serve.app:build_app model=MODEL num_replicas=2 [any `ridge serve` flag=value]

Two deployments: EngineReplica (ridge.ray_serve.replica: one engine each, with the GPUs its
tensor parallelism needs, none on a CPU) and OpenAIIngress (ridge's FastAPI app, its routes,
pydantic models, errors and /metrics, over a ReplicaClient instead of an engine in-process).
The ingress's handle to the replicas routes with PrefixAwareRouter (ridge.ray_serve.router).
With --max-replicas, Ray Serve's autoscaler adds and removes replicas to keep each one's
requests in flight near --target-ongoing-requests.
"""
from __future__ import annotations

import argparse
import signal

import ray
import torch
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from ray import serve
from ray.serve.config import RequestRouterConfig

from ridge.config import EngineConfig
from ridge.ray_serve.replica import EngineReplica
from ridge.ray_serve.replica_client import ReplicaClient
from ridge.ray_serve.router import PrefixAwareRouter
from ridge.server.app import create_app
from ridge.server.config import ServerConfig

APP_NAME = "ridge"
# how often each replica reports its engine's stats (the ingress's /metrics and the per-replica
# series read them): often enough that a scrape sees the last second's work
STATS_PERIOD_S = 1.0


class _ReplicaCollector:
    """Per-replica series in the ingress's /metrics (label `replica`): where the load and the
    prefix-cache hits went."""

    def __init__(self, client: ReplicaClient):
        self.client = client

    def collect(self):
        series = (("ridge_replica_num_requests_running", GaugeMetricFamily, "num_running"),
                  ("ridge_replica_num_requests_waiting", GaugeMetricFamily, "num_waiting"),
                  ("ridge_replica_prefix_cache_queries", CounterMetricFamily, "prefix_cache_queries"),
                  ("ridge_replica_prefix_cache_hits", CounterMetricFamily, "prefix_cache_hits"))
        stats = self.client.replica_stats()
        for name, kind, field in series:
            family = kind(name, f"{field} of each engine replica", labels=["replica"])
            for replica, st in sorted(stats.items()):
                family.add_metric([replica], getattr(st, field))
            yield family


@serve.ingress()
class OpenAIIngress:
    async def __init__(self, engine_handle, server: ServerConfig):
        self.cfg = server
        self.client = await ReplicaClient.connect(engine_handle, server.tokenizer_pool_size)

    def __serve_build_asgi_app__(self):
        app = create_app(None, self.cfg, client=self.client)
        app.state.metrics.registry.register(_ReplicaCollector(self.client))
        return app


def _gpus_per_replica(engine: EngineConfig) -> int:
    device = str(engine.device)
    on_gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    return engine.tensor_parallel_size if on_gpu else 0


def application(engine: EngineConfig, server: ServerConfig) -> serve.Application:
    """The two deployments, bound: what `serve.run` takes."""
    scaling = dict(num_replicas=server.num_replicas) if server.max_replicas is None else dict(
        autoscaling_config=dict(min_replicas=server.num_replicas, max_replicas=server.max_replicas,
                                target_ongoing_requests=server.target_ongoing_requests))
    router = RequestRouterConfig(request_router_class=PrefixAwareRouter,
                                 request_router_kwargs=dict(page_size=engine.page_size),
                                 request_routing_stats_period_s=STATS_PERIOD_S)
    replica = serve.deployment(EngineReplica, name="EngineReplica",
                               ray_actor_options=dict(num_gpus=_gpus_per_replica(engine)),
                               max_ongoing_requests=server.max_ongoing_requests,
                               request_router_config=router, **scaling)
    most = server.max_replicas or server.num_replicas
    ingress = serve.deployment(OpenAIIngress, name="OpenAIIngress",
                               max_ongoing_requests=server.max_ongoing_requests * most)
    return ingress.bind(replica.bind(engine.as_kwargs(), server.tokenizer_pool_size), server)


def configs(argv: list[str]) -> tuple[EngineConfig, ServerConfig]:
    """`ridge serve`'s settings for these flags (parsed by the same parser)."""
    from ridge.cli import build_parser
    from ridge.server.cli import serve_configs
    a, unknown = build_parser().parse_known_args(["serve", *argv])
    if unknown:
        raise ValueError(f"not a `ridge serve` setting: {' '.join(unknown)}")
    return serve_configs(a)


def build_app(args: dict) -> serve.Application:
    """`serve run ridge.ray_serve.app:build_app model=MODEL num_replicas=2 ...`: each key=value is
    the `ridge serve` flag --key value (a true/false value: the flag on or off)."""
    argv = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if str(value).lower() in ("true", "false"):
            argv.append(flag if str(value).lower() == "true" else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return application(*configs(argv))


def cmd_serve_ray(a: argparse.Namespace) -> int:
    """`ridge serve --ray`: start (or join) Ray, run the application, serve until Ctrl-C or SIGTERM."""
    from ridge.server.cli import serve_configs

    engine, server = serve_configs(a)
    serve.start(http_options=dict(host=server.host, port=server.port))
    # SIGTERM (docker stop, a supervisor) ends it as Ctrl-C does, the deployments shut down first;
    # set once Ray has started, whose own handler would abort the process
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        serve.run(application(engine, server), name=APP_NAME, route_prefix="/", blocking=True)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt
