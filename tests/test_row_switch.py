"""One weight in two formats (:mod:`minserve.quant.row_switch`) and ``quantization="auto"``
(:mod:`minserve.quant.auto`): int4 codes for steps of few rows, the dense float copy for steps of many,
each path exactly its own module's, chosen only where a 4-bit file is served on a CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from minserve import LLM, SamplingParams
from minserve.model.loader import resolve_model_path
from minserve.quant import Int4Linear, QuantScheme, quantize_model
from minserve.quant.auto import choose_scheme
from minserve.quant.formats import quantize
from minserve.quant.row_switch import ROW_CANDIDATES, RowSwitchedLinear, dense_dtype, dense_twin, tune_row_switches
from minserve.quant.swap import describe_weights, layer_formats, linear_weight_bytes

CPU = torch.device("cpu")
SMOLLM = "smollm2-135m-instruct"


def _pair(max_rows: int = 4) -> RowSwitchedLinear:
    torch.manual_seed(0)
    weight = quantize(torch.randn(32, 64), "int4", group_size=32)
    return RowSwitchedLinear(Int4Linear(weight, None), dense_twin(weight, None, torch.float32), max_rows)


def _dense_path(pair: RowSwitchedLinear, x: torch.Tensor) -> torch.Tensor:
    """The dense branch as the packed kernel rounds: bfloat16 in, float32 sums, bfloat16 out."""
    return pair.dense(x.to(torch.bfloat16).float()).to(torch.bfloat16).float()


@pytest.mark.parametrize("rows", [1, 4, 5, 64])
def test_a_step_of_few_rows_reads_the_codes_and_one_of_many_the_dense_copy(rows):
    pair = _pair(max_rows=4)
    x = torch.randn(rows, 64)
    expected = pair.narrow(x) if rows <= 4 else _dense_path(pair, x)
    assert torch.equal(pair(x), expected)


def test_both_paths_compute_one_function_to_the_last_bfloat16_bit():
    """The dense twin holds exactly the weight the kernel applies (its codes, scales rounded to bfloat16), so
    the paths differ only in their sums' order: at most one bfloat16 step apart. The file's float weight in
    the twin's place (scales not rounded) is further off, and it was enough to flip a greedy answer."""
    pair, x = _pair(), torch.randn(64, 64)
    narrow, dense = pair.narrow(x), _dense_path(pair, x)
    one_step = 2.0**-7 * narrow.abs()  # bfloat16 keeps 8 significant bits: one step is ≤ 2⁻⁷ of a value
    assert ((narrow - dense).abs() <= one_step + 1e-6).all()
    weight = quantize(torch.randn(32, 64, generator=torch.Generator().manual_seed(0)), "int4", group_size=32)
    unrounded = nn.Linear(64, 32, bias=False).requires_grad_(False)
    unrounded.weight.copy_(weight.dequantize())
    assert not ((narrow - unrounded(x)).abs() <= one_step + 1e-6).all()


def test_the_rows_of_a_batched_input_are_counted_across_its_leading_dimensions():
    pair = _pair(max_rows=4)
    x = torch.randn(2, 3, 64)  # six rows: the dense copy
    assert torch.equal(pair(x), _dense_path(pair, x))


def test_tuning_sets_one_step_size_per_format_from_the_candidates():
    model = nn.Sequential(_pair(), _pair(), nn.Linear(64, 64))
    chosen = tune_row_switches(model, torch.float32, candidates=(1, 2, 4))
    assert set(chosen) == {"int4"} and chosen["int4"] in (1, 2, 4)
    assert {model[0].max_narrow_rows, model[1].max_narrow_rows} == {chosen["int4"]}


def test_auto_keeps_a_4bit_file_s_codes_on_a_cpu_and_nothing_else():
    smollm, tiny = resolve_model_path(SMOLLM), resolve_model_path("minserve-tiny")
    scheme = choose_scheme("auto", None, smollm, CPU, dtype_asked="auto")
    assert scheme is not None and scheme.format == "int4" and scheme.keep_dense
    assert choose_scheme("auto", None, smollm, CPU, dtype_asked="float32") is None  # a named dtype is kept
    assert choose_scheme("auto", None, smollm, torch.device("cuda"), dtype_asked="auto") is None
    assert choose_scheme("auto", None, tiny, CPU, dtype_asked="auto") is None  # safetensors: float weights
    assert choose_scheme("none", None, smollm, CPU, dtype_asked="auto") is None
    assert not choose_scheme("int4", None, smollm, CPU, dtype_asked="auto").keep_dense  # a named format as named


def test_a_row_switched_model_counts_its_codes_as_what_a_decode_step_reads():
    model = LLM(enable_tracing=False).engine.model
    float_bytes, weights = linear_weight_bytes(model)
    quantize_model(model, QuantScheme("int4", 64, "int8", keep_dense=True))
    step_bytes, same_weights = linear_weight_bytes(model)
    assert same_weights == weights and step_bytes < float_bytes / 4  # the codes, not the dense copies
    dense = str(dense_dtype(torch.float32)).removeprefix("torch.")  # bfloat16 where the CPU multiplies it
    formats = layer_formats(model)
    assert formats["lm_head"] == f"int8+{dense}" and "layers.0.mlp.gate_up_proj.dense" not in formats
    assert describe_weights(model).startswith(f"int4+{dense} ×")


@pytest.mark.slow
def test_auto_on_the_4bit_file_keeps_codes_and_chats():
    llm = LLM(SMOLLM, quantization="auto", enable_tracing=False, kv_cache_memory_bytes=16 * 2**20)
    assert any(isinstance(m, RowSwitchedLinear) for m in llm.engine.model.modules())
    switch = llm.engine.model.get_submodule("layers.0.mlp.gate_up_proj")
    assert switch.max_narrow_rows in ROW_CANDIDATES
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    first = llm.generate([prompt], greedy)[0].text  # the whole prompt in one step of many rows: dense copies
    cached = llm.generate([prompt], greedy)[0].text  # its blocks cached: the last few rows through the codes
    others = [llm.tokenizer.apply_chat_template([{"role": "user", "content": f"Count to {n}."}]) for n in (3, 9)]
    batched = llm.generate([*others, prompt], greedy)[-1].text
    assert "Paris" in first and cached == first and batched == first  # one answer, whichever path served it
