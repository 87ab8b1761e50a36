"""Decode steps through torch.compile (``compile_model=True``): the eager engine's greedy tokens exactly, from
one compile at start-up that serves every batch size and context length, and a clear error where it cannot."""

from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.utils import counters

from minserve import LLM, SamplingParams
from minserve.engine.compilation import CompiledDecode
from minserve.model.backends import TorchBackend

# Prompts of 3, about 20 and about 40 tokens (one, two and three blocks of 16), and answers of different
# lengths: the first step prefills all three (eager), then decode steps run 3, 2, then 1 sequence (compiled)
# while contexts cross block boundaries, so the batch size and the blocks per sequence both change.
PROMPTS = [
    "x = 1",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):",
    "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n"
    "        self.items = {}\n\n    def load(self):",
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 1}
PARAMS = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (6, 14, 22)]


@pytest.mark.slow
def test_compiled_decode_gives_the_eager_tokens_from_one_compile():
    eager = LLM(dtype="float32", device="cpu", enable_tracing=False)
    compiled = LLM(dtype="float32", device="cpu", enable_tracing=False, compile_model=True)
    graphs_after_start_up = counters["stats"]["unique_graphs"]
    decode = compiled.engine.runner.compiled
    compiled_steps = []
    forward = decode.forward
    decode.forward = lambda ids, positions, meta: compiled_steps.append(len(ids)) or forward(ids, positions, meta)

    expected = [out.token_ids for out in eager.generate(PROMPTS, PARAMS)]
    assert [out.token_ids for out in compiled.generate(PROMPTS, PARAMS)] == expected
    assert sorted(set(compiled_steps)) == [1, 2, 3]  # every decode step ran compiled, at every batch size
    assert counters["stats"]["unique_graphs"] == graphs_after_start_up  # and none needed a new graph
    assert decode.compile_s > 0


def test_a_failed_compile_is_an_error_that_says_so(monkeypatch):
    def compiler_that_fails(function, **options):
        def fail(*args):
            raise RuntimeError("no working C++ compiler")

        return fail

    monkeypatch.setattr(torch, "compile", compiler_that_fails)
    with pytest.raises(ValueError, match="compile_model=True.*no working C.. compiler.*leave compile_model off"):
        LLM(dtype="float32", device="cpu", compile_model=True)


def test_only_the_torch_backend_is_compiled():
    llm = LLM(dtype="float32", device="cpu")

    class OtherBackend(TorchBackend):
        name = "triton"

    llm.model.set_backend(OtherBackend())
    with pytest.raises(ValueError, match="pass backend='torch'"):
        CompiledDecode(llm.model, block_size=16)


def test_llm_runs_eagerly_by_default_and_serve_takes_both_switches():
    from minserve.cli import build_parser

    assert LLM().engine.runner.compiled is None
    assert build_parser().parse_args(["serve", "--compile"]).compile_model is True
    assert build_parser().parse_args(["serve", "--no-compile"]).compile_model is False
    assert build_parser().parse_args(["serve"]).compile_model is None  # serving_compiles decides


@pytest.mark.parametrize(
    ("options", "compiles"),
    [
        ({"model": "smollm2-135m-instruct"}, True),  # the file's 4-bit codes: dispatch-bound steps
        ({"model": "smollm2-135m-instruct", "quantization": "int8"}, True),
        ({"model": "smollm2-135m-instruct", "quantization": "none"}, False),  # float: bound by its bytes
        ({"model": "smollm2-135m-instruct", "dtype": "bfloat16"}, False),  # a dtype named is computed in
        ({"model": "minserve-tiny"}, False),  # safetensors in float
        ({"model": "smollm2-135m-instruct", "speculative_config": NGRAM}, False),
    ],
)
def test_a_server_compiles_where_decode_is_bound_by_dispatch(options, compiles):
    from minserve.config import EngineConfig
    from minserve.engine.compilation import serving_compiles

    decided, why = serving_compiles(EngineConfig.from_options(device="cpu", **options))
    assert decided is compiles
    assert why.startswith("compiled" if compiles else "eager")


def test_a_server_on_device_auto_decides_for_the_device_it_resolves_to():
    from minserve.config import EngineConfig
    from minserve.engine.compilation import serving_compiles

    here = "cuda" if torch.cuda.is_available() else "cpu"
    auto = serving_compiles(EngineConfig.from_options(model="smollm2-135m-instruct"))
    assert auto == serving_compiles(EngineConfig.from_options(model="smollm2-135m-instruct", device=here))


def test_a_server_without_a_cpp_compiler_runs_eagerly_and_says_why(monkeypatch):
    from minserve.config import EngineConfig
    from minserve.engine import compilation

    monkeypatch.setattr(compilation, "_cpp_compiler", lambda: None)
    decided, why = compilation.serving_compiles(EngineConfig.from_options(model="smollm2-135m-instruct", device="cpu"))
    assert not decided and "C++ compiler" in why


@pytest.mark.slow
def test_row_switched_layers_compile_a_graph_for_the_codes_and_one_for_the_dense_copies(monkeypatch):
    """The tiny model held as int4 codes with dense copies (as if it came from a 4-bit file), switching
    above two rows: decode steps of one and two sequences run the graph traced on the codes, three the graph
    traced on the dense copies, and the tokens are the eager engine's."""
    monkeypatch.setattr("minserve.quant.auto.stores_int4_layers", lambda path: True)
    monkeypatch.setattr("minserve.quant.swap.tune_row_switches", _switch_above_two_rows)
    eager = LLM(device="cpu", quantization="auto", enable_tracing=False)
    compiled = LLM(device="cpu", quantization="auto", enable_tracing=False, compile_model=True)
    decode = compiled.engine.runner.compiled
    assert (decode.max_seqs, decode.wide_above) == (2, 2)
    steps: dict[str, list[int]] = {"narrow": [], "wide": []}
    for graph, attribute in (("narrow", "forward"), ("wide", "wide_forward")):
        forward = getattr(decode, attribute)
        setattr(decode, attribute, lambda ids, positions, meta, f=forward, seen=steps[graph]: seen.append(len(ids))
                or f(ids, positions, meta))  # fmt: skip

    expected = [out.token_ids for out in eager.generate(PROMPTS, PARAMS)]
    assert [out.token_ids for out in compiled.generate(PROMPTS, PARAMS)] == expected
    assert (sorted(set(steps["narrow"])), sorted(set(steps["wide"]))) == ([1, 2], [3])


def _switch_above_two_rows(model: torch.nn.Module, activation_dtype: torch.dtype) -> dict[str, int]:
    from minserve.quant.row_switch import RowSwitchedLinear

    for module in model.modules():
        if isinstance(module, RowSwitchedLinear):
            module.max_narrow_rows = 2
    return {"int4": 2}


@pytest.mark.slow
def test_a_change_to_the_model_after_start_up_is_an_error_not_a_recompile(caplog):
    llm = LLM(dtype="float32", device="cpu", enable_tracing=False, compile_model=True)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    model = llm.engine.model
    # Deep in the model too: the guards skip a module only while its attributes, and its submodules', are unset.
    norm = model.layers[-1].post_attention_layernorm
    norm.eps, eps = 0.5, norm.eps
    with caplog.at_level(logging.ERROR, logger="minserve.engine.core"):
        out = llm.generate([PROMPTS[0]], params)[0]
    assert (out.finish_reason, len(out.token_ids)) == ("error", 1)
    assert "would have to be traced again" in str(caplog.records[-1].exc_info[1])
    norm.eps = eps
    assert llm.generate([PROMPTS[0]], params)[0].finish_reason == "length"  # as traced again: the graph serves
    forward = model.forward
    # A wrapper dynamo can trace: without the stance the step would quietly trace a second graph and go on.
    model.forward = lambda *args, **kwargs: forward(*args, **kwargs)

    with caplog.at_level(logging.ERROR, logger="minserve.engine.core"):
        out = llm.generate([PROMPTS[0]], params)[0]
    assert (out.finish_reason, len(out.token_ids)) == ("error", 1)  # the prefill's token, then the decode failed
    message = str(caplog.records[-1].exc_info[1])  # the engine logs why a batch failed
    assert "would have to be traced again" in message and "model.forward" in message
