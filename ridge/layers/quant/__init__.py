"""Quantized layers: INT4 weight-only (int4.py) and the checkpoint formats it reads and writes (formats.py)."""
