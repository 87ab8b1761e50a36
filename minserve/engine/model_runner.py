"""The model runner turns a scheduled batch into tensors, runs the model once, and samples.

It owns the KV cache tensors (allocated once, up front) and knows nothing of queues or policies: it is
handed sequences with a number of new tokens each, and it returns one sampled token for every sequence
whose new tokens reach the end of what it has (a prefill chunk in the middle of a prompt samples nothing).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from minserve.engine.batch import ScheduledBatch
from minserve.engine.cuda_graphs import DecodeGraphs
from minserve.engine.sampler import Sample, SamplingError, sample_batch
from minserve.engine.speculative.verifier import verify_drafts
from minserve.model.attention import AttentionMetadata, allocate_kv_cache
from minserve.model.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from minserve.engine.compilation import CompiledDecode


@dataclass(frozen=True)
class CacheShape:
    """The paged KV cache a runner allocates, the same in every process of an engine: ``num_blocks`` blocks
    of ``block_size`` tokens on the device, ``num_cpu_blocks`` in host memory for swapped-out sequences, and
    the element ``dtype`` (``None``: the model's own). The block manager counts the same blocks; each rank
    of a parallel engine gets this from rank 0 and allocates its own heads' or layers' share."""

    num_blocks: int
    block_size: int
    num_cpu_blocks: int = 0
    dtype: torch.dtype | None = None


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, shape: CacheShape, kv_scales: list[torch.Tensor] | None = None) -> None:
        """An 8-bit cache (``shape.dtype`` int8 or float8_e4m3fn) needs each layer's ``[2, num_kv_heads]``
        ``kv_scales`` (see :mod:`minserve.model.kv_quant`). The cache holds the layers ``model`` has: all of
        them, or a pipeline stage's."""
        self.model = model
        self.graphs: DecodeGraphs | None = None  # set by capture_decode_graphs, on CUDA only
        self.compiled: CompiledDecode | None = None  # set by compile_decode
        self.block_size = block_size = shape.block_size
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        config = model.config
        self.kv_cache_dtype = shape.dtype or self.dtype
        self.kv_caches = allocate_kv_cache(
            len(model.layers), shape.num_blocks, block_size, model.num_kv_heads, config.head_dim,
            self.kv_cache_dtype, self.device,
        )  # fmt: skip
        model.set_kv_caches(self.kv_caches, kv_scales)
        # The tracer's split of a step into the forward pass and sampling: when set, ``execute`` notes the
        # time sampling began (on a GPU after a synchronize, so the forward's queued kernels count as its own).
        self.time_sampling = False
        self.sampling_started_s: float | None = None
        # Host memory for swapped-out sequences (pinned on a GPU machine, so copies can overlap compute).
        self.cpu_kv_caches = allocate_kv_cache(
            len(model.layers), shape.num_cpu_blocks, block_size, model.num_kv_heads, config.head_dim,
            self.kv_cache_dtype, "cpu",
        ) if shape.num_cpu_blocks else []  # fmt: skip
        if shape.num_cpu_blocks and self.device.type == "cuda":
            self.cpu_kv_caches = [cache.pin_memory() for cache in self.cpu_kv_caches]

    @property
    def kv_cache_bytes(self) -> int:
        return sum(cache.numel() * cache.element_size() for cache in self.kv_caches)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[list[Sample] | SamplingError | None]:
        """The engine core's executor: one forward over the batch. Per sequence, the tokens it produced (one,
        sampled from its last row), None where a prompt is unfinished, or the :class:`SamplingError` of a row
        that could not be sampled (that request fails; the others go on)."""
        input_ids, positions, meta = self.prepare(batch)
        # The rows that give tokens: a sequence's last row, or with d drafts its last d + 1 (one per draft,
        # and the bonus position after them).
        row_counts = [1 + len(seq.draft_token_ids) if end else 0 for seq, end in zip(batch.seqs, batch.samples)]
        rows = [row for last, count in zip(last_token_rows(meta.query_lens), row_counts) for row in
                range(last - count + 1, last + 1)]  # fmt: skip
        logits = self.logits(input_ids, positions, meta, rows)
        if self.time_sampling:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.sampling_started_s = time.perf_counter()
        return self._tokens(batch, logits, row_counts) if logits is not None else [None] * len(batch.seqs)

    def logits(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, rows: list[int]
    ) -> torch.Tensor | None:
        """One forward pass over the step's tokens and the ``[len(rows), vocab]`` logits of ``rows`` (None if
        no row samples): everything but sampling, the part every tensor-parallel rank runs."""
        if self.graphs is not None and self.graphs.can_run(meta):
            hidden = self.graphs.run(input_ids, positions, meta)
        elif self.compiled is not None and self.compiled.can_run(meta):
            hidden = self.compiled.run(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, meta)
        return self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)]) if rows else None

    def _tokens(
        self, batch: ScheduledBatch, logits: torch.Tensor, row_counts: list[int]
    ) -> list[list[Sample] | SamplingError | None]:
        """Per sequence: its sampled token (one row, sampled with the rest in one batch), the tokens it kept
        of its drafts (several rows, verified), or None (no rows: its prompt is unfinished)."""
        starts = [sum(row_counts[:i]) for i in range(len(row_counts))]
        plain = [i for i, count in enumerate(row_counts) if count == 1]
        sampled = sample_batch(logits[[starts[i] for i in plain]], [batch.seqs[i] for i in plain]) if plain else []
        results: list[list[Sample] | SamplingError | None] = [None] * len(batch.seqs)
        for i, sample in zip(plain, sampled):
            results[i] = _as_tokens(sample)
        for i, count in enumerate(row_counts):
            if count > 1:
                results[i] = verify_drafts(logits[starts[i] : starts[i] + count], batch.seqs[i])
        return results

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Copy KV blocks device → host (``(device, host)`` pairs), then host → device (``(host, device)``)."""
        if swap_out:
            device_ids, host_ids = (torch.tensor(ids) for ids in zip(*swap_out))
            for gpu, cpu in zip(self.kv_caches, self.cpu_kv_caches):
                cpu[:, host_ids] = gpu[:, device_ids.to(self.device)].cpu()
        if swap_in:
            host_ids, device_ids = (torch.tensor(ids) for ids in zip(*swap_in))
            for gpu, cpu in zip(self.kv_caches, self.cpu_kv_caches):
                gpu[:, device_ids.to(self.device)] = cpu[:, host_ids].to(self.device, non_blocking=True)

    def clear(self, block_ids: list[int]) -> None:
        """Zero these blocks' keys and values in every layer (a failed request's, which may be NaN)."""
        if block_ids:
            ids = torch.tensor(block_ids, device=self.device)
            for cache in self.kv_caches:
                cache[:, ids] = 0

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Record decode steps as CUDA graphs (see :mod:`minserve.engine.cuda_graphs`)."""
        self.graphs = DecodeGraphs(self.model, max_num_seqs, max_model_len, self.block_size)

    def compile_decode(self) -> None:
        """Run decode steps through ``torch.compile`` (see :mod:`minserve.engine.compilation`); compiles now."""
        from minserve.engine.compilation import CompiledDecode  # imports torch._dynamo: only when asked

        self.compiled = CompiledDecode(self.model, self.block_size)

    def slot(self, block_table: list[int], position: int) -> int:
        """Where the token at ``position`` lives in the flat cache: its block's first slot plus its offset."""
        return block_table[position // self.block_size] * self.block_size + position % self.block_size

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flat input ids and positions, and where each new token's K/V goes (``slot_mapping``)."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            input_ids.extend((seq.token_ids + seq.draft_token_ids)[start : start + n])
            positions.extend(range(start, start + n))
            slots.extend(self.slot(seq.block_table, position) for position in range(start, start + n))
        max_blocks = max(len(seq.block_table) for seq in batch.seqs)
        # Rows are padded with the sequence's own last block: a decode step reads every block of its row
        # (masking the slots past the context), and block 0 may be another request's, written this step.
        tables = [seq.block_table + seq.block_table[-1:] * (max_blocks - len(seq.block_table)) for seq in batch.seqs]
        meta = AttentionMetadata(
            query_lens=list(batch.num_new_tokens),
            context_lens=[seq.num_computed_tokens + n for seq, n in zip(batch.seqs, batch.num_new_tokens)],
            slot_mapping=torch.tensor(slots, device=self.device),
            block_tables=torch.tensor(tables, device=self.device),
        )
        return torch.tensor(input_ids, device=self.device), torch.tensor(positions, device=self.device), meta


def last_token_rows(query_lens: list[int]) -> list[int]:
    """Row of each sequence's last new token in the flat batch."""
    ends, total = [], 0
    for n in query_lens:
        total += n
        ends.append(total - 1)
    return ends


def _as_tokens(result: Sample | SamplingError) -> list[Sample] | SamplingError:
    return result if isinstance(result, SamplingError) else [result]
