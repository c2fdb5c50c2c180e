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


def test_bad_engine_flag_is_reported_before_loading(capsys, monkeypatch):
    """Every command checks its engine flags before any weights are read: `ridge: error: <setting>: ...`."""
    import ridge.engine.llm as llm_module
    from ridge.cli import main
    monkeypatch.setattr(llm_module, "ModelRunner", None)          # loading would fail differently
    for argv, name in ((["generate", "--max-num-seqs", "0", "x"], "max_num_seqs"),
                       (["generate", "--gpu-memory-utilization", "2", "x"], "gpu_memory_utilization"),
                       (["generate", "--kv-cache-memory", "1GiB", "--gpu-memory-utilization", "0.5", "x"],
                        "gpu_memory_utilization"),
                       (["eval-ppl", "--max-model-len", "1"], "max_model_len"),
                       (["bench", "latency", "--page-size", "0"], "page_size"),
                       (["bench", "throughput", "--max-n", "0"], "max_n"),
                       (["roofline", "--seed", "-1"], "seed"),
                       (["serve", "--max-model-len", "0"], "max_model_len"),
                       (["serve", "--port", "70000"], "port"),
                       (["serve", "--served-model-name", ""], "model_name")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"ridge: error: {name}:"), (argv, err)


def test_commands_take_settings_from_config_not_from_cli():
    """No import loop: the commands' parsers come from ridge.config / ridge.settings, never ridge.cli."""
    import ast
    import importlib
    for name in ("ridge.bench.latency", "ridge.bench.throughput", "ridge.bench.serve", "ridge.roofline.cli",
                 "ridge.server.cli"):
        tree = ast.parse(open(importlib.import_module(name).__file__).read())
        modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "ridge.cli" not in modules, name


def test_ctrl_c_ends_a_command_with_a_line_not_a_traceback(monkeypatch, capsys):
    import argparse
    import types

    import ridge.cli as cli

    def interrupted(a):
        raise KeyboardInterrupt
    ns = argparse.Namespace(func=interrupted)
    monkeypatch.setattr(cli, "build_parser", lambda: types.SimpleNamespace(parse_args=lambda argv: ns))
    assert cli.main([]) == 130
    assert capsys.readouterr().err.strip() == "ridge: interrupted"


def test_show_progress_false_shows_no_generate_bar(tiny_llm, capsys):
    from ridge import SamplingParams
    capsys.readouterr()
    tiny_llm.generate(["def f():"], SamplingParams(max_tokens=2))
    assert "generating" not in capsys.readouterr().err


def test_bad_choice_prints_the_error_not_the_usage_block(capsys):
    """A bad choice (or any flag argparse refuses) is the one line that matters and a pointer to
    --help, not argparse's usage block of every engine flag first."""
    import pytest

    from ridge.cli import main
    for argv, wanted in (
            (["generate", "--dtype", "bf16", "x"], "ridge generate: error: argument --dtype: invalid choice"),
            (["serve", "--kv-cache-dtype", "int8"], "ridge serve: error: argument --kv-cache-dtype"),
            (["bench", "latency", "--max-num-seqs", "many"], "ridge bench latency: error: argument")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith(wanted), (argv, err)
        assert "usage:" not in err and len(err.splitlines()) == 2, err


def test_eval_ppl_checks_its_files_before_loading(capsys, monkeypatch, tmp_path):
    import ridge.engine.llm as llm_module
    from ridge.cli import main
    monkeypatch.setattr(llm_module, "ModelRunner", None)          # a load would fail differently
    for files, why in ((["missing.txt"], "'missing.txt' does not exist"), ([str(tmp_path)], "is a directory")):
        assert main(["eval-ppl", "--files", *files]) == 2
        err = capsys.readouterr().err
        assert err.startswith("ridge: error: files: ") and why in err and len(err.splitlines()) == 1, err


def test_eval_ppl_progress_bar_names_what_it_does(tiny_llm, capsys, tmp_path):
    from ridge.eval_ppl import perplexity
    text = tmp_path / "text.py"
    text.write_text("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 20)
    capsys.readouterr()
    r = perplexity(tiny_llm, [str(text)], seq_len=64)
    err = capsys.readouterr().err
    assert r.windows > 1 and "scoring: 100%" in err and f"{r.windows}/{r.windows}" in err and "window" in err, err
    assert "generating" not in err and "req/s" not in err
