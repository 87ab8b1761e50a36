"""Chapter 03 exercise: the roofline by hand, then paged decode attention in Triton. Reference solution.

Fill in every function below (replace ``raise NotImplementedError``), then grade yourself:

    minserve grade ch03

Part 1 is arithmetic on the roofline (chapter 03's claim section): plain Python, floats in, floats out. Units
are in the names: ``_s`` seconds, ``flops`` a count of floating-point operations, ``_flops_per_s``,
``_bytes_per_s``.

Part 2 is Triton, and the kernel at the heart of a serving engine's decode step: **paged decode attention**.
In a decode step every sequence brings one new token. Its query attends over every key and value the
sequence has cached, and those live in fixed-size *blocks* scattered through one cache tensor (chapter 04's
paged KV cache): the sequence's row of the *block table* says which physical block holds its tokens
``0 … block_size − 1``, which the next ``block_size``, and so on; its last block is partly filled. A
decode step is bound by the bytes of KV it reads (part 1's arithmetic), so the kernel reads each key and
value once, where it lies, and never copies a sequence's context into a tensor of its own first: that copy
is exactly what paging exists to avoid.

A Triton kernel is a Python function decorated with ``@triton.jit``, launched over a *grid* of programs,
``kernel[grid](args...)``; each program finds its share of the work from ``tl.program_id(axis)``. It loads
a tile at once, ``tl.load(ptr + offsets, mask=mask, other=0.0)``, where ``offsets`` are built from
``tl.arange(0, N)`` (``N`` a power of two known when the kernel is compiled: a ``tl.constexpr``); lanes
whose ``mask`` is false are not read (they take ``other``) and not written by ``tl.store``. Pointers are
element addresses: ``ptr + i`` is the ``i``-th element, so pass a tensor's strides to step through it.

The design is yours: the kernel's arguments, its grid, how it walks a context. One that works: a program
per (sequence, KV head), which loads the query heads that share its KV head once (grouped-query attention:
each key is then read once for the whole group), walks the sequence's blocks through its row of the table,
loads one block's keys and values as a ``[block_size, head_dim]`` tile, masks the slots past the context,
and keeps a running softmax (the maximum so far, the sum of exponentials, the weighted sum of values,
rescaled whenever the maximum grows: the *online softmax* of FlashAttention) so it never holds every score
at once. Flash-decoding splits long contexts across several programs and merges them; vLLM's paged
attention kernel and minserve's own (``kernels/decode_attention.py``, which you may not import) are two
designs to read once yours works.

Triton compiles kernels for a CUDA GPU. Without one, ``TRITON_INTERPRET=1`` runs them on the CPU, one program
after another, on CPU tensors: that is how they are graded on a laptop (the grader sets it). To try your
kernel in a notebook or a shell without a GPU, set it before anything imports triton:

    import os; os.environ["TRITON_INTERPRET"] = "1"

The grader checks it against a float64 reference on random shapes (grouped-query heads, ragged contexts,
blocks in random places, every slot past a context and every padding entry of the table pointing at NaN,
so a missing mask shows), in 16-bit, and then plugs it into the engine as the attention of every decode
step: ``minserve-tiny``'s greedy tokens must equal the ones the engine's own torch attention gives.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# --- part 1: the roofline by hand --------------------------------------------------------------------------


def matmul_intensity(m: int, n: int, k: int, bytes_per_element: int = 2) -> float:
    """Arithmetic intensity (FLOP per byte) of ``C[m, n] = A[m, k] @ B[k, n]``.

    FLOPs: ``2 m n k`` (a multiply and an add per term). Bytes: A and B read once and C written once, each
    element ``bytes_per_element`` bytes. A ``1 × k`` times ``k × n`` product (one token through a weight
    matrix, as in decode) has an intensity of about ``2 / bytes_per_element``.
    """
    flops = 2 * m * n * k
    bytes_moved = (m * k + k * n + m * n) * bytes_per_element
    return flops / bytes_moved


def ridge_point(peak_flops_per_s: float, bandwidth_bytes_per_s: float) -> float:
    """The intensity (FLOP/byte) where the roofline's two roofs meet: ``peak / bandwidth``.

    Raises ``ValueError`` when the peak or the bandwidth is not positive (as every function here that takes
    them does).
    """
    _check_roofs(peak_flops_per_s, bandwidth_bytes_per_s)
    return peak_flops_per_s / bandwidth_bytes_per_s


def roofline_time_s(flops: float, bytes_moved: float, peak_flops_per_s: float, bandwidth_bytes_per_s: float) -> float:
    """The roofline's lower bound on the time of ``flops`` FLOPs that move ``bytes_moved`` bytes.

    Whichever takes longer, computing at the peak or moving the bytes at the bandwidth. Raises
    ``ValueError`` when the peak or the bandwidth is not positive.
    """
    _check_roofs(peak_flops_per_s, bandwidth_bytes_per_s)
    return max(flops / peak_flops_per_s, bytes_moved / bandwidth_bytes_per_s)


def bound(flops: float, bytes_moved: float, peak_flops_per_s: float, bandwidth_bytes_per_s: float) -> str:
    """``"compute"`` or ``"memory"``: which roof limits this work. A tie counts as ``"compute"``."""
    _check_roofs(peak_flops_per_s, bandwidth_bytes_per_s)
    compute_s, memory_s = flops / peak_flops_per_s, bytes_moved / bandwidth_bytes_per_s
    return "compute" if compute_s >= memory_s else "memory"


def critical_batch_size(peak_flops_per_s: float, bandwidth_bytes_per_s: float, bytes_per_weight: int = 2) -> float:
    """The decode batch at which reading the weights once per step stops being the bottleneck.

    A decode step of ``B`` sequences does ``2 B`` FLOPs per weight and reads the weight's bytes once, so its
    intensity is ``2 B / bytes_per_weight`` (KV reads ignored). Return the ``B`` where that equals the ridge
    point. In bf16 it is the ridge point itself: H100 989e12 / 3.35e12 ≈ 295.
    """
    return ridge_point(peak_flops_per_s, bandwidth_bytes_per_s) * bytes_per_weight / 2


def attention_intensity(query_tokens: int, context_tokens: int, bytes_per_element: int = 2) -> float:
    """Intensity of multi-head attention of ``T = query_tokens`` queries over ``S = context_tokens`` keys.

    Per head of width ``d``: ``QKᵀ`` and ``PV`` do ``4 d S T`` FLOPs; the kernel reads K and V (``2 S d``
    elements) and reads Q and writes the output (``2 T d``). So ``d`` cancels, and in 16-bit the result is
    ``S·T / (S + T)``; in general ``(2 / bytes_per_element) · S·T / (S + T)``.
    """
    s, t = context_tokens, query_tokens
    return 2 / bytes_per_element * s * t / (s + t)


def decode_step_time_s(
    params: float,
    batch: int,
    context_tokens: int,
    kv_bytes_per_token: float,
    peak_flops_per_s: float,
    bandwidth_bytes_per_s: float,
    bytes_per_weight: int = 2,
) -> float:
    """The roofline's bound on one decode step of ``batch`` sequences with ``context_tokens`` tokens each.

    FLOPs: ``2 × params`` per sequence (attention's own FLOPs left out). Bytes: every weight once for the
    whole batch (``params × bytes_per_weight``), plus each sequence's own KV cache
    (``context_tokens × kv_bytes_per_token``), which no two sequences share.
    """
    flops = 2 * params * batch
    bytes_moved = params * bytes_per_weight + batch * context_tokens * kv_bytes_per_token
    return roofline_time_s(flops, bytes_moved, peak_flops_per_s, bandwidth_bytes_per_s)


def _check_roofs(peak_flops_per_s: float, bandwidth_bytes_per_s: float) -> None:
    if peak_flops_per_s <= 0 or bandwidth_bytes_per_s <= 0:
        raise ValueError(f"peak and bandwidth must be positive, got {peak_flops_per_s} and {bandwidth_bytes_per_s}")


# --- part 2: paged decode attention in Triton --------------------------------------------------------------


@triton.jit
def paged_decode_kernel(
    q_ptr, cache_ptr, tables_ptr, context_lens_ptr, out_ptr,
    scale, num_heads, group, tables_stride, values_offset, block_stride, slot_stride, head_stride,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP_LANES: tl.constexpr,
):  # fmt: skip
    """Program (sequence, KV head): the ``group`` query heads that share this KV head, over every block of
    the sequence's context, with a running softmax (``m`` the largest score so far, ``l`` the sum of
    exponentials under it, ``acc`` the weighted values; both rescaled by ``e^(m_old − m_new)`` when ``m`` grows)."""
    seq, kv_head = tl.program_id(0), tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    lanes = tl.arange(0, GROUP_LANES)
    heads = kv_head * group + lanes
    head_mask = lanes < group
    dims = tl.arange(0, HEAD_DIM)
    rows = (seq * num_heads + heads)[:, None] * HEAD_DIM + dims[None, :]  # [GROUP_LANES, HEAD_DIM]
    q = tl.load(q_ptr + rows, mask=head_mask[:, None], other=0.0).to(tl.float32)
    slots = tl.arange(0, BLOCK_SIZE)
    m = tl.full((GROUP_LANES,), float("-inf"), tl.float32)
    l_sum = tl.zeros((GROUP_LANES,), tl.float32)
    acc = tl.zeros((GROUP_LANES, HEAD_DIM), tl.float32)
    for block in range(0, tl.cdiv(context_len, BLOCK_SIZE)):  # every block holds at least one key
        physical = tl.load(tables_ptr + seq * tables_stride + block).to(tl.int64)
        in_context = block * BLOCK_SIZE + slots < context_len
        where = physical * block_stride + slots * slot_stride + kv_head * head_stride
        tile = where[:, None] + dims[None, :]  # [BLOCK_SIZE, HEAD_DIM]
        k = tl.load(cache_ptr + tile, mask=in_context[:, None], other=0.0).to(tl.float32)
        v = tl.load(cache_ptr + values_offset + tile, mask=in_context[:, None], other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUP_LANES, BLOCK_SIZE]
        scores = tl.where(in_context[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        rescale = tl.exp(m - m_new)  # 0 on the first block, where m is -inf
        p = tl.exp(scores - m_new[:, None])
        l_sum = l_sum * rescale + tl.sum(p, axis=1)
        acc = acc * rescale[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / l_sum[:, None]
    tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=head_mask[:, None])


def paged_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Each sequence's one new query token attending over its cached context, read in place by your kernel.

    The shapes are the engine's own, so the grader can plug this function into it:

    * ``query`` ``[batch, num_heads, head_dim]``: each sequence's new token's query heads;
    * ``kv_cache`` ``[2, num_blocks, block_size, num_kv_heads, head_dim]``: the keys (``kv_cache[0]``) and
      values (``kv_cache[1]``) of every cached token of every sequence, ``block_size`` slots a block;
    * ``block_tables`` ``[batch, max_blocks]``, integers: token ``t`` of sequence ``i`` is in block
      ``block_tables[i, t // block_size]``, slot ``t % block_size``; entries past a sequence's last block
      are padding and may hold anything;
    * ``context_lens`` ``[batch]``, integers ≥ 1: how many cached tokens sequence ``i`` attends to (its new
      token's key and value are already stored, so it attends to itself too).

    Query head ``h`` uses KV head ``h // (num_heads // num_kv_heads)``. Returns a new
    ``[batch, num_heads, head_dim]`` tensor in the query's dtype holding ``softmax(scale · q Kᵀ) V`` for each
    sequence and query head, with the arithmetic in float32 whatever the storage. ``head_dim`` and
    ``block_size`` are powers of two. The inputs are never changed; an empty batch returns an empty tensor
    and launches nothing. Raises ``ValueError`` when ``num_heads`` is not a multiple of ``num_kv_heads`` or
    the tensors disagree on the batch or the head size.
    """
    batch, num_heads, head_dim = query.shape
    num_kv_heads, kv_head_dim = kv_cache.shape[3], kv_cache.shape[4]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if kv_head_dim != head_dim or len(block_tables) != batch or len(context_lens) != batch:
        raise ValueError(
            f"shapes disagree: query {tuple(query.shape)}, kv_cache {tuple(kv_cache.shape)}, "
            f"block_tables {tuple(block_tables.shape)}, context_lens {tuple(context_lens.shape)}"
        )
    out = torch.empty_like(query)
    if batch == 0:
        return out
    query, block_tables, kv_cache = query.contiguous(), block_tables.contiguous(), kv_cache.contiguous()
    group = num_heads // num_kv_heads
    paged_decode_kernel[(batch, num_kv_heads)](
        query, kv_cache, block_tables, context_lens, out,
        scale, num_heads, group, block_tables.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        kv_cache.stride(2), kv_cache.stride(3),
        HEAD_DIM=head_dim, BLOCK_SIZE=kv_cache.shape[2], GROUP_LANES=triton.next_power_of_2(group),
    )  # fmt: skip
    return out
