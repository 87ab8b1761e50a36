"""The engine on the Triton backend: the same greedy tokens as on the torch backend, on the embedded model
(under Triton's interpreter on a machine without a GPU), and clear errors where Triton cannot run."""

from __future__ import annotations

import pytest
import torch

from minserve import LLM, SamplingParams
from minserve.engine import model_setup
from minserve.engine.cuda_graphs import DecodeGraphs, capture_sizes, padded_size
from minserve.engine.engine import uses_cuda_graphs
from minserve.model.backends import TorchBackend, TritonBackend, resolve_backend

PROMPTS = [
    "def fibonacci(n):",
    "import os\n\n\ndef walk(path):",
    "class Stack:\n",
    "def fibonacci(n):\n    if n < 2:",  # shares a prefix with the first: the prefix cache hits
]


@pytest.fixture(scope="module")
def torch_tokens():
    llm = LLM(backend="torch", num_kv_blocks=64, block_size=8, max_num_batched_tokens=16)
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0))]


def test_triton_backend_generates_the_same_tokens(torch_tokens):
    # A 16-token budget chunks the longer prompts, and the fourth prompt finds the first one's blocks cached:
    # prefill over a cached prefix, chunked prefill, mixed prefill/decode steps and pure decode steps all run.
    llm = LLM(backend="triton", num_kv_blocks=64, block_size=8, max_num_batched_tokens=16)
    assert llm.model.backend.name == "triton"
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0))
    assert [o.token_ids for o in outputs] == torch_tokens
    assert llm.stats()["prefix_cache_hit_rate"] > 0


def test_triton_backend_logits_match_torch():
    llm = LLM(backend="torch", num_kv_blocks=16, block_size=8)
    ids = torch.tensor(llm.tokenizer.encode("def add(a, b):\n    return a + b"))
    reference = llm.model.logits_without_cache(ids)
    llm.model.set_backend(TritonBackend())
    try:
        triton_logits = llm.model.logits_without_cache(ids)  # norms, rotary and SwiGLU by kernel
    finally:
        llm.model.set_backend(TorchBackend())
    torch.testing.assert_close(triton_logits, reference, rtol=1e-4, atol=1e-4)


def test_auto_is_torch_without_a_gpu_and_errors_name_the_fix(monkeypatch):
    assert resolve_backend("auto", torch.device("cpu")).name == "torch"
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("cuda-graphs", torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_backend("triton", torch.device("cpu"))


class _EagerReplay:
    """Stands in for a captured CUDA graph on the CPU: "replaying" runs the forward on the static buffers."""

    def __init__(self, model, args, outputs: dict, size: int) -> None:
        self.model, self.args, self.outputs, self.size = model, args, outputs, size

    def replay(self) -> None:
        self.outputs[self.size] = self.model(*self.args)


class _EagerDecodeGraphs(DecodeGraphs):
    def _capture_all(self) -> None:
        for size in self.sizes:
            meta = self._metadata(size)
            self.graphs[size] = _EagerReplay(self.model, (self.input_ids[:size], self.positions[:size], meta),
                                             self.outputs, size)  # fmt: skip


def test_capture_sizes_and_padding():
    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert [padded_size(n, capture_sizes(20)) for n in (1, 3, 5, 17, 20, 21)] == [1, 4, 8, 20, 20, None]


def test_decode_graph_buffers_give_the_eager_tokens(torch_tokens):
    """The graph path's static buffers, padding rows (slot −1, one key) and context-length bound, exercised on
    the CPU with the forward run eagerly in place of a replay: the same tokens as the torch backend."""
    llm = LLM(backend="triton", num_kv_blocks=64, block_size=8, max_num_batched_tokens=16, max_model_len=256)
    runner = llm.engine.runner
    runner.graphs = _EagerDecodeGraphs(llm.model, max_num_seqs=6, max_model_len=256, block_size=8)
    replayed = []
    original_run = runner.graphs.run
    runner.graphs.run = lambda *args: replayed.append(len(args[2].query_lens)) or original_run(*args)
    outputs = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=10, temperature=0))
    assert [o.token_ids for o in outputs] == torch_tokens[:3]  # batch invariance: the same as in a batch of 4
    assert 3 in replayed  # three sequences decoded in the size-4 graph, one padding row beside them
    assert llm.stats()["kv_blocks_used"] == 0


def test_cuda_graphs_only_on_a_gpu_with_triton():
    from minserve.config import EngineConfig

    config = EngineConfig()
    assert uses_cuda_graphs(config, torch.device("cuda"), "triton")
    assert not uses_cuda_graphs(config, torch.device("cpu"), "triton")
    assert not uses_cuda_graphs(config, torch.device("cuda"), "torch")
    assert not uses_cuda_graphs(EngineConfig.from_options(enable_cuda_graphs=False), torch.device("cuda"), "triton")


def test_triton_backend_reads_and_writes_an_int8_cache_as_torch_does(monkeypatch):
    # Both backends store int8 codes under the scales calibration measured and widen the same codes as they
    # read them, so greedy decoding agrees token for token; the 16-token budget and the shared prefix make
    # the kernels run prefill over cached codes, chunked prefill and decode. (Calibration runs Triton's norms
    # on one side and torch's on the other, so a scale may differ in its last bits, and a code by one.) Both
    # calibrate on 64 tokens, not 512: under the interpreter each token of it costs Triton programs.
    monkeypatch.setattr(model_setup, "CALIBRATION_TOKENS", 64)
    settings = dict(kv_cache_dtype="int8", num_kv_blocks=64, block_size=8, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=6, temperature=0)
    torch_llm, triton_llm = LLM(backend="torch", **settings), LLM(backend="triton", **settings)
    expected = [o.token_ids for o in torch_llm.generate(PROMPTS, params)]
    assert [o.token_ids for o in triton_llm.generate(PROMPTS, params)] == expected
    for torch_cache, triton_cache in zip(torch_llm.engine.runner.kv_caches, triton_llm.engine.runner.kv_caches):
        assert triton_cache.dtype == torch.int8 and triton_cache.count_nonzero() > 0
        assert (torch_cache.int() - triton_cache.int()).abs().max() <= 1
