"""The engine: a model, its tokenizer and its KV memory, around the engine core's step loop.

:class:`LLMEngine` loads the checkpoint, sizes the KV cache, and hands the :class:`~minserve.engine.core.EngineCore`
an executor (the :class:`~minserve.engine.model_runner.ModelRunner`, which runs the model and samples) and
the wall clock. The core does the rest, and the simulator runs the same core on a cost model and a virtual
clock. ``LLM.generate`` and the HTTP server both drive this same loop, so every chapter measures the code
that serves.
"""

from __future__ import annotations

import itertools
import time

import torch

from minserve.config import EngineConfig, SchedulerConfig
from minserve.engine import model_setup, pipeline_parallel, tensor_parallel
from minserve.engine.batch import ScheduledBatch
from minserve.engine.clocks import WallClock
from minserve.engine.core import EngineCore
from minserve.engine.detokenizer import IncrementalDetokenizer
from minserve.engine.input_processor import InputProcessor
from minserve.engine.model_runner import CacheShape, ModelRunner
from minserve.engine.outputs import RequestMetrics, RequestOutput
from minserve.engine.sampler import make_generator
from minserve.engine.sampling_params import SamplingParams, check_request_options
from minserve.engine.sequence import Sequence
from minserve.engine.speculative.proposer import Proposer, make_proposer
from minserve.engine.step_report import EngineStats
from minserve.engine.workers import check_launch, launched_rank, worker_main
from minserve.parallel import check_tensor_parallel
from minserve.parallel.pipeline import PipelineStats, check_pipeline_parallel
from minserve.trace import Tracer

Prompt = str | list[int]
CPU_KV_CACHE_BYTES = 256 * 2**20  # default KV budget on the CPU
GPU_MEMORY_UTILIZATION = 0.9  # default share of free GPU memory given to the KV cache


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.device.num_threads is not None:
            torch.set_num_threads(config.device.num_threads)
        self.device = resolve_device(config.device.device)
        checkpoint = model_setup.Checkpoint.open(config, self.device)
        self.model_dir, self.tokenizer, self.dtype = checkpoint.path, checkpoint.tokenizer, checkpoint.dtype
        # Tensor or pipeline parallelism: the other ranks start now and build their parts beside this one's.
        self.parallel = None
        if config.parallel.tensor_parallel_size > 1:
            check_tensor_parallel(  # before any rank starts
                checkpoint.model_config, config.parallel.tensor_parallel_size, config.parallel.enable_expert_parallel
            )
            self.parallel = tensor_parallel.start(config, self.device)
        elif config.parallel.pipeline_parallel_size > 1:
            check_pipeline_parallel(checkpoint.model_config, config.parallel.pipeline_parallel_size)  # likewise
            self.parallel = pipeline_parallel.start(config, self.device)
        comm = self.parallel.comm if config.parallel.tensor_parallel_size > 1 else None
        loaded = model_setup.load(config, self.device, checkpoint, comm)
        self.model, self.kv_cache_dtype, self.kv_scales = loaded.model, loaded.kv_cache_dtype, loaded.kv_scales
        self.model_config = self.model.config
        if config.parallel.pipeline_parallel_size > 1:  # stage 0 keeps its layers, calibrated above on the whole model
            self.kv_scales = pipeline_parallel.cut_to_stage(
                self.model, self.kv_scales, 0, config.parallel.pipeline_parallel_size
            )
        model_limit = self.model_config.max_position_embeddings
        self.max_model_len = min(config.scheduler.max_model_len or model_limit, model_limit)  # tokens: prompt + output
        self.scheduler_config = self._scheduler_config()
        sizes = self.scheduler_config
        shape = CacheShape(sizes.num_kv_blocks, sizes.block_size, sizes.host_blocks, self.kv_cache_dtype)
        self.runner = (
            ModelRunner(self.model, shape, self.kv_scales)
            if self.parallel is None
            else self.parallel.runner(self.model, shape, self.kv_scales)
        )
        self.runner.time_sampling = config.enable_tracing  # the trace's sample spans; costs nothing when off
        # A mixture of experts sizes each expert's batch from its count on the CPU: a graph cannot record that.
        if uses_cuda_graphs(config, self.device, self.model.backend.name) and not self.model_config.moe_layers:
            self.runner.capture_decode_graphs(config.scheduler.max_num_seqs, self.max_model_len)
        if config.device.compile_model:
            self.runner.compile_decode()
        self.inputs = InputProcessor(
            self.tokenizer, self.model_config.vocab_size, self.max_model_len, self.scheduler_config.kv_capacity_tokens
        )
        self.core = EngineCore(
            self.scheduler_config,
            executor=self.runner,
            clock=WallClock(),
            stop_token_ids=self._stop_token_ids(),
            tracer=Tracer(enabled=config.enable_tracing),
            proposer=self._proposer(),
        )
        self._request_counter = itertools.count()
        self._arrival_counter = itertools.count()

    # --- requests in -------------------------------------------------------------------------------------

    def encode(self, prompt: Prompt, index: int | None = None) -> list[int]:
        """Token ids of a prompt, checked (see :class:`InputProcessor`)."""
        return self.inputs.encode(prompt, index)

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time_s: float | None = None,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        deadline_s: float | None = None,
        tokenize_s: tuple[float, float] | None = None,
    ) -> str:
        """Queue one request and return its id. A bad request raises ``ValueError`` and changes nothing.

        ``prompt_token_ids`` skips tokenizing a text prompt that the caller has already encoded; then
        ``tokenize_s`` may say when the caller's tokenizing began and ended (``perf_counter`` seconds), for the
        trace. ``priority``: lower runs first under the priority policy. ``deadline_s``: seconds after arrival
        past which the request is stopped wherever it is (``finish_reason="deadline"``), its blocks freed.
        """
        check_request_options(priority, deadline_s)
        arrival_s = time.perf_counter() if arrival_time_s is None else arrival_time_s
        params = params or SamplingParams()
        if prompt_token_ids is None:
            tokenize_start_s = time.perf_counter()
            ids = self.encode(prompt)
            tokenize_s = (tokenize_start_s, time.perf_counter())
        else:
            ids = prompt_token_ids
        seq = Sequence(
            request_id=request_id if request_id is not None else str(next(self._request_counter)),
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=ids,
            params=params,
            metrics=RequestMetrics(arrival_time_s=arrival_s),
            detokenizer=IncrementalDetokenizer(self.tokenizer),
            generator=make_generator(params, self.device),
            grammar=self.inputs.grammar(params),
            held_back_token_ids=tuple(sorted(self.core.stop_token_ids)) if params.min_tokens else (),
            priority=priority,
            deadline_s=None if deadline_s is None else arrival_s + deadline_s,
            waiting_since_s=arrival_s,
        )
        self.core.add(seq, tokenize_s=tokenize_s)  # checks that it fits and that its id is new
        seq.arrival_index = next(self._arrival_counter)
        return seq.request_id

    def abort_request(self, request_id: str) -> None:
        """Cancel a request; it leaves, and its blocks are freed, at the start of the next step. Thread-safe."""
        self.core.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    # --- the loop ---------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration (:meth:`EngineCore.step`): an output for every request that produced a token or ended."""
        return self.core.step()

    def process_aborts(self) -> list[RequestOutput]:
        """Finish every request cancelled since the last step, freeing its blocks now."""
        return self.core.process_aborts()

    # --- memory and statistics --------------------------------------------------------------------------

    def _stop_token_ids(self) -> frozenset[int]:
        """The model's EOS ids, the tokenizer's EOS and the chat template's end of turn (ChatML's <|im_end|>)."""
        return frozenset(self.model_config.eos_token_ids) | self.tokenizer.stop_token_ids

    def _scheduler_config(self) -> SchedulerConfig:
        """The scheduler's group as the core takes it, sized: the KV blocks that fit, the context limit, and
        under swapping the host blocks that ``swap_space_bytes`` holds (unset: as many as the device's)."""
        group, swap_bytes = self.config.scheduler, self.config.cache.swap_space_bytes
        host_blocks = swap_bytes // self.kv_bytes_per_block() if group.swaps and swap_bytes is not None else None
        return group.replace(num_kv_blocks=self._num_kv_blocks(), max_model_len=self.max_model_len,
                             num_cpu_blocks=host_blocks)  # fmt: skip

    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token takes, every layer, in the cache's element type, in this process (under
        tensor parallelism a rank holds only its KV heads, under pipeline parallelism only its stage's layers:
        the same memory a rank has holds more tokens)."""
        c = self.model_config
        element_bytes = torch.tensor([], dtype=self.kv_cache_dtype).element_size()
        return 2 * len(self.model.layers) * self.model.num_kv_heads * c.head_dim * element_bytes

    def kv_bytes_per_block(self) -> int:
        return self.kv_bytes_per_token() * self.config.scheduler.block_size

    def _num_kv_blocks(self) -> int:
        """From the scheduler's ``num_kv_blocks``, else the cache's byte budget, else a default for this device."""
        scheduler, budget = self.config.scheduler, self.config.cache.kv_cache_memory_bytes
        if scheduler.num_kv_blocks is not None:
            return scheduler.num_kv_blocks
        if budget is None:
            if self.device.type == "cuda":
                free_bytes, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free_bytes * GPU_MEMORY_UTILIZATION)
            else:
                enough_tokens = scheduler.max_num_seqs * self.max_model_len
                budget = min(CPU_KV_CACHE_BYTES, enough_tokens * self.kv_bytes_per_token())
        num_blocks = budget // self.kv_bytes_per_block()
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={budget} holds no block; one block of {scheduler.block_size} tokens "
                f"takes {self.kv_bytes_per_block()} bytes"
            )
        return num_blocks

    def _proposer(self) -> Proposer | None:
        """Speculative decoding's proposer, if the config asks for one; a draft model shares this engine's
        device, dtype, backend and KV block count (its blocks are far smaller: it is a smaller model)."""
        if self.config.speculative is None:
            return None
        return make_proposer(
            self.config.speculative,
            self.model,
            backend=self.config.device.backend,
            num_blocks=self.scheduler_config.num_kv_blocks,
            block_size=self.config.scheduler.block_size,
        )

    def stats(self) -> EngineStats:
        return self.core.stats(kv_cache_bytes=self.runner.kv_cache_bytes)

    def pipeline_stats(self, reset: bool = False) -> PipelineStats:
        """Under pipeline parallelism, each stage's micro-batch timeline of the steps run (since the last
        ``reset``) and the bubble measured beside ``(p − 1) / (m + p − 1)`` (:mod:`minserve.parallel.pipeline`)."""
        if not isinstance(self.runner, pipeline_parallel.PipelineRunner):
            raise ValueError("pipeline_stats needs a pipeline: start the engine with pipeline_parallel_size > 1")
        return self.runner.pipeline_stats(reset)

    def shutdown(self) -> None:
        """Stop the parallel workers, if any (an engine dropped without this kills them instead)."""
        if self.parallel is not None:
            self.parallel.shutdown()


def serve_as_worker(config: EngineConfig) -> None:
    """Be rank ``RANK`` (not 0) of a group a launcher started (``torchrun``, see :mod:`.workers`): build this
    rank's part of the model as ``config`` says and run what rank 0 sends until it says stop."""
    launched = launched_rank()
    if launched is None or launched.rank == 0:
        raise RuntimeError("serve_as_worker is for ranks 1 … n−1 that torchrun started; rank 0 runs the engine")
    check_launch(launched, config.parallel.world_size)
    worker = (
        tensor_parallel.shard_worker if config.parallel.tensor_parallel_size > 1 else pipeline_parallel.stage_worker
    )
    worker_main(launched.rank, launched.world_size, "env://", config, worker, local_rank=launched.local_rank)


def uses_cuda_graphs(config: EngineConfig, device: torch.device, backend: str) -> bool:
    """Decode steps run as CUDA graphs on a GPU with the Triton backend, unless switched off; not under
    pipeline parallelism, whose steps are split into micro-batches."""
    return (config.device.enable_cuda_graphs and device.type == "cuda" and backend == "triton"
            and config.parallel.pipeline_parallel_size == 1)  # fmt: skip


def resolve_device(device: str) -> torch.device:
    """``device`` as a torch device: ``"auto"`` is CUDA where torch sees a GPU, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"device {device!r} is not a torch device (try 'cpu', 'cuda' or 'auto')") from error
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA GPU; use device='cpu' or 'auto'")
    return resolved


__all__ = ["EngineStats", "LLMEngine", "ScheduledBatch"]
