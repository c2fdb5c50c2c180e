"""Communication as the roofline's third roof (CPU): the cost of one rank's share at TP = N (its
slices of the weights plus the collectives, bytes worked out by hand), the link's fit and its
measurement (gloo between two processes), a predicted step at TP = N from fixed ceilings against
the hand-computed value, and the report's communication share."""
import pytest
import torch

from ridge.config import ModelConfig
from ridge.roofline.costs import RankShare, decode_shape, parameter_bytes, prefill_shape, step_costs
from ridge.roofline.predict import predict, predicted_step_s
from ridge.utils.ceilings import ASSUMED_LINK, CACHE_VERSION, Ceilings
from ridge.utils.collectives import fit_link, measure_link

# hidden 64, intermediate 128, 2 layers, 4 heads / 2 KV heads of 16, vocab 512, untied
SMALL = dict(architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=64, intermediate_size=128,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
             max_position_embeddings=1024)
H, I, L, V, D = 64, 128, 2, 512, 16
LINK2 = dict(latency=10e-6, busbw=100e9, kind="NVLink", backend="nccl")


def cfg() -> ModelConfig:
    return ModelConfig.from_dict(SMALL)


def fake_ceilings(**kw) -> Ceilings:
    return Ceilings("cuda", "fake", "fake-key", 1e12, {"bf16": 1e14}, 5e-6, 2e-6, details=dict(memory_bytes=1e9),
                    links={"2": dict(LINK2)}, **kw)


def by_name(costs):
    return {c.name: c for c in costs}


@pytest.mark.parametrize("n", [2, 4])
def test_rank_share_costs_and_collective_bytes(n):
    """Batch 3 decode, bf16: each projection's weights / N (TP = 4 copies the 2 KV heads, one a
    rank), and the collectives' link bytes: ring all-reduce 2(N-1)/N x [T, H] x 2 bytes, the LM
    head's all-gather (N-1)/N x [rows, V] x 2 bytes."""
    whole, share = by_name(step_costs(cfg(), decode_shape(3, 10))), by_name(step_costs(RankShare(cfg(), n),
                                                                                       decode_shape(3, 10)))
    assert not any(c.kind == "collective" for c in whole.values())
    for op in ("o_proj", "gate_up_proj", "down_proj", "lm_head"):
        assert share[op].param_bytes == whole[op].param_bytes / n, op
    kv_rows = 2 * D               # one KV head's K and V rows a rank (at TP = 4 each copied on two ranks)
    assert share["qkv_proj"].param_bytes == L * (H // n + kv_rows) * H * 2
    T, a = 3, 2
    ring = 2 * (n - 1) / n
    assert share["o_proj.all_reduce"].link_bytes == L * ring * T * H * a
    assert share["down_proj.all_reduce"].link_bytes == L * ring * T * H * a
    assert share["o_proj.all_reduce"].calls == share["down_proj.all_reduce"].calls == L
    assert share["embed.all_reduce"].link_bytes == ring * T * H * a
    assert share["lm_head.all_gather"].link_bytes == (n - 1) / n * T * V * a
    assert all(c.flops == 0 and c.bytes == 0 and c.ranks == n for c in share.values() if c.kind == "collective")
    # the parameters a rank holds: the projections' and tables' shares, the norms whole
    norms = (2 * L + 1) * H * 2
    assert parameter_bytes(RankShare(cfg(), n)) == pytest.approx(
        L * ((H // n + kv_rows) * H + H // n * H + 3 * I // n * H) * 2 + 2 * V // n * H * 2 + norms)


def test_moe_block_states_its_all_reduce():
    moe = ModelConfig.from_dict(dict(SMALL, architectures=["Qwen3MoeForCausalLM"], num_experts=4,
                                     num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16))
    c = by_name(step_costs(RankShare(moe, 2), decode_shape(1, 4)))
    assert c["moe_experts.all_reduce"].link_bytes == L * 2 * (1 / 2) * 1 * H * 2
    assert c["moe_experts.all_reduce"].calls == L


def test_latent_attention_is_refused_at_tp(checkpoints):
    with pytest.raises(ValueError, match="latent attention"):
        RankShare(ModelConfig.from_dir(checkpoints("deepseekv2")), 2)


def test_fit_link_recovers_latency_and_bandwidth():
    link_bytes = [8e3 * 4 ** i for i in range(8)]
    seconds = [7e-6 + b / 300e9 for b in link_bytes]
    lat, bw = fit_link(link_bytes, seconds)
    assert lat == pytest.approx(7e-6, rel=1e-6) and bw == pytest.approx(300e9, rel=1e-6)


def test_link_measured_or_assumed():
    c = fake_ceilings()
    two, four = c.link(2), c.link(4)
    assert two.measured and two.latency == 10e-6 and two.busbw == 100e9
    assert not four.measured and four.busbw == ASSUMED_LINK["busbw"] and "assumed" in four.describe()
    assert Ceilings.from_dict(c.to_dict()).link(2) == two


def test_gloo_link_between_two_processes():
    r = measure_link("cpu", 2, sizes=(8 << 10, 256 << 10, 2 << 20), iters=2, reps=2)
    assert r["backend"] == "gloo" and "gloo" in r["kind"] and r["ranks"] == 2
    assert r["latency"] >= 0 and r["busbw"] > 0 and len(r["seconds_by_bytes"]) == 3


def test_predicted_step_at_tp_by_hand():
    """Decode batch 1 at context 100 on 2 ranks: every compute op at max(FLOPs / peak, bytes / bw)
    plus, by hand, 2L + 1 all-reduces and one all-gather at latency + link bytes / busbw."""
    c, share = fake_ceilings(), RankShare(cfg(), 2)
    shape = decode_shape(1, 100)
    costs = step_costs(share, shape)
    compute = sum(max(x.flops / 1e14, x.bytes / 1e12) for x in costs if x.kind != "collective")
    m = 1 * H * 2                                                   # one token's activation, bf16
    comm = (2 * L + 1) * (10e-6 + m / 100e9) + (10e-6 + 0.5 * V * 2 / 100e9)
    assert predicted_step_s(share, c, shape) == pytest.approx(compute + comm, rel=1e-9)
    row, = predict(cfg(), c, batches=(1,), contexts=(100,), precisions=("bf16",), tensor_parallel_size=2)
    assert row.tp == 2 and row.decode_s == pytest.approx(compute + comm, rel=1e-9)
    assert row.decode_comm_s == pytest.approx(comm, rel=1e-9)
    assert row.decode_comm_share == pytest.approx(comm / (compute + comm))
    assert row.decode_bound == "communication"          # a tiny model: ten link latencies dwarf its bytes
    one, = predict(cfg(), c, batches=(1,), contexts=(100,), precisions=("bf16",))
    assert one.decode_comm_s == 0 and one.tp == 1
    # each rank's KV budget holds twice the sequences (half the KV heads a rank)
    assert row.kv_bytes_per_seq == one.kv_bytes_per_seq / 2
    pre = step_costs(share, prefill_shape(1, 100))
    assert row.prefill_comm_s == pytest.approx(sum(c.link(2).seconds(x.link_bytes, x.calls) for x in pre
                                                   if x.kind == "collective"))


@pytest.fixture
def cached_fake(monkeypatch, tmp_path):
    """The fake ceilings as this CPU's cached ones (with the link among 2 ranks)."""
    from ridge.utils import ceilings as ce
    from ridge.utils.device_cache import write_json
    monkeypatch.setenv("RIDGE_CACHE_DIR", str(tmp_path))
    c = fake_ceilings()
    c.device, c.key = "cpu", ce.device_key(torch.device("cpu"))
    write_json(ce.cache_path("cpu"), CACHE_VERSION, c.to_dict())
    monkeypatch.setattr("ridge.utils.collectives.measure_link", lambda *a, **k: pytest.fail("a link was measured"))
    monkeypatch.setattr("ridge.utils.collectives.link_available", lambda device, ranks: False)
    return c


def test_report_shows_the_comm_share(checkpoints, cached_fake, tmp_path, capsys):
    from ridge.cli import main
    path = checkpoints("llama")
    out = tmp_path / "r"
    assert main(["roofline", "--model", path, "--device", "cpu", "--predict", "--tensor-parallel-size", "2",
                 "--precisions", "bf16", "--predict-batches", "1", "8", "--predict-contexts", "64",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "decode comm (share)" in text and "prefill comm (share)" in text and "measured" in text
    md = (out / "report.md").read_text()
    assert "decode comm (share)" in md and "prediction only" in md
    assert main(["roofline", "--model", path, "--device", "cpu", "--predict", "--tensor-parallel-size", "4",
                 "--precisions", "bf16", "--predict-batches", "1", "--predict-contexts", "64"]) == 0
    assert "assumed" in capsys.readouterr().out
    assert main(["roofline", "--model", path, "--device", "cpu", "--tensor-parallel-size", "2"]) == 2
    assert "add --predict" in capsys.readouterr().err

