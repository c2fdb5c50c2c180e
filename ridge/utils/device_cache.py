"""Per-device measurements cached on disk (RIDGE_CACHE_DIR, default ~/.cache/ridge): the roofline's
ceilings and the kernels' dispatch tables are measured once per GPU (and torch version) and read
back on every later start.

Several processes may share the directory (a server's workers, two servers on one host): a file
is written whole to a temporary name and renamed over the old one, so a reader sees the old file
or the new one, never half of one; a file that is unreadable or of another version is measured
again, with a warning naming it (a crash while writing, a ridge of another release)."""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
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


log = logging.getLogger("ridge")


def read_json(path: str, version: int) -> dict | None:
    """The cached payload at path if it is readable and of this version, else None (nothing cached
    yet, or a file to measure again: a warning says which and why)."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("cache file %s is unreadable (%s): measuring again", path, e)
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("payload"), dict):
        log.warning("cache file %s is not a ridge cache (no payload): measuring again", path)
        return None
    if raw.get("version") != version:
        log.warning("cache file %s is of version %r, this ridge writes %r: measuring again",
                    path, raw.get("version"), version)
        return None
    return raw["payload"]


def write_json(path: str, version: int, payload: dict) -> None:
    """Atomically (write then rename), so a concurrent reader never sees half a file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(dict(version=version, payload=payload), f, indent=2)
    os.replace(tmp, path)


@contextlib.contextmanager
def locked(path: str):
    """Hold an advisory lock on path's directory for a read-merge-write, so two processes adding
    entries to one table keep both's (the directory, not a lock file beside the table: the cache
    holds only what it caches)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)                               # closing the descriptor releases the lock


def cached(path: str, version: int, measure: Callable[[], dict], remeasure: bool = False) -> dict:
    """The payload cached at path, or measure()'s, then cached."""
    payload = None if remeasure else read_json(path, version)
    if payload is None:
        payload = measure()
        write_json(path, version, payload)
    return payload
