"""The simplest correct generation loop: one request at a time, its KV cache in consecutive blocks.

This is the yardstick the batched engine is tested against. It uses the same model, attention interface
and sampler as the engine, and nothing else: prefill the prompt in one forward, then decode one token per
forward until a stop condition holds.

It borrows the model and gives it back untouched: its own KV caches are attached only for the length of
each forward, and whatever caches the model held before (an engine's, say) are put back right after, even
between the tokens it yields. So an ``LLM`` whose model the reference loop has used goes on generating
exactly as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from minserve.engine.sampler import make_generator, sample
from minserve.engine.sampling_params import SamplingParams
from minserve.model.attention import AttentionMetadata, allocate_kv_cache
from minserve.model.llama import LlamaForCausalLM

BLOCK_SIZE_TOKENS = 16


@contextmanager
def _borrowed_kv_caches(model: LlamaForCausalLM, caches: list[torch.Tensor]) -> Iterator[None]:
    """Attach ``caches`` to ``model`` for the body, then put back exactly what each layer held before."""
    previous = [layer.self_attn.kv_cache for layer in model.layers]
    model.set_kv_caches(caches)
    try:
        yield
    finally:
        for layer, cache in zip(model.layers, previous):
            layer.self_attn.kv_cache = cache


@torch.inference_mode()
def generate_token_ids(
    model: LlamaForCausalLM,
    prompt_token_ids: list[int],
    params: SamplingParams,
    stop_token_ids: tuple[int, ...] = (),
    should_stop: Callable[[list[int]], bool] = lambda ids: False,
    max_context_tokens: int | None = None,
) -> Iterator[tuple[int, float]]:
    """Yield (token id, time produced in seconds) for each output token of one request.

    Stops after ``params.max_tokens`` tokens, at a stop token (unless ``ignore_eos``), when the context is
    full (``max_context_tokens``, default the model's own limit), or when ``should_stop`` says so (the
    caller's check for stop strings).
    """
    config = model.config
    device = next(model.parameters()).device
    max_context_tokens = min(max_context_tokens or config.max_position_embeddings, config.max_position_embeddings)
    context_tokens = min(len(prompt_token_ids) + params.max_tokens, max_context_tokens)
    num_blocks = -(-context_tokens // BLOCK_SIZE_TOKENS)
    caches = allocate_kv_cache(
        config.num_layers, num_blocks, BLOCK_SIZE_TOKENS, config.num_kv_heads, config.head_dim,
        next(model.parameters()).dtype, device,
    )  # fmt: skip
    block_table = torch.arange(num_blocks, device=device)[None, :]
    generator = make_generator(params, device)
    tokens = list(prompt_token_ids)
    new = tokens
    output: list[int] = []
    while True:
        start = len(tokens) - len(new)
        positions = torch.arange(start, len(tokens), device=device)
        meta = AttentionMetadata(
            query_lens=[len(new)], context_lens=[len(tokens)], slot_mapping=positions, block_tables=block_table
        )
        with _borrowed_kv_caches(model, caches):  # never left attached while the caller holds a token
            hidden = model(torch.tensor(new, device=device), positions, meta)
        token = sample(model.compute_logits(hidden[-1:])[0], params, generator, (prompt_token_ids, output))
        output.append(token)
        tokens.append(token)
        yield token, time.perf_counter()
        if (
            len(output) >= params.max_tokens
            or len(tokens) >= max_context_tokens
            or (token in stop_token_ids and not params.ignore_eos)
            or should_stop(output)
        ):
            return
        new = [token]
