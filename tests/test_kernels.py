"""Every Triton kernel against its torch reference, on random inputs of several shapes (ragged ones
included), in float32 and 16-bit. On a machine without a GPU they run under Triton's interpreter on the CPU
(tests/conftest.py sets TRITON_INTERPRET=1), so the shapes stay small.

Tolerances, stated per dtype: float32 results agree to 1e-5; a 16-bit result may differ from the
reference by about one unit in the last place, because the kernel keeps intermediates in float32 where
torch rounds them (bfloat16 has 8 bits of mantissa: 2⁻⁸ ≈ 0.4% relative; float16 has 11).
"""

from __future__ import annotations

import pytest
import torch

from minserve.kernels import decode_attention, kv_store, prefill_attention, rms_norm, rotary, silu_and_mul

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCES = {  # dtype: (rtol, atol)
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 4e-2),
    torch.float16: (2e-3, 4e-3),
}
DTYPES = list(TOLERANCES)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    rtol, atol = TOLERANCES[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol)


def paged_cache(context_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int, dtype, seed: int = 0):
    """A random cache and block tables that scatter each sequence's blocks at random over the cache."""
    generator = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_needed) + 3  # a few blocks nobody owns
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    order = torch.randperm(num_blocks, generator=generator)
    tables = torch.zeros(len(context_lens), max(blocks_needed), dtype=torch.int64)
    taken = 0
    for i, n in enumerate(blocks_needed):
        tables[i, :n] = order[taken : taken + n]
        taken += n
    return cache.to(DEVICE), tables.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "d"), [(1, 16), (7, 24), (33, 688)])
def test_silu_and_mul(dtype, num_tokens, d):
    x = torch.randn(num_tokens, 2 * d, device=DEVICE).to(dtype)
    assert_close(silu_and_mul.silu_and_mul(x), silu_and_mul.reference(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "hidden"), [(1, 16), (5, 40), (17, 256)])
@pytest.mark.parametrize("with_addend", [False, True])
def test_rms_norm_fused_with_the_residual_add(dtype, num_tokens, hidden, with_addend):
    x, addend = (torch.randn(num_tokens, hidden, device=DEVICE).to(dtype) for _ in range(2))
    weight = torch.randn(hidden, device=DEVICE).to(dtype)
    addend = addend if with_addend else None
    out, residual = rms_norm.rms_norm(x, weight, 1e-5, addend)
    expected_out, expected_residual = rms_norm.reference(x, weight, 1e-5, addend)
    assert_close(out, expected_out)
    assert_close(residual, expected_residual)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 16), (6, 6, 32), (8, 1, 64)])
def test_rotary_in_place_on_views_of_a_fused_projection(dtype, num_heads, num_kv_heads, head_dim):
    num_tokens = 9
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE).to(dtype)
    q, k, _ = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k = q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim)  # strided views
    positions = torch.tensor([0, 1, 2, 7, 100, 101, 2047, 5, 3], device=DEVICE)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, device=DEVICE).float() / head_dim)
    expected_q, expected_k = rotary.reference(q, k, positions, inv_freq)
    rotary.apply_rotary_(q, k, positions, inv_freq)
    assert_close(q, expected_q)
    assert_close(k, expected_k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_store_writes_each_slot_and_skips_minus_one(dtype):
    cache = torch.zeros(2, 6, 4, 2, 16, device=DEVICE, dtype=dtype)
    expected = cache.clone()
    key, value = (torch.randn(7, 2, 16, device=DEVICE).to(dtype) for _ in range(2))
    slots = torch.tensor([3, 0, 23, -1, 7, 8, 12], device=DEVICE)
    kv_store.store_kv(key, value, cache, slots)
    kv_store.reference(key, value, expected, slots)
    assert torch.equal(cache, expected)  # a copy is exact
    assert cache.count_nonzero() == expected.count_nonzero() > 0


DECODE_CASES = [
    # block_size, heads, kv heads, head_dim, context lengths, sliding window, splits (None: chosen)
    (8, 4, 2, 16, [1, 9, 40], None, None),
    (16, 4, 4, 32, [200, 3, 129], None, 4),
    (4, 8, 2, 16, [70, 33], 20, 2),
    (16, 2, 1, 64, [300], None, 8),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("block_size", "heads", "kv_heads", "head_dim", "lens", "window", "splits"), DECODE_CASES)
def test_paged_decode_attention(dtype, block_size, heads, kv_heads, head_dim, lens, window, splits):
    cache, tables = paged_cache(lens, block_size, kv_heads, head_dim, dtype)
    query = torch.randn(len(lens), heads, head_dim, device=DEVICE).to(dtype)
    context_lens = torch.tensor(lens, device=DEVICE)
    scale = head_dim**-0.5
    out = decode_attention.decode_attention(query, cache, tables, context_lens, scale, window, splits)
    assert_close(out, decode_attention.reference(query, cache, tables, context_lens, scale, window))


def test_split_k_gives_the_same_answer_however_many_splits():
    cache, tables = paged_cache([250, 97], 16, 2, 32, torch.float32)
    query = torch.randn(2, 4, 32, device=DEVICE)
    lens = torch.tensor([250, 97], device=DEVICE)
    one = decode_attention.decode_attention(query, cache, tables, lens, 0.2, num_splits=1)
    for splits in (2, 4, 16):  # 16 splits of 250 keys: some splits of the shorter sequence are empty
        assert_close(decode_attention.decode_attention(query, cache, tables, lens, 0.2, num_splits=splits), one)


PREFILL_CASES = [
    # block_size, heads, kv heads, head_dim, new tokens per sequence, context lengths, sliding window
    (8, 4, 2, 16, [5, 20, 1], [5, 37, 9], None),  # fresh, a cached prefix of 17, a decode row
    (16, 4, 4, 32, [33], [50], None),  # a chunk after 17 cached tokens
    (4, 4, 2, 16, [12, 7], [30, 7], 6),  # a sliding window
    (16, 2, 1, 64, [40, 3], [40, 64], None),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("block_size", "heads", "kv_heads", "head_dim", "qlens", "clens", "window"), PREFILL_CASES)
def test_paged_prefill_attention(dtype, block_size, heads, kv_heads, head_dim, qlens, clens, window):
    cache, tables = paged_cache(clens, block_size, kv_heads, head_dim, dtype)
    query = torch.randn(sum(qlens), heads, head_dim, device=DEVICE).to(dtype)
    starts = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], device=DEVICE)
    query_lens, context_lens = torch.tensor(qlens, device=DEVICE), torch.tensor(clens, device=DEVICE)
    scale = head_dim**-0.5
    args = (query, cache, tables, starts, query_lens, context_lens)
    out = prefill_attention.prefill_attention(*args, max(qlens), scale, window)
    assert_close(out, prefill_attention.reference(*args, scale, window))


def test_kernels_refuse_cpu_tensors_without_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        silu_and_mul.silu_and_mul(torch.randn(2, 8))


def test_benchmark_rows_turn_milliseconds_into_rates(monkeypatch):
    from minserve.kernels import _common

    timings = iter([2.0, 4.0])  # kernel 2 ms, torch 4 ms
    monkeypatch.setattr(_common, "time_ms", lambda fn: next(timings))
    row = _common.compare(lambda: None, lambda: None, 8e9, "gbps")  # 8 GB moved
    assert row == {"kernel_ms": 2.0, "torch_ms": 4.0, "kernel_gbps": 4000.0, "torch_gbps": 2000.0}
    timings = iter([1.0, 2.0])
    row = _common.compare(lambda: None, lambda: None, 3e12, "tflops")  # 3 TFLOP
    assert row["kernel_tflops"] == 3000.0 and row["torch_tflops"] == 1500.0


# --- an 8-bit KV cache: int8 or float8 e4m3 codes, one scale per (keys or values, KV head) ------------------

OLD_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9)  # no e4m3 in Triton there
CODE_DTYPES = [torch.int8, pytest.param(torch.float8_e4m3fn, marks=pytest.mark.skipif(OLD_GPU, reason="sm < 8.9"))]


def codes_and_scales(cache: torch.Tensor, code_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cache``'s values as codes of ``code_dtype``, and the ``[2, kv_heads]`` float32 scales that map each
    KV head's largest magnitude to the largest code (the heads' scales differ: the random values do)."""
    scales = cache.float().abs().amax(dim=(1, 2, 4)) / kv_store.CODE_MAX[code_dtype]  # [2, kv_heads]
    codes = torch.stack([kv_store.reference_codes(cache[i].flatten(0, 1), scales[i], code_dtype) for i in (0, 1)])
    return codes.view(cache.shape), scales


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("code_dtype", CODE_DTYPES)
def test_kv_store_writes_the_references_8bit_codes_and_skips_minus_one(code_dtype, dtype):
    cache = torch.zeros(2, 6, 4, 2, 16, device=DEVICE, dtype=code_dtype)
    expected = cache.clone()
    key, value = (torch.randn(7, 2, 16, device=DEVICE).mul(3).to(dtype) for _ in range(2))
    scales = torch.tensor([[0.5, 0.03], [0.25, 0.07]], device=DEVICE)
    # With head 0's key scale of 0.5 these land on exact halves of int8 codes (2.5, −2.5, 0.5, 1.5: ties to
    # even), on a tie and on a carry of e4m3 (100 → 96, 7.75 → 8), and past the codes' range (clipped).
    key[:, 0, :10] = torch.tensor([1.25, -1.25, 0.25, 0.75, 50.0, 3.875, 500.0, -500.0, 0.0, -0.0]).to(dtype)
    slots = torch.tensor([3, 0, 23, -1, 7, 8, 12], device=DEVICE)
    kv_store.store_kv(key, value, cache, slots, scales)
    kv_store.reference(key, value, expected, slots, scales)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))  # the same codes, bit for bit
    written = torch.zeros(6 * 4, dtype=torch.bool)
    written[[3, 0, 23, 7, 8, 12]] = True
    assert cache.view(torch.uint8).flatten(1, 2)[:, ~written.to(DEVICE)].count_nonzero() == 0  # −1: nowhere


def test_an_8bit_cache_needs_its_scales_and_a_16bit_one_refuses_them():
    key = torch.randn(2, 2, 16, device=DEVICE)
    slots = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(ValueError, match=r"needs kv_scales of shape \[2, 2\]"):
        kv_store.store_kv(key, key, torch.zeros(2, 1, 4, 2, 16, device=DEVICE, dtype=torch.int8), slots)
    with pytest.raises(ValueError, match="kv_scales are for an 8-bit KV cache"):
        kv_store.store_kv(key, key, torch.zeros(2, 1, 4, 2, 16, device=DEVICE), slots, torch.ones(2, 2, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("code_dtype", CODE_DTYPES)
@pytest.mark.parametrize(
    ("block_size", "heads", "kv_heads", "head_dim", "lens", "window", "splits"), [DECODE_CASES[0], DECODE_CASES[2]]
)
def test_paged_decode_attention_over_an_8bit_cache(
    code_dtype, dtype, block_size, heads, kv_heads, head_dim, lens, window, splits
):
    cache, tables = paged_cache(lens, block_size, kv_heads, head_dim, torch.float32)
    codes, scales = codes_and_scales(cache, code_dtype)
    query = torch.randn(len(lens), heads, head_dim, device=DEVICE).to(dtype)
    context_lens = torch.tensor(lens, device=DEVICE)
    args = (query, codes, tables, context_lens, head_dim**-0.5, window)
    out = decode_attention.decode_attention(*args, splits, kv_scales=scales)
    assert_close(out, decode_attention.reference(*args, kv_scales=scales))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("code_dtype", CODE_DTYPES)
@pytest.mark.parametrize(
    ("block_size", "heads", "kv_heads", "head_dim", "qlens", "clens", "window"), [PREFILL_CASES[0], PREFILL_CASES[2]]
)
def test_paged_prefill_attention_over_an_8bit_cache(
    code_dtype, dtype, block_size, heads, kv_heads, head_dim, qlens, clens, window
):
    cache, tables = paged_cache(clens, block_size, kv_heads, head_dim, torch.float32)
    codes, scales = codes_and_scales(cache, code_dtype)
    query = torch.randn(sum(qlens), heads, head_dim, device=DEVICE).to(dtype)
    starts = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], device=DEVICE)
    query_lens, context_lens = torch.tensor(qlens, device=DEVICE), torch.tensor(clens, device=DEVICE)
    args = (query, codes, tables, starts, query_lens, context_lens)
    scale = head_dim**-0.5
    out = prefill_attention.prefill_attention(*args, max(qlens), scale, window, kv_scales=scales)
    assert_close(out, prefill_attention.reference(*args, scale, window, kv_scales=scales))


def test_fp8_codes_on_a_gpu_older_than_ada_are_refused_naming_int8(monkeypatch):
    from minserve.kernels import _common

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))  # an A100
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'"):
        _common.check_fp8_support(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))  # an H100
    _common.check_fp8_support(torch.device("cuda", 0))
