"""The story of issue 21's case study: the figures table in docs/case-study-70b.md and the plot across
rounds (docs/case-study-70b/rounds.png), from each round's summary.json (benchmarks/case_study/case_study_70b.py
writes them; `python benchmarks/case_study/case_study_70b.py story` calls this). A round without a summary is
shown as not yet measured; no figure comes from anywhere else."""
from __future__ import annotations

import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root
from benchmarks.case_study.case_study_70b import ROUNDS, TARGETS, fmt  # noqa: E402

BEGIN, END = "<!-- figures:begin (benchmarks/case_study/case_study_70b.py story) -->", "<!-- figures:end -->"


def story_table(found: dict) -> str:
    lines = [BEGIN, "", "| figure | target | " + " | ".join(f"round {r}" for r in ROUNDS) + " |",
             "|" + "---|" * (len(ROUNDS) + 2)]
    for n, (target, op, unit, label) in TARGETS.items():
        cells = []
        for r in ROUNDS:
            f = {x["name"]: x for x in found[r]["figures"]}.get(n) if r in found else None
            if f is None or f["measured"] is None:
                cells.append("not yet measured" if r not in found else "-")
                continue
            verdict = "" if f["met"] is None else (" (met)" if f["met"] else " (**not met**)")
            pred = "" if f["predicted"] is None else f"; predicted {fmt(f['predicted'])}" + \
                ("" if f["prediction_flag"] == "within 15%" else " (**>15% off**)")
            cells.append(f"{fmt(f['measured'])}{verdict}{pred}")
        lines.append(f"| {label} ({unit}) | {'' if target is None else f'{op} {target:g}'} | " + " | ".join(cells) + " |")
    def where(s):      # the serve sweep may have run later, on another card
        serve = (s.get("serve") or {}).get("device")
        device = s.get("device") or "device unknown"
        return device + (f"; serve sweep on {serve}" if serve and serve != device else "")
    runs = ", ".join(f"{r} ({where(found[r])}, {found[r]['date']}{', smoke' if found[r]['smoke'] else ''})"
                     for r in found)
    return "\n".join(lines + ["", f"Rounds measured: {runs or 'none'}. ITL: decode time per output token. Goodput: "
                              "output tokens/s of the requests meeting TTFT <= 500 ms and TPOT <= 50 ms. Predicted: "
                              "the roofline's floor of the same step (each op at its roof + a launch floor a kernel).", "",
                              "![figures per round](case-study-70b/rounds.png)", "", END])


def write_story(rounds: str, doc: str | None = None) -> int:
    """The figures table of `doc` (default: case-study-70b.md beside `rounds`) and rounds.png, from
    every rounds/round-N/summary.json; the rest of the doc is left as it is (a skeleton if none)."""
    found = {}
    for path in sorted(glob.glob(os.path.join(rounds, "round-*", "summary.json"))):
        with open(path) as f:
            s = json.load(f)
        found[s["round"]] = s
    block = story_table(found)
    doc = doc or os.path.join(os.path.dirname(os.path.normpath(rounds)), "case-study-70b.md")
    text = open(doc).read() if os.path.exists(doc) else SKELETON
    text = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):] if BEGIN in text else \
        text.rstrip() + "\n\n" + block + "\n"
    os.makedirs(rounds, exist_ok=True)
    with open(doc, "w") as f:
        f.write(text)
    plot(found, os.path.join(rounds, "rounds.png"))
    print(f"wrote {doc} and {os.path.join(rounds, 'rounds.png')} ({len(found)} round(s) measured)")
    return 0


def plot(found: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for ax, names in zip(axes, (["ttft_b1_ms"], ["itl_b1_ms", "itl_b1_spec_ms"], ["goodput_tok_s"])):
        width = 0.8 / len(names)
        for j, n in enumerate(names):
            dx = (j - (len(names) - 1) / 2) * width
            got = [(r, f) for r in found for f in found[r]["figures"] if f["name"] == n and f["measured"] is not None]
            ax.bar([r + dx for r, _ in got], [f["measured"] for _, f in got], width * 0.9, color=f"C{j}",
                   label=TARGETS[n][3])
            for r, f in got:
                if f["predicted"] is not None:
                    ax.hlines(f["predicted"], r + dx - width / 2, r + dx + width / 2, colors="k")
            if TARGETS[n][0] is not None:
                ax.axhline(TARGETS[n][0], color="red", ls="--" if j == 0 else ":", lw=1)
        for r in ROUNDS:
            if r not in found:
                ax.text(r, 0.02, "not yet\nmeasured", ha="center", va="bottom", fontsize=7, color="gray",
                        transform=ax.get_xaxis_transform())
        ax.set_xticks(list(ROUNDS), [f"round {r}" for r in ROUNDS])
        ax.set_xlim(-0.6, len(ROUNDS) - 0.4)
        ax.set_ylim(bottom=0)
        ax.set_ylabel(TARGETS[names[0]][2])
        ax.legend(fontsize=7, loc="upper right")
    fig.suptitle("70B shape, one GPU: measured (bars), roofline prediction (black), target (red)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


SKELETON = f"""# The 70B case study on one GPU (issue 21)

A Llama-3-70B shape (80 layers, hidden 8192, 64 query / 8 KV heads, intermediate 28672, vocab 128256,
`--load-format dummy`) on one GPU, round by round: measure, let `ridge roofline` name the bottleneck,
pull the lever, re-measure. Round N's files (roofline report, `ridge bench latency` / `serve` JSON,
summary.json) are in `case-study-70b/round-N/`, from `python benchmarks/case_study/case_study_70b.py round --round N`
(`python3 benchmarks/run.py case-70b --round N`); the table below from `... story`.

## Figures

{BEGIN}
{END}
""" + "".join(f"\n## Round {r}: {about}\n\n(not yet written)\n" for r, (about, _) in ROUNDS.items())
