"""Ray is imported only when asked for: `ridge generate` and `ridge serve` without --ray load no
part of it (nor ridge.ray_serve), so they pay nothing for it."""
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]

# generate runs to the end; serve builds its app and parses its flags as the command does (its
# engine would load in the app's lifespan, which is ridge.server's, tested elsewhere)
SCRIPT = """
import sys
from ridge.cli import build_parser, main
assert main(["generate", "def add(a, b):", "--model", "demo-code-12m", "--max-tokens", "2",
             "--kv-cache-memory", "16MiB"]) == 0
from ridge.server.cli import build_app
app, cfg = build_app(build_parser().parse_args(["serve", "--model", "demo-code-12m", "--port", "0"]))
assert not cfg.ray
loaded = sorted(m for m in sys.modules if m == "ray" or m.startswith(("ray.", "ridge.ray_serve")))
print("LOADED", loaded)
"""


def test_generate_and_serve_without_ray_do_not_import_it():
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "LOADED []" in out.stdout, out.stdout[-2000:]


def test_the_ray_flag_reaches_ray_serve_and_the_replica_settings_are_checked():
    from ridge.cli import build_parser
    from ridge.server.cli import serve_configs

    a = build_parser().parse_args(["serve", "--model", "demo-code-12m", "--ray", "--num-replicas", "2",
                                   "--max-replicas", "4", "--target-ongoing-requests", "8"])
    engine, server = serve_configs(a)
    assert (server.ray, server.num_replicas, server.max_replicas, server.target_ongoing_requests) == (True, 2, 4, 8)
    a = build_parser().parse_args(["serve", "--model", "demo-code-12m", "--num-replicas", "3", "--max-replicas", "2"])
    with pytest.raises(ValueError, match="max_replicas: must be at least num_replicas"):
        serve_configs(a)


def test_the_serve_run_builder_takes_ridge_serves_flags():
    from ridge.ray_serve.app import build_app

    app = build_app({"model": "demo-code-12m", "num_replicas": "2", "enforce_eager": "true",
                     "kv_cache_memory": "16MiB"})
    ingress = app._bound_deployment
    replica = ingress.init_args[0]._bound_deployment
    assert replica._deployment_config.num_replicas == 2
    assert replica.init_args[0]["enforce_eager"] is True and replica.init_args[0]["kv_cache_memory"] == 16 << 20
    assert replica.ray_actor_options["num_gpus"] == 0
    scaled = build_app({"model": "demo-code-12m", "num_replicas": "1", "max_replicas": "3"})
    config = scaled._bound_deployment.init_args[0]._bound_deployment._deployment_config.autoscaling_config
    assert (config.min_replicas, config.max_replicas) == (1, 3)
    with pytest.raises(ValueError, match="not a `ridge serve` setting: --no-such-flag"):
        build_app({"model": "demo-code-12m", "no_such_flag": "1"})
