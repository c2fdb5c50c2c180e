"""`ridge quantize`'s parser and command. The engine flags (--model, --device, --dtype, ...) come
from EngineConfig like every other command's; they configure the engine that loads the model and
runs the calibration text. The quantizer's own flags are few and list-valued (--calib-files), so
they are plain argparse, as eval-ppl's are."""
from __future__ import annotations

import argparse

from ridge import settings
from ridge.config import EngineConfig
from ridge.quantize import DEFAULT_CALIB_SEQ_LEN, DEFAULT_CALIB_TOKENS, DEFAULT_GROUP_SIZE, METHODS


def add_quantize_parser(sub) -> argparse.ArgumentParser:
    q = sub.add_parser("quantize", help="write an INT4 (W4A16) checkpoint: round-to-nearest or AWQ")
    q.add_argument("--out", required=True, metavar="DIR", help="directory for the quantized checkpoint (new or empty)")
    q.add_argument("--method", choices=METHODS, default="awq",
                   help="awq: activation-aware scales and clipping searched on calibration text; "
                        "rtn: round to nearest (both INT4, compressed-tensors); fp8: e4m3 weights with 128 x 128 "
                        "block scales in the HF fp8 format (default: awq)")
    q.add_argument("--group-size", type=int, default=DEFAULT_GROUP_SIZE, metavar="N",
                   help=f"input channels sharing one scale and zero point (default: {DEFAULT_GROUP_SIZE})")
    q.add_argument("--calib-files", nargs="+", default=None, metavar="FILE",
                   help="text files to calibrate AWQ on (default: the demo corpus's training files; "
                        "held-out files are refused)")
    q.add_argument("--calib-tokens", type=int, default=DEFAULT_CALIB_TOKENS, metavar="N",
                   help=f"calibration tokens (default: {DEFAULT_CALIB_TOKENS})")
    q.add_argument("--calib-seq-len", type=int, default=DEFAULT_CALIB_SEQ_LEN, metavar="N",
                   help=f"tokens per calibration window (default: {DEFAULT_CALIB_SEQ_LEN})")
    settings.add_arguments(q, EngineConfig, title="engine (loads the model, runs the calibration)",
                           defaults={"dtype": ("float32", "float32: the search and folding in full precision")})
    q.set_defaults(func=cmd_quantize)
    return q


def cmd_quantize(a: argparse.Namespace) -> int:
    from ridge.quantize import quantize

    engine = settings.values(EngineConfig, a)
    model = engine.pop("model")
    r = quantize(model, a.out, method=a.method, group_size=a.group_size, calib_files=a.calib_files,
                 calib_tokens=a.calib_tokens, calib_seq_len=a.calib_seq_len, **engine)
    if r["method"] == "fp8":
        print(f"wrote {r['out']} ({r['format']})")
        return 0
    reports = list(r["linears"].values())
    line = f"wrote {r['out']} ({r['method']}, group {r['group_size']}, {r['format']})"
    if reports:
        mean = lambda key: sum(x[key] for x in reports) / len(reports)    # noqa: E731
        line += (f"; calibrated on {r['calib_tokens']} tokens of {r['calib_files']} files; mean relative output "
                 f"error of the {len(reports)} Linears: RTN {mean('rtn_rel_error'):.3e}, "
                 f"AWQ {mean('awq_rel_error'):.3e}")
    print(line)
    return 0
