"""Per-device measurements cached on disk (RIDGE_CACHE_DIR, default ~/.cache/ridge): the roofline's
ceilings and the FP8 GEMM dispatch table are measured once per GPU (and torch version) and read
back on every later start."""
from __future__ import annotations

import json
import os
import platform
import re
from typing import Callable

import torch


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def device_key(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        raw = f"cuda-{device_name(device)}-sm{major}{minor}-torch{torch.__version__}"
    else:
        raw = f"cpu-{device_name(device)}-{torch.get_num_threads()}t-torch{torch.__version__}"
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", raw)


def cache_root() -> str:
    return os.environ.get("RIDGE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ridge")


def read_json(path: str, version: int) -> dict | None:
    """The cached payload at path if it is readable and of this version, else None."""
    try:
        with open(path) as f:
            raw = json.load(f)
        return raw["payload"] if raw.get("version") == version else None
    except (OSError, ValueError, KeyError, TypeError):
        return None                                # unreadable cache: measure again


def write_json(path: str, version: int, payload: dict) -> None:
    """Atomically (write then rename), so a concurrent reader never sees half a file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(dict(version=version, payload=payload), f, indent=2)
    os.replace(tmp, path)


def cached(path: str, version: int, measure: Callable[[], dict], remeasure: bool = False) -> dict:
    """The payload cached at path, or measure()'s, then cached."""
    payload = None if remeasure else read_json(path, version)
    if payload is None:
        payload = measure()
        write_json(path, version, payload)
    return payload
