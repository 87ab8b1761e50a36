"""Decode steps as CUDA graphs: the forward pass recorded once per batch size, then replayed.

A decode step of a small model on a GPU is dozens of tiny kernels per layer, and launching each from Python
costs more than running it: the GPU waits on the CPU. A CUDA graph records the whole sequence of launches
once; replaying it is one launch. The price is that a graph is fixed: the same tensor addresses and shapes
every time. So:

* graphs are captured for a few batch sizes (1, 2, 4, then every 8 up to ``max_num_seqs``), and a step with
  ``n`` sequences runs the smallest captured size ``≥ n``, padded with rows that write nowhere (slot −1)
  and whose outputs are thrown away;
* every input lives in a static buffer the graph was recorded with; a replay first copies the step's ids,
  positions, slots, block tables and context lengths into them;
* nothing may read a GPU value back to the CPU during capture, so the decode attention is told an upper
  bound of the context length (``max_model_len``) instead of measuring it.

Only pure decode steps run as graphs (a prefill's shape changes every step), only on CUDA, and only on the
Triton backend (the torch backend builds index tensors from Python lists inside the forward).
``EngineConfig.enable_cuda_graphs=False`` (``--no-cuda-graphs``) turns them off, for debugging.
"""

from __future__ import annotations

import torch

from minserve.model.attention import AttentionMetadata, StepTensors
from minserve.model.llama import LlamaForCausalLM


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then multiples of 8, up to and including ``max_num_seqs``."""
    sizes = [size for size in (1, 2, 4) if size <= max_num_seqs]
    sizes += list(range(8, max_num_seqs + 1, 8))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def padded_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds ``num_seqs`` sequences, or ``None`` when none does."""
    return next((size for size in sizes if size >= num_seqs), None)


class DecodeGraphs:
    """One captured decode forward per batch size, sharing static input buffers and one memory pool."""

    def __init__(self, model: LlamaForCausalLM, max_num_seqs: int, max_model_len: int, block_size: int) -> None:
        self.model = model
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_num_seqs)
        device = next(model.parameters()).device
        largest, max_blocks = self.sizes[-1], -(-max_model_len // block_size)
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(largest, max_blocks, dtype=torch.int64, device=device)
        self.context_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.query_starts = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._capture_all()

    def _metadata(self, size: int) -> AttentionMetadata:
        """Metadata over the static buffers, with its device tensors already built (no copy while capturing)."""
        ones = self.query_starts[1 : size + 1] - self.query_starts[:size]  # a static tensor of ones
        starts, context_lens = self.query_starts[: size + 1], self.context_lens[:size]
        tensors = StepTensors(starts, ones, context_lens, 1, self.max_model_len, True)
        return AttentionMetadata([1] * size, [1] * size, self.slot_mapping[:size], self.block_tables[:size], tensors)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its memory
            meta = self._metadata(size)
            args = (self.input_ids[:size], self.positions[:size], meta)
            self.model(*args)  # warm-up: compiles the kernels and settles the allocator, outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.model(*args)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def can_run(self, meta: AttentionMetadata) -> bool:
        """A pure decode step small enough for a captured graph."""
        return all(n == 1 for n in meta.query_lens) and padded_size(len(meta.query_lens), self.sizes) is not None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The step's final hidden states ``[num_seqs, hidden]``, by replaying the right graph."""
        num_seqs = len(meta.query_lens)
        size = padded_size(num_seqs, self.sizes)
        width = meta.block_tables.shape[1]
        self.input_ids[:num_seqs].copy_(input_ids)
        self.positions[:num_seqs].copy_(positions)
        self.slot_mapping[:num_seqs].copy_(meta.slot_mapping)
        self.slot_mapping[num_seqs:size].fill_(-1)  # padding rows store nothing
        self.block_tables[:num_seqs, :width].copy_(meta.block_tables)
        self.context_lens[:num_seqs].copy_(torch.as_tensor(meta.context_lens, dtype=torch.int32), non_blocking=True)
        self.context_lens[num_seqs:size].fill_(1)  # padding rows attend to one (meaningless) key, not to none
        self.graphs[size].replay()
        return self.outputs[size][:num_seqs]
