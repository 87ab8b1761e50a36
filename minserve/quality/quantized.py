"""Each weight format against the full-precision model: bytes, and what they cost in quality.

One function, :func:`compare_formats`, that chapter 07 and ``benchmarks/quantization.py`` both call: it loads
the model once in float32 as the reference and once per format, and measures every format on the same
tokens (:mod:`.agreement`) and the same greedy prompts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import pandas as pd
import torch

from minserve.engine.llm import LLM
from minserve.engine.sampling_params import SamplingParams
from minserve.quality.agreement import Agreement, greedy_divergence, next_token_agreement
from minserve.quality.held_out import held_out_text
from minserve.quality.kv_cache import logits_through_cache
from minserve.quant.swap import format_options, linear_weight_bytes, weight_bytes

# Four short, different beginnings: code, prose, a list, a question.
PROMPTS = (
    "def fibonacci(n):",
    "The history of the printing press begins",
    "Three things to pack for a hike:",
    "Why do leaves change colour in autumn?",
)
EVAL_KV_BYTES = 64 * 2**20  # the comparison generates little: a small cache keeps four models in memory


@dataclass(frozen=True)
class FormatReport:
    """One format of one model, measured against the same model in float32."""

    label: str  # "float32", "int8", "int4-g64", "fp8", "kv-int8", "int4+kv-fp8"
    weight_bytes: int  # all of the model's weights as stored
    kv_bytes_per_token: int  # the KV cache's, every layer
    step_weight_bytes: int  # the linear layers' (head included): what one decode step reads
    bits_per_weight: float  # over the linear layers
    agreement: Agreement  # next-token distributions against float32's, on the held-out text
    greedy_same_tokens: tuple[int, ...]  # per prompt: tokens until greedy decoding first differs

    def row(self) -> dict[str, float | str | int]:
        a = self.agreement
        return {
            "format": self.label,
            "bits/weight": self.bits_per_weight,
            "weights (MB)": self.weight_bytes / 1e6,
            "read per step (MB)": self.step_weight_bytes / 1e6,
            "KV bytes/token": self.kv_bytes_per_token,
            "perplexity": a.perplexity,
            "KL (nats/token)": a.kl_per_token,
            "top-1 agreement": a.top1_agreement,
            "greedy tokens same (min)": min(self.greedy_same_tokens),
        }


def compare_formats(
    model: str,
    formats: Sequence[str] = ("int8", "int4-g64", "fp8", "kv-int8"),
    text: str | None = None,
    max_tokens: int = 2048,
    window_tokens: int = 512,
    prompts: Sequence[str] = PROMPTS,
    new_tokens: int = 48,
    progress: bool = False,
    edits: Mapping[str, Callable[[LLM], None]] | None = None,
) -> list[FormatReport]:
    """float32 first, then each format, on ``max_tokens`` tokens of ``text`` (the held-out text by default)
    in windows of ``window_tokens``, and ``new_tokens`` greedy tokens from each prompt.

    A format is a weight format (a :meth:`QuantScheme.from_label` label: ``"int8"``, ``"int4-g32"``), a KV
    cache format (``"kv-int8"``, ``"kv-fp8"``: float32 weights), or both joined by ``+``
    (``"int4+kv-int8"``). With an 8-bit cache, every scored position attends to keys and values read back
    from their codes (:func:`~minserve.quality.kv_cache.logits_through_cache`), as when serving.

    ``edits`` adds formats the engine cannot load by name: each label's callable changes a freshly loaded
    float32 engine in place (W8A8, simulated: :func:`minserve.quant.activations.quantize_w8a8`)."""
    reference = LLM(model, kv_cache_memory_bytes=EVAL_KV_BYTES, quantization="none")  # the file's float values
    reference_logits = _once_per_window(reference.model.logits_without_cache)
    stream = torch.tensor(reference.tokenizer.encode(text or held_out_text())[:max_tokens])
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    reference_tokens = [o.token_ids for o in reference.generate(list(prompts), greedy)]

    def report(label: str, llm: LLM) -> FormatReport:
        engine = llm.engine
        if engine.kv_scales is None:
            logits_of = engine.model.logits_without_cache
        else:
            logits_of = functools.partial(
                logits_through_cache, engine.model, cache_dtype=engine.kv_cache_dtype, kv_scales=engine.kv_scales
            )
        agreement = next_token_agreement(reference_logits, logits_of, stream, window_tokens, progress)
        same = greedy_divergence(reference_tokens, [o.token_ids for o in llm.generate(list(prompts), greedy)])
        step_bytes, weights = linear_weight_bytes(engine.model)
        kv_per_token = engine.kv_bytes_per_token()
        return FormatReport(
            label, weight_bytes(engine.model), kv_per_token, step_bytes, 8 * step_bytes / weights, agreement,
            tuple(same),
        )  # fmt: skip

    reports = [report("float32", reference)]
    for label in formats:
        llm = LLM(model, kv_cache_memory_bytes=EVAL_KV_BYTES, **format_options(label))
        reports.append(report(label, llm))
        del llm  # one changed model at a time beside the reference
    for label, edit in (edits or {}).items():
        llm = LLM(model, kv_cache_memory_bytes=EVAL_KV_BYTES, quantization="none")
        edit(llm)
        reports.append(report(label, llm))
        del llm
    return reports


def _once_per_window(logits_of: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``logits_of``, remembering its logits per window of tokens. Every format is scored against the reference
    on the same windows, so the reference's forward runs once per window, not once per format (a window of
    512 tokens keeps 512 × vocabulary floats: about 100 MB for SmolLM2's 49k tokens)."""
    seen: dict[tuple[int, ...], torch.Tensor] = {}

    def logits(window: torch.Tensor) -> torch.Tensor:
        key = tuple(window.tolist())
        if key not in seen:
            seen[key] = logits_of(window)
        return seen[key]

    return logits


def format_table(reports: Sequence[FormatReport]) -> pd.DataFrame:
    """One row per format, float32 first."""
    return pd.DataFrame([r.row() for r in reports]).set_index("format")
