"""`ridge trace FILE`: each stall a trace recorded (a request's gap between two tokens over 10x the
running median, ridge/utils/trace.py) and what the process was doing meanwhile: the spans that
overlapped the gap, by how much of it they covered, on which thread.

    ridge serve --model M --trace-dir traces/ &
    ...
    ridge trace traces/ridge-trace-*.json
"""
from __future__ import annotations

import argparse
import bisect
import json
from collections import defaultdict


def load(path: str) -> list[dict]:
    """The events of a trace, closed or not (a process killed mid-run leaves no closing bracket)."""
    try:
        with open(path) as f:
            text = f.read().rstrip()
    except OSError as e:
        raise ValueError(f"trace: cannot read {path}: {e.strerror}") from None
    if not text.startswith("["):
        raise ValueError(f"trace: {path} is not a trace in the Chrome trace format (no '[' at its start)")
    if not text.endswith("]"):
        text = text.rstrip(",") + "]"
    try:
        events = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"trace: {path} is not valid JSON ({e.msg} at line {e.lineno})") from None
    return [e for e in events if isinstance(e, dict)]


def explain(events: list[dict], top: int = 5) -> list[dict]:
    """For each stall (the requests whose gaps ended at the same step, together): the requests,
    the longest of their gaps and the median gap then, when it ended (seconds since the trace's
    first event) and the `top` span names by the time they overlapped the gap."""
    threads = {e.get("tid"): e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = sorted((e for e in events if e.get("ph") == "X"), key=lambda e: e["ts"])
    starts = [e["ts"] for e in spans]
    longest = max((e["dur"] for e in spans), default=0.0)
    origin = min((e["ts"] for e in events if "ts" in e), default=0.0)
    stalls: dict[float, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("name") == "stall":
            stalls[e["ts"]].append(e["args"])
    out = []
    for hi, group in sorted(stalls.items()):
        lo = min(g["start_us"] for g in group)
        by = defaultdict(lambda: dict(overlap_ms=0.0, spans=0, longest_ms=0.0, args=None))
        for s in spans[bisect.bisect_left(starts, lo - longest):bisect.bisect_left(starts, hi)]:
            overlap = min(hi, s["ts"] + s["dur"]) - max(lo, s["ts"])
            if overlap <= 0:
                continue
            row = by[(s["name"], threads.get(s.get("tid"), str(s.get("tid"))))]
            row["overlap_ms"] += overlap / 1e3
            row["spans"] += 1
            if s["dur"] / 1e3 >= row["longest_ms"]:
                row["longest_ms"], row["args"] = s["dur"] / 1e3, s.get("args") or {}
        rows = sorted(({"name": n, "thread": t, **r} for (n, t), r in by.items()), key=lambda r: -r["overlap_ms"])
        out.append(dict(request_ids=[g["request_id"] for g in group], at_s=(hi - origin) / 1e6,
                        gap_ms=max(g["gap_ms"] for g in group), median_ms=group[0]["median_ms"], spans=rows[:top]))
    return out


def format_explained(stalls: list[dict]) -> str:
    if not stalls:
        return "no stalls: no request waited more than 10x the median gap between two tokens"
    lines = [f"{len(stalls)} stall(s): requests' gaps between two tokens over 10x the running median"]
    for s in stalls:
        ids = s["request_ids"]
        who = ", ".join(ids[:3]) + (f" and {len(ids) - 3} more" if len(ids) > 3 else "")
        lines.append(f"- {who} waited up to {s['gap_ms']:.1f} ms (median {s['median_ms']:.2f} ms), "
                     f"ending {s['at_s']:.2f} s into the trace; meanwhile:")
        for r in s["spans"]:
            args = ", ".join(f"{k}={v}" for k, v in (r["args"] or {}).items())
            lines.append(f"    {r['overlap_ms']:9.1f} ms  {r['name']} on {r['thread']} ({r['spans']} span(s), "
                         f"longest {r['longest_ms']:.1f} ms{': ' + args if args else ''})")
        if not s["spans"]:
            lines.append("    (no span: the process was idle or in code the trace does not cover)")
    return "\n".join(lines)


def add_trace_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("trace", help="explain the stalls a --trace-dir trace recorded", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", help="a trace written under --trace-dir")
    p.add_argument("--top", type=int, default=5, help="spans listed per stall (default 5)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the stalls and their spans as JSON here")
    p.set_defaults(func=cmd_trace)
    return p


def cmd_trace(a: argparse.Namespace) -> int:
    if a.top < 1:
        raise ValueError(f"top: must be >= 1, got {a.top}")
    stalls = explain(load(a.file), a.top)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(stalls, f, indent=1)
    print(format_explained(stalls))
    return 0
