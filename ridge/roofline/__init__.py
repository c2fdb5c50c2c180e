"""`ridge roofline`: measured ceilings, a per-op cost model, per-kernel timing of real engine
steps, a diagnosis (memory-, compute-, launch- or implementation-bound) with advice, MFU/MBU,
predictions, and a report with a roofline plot.

    from ridge.roofline import run_roofline
    rep = run_roofline(device="cpu", batches=[1, 8], context=512, prefill_len=512, out="roofline-out")

For benchmarks: `load_ceilings(device)` and `step_utilization(model_cfg, ceilings, shape, seconds)`
with `shape = StepShape.from_scheduler_output(sched, Precision.from_dtype(dtype))`.

Names are imported on first use, so that `ridge --help` does not pay for torch.
"""
import importlib

_EXPORTS = {
    "run_roofline": "api", "build_llm": "api",
    "Ceilings": "ceilings", "load_ceilings": "ceilings", "measure_ceilings": "ceilings",
    "PRECISIONS": "cost_model", "OpCost": "cost_model", "Precision": "cost_model", "StepShape": "cost_model",
    "step_costs": "cost_model",
    "OpRow": "diagnose", "StepReport": "diagnose", "classify": "diagnose", "diagnose_step": "diagnose",
    "StepTiming": "measure", "Timeline": "measure", "time_step": "measure",
    "PredictionRow": "predict", "predict": "predict", "predicted_step_s": "predict", "step_utilization": "predict",
    "Report": "report", "format_terminal": "report", "write_report": "report",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"ridge.roofline.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'ridge.roofline' has no attribute {name!r}")
