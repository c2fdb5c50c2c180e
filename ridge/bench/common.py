"""What `ridge bench latency` and `ridge bench throughput` share: timing hooks on the engine's
runner, device synchronisation, the run environment, JSON output and the closing table."""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field

import torch

from ridge.engine.request import acceptance_rate, mean_accepted_length


def sync(device: torch.device) -> None:
    """Wait for the device. On CUDA the host runs ahead of the kernels it queued, so a host clock
    read without this would time the launches, not the work; on the CPU there is nothing to wait for."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class StepRecord:
    """What one forward pass computed, as the roofline cost model wants it: per scheduled sequence,
    the tokens fed in this step and the context attended over after it; the rows that sample."""
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    num_sampled: int
    greedy: bool

    @classmethod
    def of(cls, sched) -> "StepRecord":
        items = sched.scheduled
        return cls(tuple(i.num_new_tokens for i in items), tuple(i.start + i.num_new_tokens for i in items),
                   sum(1 for i in items if i.samples), all(i.seq.request.params.greedy for i in items))

    @property
    def is_decode(self) -> bool:
        return all(q == 1 for q in self.query_lens)


@dataclass
class RunnerTimer:
    """Host-clock time inside `runner.execute` (batch preparation, forward, logits) and
    `runner.sample`, accumulated over a run; the device's busy time; optionally the shape of
    every step.

    The engine is used as it is: the timer is one of the runner's `step_observers` for the
    duration of the `with` block, told when each execute and sample starts and ends. Nothing here
    waits for the device: with async scheduling the engine launches step N+1 before it reads step
    N's ids, and a synchronise here would serialise the two again.

    Device busy time: on CUDA a pair of timing events per step, recorded on the stream before
    `execute` queues the step's work and after `sample` queues the last of it; the start event
    completes when the device reaches it (when the previous step's work is done, or when the host
    enqueued it if the device was idle by then), so the pairs' elapsed times add up to the time the
    device spent on the steps, idle time between steps excluded (an upper bound: idle gaps inside a
    step count as busy). Read once, after a synchronise, when `device_s` is first asked for. On a
    CPU, where `execute` returns only when the forward is done, it is the time inside the two
    calls."""
    engine: object
    record_shapes: bool = False
    execute_s: float = 0.0
    sample_s: float = 0.0
    between_s: float = 0.0
    execute_calls: int = 0
    sample_calls: int = 0
    shapes: list[StepRecord] = field(default_factory=list)
    events: list[tuple[object, object]] = field(default_factory=list)   # CUDA (start, end) per step

    def __enter__(self) -> "RunnerTimer":
        self._cuda = self.engine.cfg.device.type == "cuda"
        self._t = self._execute_end = self._start = self._device_s = None
        self.engine.runner.step_observers.append(self)
        return self

    def __exit__(self, *exc) -> None:
        self.engine.runner.step_observers.remove(self)

    def on_step_start(self, phase: str, arg) -> None:
        t = time.perf_counter()
        if phase == "execute":
            if self.record_shapes:
                self.shapes.append(StepRecord.of(arg))       # before the engine advances the sequences
            if self._cuda and self._start is None:           # a step that sampled nothing joins the next
                self._start = torch.cuda.Event(enable_timing=True)
                self._start.record()
        elif self._execute_end is not None:
            self.between_s += t - self._execute_end
            self._execute_end = None
        self._t = time.perf_counter()

    def on_step_end(self, phase: str, arg) -> None:
        t = time.perf_counter()
        if phase == "execute":
            self._execute_end = t
            self.execute_s += t - self._t
            self.execute_calls += 1
            return
        if self._cuda and self._start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.events.append((self._start, end))
            self._start = None
        self.sample_s += time.perf_counter() - self._t
        self.sample_calls += 1

    @property
    def inside_calls_s(self) -> float:
        return self.execute_s + self.sample_s

    @property
    def device_s(self) -> float:
        """Time the device was busy with the steps (see the class docstring)."""
        if self.engine.cfg.device.type != "cuda":
            return self.execute_s + self.sample_s
        if self._device_s is None:
            sync(self.engine.cfg.device)
            self._device_s = sum(start.elapsed_time(end) for start, end in self.events) / 1e3
        return self._device_s

    def check_engaged(self, steps: int) -> None:
        """The hooks only see what the engine routes through `runner.execute`/`runner.sample`; if the
        step loop stops calling them, say so instead of reporting a busy fraction of zero."""
        if steps and (self.execute_calls == 0 or self.sample_calls == 0):
            raise RuntimeError("bench: the engine ran steps without calling runner.execute/runner.sample, "
                               "so the device time cannot be measured; update ridge/bench/common.py")


def speculation(stats0, stats1) -> dict:
    """Speculative decoding between two `Engine.stats()` snapshots, with vLLM's names: the proposer,
    verify steps with drafts, draft and accepted tokens, acceptance rate, mean accepted length
    (tokens a verify step emitted: accepted drafts + 1), the acceptance at each draft position (the
    share of verify steps that accepted it) and the draft cost (the proposer's host time, in all and
    a draft token)."""
    drafts = stats1.spec_num_drafts - stats0.spec_num_drafts
    proposed = stats1.spec_num_draft_tokens - stats0.spec_num_draft_tokens
    accepted = stats1.spec_num_accepted_tokens - stats0.spec_num_accepted_tokens
    before = stats0.spec_accepted_per_pos
    per_pos = [n - (before[i] if i < len(before) else 0) for i, n in enumerate(stats1.spec_accepted_per_pos)]
    propose = stats1.spec_propose_seconds - stats0.spec_propose_seconds
    return dict(spec_method=stats1.spec_method or None, spec_num_drafts=drafts, spec_num_draft_tokens=proposed,
                spec_num_accepted_tokens=accepted, spec_acceptance_rate=acceptance_rate(accepted, proposed),
                spec_mean_accepted_length=mean_accepted_length(accepted, drafts),
                spec_acceptance_per_pos=[n / drafts for n in per_pos] if drafts else [],
                spec_propose_s=propose, spec_propose_us_per_draft_token=1e6 * propose / proposed if proposed else None)


def speculation_rows(r: dict) -> list[list[str]]:
    """Table rows for a result's speculation counters (none when nothing was drafted)."""
    if not r.get("spec_num_drafts"):
        return []
    return [["spec proposer", r["spec_method"]],
            ["spec draft / accepted tokens", f"{r['spec_num_draft_tokens']} / {r['spec_num_accepted_tokens']}"],
            ["spec acceptance rate", f"{r['spec_acceptance_rate']:.1%}"],
            ["spec acceptance by position", " ".join(f"{a:.0%}" for a in r["spec_acceptance_per_pos"])],
            ["spec mean accepted length", f"{r['spec_mean_accepted_length']:.2f}"],
            ["spec draft cost", f"{r['spec_propose_s'] * 1e3:.1f} ms proposing, "
                                f"{r['spec_propose_us_per_draft_token']:.1f} us a draft token"]]


def overlap(stats0, stats1) -> dict:
    """Decode steps between two `Engine.stats()` snapshots and the fraction launched before the
    previous step's ids were read back (0 where no step took the static decode path that overlaps)."""
    steps = stats1.num_decode_steps - stats0.num_decode_steps
    overlapped = stats1.num_overlapped_steps - stats0.num_overlapped_steps
    return dict(overlap_fraction=overlapped / steps if steps else 0.0, static_decode_steps=steps,
                overlapped_decode_steps=overlapped)


def resolve_max_model_len(model: str | None, max_model_len: int | None):
    """(the max_model_len LLM(...) will use, the ModelConfig), read from config.json alone, so that a
    benchmark rejects impossible lengths before it spends time loading weights."""
    from ridge.config import ModelConfig, model_dir

    model_cfg = ModelConfig.from_dir(model_dir(model))
    limit = model_cfg.max_position_embeddings
    if max_model_len is not None and not 1 < max_model_len <= limit:
        raise ValueError(f"max_model_len: must be in [2, {limit}] (the model's max_position_embeddings), "
                         f"got {max_model_len}")
    return max_model_len or limit, model_cfg


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def environment(engine) -> dict:
    """The facts a reader needs to reproduce a number: device, versions, commit, engine config."""
    import ridge
    cfg, runner = engine.cfg, engine.runner
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(ridge.__file__)), timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    backend = getattr(runner, "backend", None)
    graphs = getattr(getattr(runner, "decode_graphs", None), "graphs", None)
    return dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=device_name(cfg.device), torch=torch.__version__, ridge=ridge.__version__, commit=commit or None,
        model=cfg.model, dtype=str(cfg.dtype).removeprefix("torch."), device_type=cfg.device.type,
        attention_backend=getattr(backend, "name", None), max_model_len=cfg.max_model_len,
        max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
        page_size=cfg.page_size, num_pages=cfg.num_pages, enable_prefix_caching=cfg.enable_prefix_caching,
        enforce_eager=getattr(cfg, "enforce_eager", None), decode_cuda_graphs=len(graphs) if graphs else 0,
        decode_graph_capture_s=getattr(getattr(runner, "decode_graphs", None), "capture_seconds", None),
        prefill_warm_up_s=getattr(runner, "warm_up_seconds", None),
        async_scheduling=getattr(cfg, "async_scheduling", None),
    )


def summarize(values: list[float]) -> dict | None:
    """mean / median / p90 / p99 / min / max of a sample (None when empty)."""
    if not values:
        return None
    s = sorted(values)

    def pct(q):
        return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]

    return dict(mean=statistics.fmean(s), median=statistics.median(s), p90=pct(0.90), p99=pct(0.99),
                min=s[0], max=s[-1], n=len(s))


def write_json(path: str, obj: dict) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


def format_table(headers: list[str], rows: list[list], title: str | None = None) -> str:
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [title] if title else []
    for j, r in enumerate(cells):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def fmt(x, spec: str = ".2f", scale: float = 1.0, suffix: str = "") -> str:
    return "n/a" if x is None else f"{x * scale:{spec}}{suffix}"
