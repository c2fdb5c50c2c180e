"""Checkpoints bundled with ridge."""
from __future__ import annotations

import os

ASSETS = os.path.dirname(os.path.abspath(__file__))
DEMO_MODEL = "demo-code-12m"


def demo_model_path() -> str:
    path = os.path.join(ASSETS, DEMO_MODEL)
    if not os.path.isdir(path):
        raise ValueError(f"model: the bundled demo model is missing at {path!r}; pass --model PATH")
    return path
