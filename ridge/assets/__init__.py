"""Checkpoints bundled with ridge, named by their directory names ("demo-code-12m", "demo-code-3m"):
a name works from any directory and from an installed package, because it is looked up here, beside
the files, rather than against the working directory."""
from __future__ import annotations

import os

ASSETS = os.path.dirname(os.path.abspath(__file__))
DEMO_MODEL = "demo-code-12m"


def bundled_models() -> list[str]:
    """The names of the bundled checkpoints (each a directory here holding a config.json)."""
    return sorted(n for n in os.listdir(ASSETS) if os.path.isfile(os.path.join(ASSETS, n, "config.json")))


def bundled_model_path(name: str) -> str | None:
    """The directory of the bundled checkpoint called `name`, or None if no bundled model has it."""
    return os.path.join(ASSETS, name) if name in bundled_models() else None


def demo_model_path() -> str:
    path = bundled_model_path(DEMO_MODEL)
    if path is None:
        raise ValueError(f"model: the bundled demo model is missing at {os.path.join(ASSETS, DEMO_MODEL)!r}; "
                         f"pass --model PATH")
    return path
