"""minserve.capacity: KV-cache arithmetic against published numbers, and its invariants as properties."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minserve import capacity
from minserve.capacity import memory
from minserve.model.config import ModelConfig
from minserve.model.loader import ASSETS_DIR

# Published KV bytes per token in 16-bit (the curriculum's reference numbers). The tests compute them from
# the preset configs; only the expected values are written here.
PUBLISHED_KV_BYTES_PER_TOKEN_BF16 = {
    "Llama-2-7B": 524_288,
    "Llama-2-13B": 819_200,
    "Llama-3-8B": 131_072,
    "Mistral-7B": 131_072,
    "Llama-3-70B": 327_680,
}
# Published parameter counts (model cards), for the weights estimate.
PUBLISHED_PARAMS = {
    "Llama-2-7B": 6.74e9,
    "Llama-2-13B": 13.0e9,
    "Llama-3-8B": 8.03e9,
    "Llama-3-70B": 70.6e9,
    "Mistral-7B": 7.24e9,
    "Qwen3-0.6B": 0.6e9,
    "Qwen3-8B": 8.2e9,
    "Mixtral-8x7B": 46.7e9,  # every expert counts: they all take memory
    "Qwen3-30B-A3B": 30.5e9,
}
LLAMA_3_8B = capacity.model_config("Llama-3-8B")


def _embedded_hf(name: str = "minserve-tiny") -> dict:
    return json.loads((ASSETS_DIR / name / "config.json").read_text())


def _safetensors_param_count(path: Path) -> int:
    """Parameters in a safetensors file, from its JSON header alone (8-byte length, then the header)."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")


@pytest.mark.parametrize("name", sorted(PUBLISHED_KV_BYTES_PER_TOKEN_BF16))
def test_published_kv_bytes_per_token(name):
    expected = PUBLISHED_KV_BYTES_PER_TOKEN_BF16[name]
    assert capacity.kv_bytes_per_token(capacity.model_config(name), "bfloat16") == expected
    assert capacity.kv_bytes_per_token_hf(capacity.model_preset(name), "float16") == expected
    assert capacity.kv_bytes_per_token_preset(name) == expected


def test_every_preset_agrees_through_every_path_and_dtype():
    for name, hf in capacity.MODEL_PRESETS.items():
        config = ModelConfig.from_hf(hf)
        for dtype, size in [("float32", 4), ("bfloat16", 2), ("fp8", 1), (2, 2)]:
            per_token = capacity.kv_bytes_per_token(config, dtype)
            assert (
                per_token
                == capacity.kv_bytes_per_token_hf(hf, dtype)
                == capacity.kv_bytes_per_token_preset(name, dtype)
            )
            assert per_token == 2 * config.num_layers * config.num_kv_heads * config.head_dim * size


def test_explicit_head_dim_and_missing_kv_heads():
    # Qwen3-0.6B: head_dim 128 is not hidden/heads = 64; 2 × 28 layers × 8 KV heads × 128 × 2 bytes.
    assert capacity.kv_bytes_per_token_preset("Qwen3-0.6B") == 114_688
    mha = {k: v for k, v in capacity.model_preset("Llama-2-7B").items() if k != "num_key_value_heads"}
    assert capacity.kv_bytes_per_token_hf(mha) == 524_288  # no KV-head count means one per query head


def test_grouped_query_attention_is_a_quarter_of_multi_head():
    assert capacity.kv_bytes_per_token_preset("Llama-2-7B") == 4 * capacity.kv_bytes_per_token_preset("Llama-3-8B")


def test_dtype_bytes():
    assert [capacity.dtype_bytes(d) for d in ("float32", "torch.bfloat16", "float16", "fp8", 1)] == [4, 2, 2, 1, 1]
    for bad in ("float13", 0, True):
        with pytest.raises(ValueError):
            capacity.dtype_bytes(bad)


def test_unknown_preset_names_the_presets():
    with pytest.raises(KeyError, match="Llama-3-8B"):
        capacity.model_preset("GPT-5")
    with pytest.raises(KeyError, match="H100"):
        capacity.gpu_memory_bytes("TPU")


def test_embedded_model_numbers_from_its_config():
    hf = _embedded_hf()
    config = ModelConfig.from_hf(hf)
    # 2 × num_hidden_layers × num_key_value_heads × head_dim × 2 bytes, read from config.json itself.
    expected = 2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * hf["head_dim"] * 2
    assert capacity.kv_bytes_per_token(config) == capacity.kv_bytes_per_token_hf(hf) == expected
    assert capacity.kv_bytes_per_request(config, 100, 28) == 128 * expected
    assert capacity.kv_bytes_total(config, config.max_position_embeddings, 8) == 8 * 2048 * expected


@pytest.mark.parametrize("name", ["minserve-tiny", "minserve-tiny-draft"])
def test_parameter_estimate_is_exact_for_the_embedded_models(name):
    config = ModelConfig.from_hf(_embedded_hf(name))
    assert capacity.estimate_params(config) == _safetensors_param_count(ASSETS_DIR / name / "model.safetensors")


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_parameter_estimate_matches_published_counts(name):
    assert capacity.estimate_params(capacity.model_config(name)) == pytest.approx(PUBLISHED_PARAMS[name], rel=0.01)


@pytest.mark.parametrize("name, active", [("Mixtral-8x7B", 12.9e9), ("Qwen3-30B-A3B", 3.3e9)])
def test_a_mixture_of_experts_multiplies_by_its_published_active_parameters(name, active):
    config = capacity.model_config(name)
    # A token multiplies by its top-k experts' weights, the router's and the head's, and looks up its embedding.
    multiplied = capacity.flops_per_token(config) / 2 + config.vocab_size * config.hidden_size
    assert multiplied == pytest.approx(active, rel=0.02)


def test_a_batch_reads_more_experts_than_one_token_until_it_reads_them_all():
    from minserve.capacity.roofline import experts_touched

    config = capacity.model_config("Mixtral-8x7B")
    assert experts_touched(config, 1) == pytest.approx(2)  # one token: its top-2
    assert experts_touched(config, 64) == pytest.approx(8)  # a batch: nearly every expert
    one, many = (capacity.decode_bytes(config, batch, 1) for batch in (1, 64))
    weights = capacity.weights_bytes(config)
    assert one < 0.35 * weights < 0.99 * weights < many - 64 * capacity.kv_bytes_per_token(config)


@pytest.mark.parametrize("family", ["mixtral", "qwen3-moe-dense-first"])
def test_parameter_estimate_is_exact_for_a_mixture_of_experts_checkpoint(family):
    from tests.checkpoints import build_hf_model

    model = build_hf_model(family)
    config = ModelConfig.from_hf(model.config.to_dict())
    assert capacity.estimate_params(config) == sum(p.numel() for p in model.parameters())


def test_tied_embeddings_drop_the_lm_head():
    tied = capacity.model_config(capacity.model_preset("Qwen3-8B") | {"tie_word_embeddings": True})
    untied = capacity.model_config("Qwen3-8B")
    assert capacity.estimate_params(untied) - capacity.estimate_params(tied) == 151936 * 4096


def test_blocks_and_fragmentation_examples():
    assert [capacity.blocks_per_sequence(n, 16) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]
    assert [capacity.wasted_slots(n, 16) for n in (0, 1, 16, 17)] == [0, 15, 0, 15]
    with pytest.raises(ValueError):
        capacity.blocks_per_sequence(5, 0)


def test_paged_versus_contiguous_example():
    # Four sequences of 100 tokens with max_model_len 4096: paging allocates 7 blocks of 16 = 112 slots each.
    per_token = capacity.kv_bytes_per_token(LLAMA_3_8B)
    assert capacity.paged_kv_bytes(LLAMA_3_8B, [100] * 4, 16) == 4 * 112 * per_token
    assert capacity.contiguous_kv_bytes(LLAMA_3_8B, 4, 4096) == 4 * 4096 * per_token


def test_max_concurrent_sequences_example():
    # 1 GiB of bf16 KV for Llama-3-8B holds 8192 tokens = 512 blocks of 16; a 1000-token sequence takes 63.
    assert capacity.max_concurrent_sequences(LLAMA_3_8B, 2**30, 1000, 16) == 512 // 63
    assert capacity.max_concurrent_sequences(LLAMA_3_8B, -5, 1000) == 0
    with pytest.raises(ValueError):
        capacity.max_concurrent_sequences(LLAMA_3_8B, 2**30, 0)


def test_fit_examples():
    small = capacity.fit("Llama-3-8B", "H100 80GB", context_tokens=8192, batch=8)
    assert small.fits and small.headroom_bytes > 0 and small.max_sequences >= 8
    assert small.weights_bytes == 2 * capacity.estimate_params(LLAMA_3_8B)
    assert small.kv_bytes == 8 * 8192 * 131_072
    assert small.usable_bytes == int(80e9 * memory.DEFAULT_GPU_MEMORY_UTILIZATION)
    big = capacity.fit("Llama-3-70B", "H100 80GB", context_tokens=8192, batch=1)
    assert not big.fits and big.headroom_bytes < 0 and big.max_sequences == 0  # 141 GB of bf16 weights
    assert capacity.fit("Llama-3-70B", "H100 80GB", 8192, 1, dtype="fp8").fits  # 70.6 GB in fp8, just
    fp8_kv = capacity.fit("Llama-3-8B", "H100 80GB", 8192, 8, kv_dtype="fp8")
    assert fp8_kv.kv_bytes * 2 == small.kv_bytes and fp8_kv.max_sequences > small.max_sequences


# --- properties --------------------------------------------------------------------------------------------

tokens = st.integers(min_value=0, max_value=200_000)
block_sizes = st.sampled_from([1, 2, 8, 16, 32, 128, 256])
presets = st.sampled_from(sorted(capacity.MODEL_PRESETS))


@given(tokens, block_sizes)
def test_fragmentation_is_below_one_block(num_tokens, block_size):
    wasted = capacity.wasted_slots(num_tokens, block_size)
    assert 0 <= wasted < block_size
    assert capacity.blocks_per_sequence(num_tokens, block_size) * block_size == num_tokens + wasted


@settings(max_examples=50)
@given(presets, st.lists(st.integers(0, 8192), max_size=32), block_sizes, st.integers(1, 8))
def test_paged_never_exceeds_contiguous(name, seq_lens, block_size, max_len_blocks):
    config = capacity.model_config(name)
    max_model_len = max(max_len_blocks * block_size, *seq_lens, 0)
    max_model_len = capacity.blocks_per_sequence(max_model_len, block_size) * block_size  # whole blocks
    paged = capacity.paged_kv_bytes(config, seq_lens, block_size)
    exact = sum(seq_lens) * capacity.kv_bytes_per_token(config)
    assert exact <= paged <= capacity.contiguous_kv_bytes(config, len(seq_lens), max_model_len)
    assert paged - exact < len(seq_lens) * block_size * capacity.kv_bytes_per_token(config) or not seq_lens


@settings(max_examples=50)
@given(presets, st.integers(0, 100_000), st.integers(0, 100_000), st.integers(1, 256))
def test_kv_grows_with_context_and_concurrency(name, context, extra, concurrency):
    config = capacity.model_config(name)
    assert capacity.kv_bytes_total(config, context, concurrency) <= capacity.kv_bytes_total(
        config, context + extra, concurrency
    )
    assert capacity.kv_bytes_total(config, context, concurrency) <= capacity.kv_bytes_total(
        config, context, concurrency + 1
    )
    assert capacity.kv_bytes_per_request(config, context, extra) == capacity.kv_bytes_total(config, context + extra, 1)


@settings(max_examples=50)
@given(presets, st.integers(0, 200 * 10**9), st.integers(0, 10**9), st.integers(1, 32_768), block_sizes)
def test_max_sequences_is_monotone_and_really_fits(name, budget, extra_budget, seq_tokens, block_size):
    config = capacity.model_config(name)
    n = capacity.max_concurrent_sequences(config, budget, seq_tokens, block_size)
    assert capacity.paged_kv_bytes(config, [seq_tokens] * n, block_size) <= budget
    assert capacity.paged_kv_bytes(config, [seq_tokens] * (n + 1), block_size) > budget  # and one more does not
    assert capacity.max_concurrent_sequences(config, budget + extra_budget, seq_tokens, block_size) >= n
    assert capacity.max_concurrent_sequences(config, budget, seq_tokens + 1, block_size) <= n


@settings(max_examples=50)
@given(presets, st.sampled_from(sorted(capacity.GPU_MEMORY_BYTES)), st.integers(1, 65_536), st.integers(1, 512))
def test_fits_exactly_when_the_batch_is_within_max_sequences(name, gpu, context, batch):
    result = capacity.fit(name, gpu, context, batch)
    assert result.fits == (batch <= result.max_sequences) == (result.headroom_bytes >= 0)
