"""Data for ridge's bundled demo model: the Python standard library source.

Corpus
    Every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` of the running
    interpreter, except those under a directory named in ``EXCLUDED_DIRS``
    (third-party packages, test suites, IDLE, lib2to3, the codec tables in
    ``encodings``, the generated docs in ``pydoc_data``, ...) and the generated
    ``_sysconfigdata*`` modules. Files that are not valid UTF-8 or are blank are
    skipped. Paths are relative POSIX paths (e.g. ``"json/decoder.py"``), sorted.

Options (train_demo_model.py flags)
    ``--include-tests`` (``include_tests=True``) also takes the stdlib's own test suite (``Lib/test``), which
    quadruples the corpus where the install has it; ``--stdlib DIR`` reads another
    standard-library tree (the bundled models were trained on CPython 3.11.7's Lib
    with its tests, carried to a GPU machine whose Python has no Lib/test).

Held-out split (fixed, independent of Python version and file ordering)
    A file is held out for evaluation iff the SHA-1 hex digest of its relative
    POSIX path (UTF-8) starts with ``"0"`` or ``"1"`` -- about 1/8 of the files.
    The same path is always on the same side, whichever Python version
    provides the stdlib (the set of files itself differs between versions).

Reuse from an evaluation script::

    import demo_data
    d = demo_data.stdlib_dir()
    texts = demo_data.read_files(d, demo_data.heldout_files(d))
"""

from __future__ import annotations

import hashlib
import os
import sysconfig

EXCLUDED_DIRS = frozenset({
    "site-packages", "dist-packages", "__pycache__",
    "test", "tests", "idle_test", "idlelib", "lib2to3",
    "encodings", "pydoc_data", "turtledemo", "ensurepip",
})
TEST_DIRS = frozenset({"test", "tests", "idle_test"})
HELDOUT_PREFIXES = ("0", "1")


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def is_heldout(relpath: str) -> bool:
    return hashlib.sha1(relpath.encode("utf-8")).hexdigest().startswith(HELDOUT_PREFIXES)


def all_files(stdlib: str | None = None, include_tests: bool = False) -> list[str]:
    """Sorted relative POSIX paths of the corpus files (before content checks)."""
    stdlib = stdlib or stdlib_dir()
    out = []
    for root, dirs, files in os.walk(stdlib):
        rel_root = os.path.relpath(root, stdlib)
        parts = [] if rel_root == "." else rel_root.split(os.sep)
        # Skip excluded directories and non-package dirs like config-3.11-x86_64-linux-gnu.
        excluded = EXCLUDED_DIRS - TEST_DIRS if include_tests else EXCLUDED_DIRS
        dirs[:] = [d for d in dirs if d not in excluded and not d.startswith("config-")]
        for f in files:
            if f.endswith(".py") and not f.startswith("_sysconfigdata"):
                out.append("/".join(parts + [f]))
    return sorted(out)


def heldout_files(stdlib: str | None = None, include_tests: bool = False) -> list[str]:
    return [p for p in all_files(stdlib, include_tests) if is_heldout(p)]


def train_files(stdlib: str | None = None, include_tests: bool = False) -> list[str]:
    return [p for p in all_files(stdlib, include_tests) if not is_heldout(p)]


def read_files(stdlib: str | None, relpaths: list[str]) -> tuple[list[str], list[str]]:
    """Read files as UTF-8; returns (kept relpaths, texts). Skips undecodable/blank files."""
    stdlib = stdlib or stdlib_dir()
    kept, texts = [], []
    for rel in relpaths:
        with open(os.path.join(stdlib, *rel.split("/")), "rb") as fh:
            raw = fh.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text.strip():
            kept.append(rel)
            texts.append(text)
    return kept, texts
