"""The one GPU runner: the parts named on the command line, in the order of PARTS below, each under
its own timeout inside an overall budget (a part that would not fit in what is left is skipped and
the table says so). Under --out: run.log (everything), logs/<part>.log, each part's JSON and other
outputs, summary.txt; a short table comes last.

    python3 benchmarks/run.py tests-kernels ab dummy tests-engine --out out --baseline .baseline/5dbd213
    python3 benchmarks/run.py int4 --out out -- --models llama3-8b      # after --: the part's own flags
    python3 benchmarks/run.py --list                                    # every part, what it runs and writes
    python3 benchmarks/run.py --export-baseline 5dbd213                 # .baseline/5dbd213 for `ab` (carry it)

Arguments after `--` go to the benchmark script of every chosen part that takes them (the table's
`extra` column). The GPU tests: `tests-kernels` is `pytest -m gpu tests/kernels` (the one list of
kernel tests, the folder CI reads too), `tests-gpu` the whole GPU suite in one process, and
`tests-engine` the rest of it. Every part runs with NCCL_NVLS_ENABLE=0 (NVLink multicast off).
The Llama-3-8B-shaped random checkpoint (transformers) is written in the background at the start
when a chosen part needs it, while the first part runs; every later part waits for it first.
Server packages carried as wheels in .whl/ (the serving parts need FastAPI and uvicorn) are
installed to /tmp/site first; fetch them with their dependencies:
    pip download -d .whl --only-binary=:all: --python-version 3.12 --implementation cp \\
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 fastapi uvicorn "pydantic>=2" prometheus-client
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
CKPT_8B = "/tmp/ridge-llama3-8b"             # random weights (transformers), for the HF peer and the engine tests
CFG_8B = "/tmp/ridge-llama3-8b-config"       # config only: --load-format dummy
DSV2 = "/tmp/dsv2lite"
QWEN_MOE = "/tmp/qwen3-30b-a3b"
DEMO = "ridge/assets/demo-code-12m"


@dataclass
class Run:
    """What one invocation knows: its options, where outputs go, the clock."""
    out: str
    extra: list[str]
    baseline: str | None
    round: int
    batches: list[int] | None
    tests: bool
    budget_s: float
    env: dict               # every command's environment (PYTHONPATH: this tree, then the carried wheels)
    site: str | None = None  # where the carried wheels were installed
    t0: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def o(self, name: str) -> str:
        return os.path.join(self.out, name)

    def pythonpath(self, tree: str) -> dict:
        """PYTHONPATH for a command that runs another tree's ridge (the A/B's baseline)."""
        return {"PYTHONPATH": os.pathsep.join([tree] + ([self.site] if self.site else []))}


@dataclass(frozen=True)
class Cmd:
    """One command of a part: argv, where it runs, more environment; check=False: the part goes on
    when it fails (the tests before a benchmark)."""
    argv: list[str]
    cwd: str | None = None
    env: dict | None = None
    check: bool = True


Step = Cmd | Callable[[Run], None]       # a callable runs in this process (collects or merges outputs)


@dataclass(frozen=True)
class Part:
    name: str
    help: str
    steps: Callable[[Run], list[Step]]
    timeout_s: int          # at most this long
    need_s: int             # skipped when less than this is left
    outputs: tuple[str, ...] = ()
    extra: bool = False     # takes the arguments after --
    ckpt: bool = False      # needs the 8B random checkpoint


def py(*args: str, **kw) -> Cmd:
    return Cmd([PY, *args], **kw)


def script(path: str, *args: str, **kw) -> Cmd:
    return py(f"benchmarks/{path}", *args, **kw)


def ridge(*args: str, **kw) -> Cmd:
    return py("-m", "ridge", *args, **kw)


def checkpoint(path: str, *args: str) -> Cmd:
    return py("-m", "ridge.utils.random_checkpoint", path, *args, "--config-only")


def cfg8b() -> Cmd:
    return checkpoint(CFG_8B, "--preset", "llama3-8b")


def dsv2(path: str = DSV2) -> Cmd:
    return checkpoint(path, "--arch", "deepseekv2", "--preset", "deepseek-v2-lite")


def test_file(name: str) -> str:
    """A GPU test file by its name, wherever it lives under tests/."""
    found = sorted(glob.glob(os.path.join("tests", "**", name), recursive=True))
    if not found:
        raise SystemExit(f"run.py: no tests/**/{name}")
    return found[0]


def pytest(*args: str, check: bool = True, **kw) -> Cmd:
    return py("-m", "pytest", "-q", "-rA", "-m", "gpu", *args, check=check, **kw)


def gpu_tests(r: Run, *args: str) -> list[Step]:
    return [pytest(*args, check=False)] if r.tests else []


def copy_report(src_dir: str, name: str) -> Callable[[Run], None]:
    def copy(r: Run) -> None:
        shutil.copy(os.path.join(src_dir, "report.md"), r.o(f"{name}.md"))
        shutil.copy(os.path.join(src_dir, "report.json"), r.o(f"{name}.json"))
    return copy


def merge_json(names: dict[str, str], dest: str) -> Callable[[Run], None]:
    """{key: the JSON at path} into one file under --out."""
    def merge(r: Run) -> None:
        with open(r.o(dest), "w") as f:
            json.dump({k: json.load(open(p)) for k, p in names.items()}, f, indent=2)
    return merge


def cache_dir(r: Run) -> str:
    return r.env.get("RIDGE_CACHE_DIR") or os.path.expanduser("~/.cache/ridge")


def latency(model: str, out: str, *args: str) -> Cmd:
    return ridge("bench", "latency", "--model", model, "--load-format", "dummy", *args, "--no-progress", "--json", out)


def roofline(model: str, tmp: str, *args: str) -> list[Step]:
    return [ridge("roofline", "--model", model, "--load-format", "dummy", *args, "--out", tmp)]


def int4_e2e(r: Run) -> list[Step]:
    return [cfg8b()] + [latency(CFG_8B, r.o(f"lat_{q}_b{b}.json"), *(["--quantization", q] if q != "bf16" else []),
                                "--batch-size", str(b), "--input-len", "128", "--output-len", "256")
                        for b in r.batches or (1, 64) for q in ("bf16", "int4")]


def int4_quality(r: Run) -> list[Step]:
    steps: list[Step] = [ridge("quantize", "--model", DEMO, "--out", f"/tmp/demo-{m}", "--method", m)
                         for m in ("rtn", "awq")]
    steps.append(ridge("eval-ppl", "--model", DEMO, "--dtype", "bfloat16", "--json", "/tmp/ppl_bf16.json"))
    steps += [ridge("eval-ppl", "--model", f"/tmp/demo-{m}", "--dtype", "bfloat16", "--compare", DEMO,
                    "--json", f"/tmp/ppl_{m}.json") for m in ("rtn", "awq")]
    return steps + [merge_json({m: f"/tmp/ppl_{m}.json" for m in ("bf16", "rtn", "awq")}, "int4_quality.json")]


FP8_QUALITY = {"w": ["--quantization", "fp8"], "kv": ["--kv-cache-dtype", "fp8"],
               "kvh": ["--kv-cache-dtype", "fp8", "--kv-cache-hadamard"]}


def fp8_quality(r: Run) -> list[Step]:
    steps: list[Step] = [ridge("eval-ppl", "--model", DEMO, "--dtype", "bfloat16", "--json", "/tmp/fq_bf16.json")]
    steps += [ridge("eval-ppl", "--model", DEMO, "--dtype", "bfloat16", *flags, "--compare", DEMO,
                    "--json", f"/tmp/fq_{n}.json") for n, flags in FP8_QUALITY.items()]
    return steps + [merge_json({n: f"/tmp/fq_{n}.json" for n in ("bf16", *FP8_QUALITY)}, "fp8_quality.json")]


def fp8_dispatch_tables(r: Run) -> None:
    """The FP8 GEMM dispatch tables the engine wrote at load: every path's time per bucket."""
    paths = glob.glob(os.path.join(cache_dir(r), "fp8", "*.json"))
    tables = {os.path.basename(f): json.load(open(f)) for f in paths}
    with open(r.o("fp8_dispatch.json"), "w") as f:
        json.dump(tables, f)


def fp8_e2e(r: Run) -> list[Step]:
    steps: list[Step] = [cfg8b()]
    steps += [latency(CFG_8B, r.o(f"lat_{q}_ttft.json"), *(["--quantization", "fp8"] if q == "fp8" else []),
                      "--batch-size", "1", "--input-len", "4096", "--output-len", "4", "--max-num-batched-tokens", "4096")
              for q in ("bf16", "fp8")]
    steps += [latency(CFG_8B, r.o(f"lat_fp8_b{b}.json"), "--quantization", "fp8", "--batch-size", str(b),
                      "--input-len", "128", "--output-len", "128") for b in r.batches or (1, 64)]
    return steps + [fp8_dispatch_tables]


def fp8_throughput(r: Run) -> list[Step]:
    return [cfg8b()] + [ridge("bench", "throughput", "--model", CFG_8B, "--load-format", "dummy",
                              *(["--kv-cache-dtype", "fp8"] if kv == "fp8" else []), "--num-prompts", "256",
                              "--input-len", "1024", "--output-len", "256", "--ignore-eos", "--max-num-seqs", "256",
                              "--kv-cache-memory", str(16 << 30), "--no-progress", "--json", r.o(f"tput_kv_{kv}.json"))
                        for kv in ("bf16", "fp8")]


def baseline_script(base: str, folder: str, name: str) -> str:
    """A benchmark in the baseline tree: in its folder, or at the top of benchmarks/ (trees before
    the folders)."""
    inside = os.path.join(base, "benchmarks", folder, name)
    return inside if os.path.isfile(inside) else os.path.join(base, "benchmarks", name)


def need_baseline(r: Run) -> str:
    if not r.baseline or not os.path.isdir(os.path.join(r.baseline, "ridge")):
        raise SystemExit(f"run.py ab: --baseline {r.baseline} is no tree (write one with --export-baseline COMMIT "
                         "and carry .baseline)")
    return os.path.abspath(r.baseline)


def spec_with_baseline(part: str, *args: str) -> Callable[[Run], list[Step]]:
    """spec_decode.py PART in this tree and, with --baseline, the same in that tree."""
    def steps(r: Run) -> list[Step]:
        argv = [part, *args, *r.extra]
        out: list[Step] = [cfg8b()] if "--model" in args else []
        out.append(script("engine/spec_decode.py", *argv, "--json", r.o(f"spec_{part}.json")))
        if r.baseline:
            base = os.path.abspath(r.baseline)
            out.append(py(baseline_script(base, "engine", "spec_decode.py"), *argv,
                          "--json", r.o(f"spec_{part}_base.json"), cwd=base, env=r.pythonpath(base)))
        return out
    return steps


def serve_load(r: Run) -> list[Step]:
    args = ["--rounds", "3", "--max-tokens", "256", *r.extra]
    return [script("serving/serve_load.py", *args, "--json", r.o("serve_load.json")),
            script("serving/serve_load.py", *args, "--attack-rounds", "1", "--json", r.o("serve_load_burst.json"))]


def moe_int4(r: Run) -> list[Step]:
    model = "/tmp/dsv2lite-int4"
    load = ("import logging, time; t = time.time(); from ridge import LLM; "
            "logging.basicConfig(level=logging.INFO, format='%(asctime)s %(message)s'); "
            f"LLM({model!r}, load_format='dummy', quantization='int4', max_model_len=1024, kv_cache_memory=8 << 30, "
            "show_progress=False); print(f'INT4 V2-Lite engine ready in {time.time() - t:.0f} s (first load: expert "
            "tiles tuned)')")
    steps = gpu_tests(r, test_file("test_moe_gpu.py"), "-k", "int4") + [dsv2(model), py("-c", load)]
    steps += [latency(model, r.o(f"lat_mla_int4_b{b}.json"), "--quantization", "int4", "--batch-size", str(b),
                      "--input-len", "128", "--output-len", "64", "--num-iters", "2", "--max-model-len", "1024",
                      "--kv-cache-memory", str(8 << 30)) for b in (1, 64)]
    return steps + roofline(model, "/tmp/roofline-mla-int4", "--quantization", "int4", "--batch", "1", "64",
                            "--context", "1024", "--prefill-len", "128", "--max-model-len", "2048",
                            "--kv-cache-memory", str(8 << 30)) \
        + [copy_report("/tmp/roofline-mla-int4", "roofline_mla_int4")]


def mla_e2e(r: Run) -> list[Step]:
    return [dsv2()] + [latency(DSV2, r.o(f"lat_mla_{be}_b{b}.json"), "--attention-backend", be, "--batch-size", str(b),
                               "--input-len", "128", "--output-len", "64", "--num-iters", "2", "--max-model-len", "1024",
                               "--kv-cache-memory", "8e9", *r.extra) for be in ("triton", "torch") for b in (1, 64)]


def case_70b(r: Run) -> list[Step]:
    d = f"/tmp/case-70b/round-{r.round}"

    def prepare(_: Run) -> None:
        os.makedirs(d, exist_ok=True)
        if "--serve-only" in r.extra:      # the serve sweep of a written round: its latency run sizes the chunk
            shutil.copytree(f"docs/case-study-70b/round-{r.round}", d, dirs_exist_ok=True)

    def collect(_: Run) -> None:
        os.makedirs(f"{d}/int4-dispatch", exist_ok=True)
        for f in glob.glob(os.path.join(cache_dir(r), "int4", "*.json")):
            shutil.copy(f, f"{d}/int4-dispatch/")
        shutil.copy(f"{d}/summary.json", r.o(f"case70b_round{r.round}_summary.json"))
        with tarfile.open(r.o(f"case70b_round{r.round}.tar.gz"), "w:gz") as t:
            t.add(d, arcname=f"round-{r.round}")

    return [prepare, script("case_study/case_study_70b.py", "round", "--round", str(r.round),
                            "--model", "/tmp/llama3-70b", "--out", d, "--budget-s", str(int(r.left() - 30)), *r.extra,
                            check=False), collect]


def tp_scale(shape: str, sizes: tuple[str, ...], out: str) -> Callable[[Run], list[Step]]:
    def steps(r: Run) -> list[Step]:
        return [script("engine/tp.py", "scale", "--shapes", shape, "--tp", *sizes,
                       "--budget-s", str(int(r.left() - 90)), *r.extra, "--json", r.o(out))]
    return steps


def roofline_8b(tmp: str, name: str, *args: str) -> Callable[[Run], list[Step]]:
    return lambda r: [cfg8b()] + roofline(CFG_8B, tmp, *args) + [copy_report(tmp, name)]


def kernel_bench(path: str, out: str, *args: str) -> Callable[[Run], list[Step]]:
    return lambda r: [script(path, *args, *r.extra, "--json", r.o(out))]


PARTS = [
    Part("tests-kernels", "pytest -m gpu tests/kernels: the kernel tests, one list (the folder)",
         lambda r: [pytest("tests/kernels")], 400, 60),
    Part("tests-gpu", "pytest -m gpu tests: the whole GPU suite in one process",
         lambda r: [pytest("tests", env={"RIDGE_8B_PATH": CKPT_8B})], 600, 300, ckpt=True),
    Part("attention", "benchmarks/kernels/attention.py", kernel_bench("kernels/attention.py", "attention.json"),
         240, 60, ("attention.json",), extra=True),
    Part("gemv", "benchmarks/kernels/gemv.py", kernel_bench("kernels/gemv.py", "gemv.json"), 200, 60, ("gemv.json",), extra=True),
    Part("fused", "benchmarks/kernels/fused_kernels.py", kernel_bench("kernels/fused_kernels.py", "fused_kernels.json"),
         180, 60, ("fused_kernels.json",), extra=True),
    Part("int4", "benchmarks/kernels/int4_gemm.py: W4A16 kernels vs cuBLAS bf16 and tinygemm, 8B/70B shapes",
         kernel_bench("kernels/int4_gemm.py", "int4_gemm.json"), 450, 90, ("int4_gemm.json",), extra=True),
    Part("fp8", "benchmarks/kernels/fp8_gemm.py: the block-scaled FP8 GEMM vs cuBLAS _scaled_mm and bf16",
         kernel_bench("kernels/fp8_gemm.py", "fp8_gemm.json"), 450, 90, ("fp8_gemm.json",), extra=True),
    Part("fp8-producers", "benchmarks/kernels/fp8_producers.py: norm / SiLU-and-mul with the FP8 quantization fused in",
         kernel_bench("kernels/fp8_producers.py", "fp8_producers.json"), 200, 40, ("fp8_producers.json",), extra=True),
    Part("ab", "this tree vs --baseline (a git archive export): `ridge bench latency` on the 8B shape (dummy "
         "weights), decode bf16/INT4/FP8 at batch 1 and bf16 at batch 64, each tree in its own processes",
         lambda r: [cfg8b(), script("engine/ab_decode.py", "--model", CFG_8B, "--baseline", need_baseline(r), *r.extra,
                                    "--budget-s", str(int(r.left() - 20)), "--log-dir", r.o("ab"), "--json", r.o("ab.json"))],
         590, 200, ("ab.json", "ab/"), extra=True),
    Part("dummy", "benchmarks/engine/engine_ready.py: 8B-shaped engine ready time, cold then warm compile cache",
         kernel_bench("engine/engine_ready.py", "engine_ready.json"), 300, 60, ("engine_ready.json",), extra=True),
    Part("tests-engine", "pytest -m gpu tests, less tests/kernels (engine, models, roofline, ...)",
         lambda r: [pytest("tests", "--ignore=tests/kernels", env={"RIDGE_8B_PATH": CKPT_8B})], 500, 120, ckpt=True),
    Part("fastpath", "benchmarks/engine/fast_path.py (a)-(c) on the 8B shape with the HF peer",
         lambda r: [script("engine/fast_path.py", "--model", CKPT_8B, "--no-progress", *r.extra,
                           "--json", r.o("fast_path_8b.json"))], 500, 200, ("fast_path_8b.json",), extra=True, ckpt=True),
    Part("int4-e2e", "ridge bench latency, 8B shape (dummy weights): bf16 vs --quantization int4 at --batches (1 64)",
         int4_e2e, 500, 150, ("lat_{bf16,int4}_b{1,64}.json",)),
    Part("int4-roofline", "ridge roofline, 8B shape, --quantization int4, decode batch 1 and 64",
         roofline_8b("/tmp/roofline-int4", "roofline_int4", "--quantization", "int4", "--batch", "1", "64",
                     "--context", "1024", "--prefill-len", "512"), 300, 100, ("roofline_int4.md", "roofline_int4.json")),
    Part("int4-quality", "the INT4 quality contract on the demo model: quantize RTN and AWQ, eval-ppl vs bf16 (KL)",
         int4_quality, 500, 300, ("int4_quality.json",)),
    Part("fp8-attn", "benchmarks/kernels/attention.py --only decode --kv-cache-dtype both",
         lambda r: [script("kernels/attention.py", "--only", "decode", "--kv-cache-dtype", "both", *r.extra,
                           "--json", r.o("attention_fp8.json"))], 200, 40, ("attention_fp8.json",), extra=True),
    Part("fp8-quality", "the FP8 quality contract on the demo model: FP8 weights, FP8 KV, FP8 KV + Hadamard vs bf16",
         fp8_quality, 450, 150, ("fp8_quality.json",)),
    Part("fp8-e2e", "8B shape (dummy weights): TTFT of 4096 tokens bf16 vs fp8; fp8 decode at --batches (1 64)",
         fp8_e2e, 540, 150, ("lat_{bf16,fp8}_ttft.json", "lat_fp8_b{1,64}.json", "fp8_dispatch.json")),
    Part("fp8-throughput", "8B shape: 256 requests 1024 -> 256 in a 16 GiB KV budget, bf16 KV vs fp8 KV",
         fp8_throughput, 400, 200, ("tput_kv_{bf16,fp8}.json",)),
    Part("fp8-roofline", "ridge roofline, 8B shape, --quantization fp8 --kv-cache-dtype fp8",
         roofline_8b("/tmp/roofline-fp8", "roofline_fp8", "--quantization", "fp8", "--kv-cache-dtype", "fp8",
                     "--batch", "1", "64", "--context", "2048", "--prefill-len", "4096"), 300, 100,
         ("roofline_fp8.md", "roofline_fp8.json")),
    Part("spec-demo", "benchmarks/engine/spec_decode.py demo: the demo pair and n-gram, batch 1",
         lambda r: [script("engine/spec_decode.py", "demo", *r.extra, "--json", r.o("spec_demo.json"))], 300, 60,
         ("spec_demo.json",), extra=True),
    Part("spec-agent", "benchmarks/engine/spec_decode.py agent: suffix decoding vs n-gram on turns of file edits, "
         "batch 1; with --baseline the same in that tree", spec_with_baseline("agent"), 400, 60,
         ("spec_agent.json", "spec_agent_base.json"), extra=True),
    Part("spec-verify", "benchmarks/engine/spec_decode.py verify, 8B shape; with --baseline the same in that tree",
         spec_with_baseline("verify", "--model", CFG_8B, "--load-format", "dummy"), 500, 90,
         ("spec_verify.json", "spec_verify_base.json"), extra=True),
    Part("spec-oracle", "benchmarks/engine/spec_decode.py oracle, 8B shape, batch 1 and 64, k 2 4 8",
         lambda r: [cfg8b(), script("engine/spec_decode.py", "oracle", "--model", CFG_8B, "--load-format", "dummy",
                                    "--batches", "1", "64", "--ks", "2", "4", "8", *r.extra,
                                    "--json", r.o("spec_oracle.json"))], 400, 120, ("spec_oracle.json",), extra=True),
    Part("structured", "benchmarks/engine/structured.py, 8B shape (dummy weights): a 50-field JSON schema's compile "
         "time, and its decode overhead at batch 1, 16 and 64",
         lambda r: [cfg8b(), script("engine/structured.py", "--model", CFG_8B, "--load-format", "dummy",
                                    "--batches", "1", "16", "64", "--max-tokens", "512", *r.extra,
                                    "--json", r.o("structured.json"))], 400, 120, ("structured.json",), extra=True),
    Part("serve-load", "benchmarks/serving/serve_load.py: 64 streams on the demo model, without and with the burst",
         serve_load, 400, 120, ("serve_load.json", "serve_load_burst.json"), extra=True),
    Part("mla", "the MLA GPU tests, then benchmarks/kernels/mla.py (decode and prefill vs SDPA)",
         lambda r: gpu_tests(r, test_file("test_mla_gpu.py")) + [script("kernels/mla.py", *r.extra, "--json",
                                                                         r.o("mla_decode.json"))],
         500, 150, ("mla_decode.json",), extra=True),
    Part("mla-e2e", "DeepSeek-V2-Lite shape: ridge bench latency b1/b64, Triton backend (graphs) and torch (eager)",
         mla_e2e, 560, 150, ("lat_mla_{backend}_b{1,64}.json",), extra=True),
    Part("moe-fp8", "the MoE FP8 GPU tests, then V2-Lite --quantization fp8: ridge bench latency b1/b64",
         lambda r: gpu_tests(r, test_file("test_moe_gpu.py"), "-k", "fp8") + [dsv2()] + [
             latency(DSV2, r.o(f"lat_mla_fp8_b{b}.json"), "--quantization", "fp8", "--batch-size", str(b),
                     "--input-len", "128", "--output-len", "64", "--num-iters", "2", "--max-model-len", "1024",
                     "--kv-cache-memory", "8e9") for b in (1, 64)], 560, 150, ("lat_mla_fp8_b{1,64}.json",)),
    Part("moe-int4", "the MoE INT4 GPU tests, V2-Lite --quantization int4: first load (tiles tuned), latency, roofline",
         moe_int4, 590, 150, ("lat_mla_int4_b{1,64}.json", "roofline_mla_int4.md", "roofline_mla_int4.json")),
    Part("moe-tests", "pytest -m gpu on the MoE GPU tests",
         lambda r: [pytest(test_file("test_moe_gpu.py"))], 500, 120),
    Part("moe-kernels", "benchmarks/kernels/moe.py kernels: one MoE layer at the Qwen3-30B-A3B and Mixtral shapes",
         lambda r: [script("kernels/moe.py", "kernels", *r.extra, "--json", r.o("moe_kernels.json"))], 500, 120,
         ("moe_kernels.json",), extra=True),
    Part("moe-e2e", "benchmarks/kernels/moe.py e2e, Qwen3-30B-A3B shape, batch 1/64/256 with the HF peer",
         lambda r: [checkpoint(QWEN_MOE, "--arch", "qwen3moe", "--preset", "qwen3-30b-a3b"),
                    script("kernels/moe.py", "e2e", "--model", QWEN_MOE, "--batches", "1", "64", "256", "--hf", *r.extra,
                           "--json", r.o("moe_e2e.json"))], 580, 200, ("moe_e2e.json",), extra=True),
    Part("moe-roofline", "ridge roofline, Qwen3-30B-A3B shape: prefill 2048, decode batch 1 and 64",
         lambda r: [checkpoint(QWEN_MOE, "--arch", "qwen3moe", "--preset", "qwen3-30b-a3b")]
         + roofline(QWEN_MOE, "/tmp/roofline-moe", "--batch", "1", "64", "--context", "1024", "--prefill-len", "2048",
                    "--max-model-len", "4096", "--kv-cache-memory", "8e9")
         + [copy_report("/tmp/roofline-moe", "roofline_moe")], 300, 100, ("roofline_moe.md", "roofline_moe.json")),
    Part("moe-mixtral", "benchmarks/kernels/moe.py e2e, Mixtral-8x7B shape (94 GB bf16: an H200), batch 1",
         lambda r: [checkpoint("/tmp/mixtral-8x7b", "--arch", "mixtral", "--preset", "mixtral-8x7b"),
                    script("kernels/moe.py", "e2e", "--model", "/tmp/mixtral-8x7b", "--batches", "1",
                           "--kv-cache-memory", "4e9", *r.extra, "--json", r.o("moe_mixtral.json"))], 500, 150,
         ("moe_mixtral.json",), extra=True),
    Part("tp-tests", "pytest -m gpu on the TP = 2 tests (a 2-GPU kind)",
         lambda r: [pytest(test_file("test_tp_gpu.py"))], 500, 120),
    Part("tp", "benchmarks/engine/tp.py decode: TP 1 vs 2, 8B and 70B shapes, batch 1 and 64 (2+ GPUs)",
         lambda r: [script("engine/tp.py", "decode", "--shapes", "llama3-8b", "llama3-70b", *r.extra,
                           "--json", r.o("tp_decode.json"))], 580, 300, ("tp_decode.json",), extra=True),
    Part("case-70b", "benchmarks/case_study/case_study_70b.py round --round N, Llama-3-70B shape (one H200)",
         case_70b, 600, 300, ("case70b_round{N}.tar.gz", "case70b_round{N}_summary.json"), extra=True),
    Part("tp-comm", "benchmarks/engine/tp.py comm (after --: e.g. --shape llama3-70b) and ring (2+ GPUs)",
         lambda r: [script("engine/tp.py", "comm", "--shape", "llama3-8b", "--tp", "2", *r.extra,
                           "--json", r.o("tp_comm.json")),
                    script("engine/tp.py", "ring", "--batches", "1", "256", "--json", r.o("tp_ring.json"))],
         500, 200, ("tp_comm.json", "tp_ring.json"), extra=True),
    Part("tp-scale", "benchmarks/engine/tp.py scale, 70B shape, TP 4 and 8 (a 4- or 8-GPU kind)",
         tp_scale("llama3-70b", ("4", "8"), "tp_scale.json"), 600, 300, ("tp_scale.json",), extra=True),
    Part("tp-scale-8b", "benchmarks/engine/tp.py scale, 8B shape, TP 1 2 4 8 (a 4- or 8-GPU kind)",
         tp_scale("llama3-8b", ("1", "2", "4", "8"), "tp_scale_8b.json"), 600, 300, ("tp_scale_8b.json",), extra=True),
]
BY_NAME = {p.name: p for p in PARTS}


def run_cmd(c: Cmd, r: Run, log, deadline: float) -> int:
    """One command, its output into the part's log and run.log, killed (its process group) at the deadline."""
    env = {**r.env, **(c.env or {})}
    log.write(f"$ {' '.join(c.argv)}{f'  (in {c.cwd})' if c.cwd else ''}\n")
    log.flush()
    proc = subprocess.Popen(c.argv, cwd=c.cwd or ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        return proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return 124


class Checkpoint8B:
    """The 8B random checkpoint, written in the background while the first part runs."""

    def __init__(self, r: Run, wanted: bool):
        self.proc, self.note = None, None
        if wanted and not os.path.isfile(os.path.join(CKPT_8B, "config.json")):
            self.log = open(r.o("logs/checkpoint_8b.log"), "w")
            self.proc = subprocess.Popen([PY, "-m", "ridge.utils.random_checkpoint", CKPT_8B, "--preset", "llama3-8b",
                                          "--dtype", "bfloat16", "--device", "cuda"], cwd=ROOT, env=r.env,
                                         stdout=self.log, stderr=subprocess.STDOUT)

    def wait(self) -> str | None:
        if self.proc is not None:
            t0, rc = time.monotonic(), self.proc.wait()
            self.note = f"8B checkpoint written: rc={rc} (waited {time.monotonic() - t0:.0f} s)"
            self.proc = None
            return self.note
        return None


def run_part(p: Part, r: Run, run_log) -> dict:
    left = r.left()
    row = {"part": p.name, "status": "", "seconds": 0.0}
    if left < p.need_s:
        row["status"] = f"SKIPPED (needs ~{p.need_s} s, {left:.0f} s left)"
        return row
    limit = min(p.timeout_s, left - 5)
    t0 = time.monotonic()
    deadline = t0 + limit
    with open(r.o(f"logs/{p.name}.log"), "w") as log:
        try:
            steps = p.steps(r)
        except SystemExit as e:
            row["status"] = f"error: {e}"
            return row
        rc = 0
        for step in steps:
            if isinstance(step, Cmd):
                code = run_cmd(step, r, log, deadline)
                if code == 124:
                    rc = 124
                    break
                if code != 0 and step.check:
                    rc = code
                    break
                rc = rc or code
            else:
                try:
                    step(r)
                except (OSError, ValueError) as e:
                    log.write(f"{type(e).__name__}: {e}\n")
                    rc = 1
                    break
    row["seconds"] = time.monotonic() - t0
    row["status"] = "ok" if rc == 0 else "timed out" if rc == 124 else f"rc={rc}"
    text = open(r.o(f"logs/{p.name}.log")).read()
    run_log.write(f"=== {p.name} (timeout {limit:.0f} s, {left:.0f} s left) ===\n{text}")
    tail = [ln for ln in text.splitlines() if "warn" not in ln.lower()][-15:]
    print(f"=== {p.name}: {row['status']} in {row['seconds']:.0f} s\n" + "\n".join(tail), flush=True)
    return row


def load(r: Run, name: str):
    try:
        with open(r.o(name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def headlines(r: Run) -> list[str]:
    """The figures a reader looks for first, from the outputs this run wrote."""
    lines = []
    ab = load(r, "ab.json")
    if ab:
        def f(x, spec):
            return "n/a" if x is None else format(x, spec)
        for case, e in ab.get("summary", {}).items():
            lines.append(f"ab  {case:<10} decode tok/s  this {f(e.get('this'), '.1f')}  base {f(e.get('base'), '.1f')}  "
                         f"this/base {f(e.get('ratio'), '.3f')}")
    er = load(r, "engine_ready.json")
    if er:
        runs = ", ".join(f"{x['cache']} {x.get('spawn_to_ready_s', float('nan')):.1f} s" for x in er["runs"])
        lines.append(f"dummy  8B engine ready: {runs}; target <= {er['target_s']:.0f} s warm: "
                     f"{'met' if er['meets_target'] else 'NOT met'}")
    return lines


def table(rows: list[dict]) -> str:
    width = max([len(x["part"]) for x in rows] + [4])
    return "\n".join([f"{'part':<{width}}  {'seconds':>7}  status"]
                     + [f"{x['part']:<{width}}  {x['seconds']:7.0f}  {x['status']}" for x in rows])


def install_wheels() -> str | None:
    """The server's packages carried as wheels (.whl/), installed beside the tree."""
    wheels = sorted(glob.glob(os.path.join(ROOT, ".whl", "*.whl")))
    if not wheels:
        return None
    site = "/tmp/site"
    subprocess.run([PY, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
                    "--upgrade", "--target", site, *wheels], check=True)
    return site


def export_baseline(commit: str, dest: str | None = None) -> int:
    """The baseline commit's ridge package (and its benchmarks) from `git archive` into dest
    (.baseline/<commit>), without the demo checkpoints' weights: small enough to carry to the device."""
    dest = dest or os.path.join(ROOT, ".baseline", commit)
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    archive = subprocess.run(["git", "archive", commit, "--", "ridge", "benchmarks", "pyproject.toml",
                              ":(exclude)ridge/assets/*/model.safetensors", ":(exclude)benchmarks/results"],
                             cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    full = subprocess.run(["git", "rev-parse", commit], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    with open(os.path.join(dest, "COMMIT"), "w") as f:
        f.write(full)
    kib = sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(dest) for n in ns) // 1024
    print(f"{dest}: {kib} KiB (carry it: carry=[\".baseline\"])")
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("parts", nargs="*", metavar="PART", help="parts to run (--list shows them)")
    ap.add_argument("--out", default="out", help="output folder (default: out)")
    ap.add_argument("--budget-s", type=float, default=560, help="overall budget, seconds (default 560)")
    ap.add_argument("--baseline", default=None, help="a baseline tree (ab, spec-verify): --export-baseline writes one")
    ap.add_argument("--round", type=int, default=0, help="case-70b: the round (default 0)")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="int4-e2e, fp8-e2e: decode batches (1 64)")
    ap.add_argument("--no-tests", dest="tests", action="store_false",
                    help="mla, moe-fp8, moe-int4: skip the GPU tests before the benchmark")
    ap.add_argument("--list", action="store_true", help="print the parts and exit")
    ap.add_argument("--export-baseline", metavar="COMMIT", help="write .baseline/COMMIT (git archive) and exit")
    a = ap.parse_args(argv)
    a.extra = extra
    unknown = [p for p in a.parts if p not in BY_NAME]
    if unknown:
        ap.error(f"unknown part(s) {', '.join(unknown)} (known: {', '.join(BY_NAME)})")
    if not a.parts and not a.list and not a.export_baseline:
        ap.error("name the parts to run (--list shows them)")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.list:
        for p in PARTS:
            print(f"{p.name:<15} {p.help}\n{'':<15} timeout {p.timeout_s} s; writes {', '.join(p.outputs) or 'logs'}"
                  f"{'; takes -- args' if p.extra else ''}")
        return 0
    if a.export_baseline:
        return export_baseline(a.export_baseline)
    out = os.path.abspath(a.out)
    os.chdir(ROOT)              # the parts name the tree's files from its root
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    site = install_wheels()
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", NCCL_NVLS_ENABLE="0",
               PYTHONPATH=os.pathsep.join([ROOT] + ([site] if site else [])))
    r = Run(out, a.extra, a.baseline, a.round, a.batches, a.tests, a.budget_s, env, site=site)
    chosen = [p for p in PARTS if p.name in a.parts]
    with open(r.o("run.log"), "w") as run_log:
        head = subprocess.run("nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,temperature.gpu,"
                              "power.draw --format=csv,noheader; git rev-parse HEAD", shell=True, cwd=ROOT,
                              capture_output=True, text=True).stdout
        head += subprocess.run([PY, "-c", "import torch, triton; print('torch', torch.__version__, 'triton', "
                                "triton.__version__)"], capture_output=True, text=True, env=env).stdout
        print(head, end="", flush=True)
        run_log.write(head)
        ckpt = Checkpoint8B(r, any(p.ckpt for p in chosen))
        rows, notes = [], []
        for i, p in enumerate(chosen):
            if i > 0 or p.ckpt:     # the timed parts run alone on the device: the checkpoint writer finishes first
                notes += [n for n in [ckpt.wait()] if n]
            rows.append(run_part(p, r, run_log))
        notes += [n for n in [ckpt.wait()] if n]
        summary = "\n".join([table(rows), *notes, *headlines(r),
                             f"run.py {' '.join(a.parts)}: {time.monotonic() - r.t0:.0f} s of --budget-s {a.budget_s:.0f}"])
        run_log.write("\n=== summary ===\n" + summary + "\n")
    with open(r.o("summary.txt"), "w") as f:
        f.write(summary + "\n")
    print("\n=== summary ===\n" + summary)
    return 0 if all(x["status"] == "ok" for x in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
