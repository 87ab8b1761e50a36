"""The offline API: ``LLM(model).generate(prompts, params)``.

This first version runs each request on its own through :mod:`minserve.engine.reference_loop`. The paged,
continuously batched engine replaces the loop behind the same methods, so code written against this API
(the chapters, the CLI, the tests) keeps working.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from minserve.config import EngineConfig
from minserve.engine.outputs import RequestMetrics, RequestOutput
from minserve.engine.reference_loop import generate_token_ids
from minserve.engine.sampling_params import SamplingParams
from minserve.model.loader import DEFAULT_MODEL, load_config, load_model, resolve_dtype, resolve_model_path
from minserve.model.tokenizer import Tokenizer

Prompt = str | list[int]


class LLM:
    """A loaded model and its tokenizer, ready to generate.

    >>> llm = LLM()                                       # the embedded "minserve-tiny"
    >>> out = llm.generate(["def add(a, b):"], SamplingParams(max_tokens=8, temperature=0))[0]
    >>> out.finish_reason in ("stop", "length")
    True
    """

    def __init__(
        self,
        model: str | Path = DEFAULT_MODEL,
        dtype: str = "auto",
        device: str = "auto",
        max_model_len: int | None = None,
    ) -> None:
        self.config = EngineConfig(model=str(model), dtype=dtype, device=device, max_model_len=max_model_len)
        self.model_dir = resolve_model_path(self.config.model)
        self.device = _resolve_device(self.config.device)
        self.tokenizer = Tokenizer(self.model_dir)
        self.dtype = resolve_dtype(self.config.dtype, load_config(self.model_dir), self.device)
        self.model = load_model(self.model_dir, self.dtype, self.device)
        self.model_config = self.model.config
        model_limit = self.model_config.max_position_embeddings
        self.max_model_len = min(max_model_len or model_limit, model_limit)  # tokens: prompt + output
        self._next_request_id = 0

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text, or a list of token ids). Outputs come back in prompt order.

        ``params`` is one :class:`SamplingParams` for all prompts or one per prompt. Every request is
        checked before any runs, so a bad one raises ``ValueError`` and nothing is half done.
        """
        prompts = _as_prompt_list(prompts)
        params_list = _as_params_list(params, len(prompts))
        encoded = [self._encode(prompt, i) for i, prompt in enumerate(prompts)]
        for ids, p in zip(encoded, params_list):
            self._check_fits(ids, p)
        requests = zip(prompts, encoded, params_list)
        return [self._run_one(*request) for request in tqdm(list(requests), disable=not use_tqdm, desc="generate")]

    def _encode(self, prompt: Prompt, index: int) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            vocab = self.model_config.vocab_size
            if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
                raise ValueError(f"prompt {index}: token ids must be integers in [0, {vocab})")
        if not ids:
            raise ValueError(f"prompt {index}: the prompt is empty")
        return ids

    def _check_fits(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(prompt_ids)} tokens leave no room to generate within the model's context of "
                f"{self.max_model_len} tokens; shorten the prompt"
            )

    def _run_one(self, prompt: Prompt, prompt_ids: list[int], params: SamplingParams) -> RequestOutput:
        request_id = str(self._next_request_id)
        self._next_request_id += 1
        metrics = RequestMetrics(arrival_time_s=time.perf_counter())
        stop_checker = _StopStrings(self.tokenizer, params.stop)
        token_ids: list[int] = []
        for token, produced_s in generate_token_ids(
            self.model, prompt_ids, params, self.stop_token_ids, stop_checker, self.max_model_len
        ):
            token_ids.append(token)
            metrics.token_times_s.append(produced_s)
        metrics.finish_time_s = time.perf_counter()
        text = self.tokenizer.decode(token_ids)
        finish_reason, stop_reason = "length", None
        if stop_checker.matched is not None:
            finish_reason, stop_reason = "stop", stop_checker.matched
            text = text[: text.index(stop_checker.matched)]
        elif token_ids and token_ids[-1] in self.stop_token_ids and not params.ignore_eos:
            finish_reason, stop_reason = "stop", token_ids[-1]
        return RequestOutput(
            request_id=request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=prompt_ids,
            text=text,
            token_ids=token_ids,
            finish_reason=finish_reason,
            metrics=metrics,
            stop_reason=stop_reason,
        )


class _StopStrings:
    """Checks the decoded output for any stop string after each token; remembers which one matched."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str]) -> None:
        self.tokenizer, self.stop, self.matched = tokenizer, stop, None

    def __call__(self, output_ids: list[int]) -> bool:
        if not self.stop:
            return False
        text = self.tokenizer.decode(output_ids)
        hits = [(text.index(s), s) for s in self.stop if s in text]
        if hits:
            self.matched = min(hits)[1]
        return bool(hits)


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"device {device!r} is not a torch device (try 'cpu', 'cuda' or 'auto')") from error
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA GPU; use device='cpu' or 'auto'")
    return resolved


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single prompt given as token ids
    return prompts


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts; pass one, or one per prompt")
    return params
