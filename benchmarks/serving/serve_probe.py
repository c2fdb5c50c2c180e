"""Where a stream's inter-token gap goes: `ridge serve` with two timing probes, for diagnosis.

    python benchmarks/serving/serve_probe.py --probe-out probe.json serve --port 8765 --max-num-seqs 64 &
    python benchmarks/serving/serve_load.py --url http://127.0.0.1:8765 --json load.json
    kill %1; python benchmarks/serving/serve_probe.py --analyze load.json probe.json

Probes (wrapped around the engine client's methods, nothing in ridge changes):
  steps       how long each engine step takes in the engine thread (GPU work plus every wait for
              the GIL while other threads hold it);
  deliveries  how long a step's outputs wait between the engine thread handing them to the event
              loop and the loop running them (the loop busy with other work, or waiting for the GIL).
The analysis splits both by serve_load's runs (unattacked / attacked), using the runs' timestamps
(perf_counter is the system's monotonic clock, the same in both processes).
"""
from __future__ import annotations

import argparse
import atexit
import json
import sys
import time


def install_probes(out_path: str) -> None:
    from ridge.server import engine_client as ec

    steps, deliveries = [], []
    step, deliver = ec.EngineClient._step, ec.EngineClient._deliver

    def timed_step(self):
        t = time.perf_counter()
        step(self)
        steps.append((t, time.perf_counter() - t))

    def timed_deliver(self, batch):
        if batch:
            t = time.perf_counter()
            self._call_soon(lambda: deliveries.append((t, time.perf_counter() - t)))
        deliver(self, batch)

    ec.EngineClient._step, ec.EngineClient._deliver = timed_step, timed_deliver

    def dump():
        with open(out_path, "w") as f:
            json.dump({"steps": steps, "deliveries": deliveries}, f)

    atexit.register(dump)


def analyze(load_path: str, probe_path: str) -> None:
    with open(load_path) as f:
        runs = json.load(f)["runs"]
    with open(probe_path) as f:
        probe = json.load(f)

    def pct(values, q):
        values = sorted(values)
        return values[min(len(values) - 1, int(len(values) * q))] * 1e3 if values else float("nan")

    print("runs        gap p99 ms (each run)   steps p90/p99 ms   deliveries p90/p99 ms")
    for attacked in (False, True):
        rs = [r for r in runs if r["attack"] == attacked]
        cells = []
        for key in ("steps", "deliveries"):
            v = [d for r in rs for t, d in probe[key] if r["t_steady"] <= t <= r["t_end"]]
            cells.append(f"{pct(v, .9):6.1f} / {pct(v, .99):6.1f}")
        gaps = " ".join(f"{r['gap_p99_s'] * 1e3:5.1f}" for r in rs)
        print(f"{'attacked' if attacked else 'unattacked':10s}  {gaps:22s}  {cells[0]:17s}  {cells[1]}")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--analyze":
        ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        ap.add_argument("--analyze", nargs=2, metavar=("LOAD_JSON", "PROBE_JSON"), required=True)
        analyze(*ap.parse_args().analyze)
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 usage="serve_probe.py --probe-out FILE serve [ridge serve flags] | "
                                       "--analyze LOAD_JSON PROBE_JSON")
    ap.add_argument("--probe-out", required=True, help="where the probes' timings go (written at exit)")
    ap.add_argument("ridge_args", nargs=argparse.REMAINDER, help="the ridge command: serve ...")
    a = ap.parse_args()
    install_probes(a.probe_out)
    from ridge.cli import main as ridge_main
    return ridge_main(a.ridge_args)


if __name__ == "__main__":
    sys.exit(main())
