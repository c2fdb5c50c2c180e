"""The fused RoPE + KV-cache write kernel (ridge.kernels.rotary.rope_write_kv).

Contract: its rotated q, k and the cache it writes are bit-identical to the kernel's rotation
alone (every slot negative) followed by the reference cache write (write_kv_ref, a copy), and within the rotary kernel's rounding bound of the torch
reference (rope_write_kv_ref: apply_rotary_ref, then write_kv_ref), which the CPU/torch backend
keeps running. Inputs are q/k/v views split out of a fused QKV output; caches are poisoned with
NaN, so a slot written by mistake, or a padding row (slot -1) that writes, shows.

On CPU the kernels run under the Triton interpreter; with a GPU they compile, the CPU-tensor
tests are skipped and the `gpu` tests run at Llama-3-8B shapes.
"""
import dataclasses
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

import pytest  # noqa: E402
from tests.kernels.test_fused_kernels import apply_rotary, assert_rotary_bf16, rope_truth  # noqa: E402
from tests.kernels.test_fused_kernels_gpu import fresh_generator  # noqa: E402

from ridge.kernels.attention_meta import AttentionMetadata, KVPages  # noqa: E402
from ridge.kernels.attention_ref import write_kv_ref  # noqa: E402
from ridge.kernels.rotary import apply_rotary_ref, rope_write_kv, rope_write_kv_ref  # noqa: E402
from ridge.layers.attention import TORCH_BACKEND, Attention, select_backend  # noqa: E402
from ridge.layers.rotary import RotaryEmbedding  # noqa: E402
from tests.tests_support import capture_cuda_graph  # noqa: E402

BF16, FP32 = torch.bfloat16, torch.float32
PAGE = 16
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _cpu_tests_need_the_interpreter(request):
    if "gpu" not in request.keywords and not INTERPRET:
        pytest.skip("CPU-tensor kernel tests run under TRITON_INTERPRET=1")


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns (NaN poison compares equal to itself)."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same_bits(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype, what
    assert torch.equal(bits(a), bits(b)), f"{what}: not bit-identical"


def make_inputs(T, H, KVH, D, dtype, g, num_pages, max_pos, device="cpu", pad_rows=()):
    """q, k, v as views of one fused QKV output (the model's layout), positions, slots (distinct,
    shuffled over the pool; -1 at pad_rows) and a NaN-poisoned (k_cache, v_cache)."""
    qkv = (2 * torch.randn(T, (H + 2 * KVH) * D, generator=g, device=device)).to(dtype)
    q = qkv[:, :H * D].view(T, H, D)
    k = qkv[:, H * D:(H + KVH) * D].view(T, KVH, D)
    v = qkv[:, (H + KVH) * D:].view(T, KVH, D)
    positions = torch.randint(0, max_pos, (T,), generator=g, device=device)
    positions[0] = max_pos - 1
    slots = torch.randperm(num_pages * PAGE, generator=g, device=device)[:T]
    slots[list(pad_rows)] = -1
    caches = [torch.full((num_pages, PAGE, KVH, D), float("nan"), dtype=dtype, device=device) for _ in range(2)]
    return qkv, q, k, v, positions, slots, caches


def check_fused(q, k, v, positions, slots, caches, rope, what):
    """Fused vs the rotation alone + write_kv_ref (bit for bit) vs the torch reference (rounding bound,
    exact in fp32); untouched slots stay poisoned. Returns the fused (q_out, k_out, k_cache, v_cache)."""
    KVH, D = k.shape[1:]
    kc1, vc1 = (c.clone() for c in caches)
    q1, k1, v1 = rope_write_kv(positions, q, k, v, rope.cos, rope.sin, kc1, vc1, slots)
    assert v1 is v                              # a 16/32-bit cache: attention reads v itself
    # the peer: the kernel's rotation alone, then the reference cache write (a copy)
    kc2, vc2 = (c.clone() for c in caches)
    q2, k2 = apply_rotary(positions, q, k, rope.cos, rope.sin)
    written_rows = slots >= 0
    write_kv_ref(k2[written_rows], v[written_rows], kc2, vc2, slots[written_rows])
    for a, b, name in ((q1, q2, "q"), (k1, k2, "k"), (kc1, kc2, "k_cache"), (vc1, vc2, "v_cache")):
        assert_same_bits(a, b, f"{what}: fused vs rotation then copy, {name}")
    # the torch reference: the CPU backend's rope_write_kv (which never sees a padding row), and
    # its rotation alone on every row
    real = slots >= 0
    ref_q, ref_k = apply_rotary_ref(positions, q, k, rope.cos, rope.sin)
    kc3, vc3 = (c.clone() for c in caches)
    q3, k3, _ = rope_write_kv_ref(positions[real], q[real], k[real], v[real], rope.cos, rope.sin, kc3, vc3,
                                  slots[real])
    written = torch.zeros(caches[0].shape[0] * PAGE, dtype=torch.bool, device=slots.device)
    written[slots[real]] = True
    for kc, vc, kr in ((kc1, vc1, k1[real]), (kc3, vc3, k3)):
        flat_k, flat_v = kc.view(-1, KVH, D), vc.view(-1, KVH, D)
        assert_same_bits(flat_k[slots[real]], kr, f"{what}: cache holds the returned k")
        assert_same_bits(flat_v[slots[real]], v[real], f"{what}: cache holds v")
        assert flat_k[~written].isnan().all() and flat_v[~written].isnan().all(), f"{what}: a stray write"
    if q.dtype == FP32:
        # the same fp32 products and sum in the same order as the reference: identical
        for a, b, name in ((q1, ref_q, "q"), (k1, ref_k, "k"), (kc1, kc3, "k_cache"), (vc1, vc3, "v_cache")):
            assert_same_bits(a, b, f"{what}: fused vs reference fp32, {name}")
    else:
        for out, x, ref in ((q1, q, ref_q), (k1, k, ref_k)):
            assert_rotary_bf16(out, x, rope_truth(positions, x, rope), ref)
    return q1, k1, kc1, vc1


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("tokens", [1, 19])
def test_fused_matches_separate_kernels_and_reference(tokens, heads, kv_heads, head_dim):
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, None)
    g = torch.Generator().manual_seed(tokens * head_dim + heads)
    pad = (3, 11, 18) if tokens > 1 else ()       # a program a token: padding rows among real ones, and last
    qkv, q, k, v, positions, slots, caches = make_inputs(tokens, heads, kv_heads, head_dim, BF16, g,
                                                         num_pages=-(-tokens // PAGE) + 3, max_pos=4096,
                                                         pad_rows=pad)
    assert tokens == 1 or not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    before = qkv.clone()
    check_fused(q, k, v, positions, slots, caches, rope, f"T={tokens} {heads}:{kv_heads} d={head_dim}")
    assert torch.equal(qkv, before)   # the inputs are read, never written


def test_fp32_equals_the_reference_and_llama3_scaling():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024}
    rope = RotaryEmbedding(64, 4096, 500000.0, scaling)
    g = torch.Generator().manual_seed(5)
    _, q, k, v, positions, slots, caches = make_inputs(21, 8, 2, 64, FP32, g, num_pages=4, max_pos=4096,
                                                       pad_rows=(0, 20))
    check_fused(q, k, v, positions, slots, caches, rope, "fp32")


def test_padding_row_alone_rotates_and_writes_nothing():
    """A decode step's CUDA-graph pad (T=1, slot -1): q and k are still rotated, the cache is not
    touched."""
    rope = RotaryEmbedding(128, 64, 10000.0, None)
    g = torch.Generator().manual_seed(9)
    _, q, k, v, positions, slots, caches = make_inputs(1, 4, 1, 128, BF16, g, num_pages=2, max_pos=64,
                                                       pad_rows=(0,))
    q1, k1, kc, vc = check_fused(q, k, v, positions, slots, caches, rope, "pad only")
    assert kc.isnan().all() and vc.isnan().all() and not (q1.isnan().any() or k1.isnan().any())


def test_rejects_bad_shapes():
    rope = RotaryEmbedding(64, 64, 10000.0, None)
    g = torch.Generator().manual_seed(1)
    _, q, k, v, positions, slots, (kc, vc) = make_inputs(3, 4, 2, 64, FP32, g, num_pages=1, max_pos=64)
    with pytest.raises(ValueError, match="slot_mapping"):
        rope_write_kv(positions, q, k, v, rope.cos, rope.sin, kc, vc, slots[:2])
    with pytest.raises(ValueError, match="v must"):
        rope_write_kv(positions, q, k, v[:, :1], rope.cos, rope.sin, kc, vc, slots)
    with pytest.raises(ValueError, match="caches"):
        rope_write_kv(positions, q, k, v, rope.cos, rope.sin, kc[..., :32], vc[..., :32], slots)
    with pytest.raises(ValueError, match="positions"):
        rope_write_kv(positions[:1], q, k, v, rope.cos, rope.sin, kc, vc, slots)


def test_attention_layer_rotates_through_its_backend():
    """One code path: the Attention layer hands the unrotated q, k, v, the positions and the
    rotary tables to backend.rope_write_kv, and attends with what it returns. On a CPU the
    default backend's is the torch reference; the Triton backend's is the fused kernel."""
    assert select_backend(torch.device("cpu")).rope_write_kv is rope_write_kv_ref
    assert select_backend(torch.device("cpu"), "triton").rope_write_kv is rope_write_kv
    rope = RotaryEmbedding(64, 64, 10000.0, None)
    seen = {}

    def spy_rope_write_kv(*args):
        seen["rope"] = args
        seen["rotated"] = rope_write_kv_ref(*args)
        return seen["rotated"]

    def spy_attend(q, k, v, k_cache, v_cache, meta, scale, window, kv_scales):
        seen["attend"] = (q, k, v)
        return TORCH_BACKEND.attend(q, k, v, k_cache, v_cache, meta, scale, window, kv_scales)

    backend = dataclasses.replace(TORCH_BACKEND, rope_write_kv=spy_rope_write_kv, attend=spy_attend)
    layer = Attention(4, 2, 64, None, backend, rope)
    g = torch.Generator().manual_seed(3)
    _, q, k, v, _, _, (kc, vc) = make_inputs(5, 4, 2, 64, FP32, g, num_pages=1, max_pos=64)
    positions = torch.arange(5)
    meta = AttentionMetadata(slot_mapping=torch.arange(5), query_start_loc=torch.tensor([0, 5], dtype=torch.int32),
                             seq_lens=torch.tensor([5], dtype=torch.int32),
                             page_tables=torch.zeros(1, 1, dtype=torch.int32), query_start_loc_cpu=[0, 5],
                             seq_lens_cpu=[5], max_query_len=5, max_seq_len=5)
    layer(positions, q, k, v, KVPages(kc, vc), meta)
    args = seen["rope"]
    assert args[0] is positions and args[1] is q and args[2] is k and args[3] is v
    assert args[4] is rope.cos and args[5] is rope.sin and args[6] is kc and args[7] is vc
    assert args[8] is meta.slot_mapping
    assert seen["attend"][0] is seen["rotated"][0] and seen["attend"][1] is seen["rotated"][1]
    assert seen["attend"][2] is v


# ------------------------------------------------------------------------------- GPU, real shapes
HEADS, KV_HEADS, HEAD_DIM, MAX_POS = 32, 8, 128, 131072     # Llama-3-8B


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_gpu_fused_matches_separate_kernels(tokens):
    g, seed = fresh_generator()
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    rope = RotaryEmbedding(HEAD_DIM, MAX_POS, 500000.0, scaling).cuda()
    pad = (0,) if tokens == 1 else (1, tokens // 2, tokens - 1)
    for pad_rows in ((), pad):
        _, q, k, v, positions, slots, caches = make_inputs(tokens, HEADS, KV_HEADS, HEAD_DIM, BF16, g,
                                                           num_pages=-(-tokens // PAGE) + 8, max_pos=MAX_POS,
                                                           device="cuda", pad_rows=pad_rows)
        check_fused(q, k, v, positions, slots, caches, rope, f"T={tokens} pad={pad_rows} seed {seed}")


@pytest.mark.gpu
@needs_gpu
def test_gpu_fused_kernel_captures_in_a_cuda_graph_and_the_backend_uses_it():
    """Records into a CUDA graph (no host sync) and replays on new inputs and slots; the
    Triton backend's rope_write_kv is this kernel."""
    assert select_backend(torch.device("cuda")).rope_write_kv is rope_write_kv
    g, seed = fresh_generator()
    T = 8
    rope = RotaryEmbedding(HEAD_DIM, 4096, 500000.0, None).cuda()
    qkv, q, k, v, positions, slots, caches = make_inputs(T, HEADS, KV_HEADS, HEAD_DIM, BF16, g, num_pages=4,
                                                         max_pos=4096, device="cuda")
    kc, vc = (c.clone() for c in caches)

    def step():
        return rope_write_kv(positions, q, k, v, rope.cos, rope.sin, kc, vc, slots)

    graph, (q_out, k_out, v_out) = capture_cuda_graph(step)     # rope_write_kv's (q, k, v) as attention reads them
    assert v_out is v                           # a 16-bit cache: attention reads v itself
    qkv.copy_(torch.randn(qkv.shape, generator=g, device="cuda"))
    positions.copy_(torch.randint(0, 4096, (T,), generator=g, device="cuda"))
    new_slots = torch.randperm(4 * PAGE, generator=g, device="cuda")[:T]
    new_slots[T - 1] = -1
    slots.copy_(new_slots)
    kc.copy_(caches[0])
    vc.copy_(caches[1])
    graph.replay()
    torch.cuda.synchronize()
    kc2, vc2 = (c.clone() for c in caches)
    q2, k2 = apply_rotary(positions, q, k, rope.cos, rope.sin)
    write_kv_ref(k2[slots >= 0], v[slots >= 0], kc2, vc2, slots[slots >= 0])
    for a, b, name in ((q_out, q2, "q"), (k_out, k2, "k"), (kc, kc2, "k_cache"), (vc, vc2, "v_cache")):
        assert_same_bits(a, b, f"graph replay {name} seed {seed}")
