"""The 8-bit KV cache: codes within their step of the values, scales that cover what calibration saw, twice
(four times) the tokens in the same memory, and every cache feature (prefix hits, preemption by swap and
by recompute, chunked prefill) giving the tokens it gives without them."""

import functools

import pytest
import torch

from minserve import LLM, SamplingParams
from minserve.model.kv_quant import CODE_MAX, HEADROOM, dequantize_kv, kv_absmax, quantize_kv
from minserve.quality.agreement import next_token_agreement
from minserve.quality.kv_cache import logits_through_cache

DTYPES = ["int8", "fp8"]
TORCH_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


@pytest.mark.parametrize("name", DTYPES)
def test_codes_come_back_within_half_a_step_of_the_values(name):
    dtype = TORCH_DTYPES[name]
    x = torch.randn(50, 3, 16, generator=torch.Generator().manual_seed(0)) * torch.tensor([1.0, 5.0, 0.1])[:, None]
    scales = x.abs().amax(dim=(0, 2)) / CODE_MAX[dtype]
    back = dequantize_kv(quantize_kv(x, scales, dtype), scales, torch.float32)
    if name == "int8":
        bound = (scales / 2)[None, :, None]
    else:  # e4m3: half an ulp, a relative 2^-4, above the subnormals' floor
        bound = torch.maximum(x.abs() * 2.0**-4, (2.0**-10 * scales)[None, :, None])
    assert torch.all((back - x).abs() <= bound * (1 + 1e-5))


def test_values_beyond_a_heads_range_are_clipped_to_it_not_wrapped():
    scales = torch.tensor([0.01])
    codes = quantize_kv(torch.tensor([[[5.0, -5.0]]]), scales, torch.int8)
    assert codes.tolist() == [[[127, -127]]]


@pytest.fixture(scope="module")
def int8_llm():
    return LLM(kv_cache_dtype="int8", kv_cache_memory_bytes=4 * 2**20)


def test_the_headroom_covers_text_calibration_never_saw(int8_llm):
    """The scales come from the json package's source; on the held-out text (other prose) almost no head
    reaches past its range, so clipping is rare, and without the headroom many would."""
    from minserve.quality import held_out_text

    engine = int8_llm.engine
    tokens = torch.tensor(int8_llm.tokenizer.encode(held_out_text(20_000))[:1024])
    seen = torch.stack(kv_absmax(engine.model, tokens))  # [layers, 2, heads]
    ranges = torch.stack(engine.kv_scales) * CODE_MAX[torch.int8]
    assert float((seen > ranges).float().mean()) <= 0.1
    assert float((seen > ranges / HEADROOM).float().mean()) > float((seen > ranges).float().mean())


@pytest.mark.parametrize(("kv_cache_dtype", "model_dtype", "ratio"), [("int8", "float32", 4), ("fp8", "bfloat16", 2)])
def test_the_same_kv_memory_holds_more_tokens_by_the_ratio_of_element_sizes(kv_cache_dtype, model_dtype, ratio):
    budget = 8 * 2**20
    full = LLM(dtype=model_dtype, kv_cache_memory_bytes=budget).stats()
    narrow = LLM(dtype=model_dtype, kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=budget).stats()
    assert narrow["kv_blocks_total"] == ratio * full["kv_blocks_total"]
    assert narrow["kv_cache_bytes"] <= budget


PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef walk(path):", "class Stack:\n", "The quick brown fox"]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
# Measured on 1,024 held-out tokens of minserve-tiny: KL 8e-5 (int8) and 5e-4 (fp8) nats a token.
KL_BOUND = {"int8": 1e-3, "fp8": 5e-3}


@pytest.mark.parametrize("name", DTYPES)
def test_an_8_bit_cache_keeps_the_next_token_distribution_of_float32(name, held_out_tokens):
    reference = LLM()
    engine = LLM(kv_cache_dtype=name).engine
    through = functools.partial(logits_through_cache, engine.model, cache_dtype=engine.kv_cache_dtype,
                                kv_scales=engine.kv_scales)  # fmt: skip
    kl = next_token_agreement(reference.model.logits_without_cache, through, held_out_tokens, 512).kl_per_token
    assert 0 < kl < KL_BOUND[name]
    # The bound can fail: scales 20× too small clip most keys and values, and the distribution moves.
    clipped = [s / 20 for s in engine.kv_scales]
    through_clipped = functools.partial(logits_through_cache, engine.model, cache_dtype=engine.kv_cache_dtype,
                                        kv_scales=clipped)  # fmt: skip
    worse = next_token_agreement(reference.model.logits_without_cache, through_clipped, held_out_tokens, 512)
    assert worse.kl_per_token > 10 * KL_BOUND[name]


@pytest.fixture(scope="module")
def held_out_tokens():
    from minserve.quality import held_out_text

    return torch.tensor(LLM().tokenizer.encode(held_out_text(20_000))[:1024])


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_preemption_prefix_hits_and_chunks_on_an_8_bit_cache_change_no_token(preemption_mode):
    """A cache too small for the batch (preempting), with a shared prefix and chunked prefill, gives the tokens
    of a cache that holds everything: recomputed KV quantizes to the same codes, swapped KV is copied as codes."""
    shared = "def shared_prefix_function(argument):\n    return argument * 2\n\n\n"
    prompts = [shared + p for p in PROMPTS] * 2
    roomy = LLM(kv_cache_dtype="int8", enable_prefix_caching=False)
    expected = [o.token_ids for o in roomy.generate(prompts, GREEDY)]
    tight = LLM(kv_cache_dtype="int8", num_kv_blocks=12, preemption_mode=preemption_mode, max_num_batched_tokens=32)
    outs = tight.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    stats = tight.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_rate"] > 0, stats
    assert stats["kv_blocks_used"] == 0
    tight.engine.core.block_manager.check_invariants([])


def test_an_unknown_kv_cache_dtype_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8"):
        LLM(kv_cache_dtype="int4")
