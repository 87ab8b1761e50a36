"""Decode steps through ``torch.compile``: the model's forward traced once, fused by inductor, then reused.

On a CPU, a decode step of a small model is hundreds of small tensor operations, and each pays Python's
and torch's dispatch overhead, which costs more than the arithmetic. Inductor fuses the elementwise ones
(norms, rotary, SwiGLU, the attention mask) into generated C++ loops; the matmuls stay library calls.
How this module makes that work on a paged KV cache, and why only decode steps are compiled:

* **Decode steps only.** The torch backend's general attention loops over sequences in Python and reads
  the longest context back to the host, so every new batch composition is a new graph. Compiling the
  whole forward that way (measured with ``dynamic=True`` on minserve-tiny) recompiled on almost every
  step and ran hundreds of times slower than eager. A pure decode step attends from tensors alone
  (:func:`~minserve.model.attention.decode_attention`) and traces into one graph. Prefill, mixed and
  speculative verification steps run eagerly, as they do beside CUDA graphs.
* **One graph, no silent fallback.** ``fullgraph=True``: a graph break is an error, not a forward quietly
  cut into eager pieces.
* **One compile for every batch size and context length.** The batch size and the blocks per sequence are
  marked *unbacked*: sizes the graph may not specialize on. Plain ``dynamic=True`` treats a size of 1 as a
  constant, which would mean four compiles (one sequence or more, one block or more), some of them in the
  middle of serving.
* **Two graphs where the weights switch format.** A layer held as codes and as a dense copy
  (:mod:`minserve.quant.row_switch`) takes a different path above its crossover, so a checkpoint served that
  way gets one graph for steps of few sequences (the codes) and one for steps of many (the dense copies),
  each told its range of batch sizes so it traces one branch. The second matters as much as the first: an
  eager step of 32 sequences of SmolLM2 spent more on small operations (gathering keys and values, norms,
  rotary, copies) than on its matmuls, 123 ms a step against 68 ms compiled (docs/benchmarks.md, section 11).
* **At start-up.** The compile runs on a dummy decode step when the engine is built, so a machine where
  inductor cannot compile (no C++ compiler, say) fails there with an error that says so, and no request
  waits on a compile. The dummy steps write keys and values into block 0, which no request holds yet.
* **Never again after start-up.** The graph is reused only while dynamo's guards hold: checks that what it
  traced is still what would run (the model's modules and attributes, the inputs' dtypes). Anything that
  changes those after start-up (a timer wrapped around ``model.forward``, a hook, a swapped module) would
  make dynamo trace again: tens of seconds in the middle of serving, a graph for every change, and an
  error anyway where the new trace breaks the graph. Every step after start-up therefore runs under torch's
  ``fail_on_recompile`` stance: a recompile is an error naming the guard that failed. (Measured on
  SmolLM2, int4: a benchmark that wrapped the model's forward to time it made every decode step fail,
  which its table showed as 15 tokens/s offline; untouched, the same run has no recompile.) Time the
  forward from outside the compiled region, :meth:`ModelRunner.logits` say, not inside it.
* **Guards checked by the module, not by the attribute.** Those guards are thousands of checks (every
  attribute the trace read of every layer), and running them all before each step cost 0.7 ms of a
  10 ms one-stream SmolLM2 step. The graphs are built with dynamo's recursive dict tags: a module whose
  attributes (and its submodules') have not been set since the trace passes with one check of its
  ``__dict__``'s tag, and a module changed since gets every check, as before (0.3 ms a step;
  docs/benchmarks.md, section 12).
"""

from __future__ import annotations

import functools
import logging
import shutil
import time
from collections.abc import Callable

import torch
from torch._dynamo.decorators import mark_unbacked
from torch._dynamo.exc import BackendCompilerFailed

from minserve.config import EngineConfig
from minserve.model.attention import AttentionMetadata, StepTensors
from minserve.model.llama import LlamaForCausalLM
from minserve.quant.row_switch import RowSwitchedLinear

logger = logging.getLogger(__name__)


# Weight formats whose decode step is bound by dispatch, not bytes, on a CPU: an eager int4 step of SmolLM2
# took 20.8 ms where its 94.8 MB of codes take 3.8 ms to read (docs/benchmarks.md, section 9).
DISPATCH_BOUND_FORMATS = ("int4", "int8")


def serving_compiles(config: EngineConfig) -> tuple[bool, str]:
    """Whether ``minserve serve`` compiles decode steps when neither ``--compile`` nor ``--no-compile`` is
    given, and why, in a phrase for the start-up line.

    A server runs for hours, so a compile of half a minute (minutes the first time, before inductor's cache
    is warm) pays wherever it shortens every decode step, which is where the step is bound by dispatch:
    on a CPU whose layers hold 4- or 8-bit codes, the bytes a step reads are so few that the eager step's
    hundreds of small operations cost several times the reading. A float model's step is bound by its
    bytes, and compiling it gained 6% (section 7). And only where the compiled path runs at all: one
    process, the torch backend, no speculation, and a C++ compiler for inductor.
    """
    from minserve.engine.engine import resolve_device
    from minserve.engine.model_setup import quant_scheme
    from minserve.model.loader import resolve_model_path

    device = resolve_device(config.device.device)
    if device.type != "cpu" or config.device.backend == "triton":
        return False, "eager: compiling is for the CPU's torch backend (a GPU has CUDA graphs)"
    if config.parallel.world_size > 1 or config.speculative is not None:
        return False, "eager: parallel and speculative engines run eager decode steps"
    scheme = quant_scheme(config, resolve_model_path(config.checkpoint.model), device)
    if scheme is None or scheme.format not in DISPATCH_BOUND_FORMATS:
        return False, "eager: float weights, whose decode steps are bound by reading them"
    if _cpp_compiler() is None:
        return False, "eager: no C++ compiler for inductor on this machine"
    return True, f"compiled: {scheme.format} codes, whose decode steps are bound by dispatch"


def _cpp_compiler() -> str | None:
    """The path of the C++ compiler inductor would use, or None where it finds none."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        return shutil.which(get_cpp_compiler())
    except Exception:  # inductor raises its own InvalidCxxCompiler, and whatever its search trips on
        return None


def expected_compile_s(num_layers: int) -> float:
    """Seconds one compile is expected to take, to tell a user before it starts (not a limit): a line
    through two cold compiles on a 2-core CPU, 18 s for minserve-tiny's 4 layers and 51 s for SmolLM2's 30
    (dynamo traces every layer, and inductor generates code for each). On a CPU the C++ wrapper's own
    compile comes on top, one compiler process for the whole step: 31 s for SmolLM2 with inductor's cache
    warm, about three minutes cold on one thread (2026-12-07, 2-core Xeon VM)."""
    return 13 + 1.27 * num_layers


class CompiledDecode:
    """The model's forward over pure decode steps, compiled once, when this is built.

    ``compile_s`` is how long that took, in seconds: tracing, inductor's code generation, the C++
    compiler, and the dummy step itself.
    """

    def __init__(self, model: LlamaForCausalLM, block_size: int) -> None:
        if model.backend.name != "torch":
            raise ValueError(
                f"compile_model=True compiles the torch backend's forward; this model runs on the "
                f"{model.backend.name!r} backend (on a GPU its kernels and CUDA graphs are the levers): "
                "pass backend='torch', or leave compile_model off"
            )
        self.device = next(model.parameters()).device
        # Layers held in two formats switch by the step's rows (:mod:`minserve.quant.row_switch`), so one
        # graph is traced for steps small enough for every layer's narrow format, another for steps large
        # enough for every layer's dense copy. Where the layers' switches differ (a file mixing 4- and 6-bit
        # blocks, say), the steps between the two run eagerly. The output layer is not in the graph.
        switches = [m.max_narrow_rows for m in model.layers.modules() if isinstance(m, RowSwitchedLinear)]
        self.max_seqs: int | None = min(switches, default=None)  # the narrow graph's most sequences
        self.wide_above: int | None = max(switches, default=None)  # the wide graph's fewest, less one
        # Only the two sizes marked in `run` are dynamic; every other (hidden size, heads, the cache's
        # shape) stays a constant, for which inductor generates tighter loops. On a CPU the generated code
        # is driven from C++ rather than Python (inductor's cpp_wrapper): a decode step launches hundreds of
        # small kernels, and a Python line per launch cost more than the kernels (SmolLM2 int4, one stream:
        # 52.6 tok/s with the Python wrapper, 78.5 with the C++ one).
        options = {"cpp_wrapper": True} if self.device.type == "cpu" else None
        compile_step = functools.partial(torch.compile, fullgraph=True, options=options)
        self.forward = compile_step(functools.partial(_narrow_step, model, self.max_seqs))
        # Steps too large for the narrow format get a graph of their own on the dense copies: their eager
        # step spends more on small operations (gathering keys, norms, rotary) than on its matmuls.
        self.wide_forward = None if self.max_seqs is None else compile_step(
            functools.partial(_wide_step, model, self.wide_above)
        )  # fmt: skip
        # A warning, not an info line: an unconfigured logger shows only warnings, and a start-up that goes
        # quiet this long without a word is what the line is for.
        graphs = 1 if self.max_seqs is None else 2
        logger.warning(
            "compiling the model's forward with torch.compile (decode steps, %d graph%s; prefill stays eager): "
            "~%.0f s on a small CPU, more the first time (a C++ compile), once, before the first request",
            graphs, "" if graphs == 1 else "s", graphs * expected_compile_s(model.config.num_layers),
        )  # fmt: skip
        self.started = False  # True once the start-up steps have compiled the graphs
        start_s = time.perf_counter()
        try:
            with torch._dynamo.config.patch(use_recursive_dict_tags_for_guards=True):  # read as guards are built
                self._dummy_steps(block_size)
        except Exception as error:  # dynamo and inductor fail with many types; each means the same here
            raise ValueError(
                f"compile_model=True: {_what_failed(error)}; leave compile_model off to run eagerly"
            ) from error
        self.started = True
        self.compile_s = time.perf_counter() - start_s
        logger.info("compiled the decode forward in %.1f s", self.compile_s)

    def can_run(self, meta: AttentionMetadata) -> bool:
        """A pure decode step (one new token for every sequence) of a size one of the graphs takes."""
        return self._graph_for(len(meta.query_lens)) is not None and all(n == 1 for n in meta.query_lens)

    def _graph_for(self, num_seqs: int) -> Callable[..., torch.Tensor] | None:
        """The compiled forward that takes a step of ``num_seqs`` sequences; None between the two graphs'
        ranges (layers whose switches differ)."""
        if self.max_seqs is None or num_seqs <= self.max_seqs:
            return self.forward
        return self.wide_forward if num_seqs > self.wide_above else None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The step's final hidden states ``[num_seqs, hidden]``, from the graph for its number of sequences."""
        meta.step_tensors = StepTensors.build(meta.query_lens, meta.context_lens, self.device)
        forward = self._graph_for(len(meta.query_lens))
        assert forward is not None, "can_run says which steps a graph takes"
        one_sequence_graph = forward is self.forward and self.max_seqs == 1
        _mark_sizes_unbacked(input_ids, positions, meta, any_batch=not one_sequence_graph)
        if not self.started:  # the start-up steps: one compile per graph
            return forward(input_ids, positions, meta)
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                return forward(input_ids, positions, meta)
        except RuntimeError as error:
            if "fail_on_recompile" not in str(error):
                raise
            raise RuntimeError(_recompile_message(error)) from error

    @torch.inference_mode()
    def _dummy_steps(self, block_size: int) -> None:
        """A decode step through each graph, every sequence one token in block 0. Any sizes would do (they
        are unbacked); two sequences, where the narrow graph takes more than one, keep the step from looking
        like a special case, and the wide graph gets one more sequence than the narrow one takes."""
        assert block_size >= 2, "the dummy step's two tokens must fit in block 0"
        sizes = [1 if self.max_seqs == 1 else 2]
        if self.wide_above is not None:
            sizes.append(self.wide_above + 1)
        for seqs in sizes:
            ids = torch.zeros(seqs, dtype=torch.int64, device=self.device)
            positions = torch.arange(seqs, device=self.device) % 2  # slots 0 and 1 of block 0, in turn
            tables = torch.zeros(seqs, 2, dtype=torch.int64, device=self.device)
            meta = AttentionMetadata([1] * seqs, (positions + 1).tolist(), positions.clone(), tables)
            self.run(ids, positions, meta)


def _narrow_step(
    model: LlamaForCausalLM,
    max_seqs: int | None,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """The model's forward over at most ``max_seqs`` sequences (any number where ``None``): a row-switched
    layer's test then has one answer, the narrow format, and only that branch is traced."""
    num_seqs = _check_one_row_per_sequence(input_ids, positions, meta)
    if max_seqs is not None and max_seqs > 1:  # one sequence: a constant (see _mark_sizes_unbacked)
        torch._check(num_seqs <= max_seqs)
    return model(input_ids, positions, meta)


def _wide_step(
    model: LlamaForCausalLM,
    wide_above: int,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """The model's forward over more than ``wide_above`` sequences: the dense branch of every row-switched
    layer. A function of its own, so that each graph's guards tell the two apart by the function they
    traced (the first thing they check) rather than by an argument's value further down."""
    num_seqs = _check_one_row_per_sequence(input_ids, positions, meta)
    torch._check(num_seqs > wide_above)
    return model(input_ids, positions, meta)


def _check_one_row_per_sequence(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> int:
    """Tell the compiler which unbacked sizes are the same size, and return the batch's: it knows nothing
    of them, not even that the batch's ids, positions, slots and context lengths are one per sequence
    (these checks are what it assumes, and what the compiled code asserts)."""
    num_seqs = input_ids.shape[0]
    for tensor in (positions, meta.slot_mapping, meta.block_tables, meta.step_tensors.context_lens):
        torch._check(tensor.shape[0] == num_seqs)
    torch._check(num_seqs >= 1)
    torch._check(meta.block_tables.shape[1] >= 1)
    return num_seqs


def _mark_sizes_unbacked(
    input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, any_batch: bool = True
) -> None:
    """Tell the compiler that the batch size and the blocks per sequence are any size, 1 included. A graph
    for one sequence only (``any_batch=False``: row-switched layers whose codes serve one row) keeps the
    batch size a constant 1 instead: the compiler cannot prove an unbacked size between 1 and 1 equal to 1.

    The marks are read only when a graph is traced. Marking every step (microseconds) keeps a later
    recompile, if anything ever forced one, from specializing on the step it happened to see."""
    if any_batch:
        for tensor in (input_ids, positions, meta.slot_mapping, meta.step_tensors.context_lens):
            mark_unbacked(tensor, 0)
        mark_unbacked(meta.block_tables, 0)
    mark_unbacked(meta.block_tables, 1)


def _recompile_message(error: RuntimeError) -> str:
    """What a recompile after start-up means, and what to change, above dynamo's own list of the guards
    that failed (the lines after its first)."""
    guards = "\n".join(str(error).splitlines()[1:]) or "(dynamo named no guard)"
    return (
        "the compiled decode forward would have to be traced again: something changed the model after the "
        "engine compiled it (a wrapper around model.forward, a hook, a swapped module). Change the model "
        "before building the engine, or time ModelRunner.logits instead of the model's forward.\n" + guards
    )


def _what_failed(error: Exception) -> str:
    """Which half of ``torch.compile`` failed, in a sentence: inductor building the code, or dynamo
    tracing the forward."""
    text = str(error).strip()
    detail = f"{type(error).__name__}: {text.splitlines()[0] if text else 'no message'}"
    if isinstance(error, BackendCompilerFailed):
        return (
            f"inductor could not build the decode forward on this machine ({detail}); on a CPU it needs a C++ compiler"
        )
    return f"torch.compile could not trace the model's decode forward ({detail})"
