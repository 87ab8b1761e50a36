"""The engine on the Triton backend: the same greedy tokens as on the torch backend, on the embedded model
(under Triton's interpreter on a machine without a GPU), and clear errors where Triton cannot run."""

from __future__ import annotations

import pytest
import torch

from minserve import LLM, SamplingParams
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
