"""Quantization methods as plug-ins: base.py (the interface the layers call), registry.py (the one
place a setting or a checkpoint's quantization_config becomes a method), and one folder per method
(int4/, fp8/: config, formats, linear, experts, dispatch). Only this package imports the folders."""
