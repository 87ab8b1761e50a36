"""Weight-only quantized matmuls, W8A16 and W4A16: the weight is read narrow and widened inside the matmul.

A decode step multiplies a few rows of activations by every weight matrix of the model, ``[M, K] @ [K, N]``
with ``M`` the batch, often 1. Each weight element read from memory is used ``M`` times, so at small ``M`` the
step is bound by how fast the weights stream from memory, not by arithmetic. Stored as int8 a weight is
1 byte instead of bfloat16's 2, as int4 half a byte: a kernel that reads the narrow codes and widens them
in registers reads 2 or 4 times fewer bytes per step, and that is the whole speed-up. Widening the weight
to bfloat16 first and then calling a matmul (the fallback in :mod:`minserve.quant.linear`) writes and reads
a full bfloat16 copy: more bytes than if the layer had never been quantized.

The tiling. One program computes one ``BLOCK_M × BLOCK_N`` tile of the output. It walks ``K`` in steps of
``BLOCK_K``: it loads a tile of ``x`` ``[BLOCK_M, BLOCK_K]`` and the codes of a weight tile
``[BLOCK_K, BLOCK_N]``, widens the codes, and adds their ``tl.dot`` to a float32 accumulator. ``tl.dot``
takes tiles of at least 16 along every side, so a decode step's single row is padded to 16 by masking.
The padding rows cost registers and multiplies, which a memory-bound step has to spare, not memory reads.

Where the scale is applied:

* **int8**, one scale per output channel: ``Σₖ x[m,k] · q[n,k] · s[n] = s[n] · Σₖ x[m,k] · q[n,k]``, so the
  K loop multiplies the raw codes (exact in 16 bits: ``|q| ≤ 127``) and the scale multiplies the accumulator
  once, after the loop.
* **int4**, a scale and zero point per group of ``group_size`` inputs: they change along ``K``, so they are
  applied inside the loop, to each tile's codes before its dot: ``w = (q − 8) · scale + zero``. So that a
  tile holds one group's scales, ``BLOCK_K`` divides ``group_size``: the launcher takes
  ``gcd(group_size, BLOCK_K it would like)``, and refuses a ``group_size`` that is not a multiple of 16.

The layouts are those of :class:`~minserve.quant.linear.Int8Linear` and ``Int4Linear`` on a GPU:

    x [M, K] float16 / bfloat16 / float32
    w8a16: codes [N, K] int8, scales [N]                                   →  out [M, N] in x's dtype
    w4a16: packed [N, K/2] uint8 (byte j of a row: code 2j in its low nibble, code 2j+1 in its high one),
           scales_and_zeros [K / group_size, N, 2] (scale, value of code 8)  →  out [M, N] in x's dtype
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from minserve.kernels._common import check_device, compare, interpreting

MIN_BLOCK = 16  # the smallest tile side tl.dot takes
INT4_MIDDLE = 8  # an int4 code's value is (code - 8) · scale + zero


@triton.jit
def _tile_dot(x, w, DOT_FP32: tl.constexpr):
    """``x [BM, BK] @ w [BK, BN]`` in float32. The 16-bit path is the tensor cores'; float32 operands (a float32
    input, or the interpreter, whose dot of bfloat16 multiplies raw bits) take full IEEE precision, not TF32."""
    if DOT_FP32:
        product = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    else:
        product = tl.dot(x, w.to(x.dtype))
    return product


@triton.jit
def _w8a16_kernel(
    x_ptr, codes_ptr, scales_ptr, out_ptr, M, N, K, codes_row_stride,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_in, col_in = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k_start in range(0, K, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        k_in = ks < K  # a ragged last step: zeros beyond K add nothing to the dot
        x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=row_in[:, None] & k_in[None, :], other=0.0)
        code_ptrs = codes_ptr + cols[None, :] * codes_row_stride + ks[:, None]
        codes = tl.load(code_ptrs, mask=k_in[:, None] & col_in[None, :], other=0)
        acc += _tile_dot(x, codes, DOT_FP32)
    scales = tl.load(scales_ptr + cols, mask=col_in, other=0.0).to(tl.float32)
    out = acc * scales[None, :]  # one scale per output channel: once, after the whole sum
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_in[:, None] & col_in[None, :])  # fmt: skip


@triton.jit
def _w4a16_kernel(
    x_ptr, packed_ptr, sz_ptr, out_ptr, M, N, K, group_size,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_in, col_in = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k_start in range(0, K, BLOCK_K):  # K is a multiple of group_size, hence of BLOCK_K: no ragged step
        ks = k_start + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=row_in[:, None], other=0.0)
        # Two neighbouring k share a byte; the second load of it hits the cache, not memory.
        pairs = tl.load(packed_ptr + cols[None, :] * (K // 2) + (ks // 2)[:, None], mask=col_in[None, :], other=0)
        codes = (pairs >> ((ks % 2) * 4)[:, None]) & 0xF
        group_sz = sz_ptr + ((k_start // group_size) * N + cols) * 2  # the whole tile lies in one group
        scale = tl.load(group_sz, mask=col_in, other=0.0).to(tl.float32)
        zero = tl.load(group_sz + 1, mask=col_in, other=0.0).to(tl.float32)
        w = (codes.to(tl.float32) - 8.0) * scale[None, :] + zero[None, :]  # 8: INT4_MIDDLE
        acc += _tile_dot(x, w, DOT_FP32)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_in[:, None] & col_in[None, :])  # fmt: skip


def w8a16_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` (float16, bfloat16, float32) times the int8 weight ``codes [N, K]`` with one scale per
    output channel ``scales [N]`` (any float dtype): ``[M, N]`` in x's dtype, ``x @ (codes · scales[:, None])ᵀ``.
    ``codes`` may be a view of wider rows (a CPU-padded weight's first K columns): it is read in place."""
    check_device(x, codes, scales)
    _check_activations(x, "w8a16_matmul")
    (M, K), N = x.shape, codes.shape[0]
    if codes.stride(-1) != 1:
        codes = codes.contiguous()
    if codes.dtype != torch.int8 or codes.shape != (N, K):
        raise ValueError(
            f"w8a16_matmul: codes must be int8 [N, K={K}] (K from x's last dimension), got {codes.dtype} "
            f"{tuple(codes.shape)}: quantize the weight with minserve.quant's int8 format"
        )
    if scales.shape != (N,):
        raise ValueError(f"w8a16_matmul: scales must be [N={N}], one per output channel, got {tuple(scales.shape)}")
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    block_m, block_n, block_k = _tiles(x)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _w8a16_kernel[grid](
        x.contiguous(), codes, scales.contiguous(), out, M, N, K, codes.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_FP32=_dot_fp32(x),
    )  # fmt: skip
    return out


def w4a16_matmul(
    x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """``x [M, K]`` (float16, bfloat16, float32) times the int4 weight held as ``packed [N, K/2]`` uint8 (two
    codes a byte, the even input in the low nibble) and ``scales_and_zeros [K / group_size, N, 2]`` (any float
    dtype): ``[M, N]`` in x's dtype, each weight ``(code − 8) · scale + zero`` of its group."""
    check_device(x, packed, scales_and_zeros)
    _check_activations(x, "w4a16_matmul")
    block_k = _int4_block_k(x, group_size)
    (M, K), N = x.shape, packed.shape[0]
    if packed.dtype != torch.uint8 or packed.shape != (N, K // 2) or K % 2:
        raise ValueError(
            f"w4a16_matmul: packed must be uint8 [N, K/2={K / 2:g}] (K={K} from x's last dimension, even), got "
            f"{packed.dtype} {tuple(packed.shape)}: pack two codes a byte, as Int4Linear does off the CPU"
        )
    if K % group_size:
        raise ValueError(f"w4a16_matmul: group_size {group_size} must divide K={K}; choose one that does")
    if scales_and_zeros.shape != (K // group_size, N, 2):
        raise ValueError(
            f"w4a16_matmul: scales_and_zeros must be [K/group_size={K // group_size}, N={N}, 2], "
            f"got {tuple(scales_and_zeros.shape)}"
        )
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    block_m, block_n, _ = _tiles(x)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _w4a16_kernel[grid](
        x.contiguous(), packed.contiguous(), scales_and_zeros.contiguous(), out, M, N, K, group_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_FP32=_dot_fp32(x),
    )  # fmt: skip
    return out


def _check_activations(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(
            f"{name}: x must be 2-D [M, K] float16, bfloat16 or float32, got {x.dtype} {tuple(x.shape)}: "
            "flatten the leading dimensions and cast"
        )


def _tiles(x: torch.Tensor) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K)`` for an ``x`` of ``M`` rows."""
    if not x.is_cuda:  # the interpreter: small tiles keep it quick, and test shapes still span several of each
        return MIN_BLOCK, MIN_BLOCK, 2 * MIN_BLOCK
    block_m = min(64, max(MIN_BLOCK, triton.next_power_of_2(x.shape[0])))
    block_n = 32 if x.shape[0] <= MIN_BLOCK else 64  # few rows: narrow tiles, so enough programs to fill the GPU
    return block_m, block_n, 128


def _int4_block_k(x: torch.Tensor, group_size: int) -> int:
    """The largest ``BLOCK_K`` that divides both the preferred one and ``group_size``: one group per tile."""
    if group_size <= 0 or group_size % MIN_BLOCK:
        raise ValueError(
            f"w4a16_matmul: group_size {group_size} must be a multiple of {MIN_BLOCK} (a K-tile lies within one "
            f"group, and tl.dot takes tiles of at least {MIN_BLOCK}): requantize with group size 32, 64, 128 or 256"
        )
    return math.gcd(group_size, _tiles(x)[2])


def _dot_fp32(x: torch.Tensor) -> bool:
    return interpreting() or x.dtype == torch.float32


def reference_w8a16(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What :func:`w8a16_matmul` computes, in plain torch: the weight widened, then a float32 matmul."""
    weight = codes.float() * scales.float()[:, None]
    return (x.float() @ weight.t()).to(x.dtype)


def reference_w4a16(
    x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """What :func:`w4a16_matmul` computes, in plain torch: the weight unpacked and widened, a float32 matmul."""
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(1).float()  # [N, K], 0…15
    scales, zeros = (scales_and_zeros[..., i].float().t().repeat_interleave(group_size, dim=1) for i in (0, 1))
    weight = (codes - INT4_MIDDLE) * scales + zeros
    return (x.float() @ weight.t()).to(x.dtype)


def benchmark(
    format: str = "int8", m: int = 1, n: int = 4096, k: int = 4096, group_size: int = 128,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, float]:  # fmt: skip
    """The ``format`` (``"int8"`` or ``"int4"``) kernel against ``F.linear`` on a bfloat16 weight of the same
    shape, on the GPU: milliseconds, and GB/s of what each side reads and writes (run it at ``m=1`` and
    ``m=16``: the kernel wins by reading fewer bytes, so the rates are close and the times are not)."""
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    full = torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5
    activation_bytes = (m * k + m * n) * x.element_size()  # read x, write out
    torch_bytes = activation_bytes + full.numel() * full.element_size()
    if format == "int8":
        scales = full.float().abs().amax(dim=1) / 127
        codes = torch.round(full.float() / scales[:, None]).to(torch.int8)
        scales = scales.to(torch.bfloat16)
        kernel_bytes = activation_bytes + codes.numel() + 2 * scales.numel()

        def kernel() -> torch.Tensor:
            return w8a16_matmul(x, codes, scales)
    elif format == "int4":  # random codes and scales: the speed does not depend on the values
        packed = torch.randint(0, 256, (n, k // 2), device="cuda", dtype=torch.uint8)
        sz = torch.rand(k // group_size, n, 2, device="cuda", dtype=torch.bfloat16) / 64
        kernel_bytes = activation_bytes + packed.numel() + 2 * sz.numel()

        def kernel() -> torch.Tensor:
            return w4a16_matmul(x, packed, sz, group_size)
    else:
        raise ValueError(f"benchmark: format must be 'int8' or 'int4', got {format!r}")
    row = compare(kernel, lambda: torch.nn.functional.linear(x, full), kernel_bytes, "gbps")
    row["torch_gbps"] = torch_bytes / row["torch_ms"] / 1e6  # compare() counted the kernel's bytes for both
    return row
