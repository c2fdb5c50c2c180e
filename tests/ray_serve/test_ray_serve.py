"""ridge on a local Ray Serve instance: two engine replicas of the demo model behind the OpenAI
ingress. One instance for the module (starting it loads the model twice), shut down after, with
no Serve actor left; the replica-killing test runs last."""
import json
import os
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

ROOT = Path(__file__).resolve().parents[2]
MODEL = "demo-code-12m"
# four seats per engine: a load of 32 streams leaves requests waiting in each replica's queue
FLAGS = ["--model", MODEL, "--kv-cache-memory", "16MiB", "--max-model-len", "512", "--max-num-seqs", "4",
         "--num-replicas", "2"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_actors() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("SERVE_")]


@pytest.fixture(scope="module")
def cluster():
    from ridge.ray_serve.app import APP_NAME, application, configs

    # the workers import this tree's ridge, and run as the tests do (the interpreter's kernels, one thread)
    env = {k: os.environ[k] for k in ("TRITON_INTERPRET", "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM")
           if k in os.environ}
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {**env, "PYTHONPATH": str(ROOT)}})
    port = _free_port()
    try:
        engine, server = configs(FLAGS + ["--port", str(port)])
        serve.start(http_options=dict(host="127.0.0.1", port=port))
        serve.run(application(engine, server), name=APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        left = _serve_actors()
        ray.shutdown()
    assert left == [] and not ray.is_initialized()


def _client(url):
    import openai
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def _replica_series(url) -> dict[str, dict[str, float]]:
    """Each replica's series from the ingress's /metrics: {name: {replica: value}}."""
    out: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in fam.samples:
            if s.name.startswith("ridge_replica_"):
                out.setdefault(s.name, {})[s.labels["replica"]] = s.value
    return out


def _settled_counts(url, queries: int | None = None) -> tuple[dict, dict]:
    """Per-replica prefix-cache queries and hits once the replicas' reports (every second) have
    caught up with `queries` prompt tokens in all (None: once two reports in a row agree)."""
    deadline, last = time.monotonic() + 20, None
    while True:
        series = _replica_series(url)
        q = series.get("ridge_replica_prefix_cache_queries_total", {})
        counts = q, series.get("ridge_replica_prefix_cache_hits_total", {})
        if (counts == last if queries is None else sum(q.values()) >= queries) or time.monotonic() > deadline:
            return counts
        last = counts
        time.sleep(1.5 if queries is None else 0.25)


def test_the_openai_client_through_the_ingress(cluster):
    """Completions and chat, streamed and not, through ridge's own app in the ingress: greedy
    streams spell what the plain answers say."""
    c = _client(cluster)
    assert [m.id for m in c.models.list().data] == [MODEL]
    done = c.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=12, temperature=0)
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL, prompt="def fibonacci(n):", max_tokens=12, temperature=0, stream=True))
    assert done.usage.completion_tokens == 12 and streamed == done.choices[0].text != ""
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    answer = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    pieces = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True) if ch.choices]
    assert "".join(pieces) == answer.choices[0].message.content != ""
    assert answer.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(Exception, match="max_tokens"):     # the app's own checks answer as before
        c.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    assert httpx.get(cluster + "/health", timeout=30).status_code == 200


def test_a_shared_prefix_lands_on_one_replica_and_distinct_ones_spread(cluster):
    """Prompts sharing six pages of prefix go to the replica that took the first of them: its
    prefix-cache hits grow, the other's do not. New prefixes take turns between the replicas."""
    c = _client(cluster)
    q0, h0 = _settled_counts(cluster)
    shared = [(7 * i) % 4000 + 100 for i in range(96)]           # six pages of 16
    prompts = [shared + [4100 + i] * 4 for i in range(4)]
    for p in prompts:
        c.completions.create(model=MODEL, prompt=p, max_tokens=2, temperature=0)
    total = sum(q0.values()) + sum(len(p) for p in prompts)
    q1, h1 = _settled_counts(cluster, total)
    grew = {r: h1.get(r, 0) - h0.get(r, 0) for r in q1}
    assert sorted(grew.values()) == [0, 3 * 96], grew            # the three after the first: all six pages hit
    distinct = [[5000 + 37 * k + j for j in range(40)] for k in range(4)]
    for p in distinct:
        c.completions.create(model=MODEL, prompt=p, max_tokens=2, temperature=0)
    q2, _ = _settled_counts(cluster, total + 4 * 40)
    assert all(q2[r] - q1.get(r, 0) >= 40 for r in q2) and len(q2) == 2, (q1, q2)


def _stream(url, i, events: list, started: threading.Event):
    """One streamed completion; `events` gets each data line ("error" for an error event)."""
    body = {"model": MODEL, "prompt": [300 + i, 301 + i, 302 + i] * 6, "max_tokens": 48, "ignore_eos": True,
            "temperature": 0, "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=180) as r:
            events.append(f"status {r.status_code}")
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    events.append("[DONE]")
                    continue
                event = json.loads(data)
                events.append("error" if "error" in event else event["choices"][0]["finish_reason"] or "token")
                started.set()
    except httpx.HTTPError as e:
        events.append(f"lost: {type(e).__name__}")


def test_a_replica_killed_under_load_loses_no_request(cluster):
    """32 streams, then one replica killed: a stream it had started ends with an error event, then
    [DONE]; every request that had no output yet completes on the other replica."""
    events = [[] for _ in range(32)]
    flags = [threading.Event() for _ in range(32)]
    threads = [threading.Thread(target=_stream, args=(cluster, i, events[i], flags[i]), daemon=True)
               for i in range(32)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while sum(f.is_set() for f in flags) < 6 and time.monotonic() < deadline:
        time.sleep(0.02)
    replicas = [n for n in _serve_actors() if "#EngineReplica#" in n]
    assert len(replicas) == 2
    ray.kill(ray.get_actor(replicas[0], namespace="serve"), no_restart=True)
    for t in threads:
        t.join(180)
    for i, e in enumerate(events):
        assert e[0] == "status 200" and e[-1] == "[DONE]", (i, e)          # every stream ends properly
        assert e[-2] in ("length", "error"), (i, e)
        if e[-2] == "length":
            assert e.count("token") == 47, (i, e)       # one chunk a token, the last with the finish reason
        else:
            assert e.count("token") >= 1, (i, e)        # only a stream that had started fails
    failed = [i for i, e in enumerate(events) if e[-2] == "error"]
    # the killed replica ran at most its four seats' requests; the ones waiting behind them (and
    # those routed to it as it died) were sent again and completed on the other replica
    assert 1 <= len(failed) <= 4, failed
