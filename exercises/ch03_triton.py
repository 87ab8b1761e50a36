"""Chapter 03 exercise: the roofline by hand, then paged decode attention in Triton.

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

Import only torch, triton and the standard library: the grader refuses a file that imports minserve (whose
own kernels and roofline are answers).
"""

from __future__ import annotations

import torch
import triton  # noqa: F401  (for your kernel and its launch)
import triton.language as tl  # noqa: F401

# --- part 1: the roofline by hand --------------------------------------------------------------------------


def matmul_intensity(m: int, n: int, k: int, bytes_per_element: int = 2) -> float:
    """Arithmetic intensity (FLOP per byte) of ``C[m, n] = A[m, k] @ B[k, n]``.

    FLOPs: ``2 m n k`` (a multiply and an add per term). Bytes: A and B read once and C written once, each
    element ``bytes_per_element`` bytes. A ``1 × k`` times ``k × n`` product (one token through a weight
    matrix, as in decode) has an intensity of about ``2 / bytes_per_element``.
    """
    raise NotImplementedError


def ridge_point(peak_flops_per_s: float, bandwidth_bytes_per_s: float) -> float:
    """The intensity (FLOP/byte) where the roofline's two roofs meet: ``peak / bandwidth``.

    Raises ``ValueError`` when the peak or the bandwidth is not positive (as every function here that takes
    them does).
    """
    raise NotImplementedError


def roofline_time_s(flops: float, bytes_moved: float, peak_flops_per_s: float, bandwidth_bytes_per_s: float) -> float:
    """The roofline's lower bound on the time of ``flops`` FLOPs that move ``bytes_moved`` bytes.

    Whichever takes longer, computing at the peak or moving the bytes at the bandwidth. Raises
    ``ValueError`` when the peak or the bandwidth is not positive.
    """
    raise NotImplementedError


def bound(flops: float, bytes_moved: float, peak_flops_per_s: float, bandwidth_bytes_per_s: float) -> str:
    """``"compute"`` or ``"memory"``: which roof limits this work. A tie counts as ``"compute"``."""
    raise NotImplementedError


def critical_batch_size(peak_flops_per_s: float, bandwidth_bytes_per_s: float, bytes_per_weight: int = 2) -> float:
    """The decode batch at which reading the weights once per step stops being the bottleneck.

    A decode step of ``B`` sequences does ``2 B`` FLOPs per weight and reads the weight's bytes once, so its
    intensity is ``2 B / bytes_per_weight`` (KV reads ignored). Return the ``B`` where that equals the ridge
    point. In bf16 it is the ridge point itself: H100 989e12 / 3.35e12 ≈ 295.
    """
    raise NotImplementedError


def attention_intensity(query_tokens: int, context_tokens: int, bytes_per_element: int = 2) -> float:
    """Intensity of multi-head attention of ``T = query_tokens`` queries over ``S = context_tokens`` keys.

    Per head of width ``d``: ``QKᵀ`` and ``PV`` do ``4 d S T`` FLOPs; the kernel reads K and V (``2 S d``
    elements) and reads Q and writes the output (``2 T d``). So ``d`` cancels, and in 16-bit the result is
    ``S·T / (S + T)``; in general ``(2 / bytes_per_element) · S·T / (S + T)``.
    """
    raise NotImplementedError


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
    raise NotImplementedError


# --- part 2: paged decode attention in Triton --------------------------------------------------------------

# Your kernel (or kernels) go here: a function decorated with @triton.jit, launched by the function below.


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
    raise NotImplementedError
