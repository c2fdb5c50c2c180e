"""`ridge quantize` (issue 15): the round-to-nearest grid, AWQ's search and its folding, the
checkpoint it writes (loaded back by ridge's INT4 path), the calibration data (never a held-out
file), bad arguments; and `ridge eval-ppl --compare`'s KL divergence against transformers.

Models: random transformers checkpoints (tiny: hidden 64, 4 heads / 2 kv heads of 16, MLP 128),
group size 32, a few hundred calibration tokens, so every test runs in seconds on a CPU."""
import builtins
import json
import math
import os

import pytest
import torch

from ridge.layers.quant.int4.formats import dequantize, quantize_rtn
from ridge.quantize.awq import fake_quantize, output_error, search_clip, search_scale
from ridge.utils.random_checkpoint import make_random_checkpoint

GROUP = 32
TEXT = "".join(f"def f{i}(x, y):\n    return x * {i} + y  # line {i}\n" for i in range(200))


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "calib.py"
    path.write_text(TEXT)
    return str(path)


@pytest.fixture(scope="module")
def short_file(tmp_path_factory):
    """A few hundred tokens: a handful of scoring windows."""
    path = tmp_path_factory.mktemp("text") / "short.py"
    path.write_text(TEXT[:1200])
    return str(path)


def outlier_activations(t: int, k: int, seed: int = 0) -> torch.Tensor:
    """x [t, k] with a few channels 20x larger than the rest: the case AWQ is for."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g) * (0.5 + torch.rand(k, generator=g))
    x[:, torch.randperm(k, generator=g)[:4]] *= 20
    return x


# -- round to nearest ------------------------------------------------------------------------------
def test_rtn_grid_exact_zero_point_scale_and_error_bound():
    """Asymmetric min-max over [min(w, 0), max(w, 0)]: scale = range / 15 in the scale dtype, integer
    zero point round(-lo / scale) in [0, 15], every element within scale / 2 of its dequantized value
    (plus what rounding the scale to the stored dtype moves the grid's far end), 0 exactly 0."""
    w = torch.randn(8, 128) * torch.rand(8, 1)
    w[0, :GROUP] = torch.linspace(-1.0, 2.0, GROUP)
    w[0, 5] = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        q, s, z = quantize_rtn(w, GROUP, dtype)
        g = w.reshape(8, -1, GROUP)
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        assert s.dtype == dtype and torch.equal(s, ((hi - lo) / 15).clamp(min=1e-5).to(dtype))
        assert torch.equal(z.float(), torch.round(-lo / s.float()).clamp(0, 15))
        assert int(q.min()) >= 0 and int(q.max()) <= 15 and int(z.min()) >= 0 and int(z.max()) <= 15
        err = (w - dequantize(q, s, z, GROUP)).abs().reshape(8, -1, GROUP)
        exact_scale = (hi - lo) / 15
        bound = s.float() / 2 + 15 * (s.float() - exact_scale).abs() + 1e-6 * s.float()
        assert bool((err <= bound[..., None]).all())
    q, s, z = quantize_rtn(w, GROUP, torch.float32)
    assert math.isclose(float(s[0, 0]), 3 / 15, rel_tol=1e-6) and int(z[0, 0]) == 5
    assert int(q[0, 0]) == 0 and int(q[0, GROUP - 1]) == 15 and int(q[0, 5]) == 5
    assert float(dequantize(q, s, z, GROUP)[0, 5]) == 0.0
    q, s, z = quantize_rtn(w[:, :80], GROUP, torch.float32)      # 2.5 groups: the short one on its own range
    last = w[:, 64:80]
    assert s.shape == z.shape == (8, 3) and q.shape == (8, 80)
    assert torch.equal(q[:, :64], quantize_rtn(w, GROUP)[0][:, :64])
    assert torch.equal(s[:, 2], ((last.amax(1).clamp(min=0) - last.amin(1).clamp(max=0)) / 15).clamp(min=1e-5))


# -- AWQ's search ----------------------------------------------------------------------------------
@pytest.mark.parametrize("tie,k", [(None, 128), ((2, 16), 128), (None, 144), ((3, 16), 144)])
def test_awq_never_worse_than_rtn_on_its_calibration_activations(tie, k):
    """The scale search and the clipping search each keep RTN's result unless they beat it, in the
    layer's own objective ||Q(W s) / s x - W x||^2 measured on the calibration activations
    themselves (the Gram-matrix shortcut the search uses agrees with it). k = 144: a short last group."""
    x = outlier_activations(2048, k)
    w = torch.randn(96, k) * 0.05
    h = x.T @ x / x.shape[0]
    direct = lambda w_eff: float(((x @ (w_eff - w).T) ** 2).sum()) / x.shape[0]    # noqa: E731
    rtn = fake_quantize(w, GROUP)
    assert math.isclose(output_error(rtn, w, h), direct(rtn), rel_tol=1e-4)
    r = search_scale(w, x.abs().mean(0), h, GROUP, tie=tie)
    if tie:     # one scale per kv head and dimension: the query heads of one kv head share it
        per_head = r.scale.reshape(-1, *tie)       # [kv heads, query heads of each, dim]
        assert torch.equal(per_head[:, 0], per_head[:, 1])
    awq = fake_quantize(w * r.scale, GROUP) / r.scale
    assert math.isclose(r.error, direct(awq), rel_tol=1e-4) and math.isclose(r.rtn_error, direct(rtn), rel_tol=1e-4)
    assert direct(awq) < 0.9 * direct(rtn)            # outlier channels: AWQ clearly helps
    clip = search_clip(w * r.scale, h, GROUP, input_scale=r.scale)
    assert clip is None or clip.shape == (96, -(-k // GROUP))
    clipped = fake_quantize(w * r.scale, GROUP, clip) / r.scale
    assert direct(clipped) <= direct(awq) * (1 + 1e-6)


def test_awq_keeps_rtn_where_scaling_cannot_help():
    """Activations with no salient channel: whatever the search picks is no worse than s = 1."""
    x = torch.randn(1024, 64)
    w = torch.randn(32, 64)
    h = x.T @ x / x.shape[0]
    r = search_scale(w, x.abs().mean(0), h, GROUP)
    assert r.error <= r.rtn_error


# -- folding ---------------------------------------------------------------------------------------
def _next_token_logprobs(llm, ids):
    from ridge.eval_ppl import _next_token_logprobs as f
    return f(llm, ids)[1]


@pytest.mark.parametrize("variant", ["qwen2", "llama-mqa-mlp-bias"])
def test_scale_folding_leaves_the_unquantized_model_unchanged(variant, tmp_path, monkeypatch, text_file):
    """Any positive scales, folded as AWQ folds them (into the RMSNorm weights, v rows and their
    bias, up rows and their bias; tied per kv head for o_proj), give the same model before
    quantization: logits equal to float rounding. Random scales, so the check is not vacuous."""
    from ridge import LLM
    from ridge.quantize import plan as plan_mod
    from ridge.quantize.awq import ScaleResult, _expand_tied
    from ridge.quantize.calib import calibration_windows, collect_input_stats

    path = make_random_checkpoint(str(tmp_path / variant), arch=variant.split("-")[0],
                                  **({"num_key_value_heads": 1, "mlp_bias": True} if variant != "qwen2" else {}))
    llm = LLM(path, device="cpu", show_progress=False, enable_prefix_caching=False)
    gen = torch.Generator().manual_seed(3)

    def random_scale(w, mean_abs, h, group_size, scale_dtype=torch.float32, tie=None):
        k = w.shape[1] // (tie[0] if tie else 1)
        s = torch.exp(torch.randn(k, generator=gen))
        return ScaleResult(_expand_tied(s, *tie) if tie else s, 0.5, 0.0, 0.0)

    monkeypatch.setattr(plan_mod, "search_scale", random_scale)
    stats = collect_input_stats(llm, calibration_windows(llm.tokenizer, [text_file], 256, 64), show_progress=False)
    net = llm.engine.runner.model
    plan = plan_mod.plan_model(net, "awq", GROUP, lambda i: stats, show_progress=False)
    window = calibration_windows(llm.tokenizer, [text_file], 96, 96)[0]
    before = _next_token_logprobs(llm, window)
    params = dict(net.named_parameters())
    folded = {f"model.layers.0.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm")}
    assert set(plan.tensors) >= folded
    with torch.no_grad():
        for name, lp in plan.linears.items():
            assert not torch.allclose(lp.weight, params[f"{name}.weight"])
            params[f"{name}.weight"].copy_(lp.weight)
        for name, t in plan.tensors.items():
            params[name].copy_(t)
    after = _next_token_logprobs(llm, window)
    torch.testing.assert_close(after, before, atol=2e-4, rtol=1e-4)


def test_layer_stats_in_passes_equal_one_pass(tiny_llm, text_file):
    """Statistics collected a layer per pass (a budget too small for two) equal those of one pass."""
    from ridge.quantize.calib import LayerStats, calibration_windows, collect_input_stats

    windows = calibration_windows(tiny_llm.tokenizer, [text_file], 256, 64)
    whole = collect_input_stats(tiny_llm, windows, show_progress=False)
    layered = LayerStats(tiny_llm, windows, show_progress=False, budget=1)
    for i in range(2):
        for name, st in layered(i).items():
            assert st.tokens == whole[name].tokens == 256
            torch.testing.assert_close(st.gram, whole[name].gram)
            torch.testing.assert_close(st.abs_sum, whole[name].abs_sum)
    assert layered.passes == 2 and LayerStats(tiny_llm, windows, show_progress=False).per_pass >= 2


# -- the command -----------------------------------------------------------------------------------
def test_quantize_writes_compressed_tensors_that_ridge_loads(checkpoints, tmp_path, text_file, capsys):
    from safetensors import safe_open

    from ridge import LLM, SamplingParams
    from ridge.cli import main

    src, out = checkpoints("qwen2"), str(tmp_path / "awq")
    argv = ["quantize", "--model", src, "--out", out, "--method", "awq", "--group-size", str(GROUP),
            "--calib-files", text_file, "--calib-tokens", "512", "--calib-seq-len", "128", "--device", "cpu"]
    assert main(argv) == 0, capsys.readouterr().err
    assert "wrote" in capsys.readouterr().out
    qc = json.load(open(os.path.join(out, "config.json")))["quantization_config"]
    weights = qc["config_groups"]["group_0"]["weights"]
    assert (qc["quant_method"], qc["format"], qc["ignore"]) == ("compressed-tensors", "pack-quantized", ["lm_head"])
    assert (weights["num_bits"], weights["group_size"], weights["symmetric"], weights["strategy"]) == (4, GROUP, False,
                                                                                                      "group")
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        names = set(f.keys())
    for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj"):
        p = f"model.layers.1.{proj}"
        assert {f"{p}.weight_packed", f"{p}.weight_scale", f"{p}.weight_zero_point", f"{p}.weight_shape"} <= names
        assert f"{p}.weight" not in names
    assert "model.layers.0.self_attn.v_proj.bias" in names and "lm_head.weight" in names
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert open(os.path.join(out, f), "rb").read() == open(os.path.join(src, f), "rb").read()
    report = json.load(open(os.path.join(out, "quantize_report.json")))
    assert report["calib_tokens"] == 512 and report["method"] == "awq"
    quant = LLM(out, device="cpu", show_progress=False, enable_prefix_caching=False)
    assert quant.engine.runner.model.model.layers[0].self_attn.qkv_proj.quant_method is not None
    ref = LLM(src, device="cpu", show_progress=False, enable_prefix_caching=False)
    ids = quant.tokenizer(TEXT[:400])["input_ids"][:64]
    p, q = _next_token_logprobs(ref, ids), _next_token_logprobs(quant, ids)
    kl = float((p.exp() * (p - q)).sum(-1).mean())
    assert 0 < kl < 0.05, kl
    params = SamplingParams(temperature=0, max_tokens=8)
    assert len(quant.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids) == 8


def test_rtn_checkpoint_is_what_quantization_at_load_computes(tmp_path):
    """`ridge quantize --method rtn` and `--quantization int4` share one quantizer
    (ridge/layers/quant/int4/formats.py): on a float32 checkpoint at group 128 the tables, so the logits,
    are the same; down_proj's 320 inputs end in a short group (written as ceil(320 / 128) = 3)."""
    from ridge import LLM
    from ridge.quantize import quantize

    src = make_random_checkpoint(str(tmp_path / "src"), preset="tiny-g128", intermediate_size=320)
    quantize(src, str(tmp_path / "rtn"), method="rtn", group_size=128, show_progress=False, device="cpu")
    written = LLM(str(tmp_path / "rtn"), device="cpu", show_progress=False, enable_prefix_caching=False)
    at_load = LLM(src, device="cpu", show_progress=False, quantization="int4", enable_prefix_caching=False)
    ids = list(range(3, 60))
    torch.testing.assert_close(_next_token_logprobs(written, ids), _next_token_logprobs(at_load, ids),
                               atol=1e-6, rtol=1e-6)


# -- calibration data ------------------------------------------------------------------------------
def test_calibration_never_reads_a_heldout_file(monkeypatch):
    """The default calibration files are the demo corpus's training files: none is named in
    heldout_files.txt or held out by the split rule, and choosing and reading them opens no held-out
    file; a held-out file passed explicitly is refused."""
    from transformers import AutoTokenizer

    from ridge.assets import demo_model_path
    from ridge.eval_ppl import heldout_files
    from ridge.quantize.calib import _split_rule_holds_out, calibration_files, calibration_windows

    model = demo_model_path()
    heldout = {os.path.realpath(p) for p in heldout_files(model)}
    opened, real_open = [], builtins.open

    def recording_open(file, *a, **k):
        opened.append(os.path.realpath(file) if isinstance(file, str) else file)
        return real_open(file, *a, **k)

    tok = AutoTokenizer.from_pretrained(model)
    monkeypatch.setattr(builtins, "open", recording_open)
    files = calibration_files(model, None)
    calibration_windows(tok, files, 8192, 512)
    monkeypatch.setattr(builtins, "open", real_open)
    assert files and not heldout & set(opened) and not heldout & {os.path.realpath(f) for f in files}
    import sysconfig
    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
    assert not any(_split_rule_holds_out(os.path.relpath(os.path.realpath(f), stdlib)) for f in files)
    info = json.load(open(os.path.join(model, "training_info.json")))
    import platform
    if platform.python_version() in info["stdlib"] and os.path.isdir(os.path.join(stdlib, "test")):
        assert len(files) == info["train_files"]          # the very files the demo model trained on
    with pytest.raises(ValueError, match="calib_files: held out"):
        calibration_files(model, [sorted(heldout)[0]])


# -- bad arguments ---------------------------------------------------------------------------------
def test_bad_arguments_are_refused_with_a_clear_error(checkpoints, tmp_path, text_file, capsys):
    from ridge.cli import main
    from ridge.quantize import quantize

    src, out = checkpoints("llama"), str(tmp_path / "out")
    base = ["quantize", "--model", src, "--out", out, "--device", "cpu", "--calib-files", text_file,
            "--group-size", str(GROUP)]
    cases = [(["--group-size", "48"], "group_size: 48 must be 32, 64, 128, a multiple of 128, or K = 64"),
             (["--group-size", "0"], "group_size: must be an integer >= 1"),
             (["--calib-files", str(tmp_path / "missing.py")], "calib_files: no such file"),
             (["--calib-tokens", "1"], "calib_tokens: must be an integer >= 2"),
             (["--model", str(tmp_path / "nothing")], "model:"),
             (["--out", src], "out:"),
             (["--load-format", "dummy"], "load_format:")]
    capsys.readouterr()
    for extra, message in cases:
        assert main(base + extra) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("ridge: error: ") and message in err, (extra, err)
    assert not os.path.exists(out)
    assert main(["quantize", "--model", src, "--out", out, "--device", "cpu", "--group-size", str(GROUP)]) == 2
    err = capsys.readouterr().err                  # a model without a held-out list: no default text
    assert "calib_files:" in err and "pass --calib-files" in err
    with pytest.raises(SystemExit):
        main(base + ["--method", "gptq"])
    assert "invalid choice: 'gptq'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="method: must be one of awq, rtn"):
        quantize(src, out, method="gptq")
    os.makedirs(out)
    open(os.path.join(out, "model.safetensors"), "w").close()
    with pytest.raises(ValueError, match="out: .* already holds a checkpoint"):
        quantize(src, out, method="rtn", group_size=GROUP, device="cpu")
    quantized = str(tmp_path / "rtn")
    quantize(src, quantized, method="rtn", group_size=GROUP, device="cpu", show_progress=False)
    with pytest.raises(ValueError, match="would load quantized"):
        quantize(quantized, str(tmp_path / "again"), method="rtn", group_size=GROUP, device="cpu")


# -- eval-ppl --compare ----------------------------------------------------------------------------
def test_eval_ppl_compare_kl_matches_transformers(checkpoints, tmp_path, short_file, capsys):
    """KL(reference || model) and both perplexities over the same windows equal transformers'."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ridge.cli import main
    from ridge.eval_ppl import token_stream

    model, reference, seq = checkpoints("llama"), checkpoints("llama-mqa"), 64
    out = tmp_path / "kl.json"
    assert main(["eval-ppl", "--model", model, "--compare", reference, "--files", short_file, "--seq-len", str(seq),
                 "--device", "cpu", "--json", str(out)]) == 0
    assert "KL(reference || model)" in capsys.readouterr().out
    got = json.loads(out.read_text())
    tok = AutoTokenizer.from_pretrained(model)
    stream = torch.tensor(token_stream(tok, [short_file]))
    n = (len(stream) - 1) // seq
    idx = torch.arange(n)[:, None] * seq + torch.arange(seq + 1)
    x, y = stream[idx][:, :-1], stream[idx][:, 1:]
    keep = (y != tok.bos_token_id).reshape(-1)
    with torch.no_grad():
        lp, ref = (torch.log_softmax(AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32)(input_ids=x).logits,
                                     -1).reshape(-1, 512)[keep] for p in (model, reference))
    tgt = y.reshape(-1)[keep]
    assert got["tokens"] == int(keep.sum()) and got["windows"] == n
    assert math.isclose(got["kl_divergence"], float((ref.exp() * (ref - lp)).sum(-1).mean()), rel_tol=1e-3)
    assert math.isclose(math.log(got["perplexity"]), -float(lp.gather(1, tgt[:, None]).mean()), rel_tol=1e-4)
    assert math.isclose(math.log(got["reference_perplexity"]), -float(ref.gather(1, tgt[:, None]).mean()),
                        rel_tol=1e-4)
    assert math.isclose(got["top1_agreement"], float((lp.argmax(-1) == ref.argmax(-1)).float().mean()), abs_tol=1e-9)


def test_compare_with_itself_is_zero(tiny_llm, short_file):
    from ridge.eval_ppl import compare, perplexity

    r = compare(tiny_llm, tiny_llm, [short_file], seq_len=64, use_tqdm=False)
    assert r.kl_divergence == pytest.approx(0, abs=1e-7) and r.top1_agreement == 1.0
    assert r.perplexity == r.reference_perplexity
    assert r.perplexity == pytest.approx(perplexity(tiny_llm, [short_file], seq_len=64, use_tqdm=False).perplexity,
                                         rel=1e-6)


@pytest.mark.parametrize("flags", [["--quantization", "fp8"], ["--kv-cache-dtype", "fp8", "--kv-cache-hadamard"]],
                         ids=["fp8-weights", "fp8-kv"])
def test_eval_ppl_compare_reference_runs_in_full_precision(checkpoints, tmp_path, short_file, flags):
    """--compare against the same checkpoint under a precision flag: the reference drops the flag
    (it scores the float model with a float cache), so the KL is the flag's cost, not zero."""
    from ridge.cli import main

    model, out, plain = checkpoints("llama"), tmp_path / "q.json", tmp_path / "plain.json"
    args = ["--files", short_file, "--seq-len", "64", "--device", "cpu"]
    assert main(["eval-ppl", "--model", model, *args, "--json", str(plain)]) == 0
    assert main(["eval-ppl", "--model", model, *flags, "--compare", model, *args, "--json", str(out)]) == 0
    got, float_run = json.loads(out.read_text()), json.loads(plain.read_text())
    assert got["reference_perplexity"] == pytest.approx(float_run["perplexity"], rel=1e-6)
    assert 0 < got["kl_divergence"] < 0.05 and got["perplexity"] != float_run["perplexity"]


def test_a_run_that_dies_part_way_leaves_no_checkpoint(checkpoints, tmp_path, monkeypatch):
    """The checkpoint is written beside `out` and moved in once whole (weights last): a run killed
    while writing leaves no directory that loads as a checkpoint and no partial files; a whole run
    leaves out with its report and nothing beside it."""
    import ridge.quantize.checkpoint as ckpt
    from ridge.quantize import quantize

    src, out = checkpoints("llama"), str(tmp_path / "out")
    real = ckpt.shutil.copy2

    def dies(*args, **kw):          # the weights and config are written, the tokenizer files not yet
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.shutil, "copy2", dies)
    with pytest.raises(OSError, match="disk full"):
        quantize(src, out, method="rtn", group_size=GROUP, device="cpu", show_progress=False)
    assert sorted(os.listdir(tmp_path)) == []
    monkeypatch.setattr(ckpt.shutil, "copy2", real)
    summary = quantize(src, out, method="rtn", group_size=GROUP, device="cpu", show_progress=False)
    assert sorted(os.listdir(tmp_path)) == ["out"] and summary["out"] == out
    with open(os.path.join(out, "quantize_report.json")) as f:
        assert json.load(f)["out"] == out
    assert {"model.safetensors", "config.json"} <= set(os.listdir(out))
