"""What chapter 03's graded tests plug a learner's paged decode-attention kernel into: the real engine.

The learner writes ``paged_decode_attention(query, kv_cache, block_tables, context_lens, scale)`` over the
engine's own cache layout (:func:`minserve.model.attention.allocate_kv_cache`). :func:`greedy_tokens` runs
``minserve-tiny`` with the torch backend, once as it is and once with a backend whose decode steps attend
by the learner's function (:class:`DecodeAttentionBackend`); a correct kernel gives the same greedy tokens.
:func:`paged_case` and :func:`reference_attention` are the random shapes and the float64 answer the
kernel-level tests (public and hidden) compare against, through :func:`assert_attends`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from minserve.engine.llm import LLM
from minserve.engine.sampling_params import SamplingParams
from minserve.model.attention import store_kv
from minserve.model.backends import TorchBackend

DecodeAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


class DecodeAttentionBackend(TorchBackend):
    """The torch backend, except that a step in which every sequence decodes one token stores its keys and
    values and then attends by ``decode_attention`` (counted in ``calls``). Prefill stays torch's. What the
    function raises is kept in ``errors`` as well: the engine contains it to the step's requests, and the
    grader wants it said."""

    name = "learner"

    def __init__(self, decode_attention: DecodeAttention) -> None:
        self.decode_attention = decode_attention
        self.calls = 0
        self.errors: list[Exception] = []

    def attention(self, q, k, v, kv_cache, meta, scale, sliding_window, kv_scales=None):
        plain = kv_cache is None or sliding_window is not None or kv_scales is not None
        step = None if plain else meta.device_tensors(q.device)
        if step is None or not step.all_decode:
            return super().attention(q, k, v, kv_cache, meta, scale, sliding_window, kv_scales)
        store_kv(k, v, kv_cache, meta.slot_mapping)
        self.calls += 1
        try:
            return self.decode_attention(q, kv_cache, meta.block_tables, step.context_lens, scale)
        except Exception as error:
            self.errors.append(error)
            raise


def greedy_tokens(
    decode_attention: DecodeAttention | None, prompts: Sequence[str], max_tokens: int
) -> tuple[list[list[int]], int]:
    """``minserve-tiny``'s greedy tokens for ``prompts`` (float32, the torch backend), decoding with
    ``decode_attention`` (``None``: the engine's own attention), and how many attention calls it answered.
    Raises the first exception ``decode_attention`` raised, if it did."""
    with LLM("minserve-tiny", dtype="float32", backend="torch", num_threads=1) as llm:
        backend = None if decode_attention is None else DecodeAttentionBackend(decode_attention)
        if backend is not None:
            llm.engine.model.set_backend(backend)
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        outputs = llm.generate(list(prompts), params, use_tqdm=False)
    if backend is not None and backend.errors:
        raise backend.errors[0]
    return [list(output.token_ids) for output in outputs], 0 if backend is None else backend.calls


@dataclass(frozen=True)
class PagedCase:
    """One decode step's inputs in the engine's layout, with every slot no sequence owns set to NaN."""

    query: torch.Tensor  # [batch, num_heads, head_dim]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [batch, max_blocks] int64; padding entries point at a block of NaN
    context_lens: torch.Tensor  # [batch] int32
    scale: float


def paged_case(
    contexts: Sequence[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str = "cpu",
) -> PagedCase:
    """Random queries, keys and values for sequences of ``contexts`` tokens, their blocks scattered through
    the cache in a random order (with spare blocks no table names), every table padded by at least one
    entry. Unowned slots, including those past each context in its last block, hold NaN: a kernel that reads
    one returns NaN. The scale is not ``1/√head_dim``, so a kernel that ignores its argument shows."""
    generator = torch.Generator().manual_seed(seed)
    owned = [math.ceil(n / block_size) for n in contexts]
    num_blocks = sum(owned) + 2
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), math.nan)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    nan_block = order.pop()  # never written: where padding entries point
    tables = torch.full((len(contexts), max(owned, default=0) + 1), nan_block, dtype=torch.int64)
    for i, n in enumerate(contexts):
        for b in range(owned[i]):
            physical = order.pop()
            tables[i, b] = physical
            filled = min(block_size, n - b * block_size)
            cache[:, physical, :filled] = torch.randn(2, filled, num_kv_heads, head_dim, generator=generator)
    query = torch.randn(len(contexts), num_heads, head_dim, generator=generator)
    lens = torch.tensor(list(contexts), dtype=torch.int32)
    to = {"device": device}
    return PagedCase(query.to(dtype=dtype, **to), cache.to(dtype=dtype, **to), tables.to(**to), lens.to(**to),
                     0.7 / math.sqrt(head_dim))  # fmt: skip


def reference_attention(case: PagedCase) -> torch.Tensor:
    """The answer in float64, gathered token by token through the tables: ``[batch, num_heads, head_dim]``."""
    query, cache = case.query.double().cpu(), case.kv_cache.double().cpu()
    tables, lens = case.block_tables.cpu(), case.context_lens.cpu()
    block_size, num_kv_heads = cache.shape[2], cache.shape[3]
    group = query.shape[1] // num_kv_heads
    out = torch.empty_like(query)
    for i, n in enumerate(lens.tolist()):
        positions = torch.arange(n)
        physical = tables[i, positions // block_size]
        keys, values = (cache[side, physical, positions % block_size] for side in (0, 1))  # [n, kv_heads, d]
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", query[i], keys) * case.scale
        out[i] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), values)
    return out


def attend(decode_attention: DecodeAttention, case: PagedCase) -> torch.Tensor:
    """``decode_attention`` on ``case``, checked to have left its inputs as they were."""
    inputs = (case.query, case.kv_cache, case.block_tables, case.context_lens)
    before = [t.clone() for t in inputs]
    out = decode_attention(*inputs, case.scale)
    assert all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in zip(inputs, before)), "an input changed"
    return out


def assert_attends(decode_attention: DecodeAttention, case: PagedCase, tolerance: float) -> None:
    """``decode_attention`` gives ``case``'s answer: the query's shape and dtype, no NaN (said as what a NaN
    means here), and within ``tolerance`` of :func:`reference_attention`."""
    out = attend(decode_attention, case)
    assert out.shape == case.query.shape and out.dtype == case.query.dtype, (out.shape, out.dtype)
    assert not out.isnan().any(), (
        "NaN in the output: a slot past a sequence's context (or a padding entry of its block table) was read "
        "into the softmax; mask the keys and values past context_lens[i], and read only the table entries of "
        "blocks the context reaches"
    )
    torch.testing.assert_close(out.double().cpu(), reference_attention(case), rtol=tolerance, atol=tolerance)
