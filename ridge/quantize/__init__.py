"""`ridge quantize`: INT4 weight-only checkpoints (W4A16, group-wise scales and zero points) by
round-to-nearest or AWQ, written in compressed-tensors `pack-quantized` format (checkpoint.py);
and FP8 (e4m3, 128 x 128 block scales) in the HF fp8 format.

It sits on top of the engine (like eval_ppl and the CLI): AWQ calibrates by running text through
ridge's own engine and reading what each Linear sees (calib.py); the search and folding are
awq.py, the per-layer walk plan.py; the round-to-nearest grid and the packing are those of
ridge/layers/quant/int4/formats.py, the code that reads the checkpoint back (and quantizes at load).
"""
from __future__ import annotations

import json
import os

METHODS = ("awq", "rtn", "fp8")
DEFAULT_GROUP_SIZE = 128
DEFAULT_CALIB_TOKENS = 32768
DEFAULT_CALIB_SEQ_LEN = 512


def quantize(model: str | None, out: str, method: str = "awq", group_size: int = DEFAULT_GROUP_SIZE,
             calib_files: list[str] | None = None, calib_tokens: int = DEFAULT_CALIB_TOKENS,
             calib_seq_len: int = DEFAULT_CALIB_SEQ_LEN, show_progress: bool = True, **engine_settings) -> dict:
    """Quantize the checkpoint `model` into `out`; returns a summary (also written to
    out/quantize_report.json). `engine_settings` are EngineConfig fields for the engine that loads
    the model and, for AWQ, runs the calibration text (float32 is the default dtype: the search
    and the folding want full precision, whatever the checkpoint's)."""
    from ridge.config import EngineConfig
    from ridge.kernels.int4_matmul import PACK, group_size_error
    from ridge.quantize.checkpoint import check_out_dir, staged

    if method not in METHODS:
        raise ValueError(f"method: must be one of {', '.join(METHODS)}; got {method!r}")
    for name, value, least in (("group_size", group_size, 1), ("calib_tokens", calib_tokens, 2),
                               ("calib_seq_len", calib_seq_len, 2)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name}: must be an integer >= {least}, got {value!r}")
    engine_settings.setdefault("dtype", "float32")
    cfg, model_cfg = EngineConfig.from_kwargs(model=model, **engine_settings).resolve()
    src = cfg.model
    if cfg.load_format == "dummy":
        raise ValueError("load_format: ridge quantize reads the checkpoint's weights; 'dummy' would quantize noise")
    if model_cfg.quantization_config is not None or cfg.quantization is not None:
        raise ValueError(f"model: {src!r} would load quantized (quantization_config or --quantization); "
                         f"ridge quantize starts from a float checkpoint")
    if cfg.tensor_parallel_size > 1:
        raise ValueError("tensor_parallel_size: ridge quantize calibrates the whole model in one process; "
                         f"run it with 1 (got {cfg.tensor_parallel_size})")
    if model_cfg.moe is not None:
        raise ValueError(f"model: {model_cfg.architecture} is a mixture-of-experts model; ridge quantize writes dense "
                         f"Llama-family checkpoints only (a mixture-of-experts model quantizes at load: quantization "
                         f"'fp8' or 'int4')")
    check_out_dir(src, out)
    if method != "fp8":
        for k, name in ((model_cfg.hidden_size, "qkv_proj and gate_up_proj"), (model_cfg.q_size, "o_proj"),
                        (model_cfg.intermediate_size, "down_proj")):
            if k % PACK:    # an int32 packs 8 codes along K; a group size not dividing K leaves a short last group
                raise ValueError(f"model: {k}, the input features of {name}, is not a multiple of {PACK} (INT4 packs "
                                 f"{PACK} an int32)")
            if group_size_error(group_size, k):     # what the INT4 kernels that load the checkpoint run
                raise ValueError(f"group_size: {group_size} {group_size_error(group_size, k)}, the input features of "
                                 f"{name}")
    with staged(out) as tmp:
        if method == "fp8":
            summary = _write_fp8(src, tmp, engine_settings, show_progress)
        else:
            summary = _write_int4(src, tmp, model_cfg, method, group_size, calib_files, calib_tokens, calib_seq_len,
                                  engine_settings, show_progress)
        summary["out"] = out
        with open(os.path.join(tmp, "quantize_report.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return summary


def _write_int4(src: str, out: str, model_cfg, method: str, group_size: int, calib_files, calib_tokens: int,
                calib_seq_len: int, engine_settings: dict, show_progress: bool) -> dict:
    """INT4 (round-to-nearest or AWQ) into out; the summary of what was done."""
    from ridge import LLM
    from ridge.quantize.calib import LayerStats, calibration_files, calibration_windows
    from ridge.quantize.checkpoint import FORMAT, quantization_config, quantized_tensors, write_checkpoint
    from ridge.quantize.plan import plan_model

    files = calibration_files(src, calib_files) if method == "awq" else []
    llm = LLM(src, show_progress=show_progress,
              **{**engine_settings, "enable_prefix_caching": False,
                 "max_model_len": max(engine_settings.get("max_model_len") or 0, calib_seq_len + 1)})
    net = llm.engine.runner.model
    stats, windows = None, []
    if method == "awq":
        if llm.tokenizer is None:
            raise ValueError("model: AWQ calibrates on text and this checkpoint has no tokenizer")
        windows = calibration_windows(llm.tokenizer, files, calib_tokens, calib_seq_len)
        stats = LayerStats(llm, windows, show_progress)
    scale_dtype = model_cfg.checkpoint_dtype          # the scales are stored in the checkpoint's dtype
    plan = plan_model(net, method, group_size, stats, scale_dtype, show_progress)
    packed = quantized_tensors(net, plan, group_size, scale_dtype)
    write_checkpoint(net, src, out, plan, packed, quantization_config(group_size))
    summary = dict(model=src, out=out, method=method, group_size=group_size, format=FORMAT,
                   calib_files=len(files), calib_tokens=sum(map(len, windows)),
                   linears={n: lp.report for n, lp in plan.linears.items() if lp.report})
    return summary


def _write_fp8(src: str, out: str, engine_settings: dict, show_progress: bool) -> dict:
    """No calibration: each block's scale is its amax / 448, as the format's writers compute it."""
    from ridge import LLM
    from ridge.layers.quant.registry import checkpoint_format
    from ridge.quantize.checkpoint import fp8_tensors, write_checkpoint

    config = checkpoint_format("fp8").WRITTEN_SCHEME
    # the LLM closes (its model goes from its runner) when it goes: hold it while the model is read
    with LLM(src, show_progress=show_progress, **{**engine_settings, "enable_prefix_caching": False}) as llm:
        net = llm.engine.runner.model
        write_checkpoint(net, src, out, None, fp8_tensors(net, config), config.to_hf())
    return dict(model=src, out=out, method="fp8", format="HF fp8 (e4m3, 128 x 128 block scales)")
