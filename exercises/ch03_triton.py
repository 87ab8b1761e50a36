"""Chapter 03 exercise: the roofline by hand, then two Triton kernels.

Fill in every function below (replace ``raise NotImplementedError``), then grade yourself:

    minserve grade ch03

Part 1 is arithmetic on the roofline (chapter 03's claim section): plain Python, floats in, floats out. Units
are in the names: ``_s`` seconds, ``flops`` a count of floating-point operations, ``_flops_per_s``,
``_bytes_per_s``.

Part 2 is Triton. A kernel is a Python function decorated with ``@triton.jit``; it is launched over a *grid*
of programs, ``kernel[grid](args...)``, and each program finds its share of the work from
``tl.program_id(0)``. It loads a block of ``BLOCK`` elements at once with ``tl.load(ptr + offsets,
mask=mask)``, where ``offsets = start + tl.arange(0, BLOCK)``; lanes whose ``mask`` is false are not read
(they take ``other``) and not written by ``tl.store``. ``BLOCK`` must be a power of two known when the kernel
is compiled (``tl.constexpr``), and the sizes here are not multiples of it, so the masks matter.

Triton compiles kernels for a CUDA GPU. Without one, ``TRITON_INTERPRET=1`` runs them on the CPU, one program
after another, on CPU tensors: that is how they are graded on a laptop (the grader sets it). To try your
kernels in a notebook or a shell without a GPU, set it before anything imports triton:

    import os; os.environ["TRITON_INTERPRET"] = "1"

The launchers take tensors on the kernels' device (CUDA, or the CPU under the interpreter) and return new
tensors; they never change their inputs. Do the arithmetic inside the kernels; the launchers only check the
inputs, allocate the output and launch.

Import only torch, triton and the standard library: the grader refuses a file that imports minserve (whose
own kernels and roofline are answers).
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


# --- part 2: Triton ----------------------------------------------------------------------------------------


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):
    """``out[i] = x[i] + y[i]`` for the ``BLOCK`` elements of program ``tl.program_id(0)``.

    Program ``p`` handles elements ``p·BLOCK … p·BLOCK + BLOCK − 1``; those at or past ``n_elements`` are
    masked off (neither read nor written). Launched over ``triton.cdiv(n_elements, BLOCK)`` programs.
    """
    raise NotImplementedError


def vector_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x + y`` for two 1-D tensors of the same length and dtype, computed by :func:`add_kernel`.

    Returns a new tensor (``torch.empty_like(x)`` filled by the kernel); launches nothing for empty inputs.
    Raises ``ValueError`` when the shapes differ. Use a ``BLOCK`` of 1024 (any power of two works).
    """
    raise NotImplementedError


@triton.jit
def rms_norm_kernel(x_ptr, weight_ptr, out_ptr, n_cols, eps, BLOCK: tl.constexpr):
    """One program normalizes one row of a contiguous ``[rows, n_cols]`` tensor: row ``tl.program_id(0)``.

    ``out = x / sqrt(mean(x²) + eps) * weight``, with the mean over the row's ``n_cols`` elements. Load the
    row (``BLOCK ≥ n_cols``, a power of two; lanes past ``n_cols`` masked, loaded as 0.0 so they add nothing
    to the sum) and the weight, compute in float32 (``.to(tl.float32)``), and store in the output's dtype
    (``out_ptr.dtype.element_ty``).
    """
    raise NotImplementedError


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x`` (any leading shape), computed by :func:`rms_norm_kernel`.

    ``weight`` has ``x.shape[-1]`` elements. Returns a new tensor of ``x``'s shape and dtype. Flatten ``x``
    to a contiguous ``[rows, n_cols]``, launch one program per row with ``BLOCK = triton.next_power_of_2(n_cols)``,
    and launch nothing when there are no rows. Raises ``ValueError`` when the weight's size is not
    ``x.shape[-1]``.
    """
    raise NotImplementedError
