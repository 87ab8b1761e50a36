"""The dequantize-in-the-matmul kernels (W8A16, W4A16) against their torch references, and those references
against what :mod:`minserve.quant.linear`'s modules mean, so the kernels compute the modules' product.

Without a GPU they run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so the
shapes stay small: ragged ``M`` and ``N`` (and ragged ``K`` for int8) against tiles of 16 × 16 × 32.

Tolerances, stated per dtype as in tests/test_kernels.py: float32 agrees to 1e-5; a 16-bit result may
differ from the reference by about one unit in its last place, since both sum in float32 but round the
sum (and for int4 the widened weight, on a GPU) at different points: bfloat16 2⁻⁸ ≈ 0.4% relative,
float16 2⁻¹¹. The interpreter runs bfloat16 too, once its dot is taken in float32 (the kernel does so).
"""

from __future__ import annotations

import pytest
import torch

from minserve.kernels import quant_matmul
from minserve.quant.formats import QuantizedWeight, quantize
from minserve.quant.linear import Int4Linear, Int8Linear, _triton_kernels, pack_int4

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCES = {  # dtype: (rtol, atol)
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 4e-2),
    torch.float16: (2e-3, 4e-3),
}
DTYPES = list(TOLERANCES)
ROWS = [1, 5, 17]  # a decode step, a ragged batch, more than one row tile


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    rtol, atol = TOLERANCES[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol)


def random_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k**0.5


def int8_weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``codes [n, k]`` int8 and ``scales [n]`` bfloat16, as :class:`Int8Linear` passes them to the kernel: built
    on the CPU, a ``k`` that is no multiple of 16 is padded, and the kernel reads a view of the first ``k``."""
    layer = Int8Linear(quantize(random_weight(n, k), "int8"), None)
    return layer.codes.to(DEVICE)[:, :k], layer.scales.to(DEVICE)


def int4_layout(q: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """``packed [n, k/2]`` uint8 and ``scales_and_zeros [k/group, n, 2]`` bfloat16, as :class:`Int4Linear`
    holds them off the CPU. Built here, since on the CPU the module keeps torch's packing (which takes
    only multiples of 16 outputs); test_w4a16_reference_is_the_int4_module checks it is the module's."""
    scales_and_zeros = torch.stack([q.scales.t(), q.zeros.t()], dim=-1).to(torch.bfloat16)
    return pack_int4(q.codes).to(DEVICE), scales_and_zeros.to(DEVICE)


def int4_weight(n: int, k: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return int4_layout(quantize(random_weight(n, k), "int4", group_size))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize(("n", "k"), [(16, 64), (48, 128), (40, 72)])  # the last: ragged N and K
def test_w8a16_matches_its_reference(dtype, m, n, k):
    codes, scales = int8_weight(n, k)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    assert_close(quant_matmul.w8a16_matmul(x, codes, scales), quant_matmul.reference_w8a16(x, codes, scales))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize(("n", "k", "group_size"), [(16, 64, 32), (48, 128, 64), (40, 96, 48)])
def test_w4a16_matches_its_reference(dtype, m, n, k, group_size):
    """Group 64 spans two K-tiles of the interpreter's 32; group 48 takes tiles of 16; N = 40 is ragged."""
    packed, sz = int4_weight(n, k, group_size)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    expected = quant_matmul.reference_w4a16(x, packed, sz, group_size)
    assert_close(quant_matmul.w4a16_matmul(x, packed, sz, group_size), expected)


def test_w8a16_reference_is_the_int8_module():
    q = quantize(random_weight(48, 128), "int8")
    layer = Int8Linear(q, None)
    x = torch.randn(5, 128)
    expected = x @ q.with_scales_in(torch.bfloat16).dequantize().t()
    assert_close(quant_matmul.reference_w8a16(x, layer.codes, layer.scales), expected)
    assert_close(quant_matmul.reference_w8a16(x, layer.codes, layer.scales), x @ layer.dequantized_weight().t())
    x16 = x.to(torch.bfloat16)  # and the kernel against the module's own CPU kernel, in what that takes
    out = quant_matmul.w8a16_matmul(*(t.to(DEVICE) for t in (x16, layer.codes, layer.scales)))
    assert_close(out.cpu(), layer(x16))


@pytest.mark.parametrize("group_size", [32, 64])
def test_w4a16_reference_is_the_int4_module(group_size):
    q = quantize(random_weight(48, 128), "int4", group_size)
    layer = Int4Linear(q, None)
    packed, sz = int4_layout(q)
    assert torch.equal(sz.cpu(), layer.scales_and_zeros)
    x = torch.randn(5, 128)
    expected = x @ q.with_scales_in(torch.bfloat16).dequantize().t()
    assert_close(quant_matmul.reference_w4a16(x, packed.cpu(), sz.cpu(), group_size), expected)
    x16 = x.to(torch.bfloat16)  # and the kernel against torch's packed int4 CPU kernel the module calls
    out = quant_matmul.w4a16_matmul(x16.to(DEVICE), packed, sz, group_size)
    assert_close(out.cpu(), layer(x16))


def test_pack_int4_puts_the_even_input_in_the_low_nibble():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert pack_int4(codes).tolist() == [[0x21, 0x0F]]


def test_no_rows_give_an_empty_product():
    codes, scales = int8_weight(16, 64)
    assert quant_matmul.w8a16_matmul(torch.empty(0, 64, device=DEVICE), codes, scales).shape == (0, 16)


def test_shapes_the_kernels_cannot_take_are_refused_naming_the_fix():
    packed, sz = int4_weight(16, 64, 32)
    x = torch.randn(3, 64, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of 16.*requantize with group size 32, 64, 128 or 256"):
        quant_matmul.w4a16_matmul(x, pack_int4(torch.zeros(16, 64, dtype=torch.uint8)), sz, 8)
    with pytest.raises(ValueError, match="group_size 48 must divide K=64"):
        quant_matmul.w4a16_matmul(x, packed, sz, 48)
    with pytest.raises(ValueError, match=r"scales_and_zeros must be \[K/group_size=1"):
        quant_matmul.w4a16_matmul(x, packed, sz, 64)
    with pytest.raises(ValueError, match="packed must be uint8"):
        quant_matmul.w4a16_matmul(torch.randn(3, 128, device=DEVICE), packed, sz, 32)
    codes, scales = int8_weight(16, 64)
    with pytest.raises(ValueError, match="codes must be int8"):
        quant_matmul.w8a16_matmul(x, codes.float(), scales)
    with pytest.raises(ValueError, match="scales must be"):
        quant_matmul.w8a16_matmul(x, codes, scales[:8])
    with pytest.raises(ValueError, match="flatten the leading dimensions"):
        quant_matmul.w8a16_matmul(x[None], codes, scales)


def test_kernels_refuse_cpu_tensors_without_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    codes, scales = int8_weight(16, 64)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        quant_matmul.w8a16_matmul(torch.randn(2, 64), codes.cpu(), scales.cpu())
    packed, sz = int4_weight(16, 64, 32)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        quant_matmul.w4a16_matmul(torch.randn(2, 64), packed.cpu(), sz.cpu(), 32)


def test_the_modules_find_the_kernels_where_triton_is_installed():
    assert _triton_kernels() is quant_matmul


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the modules call the kernels on CUDA tensors only")
@pytest.mark.parametrize("format", ["int8", "int4"])
def test_modules_on_cuda_call_the_kernels(format, monkeypatch):
    layer = (Int8Linear if format == "int8" else Int4Linear)(quantize(random_weight(48, 128).cuda(), format), None)
    x = torch.randn(5, 128, device="cuda", dtype=torch.bfloat16)
    calls = []
    kernel = "w8a16_matmul" if format == "int8" else "w4a16_matmul"
    original = getattr(quant_matmul, kernel)
    monkeypatch.setattr(quant_matmul, kernel, lambda *args: calls.append(1) or original(*args))
    assert_close(layer(x), torch.nn.functional.linear(x, layer.dequantized_weight(x.dtype)))
    assert calls == [1]
