"""The roofline report: a terminal table, report.md, report.json, and roofline.png/.svg."""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field

from ridge.utils.ceilings import Ceilings
from ridge.roofline.diagnose import BOUND_FRACTION, LAUNCH_BOUND_FACTOR, StepReport
from ridge.roofline.predict import PredictionRow

REPORT_VERSION = 1


@dataclass
class Report:
    model: str
    model_name: str
    model_info: dict
    device: str                   # the device's name
    device_type: str              # "cpu" or "cuda"
    dtype: str
    backend: str                  # attention backend
    compute_roof: str             # the matrix ceiling the model's GEMMs run against
    ceilings: Ceilings
    steps: list[StepReport]
    predictions: list[PredictionRow] | None = None
    kv_budget_bytes: float | None = None
    created: str = ""
    command: str | None = None
    notes: list[str] = field(default_factory=list)

    def step(self, name: str, batch: int | None = None) -> StepReport:
        for s in self.steps:
            if s.name == name and (batch is None or s.batch == batch):
                return s
        raise KeyError((name, batch))


# -- units -------------------------------------------------------------------------------------
def _units(ceilings: Ceilings) -> tuple[str, float, str, float]:
    """FLOP/s and bytes/s units that keep the device's numbers readable."""
    big = max(ceilings.matmul.values(), default=0) >= 1e13
    return ("TFLOP/s", 1e12, "TB/s", 1e12) if big else ("GFLOP/s", 1e9, "GB/s", 1e9)


def _fmt_s(s: float | None) -> str:
    if s is None:
        return "-"
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"


def _num(v: float | None, digits: int = 3) -> str:
    if v is None:
        return "-"
    if v == 0:
        return "0"
    if 10 ** digits <= abs(v) < 1e7:
        return f"{v:,.0f}"
    if abs(v) >= 1e7 or abs(v) < 1e-3:
        return f"{v:.{digits - 1}e}"
    return f"{v:.{digits}g}"


def ceilings_line(c: Ceilings) -> str:
    fu, fs, bu, bs = _units(c)
    mm = ", ".join(f"{k} {v / fs:.4g} {fu}" for k, v in sorted(c.matmul.items(), key=lambda kv: -kv[1]))
    graph = f"; in a CUDA graph {_fmt_s(c.graph_launch)}" if c.graph_launch else ""
    return (f"bandwidth {c.bandwidth / bs:.4g} {bu} (copy, read + write) | matmul {mm} | "
            f"launch overhead {_fmt_s(c.launch_overhead)} a kernel{graph}")


def datasheet_line(c: Ceilings) -> str | None:
    if not c.datasheet:
        return None
    fu, fs, bu, bs = _units(c)
    d = c.datasheet
    parts = [f"bandwidth {d['bandwidth'] / bs:.4g} {bu}"] + [f"{k} {v / fs:.4g} {fu}" for k, v in d.items()
                                                              if k != "bandwidth"]
    return "datasheet (shown only, never used): " + ", ".join(parts)


_COLS = ("op", "share", "time", "calls", "kern", "GFLOP", "MB", "FLOP/B", "{fu}", "{bu}", "roof%", "bound by")


def _row_cells(r, fs: float, bs: float) -> list[str]:
    return [r.op, f"{r.share:.1%}" if r.time_s is not None else "-", _fmt_s(r.time_s),
            f"{r.calls:.0f}", "-" if r.kernels is None else f"{r.kernels:.0f}",
            _num(r.flops / 1e9), _num(r.bytes / 1e6), _num(r.intensity),
            _num(r.achieved_flops / fs) if r.time_s else "-", _num(r.achieved_bandwidth / bs) if r.time_s else "-",
            f"{r.fraction:.0%}" if r.fraction is not None else "-", r.label]


def step_summary_line(s: StepReport) -> str:
    return (f"step {_fmt_s(s.step_time_s)}: ops {_fmt_s(s.ops_time_s)}, host prep {_fmt_s(s.host_time_s)}, "
            + (f"other kernels {_fmt_s(s.other_time_s)}, " if s.other_time_s else "")
            + f"idle {_fmt_s(s.idle_time_s)} ({s.idle_fraction:.0%}) | MBU {s.mbu:.1%}, MFU {s.mfu:.1%} | "
            f"roofline floor {_fmt_s(s.predicted_s)}, + launches {_fmt_s(s.predicted_launches_s)} | {s.label}")


def _table(headers: list[str], rows: list[list[str]], indent: str = "  ") -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    fmt = lambda cells: indent + "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                           for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([fmt(headers), indent + "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows])


def _prediction_cells(p: PredictionRow) -> list[str]:
    return [p.precision, str(p.context), str(p.batch), _fmt_s(p.prefill_s), f"{p.prefill_tok_s:,.0f}",
            _fmt_s(p.decode_s), f"{p.decode_tok_s:,.0f}", _fmt_s(p.decode_launches_s), p.decode_bound,
            str(p.max_batch), "yes" if p.fits else "no"] + ([
            str(p.tp), f"{_fmt_s(p.decode_comm_s)} ({p.decode_comm_share:.0%})",
            f"{_fmt_s(p.prefill_comm_s)} ({p.prefill_comm_s / p.prefill_s:.0%})"] if p.tp > 1 else [])


def _pred_cols(rows: list[PredictionRow]) -> list[str]:       # TP rows: the collectives' part of each step
    return ["precision", "context", "batch", "prefill", "prefill tok/s", "decode step", "decode tok/s",
            "decode + launches", "decode bound by", "max batch", "fits"] + (
        ["TP", "decode comm (share)", "prefill comm (share)"] if rows[0].tp > 1 else [])


def format_terminal(rep: Report) -> str:
    c = rep.ceilings
    fu, fs, bu, bs = _units(c)
    out = [f"ridge roofline: {rep.model_name} ({rep.model_info.get('architecture')}, "
           f"{rep.model_info.get('parameters', 0) / 1e6:.1f}M parameters), {rep.dtype}, {rep.backend} attention",
           f"device: {rep.device} ({rep.device_type}); ceilings measured {c.measured_at}",
           "ceilings: " + ceilings_line(c)]
    out += [ds for ds in [datasheet_line(c)] if ds]
    headers = [h.format(fu=fu, bu=bu) for h in _COLS]
    for s in rep.steps:
        out += ["", f"{s.title}", "  " + step_summary_line(s),
                _table(headers, [_row_cells(r, fs, bs) for r in sorted(s.rows, key=lambda r: -(r.time_s or 0))]),
                "  -> " + s.first_target]
        out += [f"  - {a}" for a in s.advice]
        out += [f"  - {r.op}: {r.advice}" for r in sorted(s.rows, key=lambda r: -(r.time_s or 0))
                if r.advice and r.share >= 0.05]
        out += [f"  note: {n}" for n in s.notes]
    if rep.predictions:
        out += ["", "prediction: each op at its measured roof, no gaps (+ launches: one measured launch floor "
                "per kernel)"
                + (f"; KV budget {rep.kv_budget_bytes / 1e9:.3g} GB" if rep.kv_budget_bytes else ""),
                _table(_pred_cols(rep.predictions), [_prediction_cells(p) for p in rep.predictions])]
    out += [f"note: {n}" for n in rep.notes]
    return "\n".join(out)


# -- files -------------------------------------------------------------------------------------------
def to_json(rep: Report) -> dict:
    steps = []
    for s in rep.steps:
        summary = {k: v for k, v in asdict(s).items() if k not in ("rows", "advice", "first_target", "notes")}
        summary["floor_fraction"] = s.predicted_s / s.step_time_s     # roofline floor / measured step
        summary["prediction_fraction"] = s.predicted_launches_s / s.step_time_s   # floor + launches / measured
        rows = [dict(asdict(r), lost_s=r.lost_s) for r in s.rows]
        steps.append(dict(name=s.name, title=s.title, summary=summary, ops=rows, advice=s.advice,
                          first_target=s.first_target, notes=s.notes))
    c = rep.ceilings
    return dict(
        version=REPORT_VERSION, created=rep.created, command=rep.command,
        model=dict(path=rep.model, name=rep.model_name, **rep.model_info),
        device=dict(name=rep.device, type=rep.device_type), dtype=rep.dtype, attention_backend=rep.backend,
        compute_roof=rep.compute_roof,
        ceilings=dict(bandwidth_bytes_per_s=c.bandwidth, matmul_flops_per_s=c.matmul,
                      launch_overhead_s=c.launch_overhead, graph_launch_s=c.graph_launch,
                      measured_at=c.measured_at, key=c.key, torch_version=c.torch_version, details=c.details,
                      datasheet_not_used=c.datasheet, links=c.links),
        thresholds=dict(launch_bound_factor=LAUNCH_BOUND_FACTOR, bound_fraction=BOUND_FRACTION),
        steps=steps,
        predictions=[asdict(p) for p in rep.predictions] if rep.predictions is not None else None,
        kv_budget_bytes=rep.kv_budget_bytes, notes=rep.notes)


def _md_table(headers: list[str], rows: list[list[str]]) -> str:
    esc = lambda t: t.replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows])


def to_markdown(rep: Report, image: str | None = "roofline.png") -> str:
    c = rep.ceilings
    fu, fs, bu, bs = _units(c)
    path = os.path.relpath(rep.model) if not os.path.relpath(rep.model).startswith("..") else rep.model
    out = [f"# ridge roofline: {rep.model_name}", "",
           f"Model `{path}` ({rep.model_info.get('architecture')}, "
           f"{rep.model_info.get('parameters', 0) / 1e6:.1f}M parameters), {rep.dtype}, {rep.backend} attention. "
           f"Device: {rep.device} ({rep.device_type}). Report written {rep.created}"
           + (f" by `{rep.command}`." if rep.command else "."), "",
           f"**Measured ceilings** ({c.measured_at}): {ceilings_line(c)}."]
    out += [x for ds in [datasheet_line(c)] if ds for x in ("", ds + ".")]
    if image:
        out += ["", f"![roofline]({image})"]
    out += ["", f"Labels: launch-bound when an op's time per kernel is under {LAUNCH_BOUND_FACTOR:g}x the launch "
            f"overhead; memory- or compute-bound when it reaches {BOUND_FRACTION:.0%} of the roofline at its "
            f"intensity (the binding roof names it); implementation-bound below that."]
    headers = [h.format(fu=fu, bu=bu) for h in _COLS]
    for s in rep.steps:
        out += ["", f"## {s.title}", "", step_summary_line(s) + ".", "",
                _md_table(headers, [_row_cells(r, fs, bs) for r in sorted(s.rows, key=lambda r: -(r.time_s or 0))]),
                "", f"**{s.first_target}**", ""]
        out += [f"- {a}" for a in s.advice]
        out += [f"- `{r.op}`: {r.advice}" for r in sorted(s.rows, key=lambda r: -(r.time_s or 0)) if r.advice]
        out += [f"- note: {n}" for n in s.notes]
    if rep.predictions:
        out += ["", "## Prediction", "", "Each op at its measured roof, no gaps between them (the floor a fused, "
                "graph-captured engine approaches); \"decode + launches\" adds one measured launch floor "
                "per kernel (a dependent trivial kernel in a replayed CUDA graph)"
                + (f"; KV budget {rep.kv_budget_bytes / 1e9:.3g} GB." if rep.kv_budget_bytes else "."), "",
                _md_table(_pred_cols(rep.predictions), [_prediction_cells(p) for p in rep.predictions])]
    out += [f"- note: {n}" for n in rep.notes]
    return "\n".join(out) + "\n"


# -- the plot ----------------------------------------------------------------------------------------
_STEP_MARKERS = ("o", "^", "s", "D", "v", "P", "X", "<", ">")


def plot_roofline(rep: Report, paths: list[str]) -> None:
    """Log-log roofline: measured ceilings (labelled with their values), each op of each step a
    point at (intensity, achieved FLOP/s), its area proportional to its share of the step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    c = rep.ceilings
    fu, fs, bu, bs = _units(c)
    points = [(s, r) for s in rep.steps for r in s.rows if r.time_s and r.flops and r.intensity]
    order = [r.op for s in rep.steps for r in s.rows]
    ops = sorted({r.op for _, r in points}, key=order.index)
    cmap = plt.get_cmap("tab20")
    colors = {op: cmap(i % 20) for i, op in enumerate(ops)}

    peaks = sorted(c.matmul.items(), key=lambda kv: -kv[1])
    top = peaks[0][1]
    xs = [r.intensity for _, r in points] + [p / c.bandwidth for _, p in peaks]
    ys = [r.achieved_flops for _, r in points]
    xmin = 10 ** math.floor(math.log10(min(xs + [1.0]) / 2))
    xmax = 10 ** math.ceil(math.log10(max(xs) * 4))
    ymin = 10 ** math.floor(math.log10(min(ys + [top / 1e4]) / 2))
    ymax = top * 4
    axes_px = 0.66 * 9.5 * 100
    longest = max(len(f"{n} matmul {p / fs:.4g} {fu} (this run)") for n, p in peaks) * 5.6 + 20
    # widen the x range until the roofs' labels fit right of the highest ridge point, where the
    # memory roof (drawn up to the highest matrix roof) ends
    while math.log10(xmax / 1.15 / (top / c.bandwidth)) < longest / (axes_px / math.log10(xmax / xmin)):
        xmax *= 10

    # A fixed layout (no tight_layout after drawing), so that the memory roof's on-screen angle,
    # computed below for its label, is the one that gets drawn.
    fig = plt.figure(figsize=(9.5, 5.8), dpi=100)
    ax = fig.add_axes((0.08, 0.1, 0.66, 0.84))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(xmin, xmax)
    ax.set_ylim(ymin, ymax)

    # memory roof up to the highest matrix roof; each matrix roof flat from its ridge point
    ax.plot([xmin, top / c.bandwidth], [c.bandwidth * xmin, top], color="black", lw=1.8, zorder=2)
    drawn = []                     # near-equal roofs (bf16 and fp16 on a GPU) share one line
    for name, peak in peaks:
        near = next((d for d in drawn if abs(d[1] - peak) / d[1] < 0.08), None)
        if near:
            near[0].append(name)
            continue
        drawn.append(([name], peak))
    renderer = fig.canvas.get_renderer()
    blocked = []                   # display boxes the point names must keep off
    for names, peak in drawn:
        ours = rep.compute_roof in names
        ax.plot([peak / c.bandwidth, xmax], [peak, peak], color="black", lw=1.8 if ours else 0.9,
                ls="-" if ours else "--", zorder=2)
        t = ax.text(xmax / 1.15, peak * 1.12, f"{'/'.join(names)} matmul {peak / fs:.4g} {fu}"
                    + (" (this run)" if ours else ""),
                    ha="right", va="bottom", fontsize=8, fontweight="bold" if ours else "normal")
        blocked.append(tuple(t.get_window_extent(renderer).extents))
        (x0, y0), (x1, _) = ax.transData.transform([(peak / c.bandwidth, peak), (xmax, peak)])
        blocked.append((x0, y0 - 2, x1, y0 + 2))              # the roof line itself
    # The memory roof's label runs along it, just above it (nothing can sit above a roof), where
    # it covers the fewest points: each candidate start is tried and its band checked.
    text = f"memory {c.bandwidth / bs:.3g} {bu}\n(measured copy)"
    x_first = max(xmin * 1.6, ymin * 1.6 / c.bandwidth)
    q0, q1 = ax.transData.transform([(x_first, c.bandwidth * x_first), (x_first * 10, c.bandwidth * x_first * 10)])
    angle = math.degrees(math.atan2(q1[1] - q0[1], q1[0] - q0[0]))
    cos_a, sin_a = math.cos(math.radians(angle)), math.sin(math.radians(angle))
    up = (-5 * sin_a, 5 * cos_a)
    probe = ax.text(0, 0, text, fontsize=8, transform=None)
    length = probe.get_window_extent(renderer).width
    probe.remove()
    dots = [(*ax.transData.transform((r.intensity, r.achieved_flops)), math.sqrt((25 + 900 * r.share) / math.pi)
             * fig.dpi / 72) for _, r in points]

    def band(x: float):
        px, py = ax.transData.transform((x, c.bandwidth * x))
        ox, oy = px + up[0] * fig.dpi / 72, py + up[1] * fig.dpi / 72
        return [(ox + t * cos_a - h * sin_a - 7, oy + t * sin_a + h * cos_a - 7,
                 ox + t * cos_a - h * sin_a + 7, oy + t * sin_a + h * cos_a + 7)
                for t in range(0, int(length), 7) for h in (6, 18)]          # two lines of text

    def covered(boxes) -> float:
        return sum(rad for (dx, dy, rad) in dots
                   if any(b[0] - rad < dx < b[2] + rad and b[1] - rad < dy < b[3] + rad for b in boxes))
    ridge_px = ax.transData.transform((top / c.bandwidth, top))[0]
    candidates = [x_first * 10 ** (k / 4) for k in range(0, 40)]
    candidates = [x for x in candidates if ax.transData.transform((x, c.bandwidth * x))[0] + length * cos_a
                  <= ridge_px] or [x_first]
    x_lab = min(candidates, key=lambda x: (covered(band(x)), x))
    ax.annotate(text, (x_lab, c.bandwidth * x_lab), xytext=up, textcoords="offset points", rotation=angle,
                rotation_mode="anchor", ha="left", va="bottom", fontsize=8)
    blocked += band(x_lab)            # keep the point names off it
    (ax0, ay0), (ax1, ay1) = ax.transData.transform([(xmin, c.bandwidth * xmin), (top / c.bandwidth, top)])
    steps_n = int(math.hypot(ax1 - ax0, ay1 - ay0) // 4)
    blocked += [(ax0 + (ax1 - ax0) * i / steps_n - 2, ay0 + (ay1 - ay0) * i / steps_n - 2,
                 ax0 + (ax1 - ax0) * i / steps_n + 2, ay0 + (ay1 - ay0) * i / steps_n + 2) for i in range(steps_n + 1)]

    step_markers = {id(s): _STEP_MARKERS[i % len(_STEP_MARKERS)] for i, s in enumerate(rep.steps)}
    for s, r in points:
        ax.scatter(r.intensity, r.achieved_flops, s=25 + 900 * r.share, marker=step_markers[id(s)],
                   color=colors[r.op], edgecolors="black", linewidths=0.5, alpha=0.85, zorder=3)
    _label_points(ax, [(r.op, r.intensity, r.achieved_flops, r.share) for _, r in points], blocked)

    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("achieved throughput (FLOP/s)")
    ax.grid(True, which="major", lw=0.4, color="0.85")
    ax.set_title(f"ridge roofline: {rep.model_name}, {rep.dtype}, {rep.device}", fontsize=10)
    op_handles = [Line2D([], [], marker="o", ls="", color=colors[o], markeredgecolor="black",
                         markeredgewidth=0.5, label=o) for o in ops]
    step_handles = [Line2D([], [], marker=step_markers[id(s)], ls="", color="0.6", markeredgecolor="black",
                           markeredgewidth=0.5, label=f"{s.title}\n{_fmt_s(s.step_time_s)}, {s.label}")
                    for s in rep.steps]
    leg1 = ax.legend(handles=op_handles, title="op", fontsize=7, title_fontsize=8, loc="upper left",
                     bbox_to_anchor=(1.02, 1.0), frameon=False)
    ax.add_artist(leg1)
    ax.legend(handles=step_handles, title="step (point area: share of its time)", fontsize=7,
              title_fontsize=8, loc="lower left", bbox_to_anchor=(1.02, 0.0), frameon=False, labelspacing=0.9)
    skipped = sorted({r.op for s in rep.steps for r in s.rows if r.time_s and not r.flops})
    foot = f"ceilings measured on this machine {c.measured_at} (no datasheet values)" + (
        f"; not drawn (no FLOPs, bandwidth in the table): {', '.join(skipped)}" if skipped else "")
    fig.text(0.01, 0.01, foot, fontsize=7, color="0.35")
    with matplotlib.rc_context({"svg.fonttype": "none"}):     # SVG text stays text: searchable, small
        for path in paths:
            fig.savefig(path)
    plt.close(fig)


# share of the step a point must carry to be named next to it (the color legend names every op)
_LABEL_SHARE = 0.05


def _label_points(ax, points, blocked=()) -> None:
    """Name the heavier points, largest first, at the first offset where the name overlaps no
    name already placed and no `blocked` box (display pixels); an op already named close by is
    not named again."""
    placed: list[tuple[float, float, float, float]] = list(blocked)
    named: list[tuple[str, float, float]] = []
    char_w, height = 4.3, 9.0                           # display pixels of a 7-point character / line
    for op, x, y, share in sorted(points, key=lambda p: -p[3]):
        if share < _LABEL_SHARE:
            continue
        px, py = ax.transData.transform((x, y))
        if any(o == op and abs(px - qx) < 60 and abs(py - qy) < 30 for o, qx, qy in named):
            continue
        w = char_w * len(op)
        r = 4 + 12 * math.sqrt(share)                   # about the marker's radius
        for dx, dy, ha in ((r, -4, "left"), (r, 6, "left"), (r, -14, "left"), (-r, -4, "right"),
                           (-r, 6, "right"), (r, 16, "left"), (-r, -14, "right")):
            x0 = px + dx if ha == "left" else px + dx - w
            box = (x0, py + dy, x0 + w, py + dy + height)
            if not any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3] for b in placed):
                placed.append(box)
                named.append((op, px, py))
                ax.annotate(op, (x, y), xytext=(dx * 72 / ax.figure.dpi, dy * 72 / ax.figure.dpi),
                            textcoords="offset points", ha=ha, va="bottom", fontsize=7, color="0.15", zorder=4)
                break


def write_report(rep: Report, out_dir: str) -> dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = {name: os.path.join(out_dir, name) for name in ("report.md", "report.json", "roofline.png", "roofline.svg")}
    with open(paths["report.json"], "w") as f, open(paths["report.md"], "w") as md:
        json.dump(_finite(to_json(rep)), f, indent=2, default=str)
        md.write(to_markdown(rep))
    plot_roofline(rep, [paths["roofline.png"], paths["roofline.svg"]])
    return paths


def _finite(o):
    """JSON has no inf/nan: those become null."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o
