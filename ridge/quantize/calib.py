"""Calibration for AWQ: which text, and what each Linear sees when ridge's engine runs it.

Which text. By default the demo corpus's TRAINING files: the Python standard library files the
checkpoint's training would have read, i.e. the corpus walk of scripts/demo_data.py (the stdlib's
*.py files minus site-packages, idlelib, lib2to3, encodings, ...; its tests when the model's
training_info.json says `include_tests`) less every held-out file. A file is held out if
heldout_files.txt names it or if the split rule (sha1 of the relative path starting with 0 or 1)
puts it there, so a file this Python has and the training Python lacked is not taken either.
Calibrating on held-out text would let the quantizer fit the very tokens the quality contract
scores, so explicit --calib-files that are held out are refused, not silently used.

What each Linear sees. The calibration windows are run as prompts through ridge's own engine
(the model's real forward, in the engine's dtype); a pre-forward hook on every Linear of the
decoder layers accumulates, for the input x [T, K] the GEMM multiplies (after the Linear's own
input activation, e.g. SiLU-and-mul for down_proj), the per-channel mean |x| (AWQ's activation
salience) and the Gram matrix H = x^T x / T. Only these are kept, never the activations: the
layer's output error for any weight error E is then sum((E H) * E) (||E x^T||^2 per token,
exactly), so a search over candidate scales costs N K^2 per candidate whatever the number of
calibration tokens, and memory is K^2 per Linear instead of T K. K^2 is still large for a big
model (an 8B model's down_proj alone is 14336^2 float64 = 1.6 GB), so `LayerStats` collects a
few decoder layers per pass of the calibration text, as many as STATS_BUDGET holds: the demo
model's six layers in one pass, an 8B model's 32 in about sixteen.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import sysconfig
from dataclasses import dataclass

import torch

from ridge.eval_ppl import heldout_files, token_stream

# the demo corpus walk (scripts/demo_data.py): directories never read, and the test ones
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test",
                            "idlelib", "lib2to3", "encodings", "pydoc_data", "turtledemo", "ensurepip"})
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})
_HELDOUT_PREFIXES = ("0", "1")
STATS_BUDGET = 4 << 30        # bytes of statistics held at once (see the module docstring)


def _split_rule_holds_out(relpath: str) -> bool:
    return hashlib.sha1(relpath.encode("utf-8")).hexdigest().startswith(_HELDOUT_PREFIXES)


def _heldout_set(model_dir: str) -> tuple[set[str], str]:
    """(real paths of the held-out files this Python has, the stdlib directory)."""
    return {os.path.realpath(p) for p in heldout_files(model_dir)}, os.path.realpath(sysconfig.get_paths()["stdlib"])


def is_heldout(path: str, heldout: set[str], stdlib: str) -> bool:
    real = os.path.realpath(path)
    if real in heldout:
        return True
    rel = os.path.relpath(real, stdlib)
    return not rel.startswith("..") and _split_rule_holds_out(rel.replace(os.sep, "/"))


def training_files(model_dir: str) -> list[str]:
    """The demo corpus's training files on this Python (see the module docstring), sorted."""
    heldout, stdlib = _heldout_set(model_dir)
    info_path = os.path.join(model_dir, "training_info.json")
    include_tests = bool(json.load(open(info_path)).get("include_tests")) if os.path.isfile(info_path) else False
    excluded = _EXCLUDED_DIRS - _TEST_DIRS if include_tests else _EXCLUDED_DIRS
    out = []
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in excluded and not d.startswith("config-"))
        out += [os.path.join(root, f) for f in sorted(files)
                if f.endswith(".py") and not f.startswith("_sysconfigdata")]
    return [p for p in out if not is_heldout(p, heldout, stdlib) and _readable(p)]


def _readable(path: str) -> bool:
    """UTF-8 and not blank: the files the training read (demo_data.read_files skips the rest)."""
    try:
        with open(path, encoding="utf-8") as f:
            return bool(f.read().strip())
    except UnicodeDecodeError:
        return False


def calibration_files(model_dir: str, files: list[str] | None) -> list[str]:
    """The files to calibrate on: `files` checked (they exist, none is held out), or by default
    the training files; a model without heldout_files.txt needs explicit files."""
    if not files:
        if not os.path.isfile(os.path.join(model_dir, "heldout_files.txt")):
            raise ValueError(f"calib_files: {model_dir!r} has no heldout_files.txt, so its training files are "
                             f"unknown; pass --calib-files")
        files = training_files(model_dir)
        if not files:
            raise ValueError("calib_files: no training files of the demo corpus on this Python; pass --calib-files")
        return files
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise ValueError(f"calib_files: no such file: {', '.join(missing)}")
    if os.path.isfile(os.path.join(model_dir, "heldout_files.txt")):
        heldout, stdlib = _heldout_set(model_dir)
        bad = [f for f in files if is_heldout(f, heldout, stdlib)]
        if bad:
            raise ValueError(f"calib_files: held out for evaluation, never calibrated on: {', '.join(bad[:5])}"
                             + (f" and {len(bad) - 5} more" if len(bad) > 5 else ""))
    return list(files)


def calibration_windows(tokenizer, files: list[str], tokens: int, seq_len: int, seed: int = 0) -> list[list[int]]:
    """`tokens` tokens in windows of seq_len: files in a seeded random order (a spread of the corpus,
    not its first directory), each BOS + text + EOS, one stream cut into windows (as eval_ppl does)."""
    order = list(files)
    random.Random(seed).shuffle(order)
    stream = []
    for path in order:
        try:
            stream += token_stream(tokenizer, [path])
        except UnicodeDecodeError:
            raise ValueError(f"calib_files: {path!r} is not UTF-8 text") from None
        if len(stream) >= tokens:
            break
    stream = stream[:tokens]
    if len(stream) < min(tokens, seq_len):
        raise ValueError(f"calib_files: {len(stream)} tokens in all, fewer than one window of {seq_len}")
    return [stream[s:s + seq_len] for s in range(0, len(stream), seq_len) if len(stream) - s >= 2]


@dataclass
class InputStats:
    """What one Linear's input looked like over the calibration tokens."""
    abs_sum: torch.Tensor       # [K] float64: sum over tokens of |x|
    gram: torch.Tensor          # [K, K] float64: sum over tokens of x x^T
    tokens: int = 0

    @property
    def mean_abs(self) -> torch.Tensor:
        return (self.abs_sum / max(self.tokens, 1)).float()

    @property
    def hessian(self) -> torch.Tensor:
        """H = x^T x / T (float32): the output error of a weight error E is sum((E H) * E)."""
        return (self.gram / max(self.tokens, 1)).float()


def decoder_linears(model) -> dict[str, torch.nn.Module]:
    """ridge parameter prefix -> Linear, for the Linears of the decoder layers (the LM head and
    embeddings are never quantized)."""
    from ridge.layers.linear import Linear

    return {name: m for name, m in model.named_modules() if isinstance(m, Linear) and ".layers." in f".{name}"}


@torch.no_grad()
def collect_input_stats(llm, windows: list[list[int]], show_progress: bool = True,
                        names: list[str] | None = None) -> dict[str, InputStats]:
    """Run the windows through the engine; InputStats of the input of every decoder Linear (or
    of those named)."""
    from ridge import SamplingParams

    model = llm.engine.runner.model
    stats: dict[str, InputStats] = {}
    linears = decoder_linears(model)
    if names is not None:
        linears = {n: linears[n] for n in names}

    def hook_for(name):
        def hook(module, args):
            x = args[0]
            if module.input_act is not None:
                x = module.input_act(x)
            x = x.reshape(-1, x.shape[-1]).float()
            s = stats.get(name)
            if s is None:
                k = x.shape[-1]
                s = stats[name] = InputStats(torch.zeros(k, dtype=torch.float64, device=x.device),
                                             torch.zeros(k, k, dtype=torch.float64, device=x.device))
            s.abs_sum += x.abs().sum(0).double()
            s.gram += (x.T @ x).double()
            s.tokens += x.shape[0]
        return hook

    handles = [m.register_forward_pre_hook(hook_for(n)) for n, m in linears.items()]
    try:
        # prompt_logprobs keeps the windows off the prefix cache: every position runs the model
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=0)
        llm.generate(windows, params, use_tqdm=show_progress)
    finally:
        for h in handles:
            h.remove()
    expected = sum(map(len, windows))
    for name, st in stats.items():
        if st.tokens != expected:
            raise RuntimeError(f"calibration: {name} saw {st.tokens} tokens, not the {expected} of the windows")
    return stats


class LayerStats:
    """`stats(i)`: the InputStats of decoder layer i's Linears, by name. Layers are asked for in
    order; each pass of the calibration text collects the next run of layers that fits
    STATS_BUDGET and drops the previous run's."""

    def __init__(self, llm, windows: list[list[int]], show_progress: bool = True, budget: int = STATS_BUDGET):
        self.llm, self.windows, self.show_progress = llm, windows, show_progress
        linears = decoder_linears(llm.engine.runner.model)
        self.layers: dict[int, list[str]] = {}
        for name in linears:
            self.layers.setdefault(int(name.split(".layers.")[1].split(".")[0]), []).append(name)
        per_layer = max(sum(linears[n].weight.shape[1] ** 2 * 8 for n in names) for names in self.layers.values())
        self.per_pass = max(1, budget // per_layer)
        self.held: dict[str, InputStats] = {}
        self.passes = 0

    def __call__(self, i: int) -> dict[str, InputStats]:
        if not all(n in self.held for n in self.layers[i]):
            self.held = {}                 # let the previous run's statistics go before collecting more
            run = [n for j in range(i, i + self.per_pass) for n in self.layers.get(j, [])]
            self.held = collect_input_stats(self.llm, self.windows, self.show_progress, run)
            self.passes += 1
        return {n: self.held[n] for n in self.layers[i]}
