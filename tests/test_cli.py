import subprocess
import sys


def test_generate_streams_completion(checkpoints):
    path = checkpoints("llama")
    r = subprocess.run([sys.executable, "-m", "ridge.cli", "generate", "--model", path, "--device", "cpu",
                        "--max-tokens", "12", "def fib(n):"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    from ridge import LLM, SamplingParams
    llm = LLM(path, device="cpu", show_progress=False)
    expected = llm.generate("def fib(n):", SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert r.stdout == expected.outputs[0].text + "\n"


def test_generate_reports_bad_parameter(checkpoints):
    r = subprocess.run([sys.executable, "-m", "ridge.cli", "generate", "--model", checkpoints("llama"),
                        "--device", "cpu", "--top-p", "0", "x"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "top_p" in r.stderr


def test_installed_entry_point_runs_the_bundled_demo():
    """`ridge generate` with no --model uses the bundled demo checkpoint."""
    import shutil
    cmd = [shutil.which("ridge")] if shutil.which("ridge") else [sys.executable, "-m", "ridge.cli"]
    r = subprocess.run(cmd + ["generate", "--device", "cpu", "--max-tokens", "16", "def fib("],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.strip()) > 0
