"""`ridge roofline`: measured ceilings, a per-op cost model, per-kernel timing of real engine
steps, a diagnosis (memory-, compute-, launch- or implementation-bound) with advice, MFU/MBU,
predictions, and a report with a roofline plot.

    from ridge.roofline import run_roofline
    rep = run_roofline(device="cpu", batches=[1, 8], context=512, prefill_len=512, out="roofline-out")

Costs are the model's own (`model.cost(step)`, ridge/layers/cost.py), summed by `step_costs`;
`utilization(costs, seconds, ceilings)` is the one place MBU and MFU are computed.

Names are imported on first use, so that `ridge --help` does not pay for torch.
"""
import importlib

_EXPORTS = {
    "run_roofline": "api", "build_llm": "api",
    "Ceilings": "ceilings", "load_ceilings": "ceilings", "measure_ceilings": "ceilings",   # ridge/utils/ceilings.py
    "OpCost": "costs", "StepShape": "costs", "PRECISIONS": "costs", "Format": "costs", "format_of": "costs",
    "matrix_compute": "costs", "op_costs": "costs", "parameter_bytes": "costs", "step_costs": "costs", "step_shape": "costs", "utilization": "costs",
    "OpRow": "diagnose", "StepReport": "diagnose", "classify": "diagnose", "diagnose_step": "diagnose",
    "StepTiming": "timeline", "Timeline": "timeline", "time_step": "timeline",
    "PredictionRow": "predict", "predict": "predict", "predicted_step_s": "predict",
    "Report": "report", "format_terminal": "report", "write_report": "report",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        module = _EXPORTS[name]
        package = "ridge.utils" if module == "ceilings" else "ridge.roofline"
        return getattr(importlib.import_module(f"{package}.{module}"), name)
    raise AttributeError(f"module 'ridge.roofline' has no attribute {name!r}")
