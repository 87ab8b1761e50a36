"""The offline API: ``LLM(model).generate(prompts, params)``, ``LLM.chat(conversations, params)`` and
``LLM.stream(...)``.

All drive :class:`~minserve.engine.engine.LLMEngine`'s ``step()`` loop, the same loop the server runs:
requests are batched continuously, share cached prefixes, and come back in prompt order.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from minserve.config import EngineConfig
from minserve.engine.engine import LLMEngine
from minserve.engine.outputs import RequestOutput
from minserve.engine.sampling_params import SamplingParams, check_request_options
from minserve.model.loader import DEFAULT_MODEL
from minserve.trace import Tracer

Prompt = str | list[int]
Conversation = Sequence[dict[str, Any]]  # {"role": "user", "content": "Hi"}, …


class LLM:
    """A loaded model behind a paged, continuously batched engine.

    >>> llm = LLM()                                       # the embedded "minserve-tiny"
    >>> out = llm.generate(["def add(a, b):"], SamplingParams(max_tokens=8, temperature=0))[0]
    >>> out.finish_reason in ("stop", "length")
    True

    Keyword arguments are the engine's settings, flat (``dtype``, ``device``, ``max_model_len``,
    ``block_size``, ``num_kv_blocks``, ``kv_cache_memory_bytes``, ``max_num_seqs``, ``quantization``,
    ``speculative_config``, …): :meth:`EngineConfig.from_options <minserve.config.EngineConfig.from_options>`
    sorts them into their groups, and an unknown one is an error that lists them all.
    """

    def __init__(self, model: str | Path = DEFAULT_MODEL, **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_options(model=str(model), **engine_options))
        self.tokenizer = self.engine.tokenizer
        self.model = self.engine.model
        self.model_config = self.engine.model_config
        self.device, self.dtype = self.engine.device, self.engine.dtype
        self.max_model_len = self.engine.max_model_len

    @property
    def tracer(self) -> Tracer:
        """Every request's lifecycle events (see :mod:`minserve.trace`)."""
        return self.engine.core.tracer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: int | Sequence[int] = 0,
        deadline_s: float | Sequence[float | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text, or a list of token ids); outputs come back in prompt order.

        ``params`` is one :class:`SamplingParams` for all prompts or one per prompt. Every request is
        checked before any is queued, so a bad one raises ``ValueError`` and nothing runs. ``priority`` (lower
        first, under the priority policy) and ``deadline_s`` (seconds after arrival, then the request is
        stopped) are one value for all prompts or one per prompt.
        """
        request_ids = self._add_all(prompts, params, priority, deadline_s)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), disable=not use_tqdm, desc="generate", unit="req") as progress:
            while len(finished) < len(request_ids):
                for output in self.engine.step():
                    if output.finished and output.request_id in request_ids:
                        finished[output.request_id] = output
                        progress.update(1)
        return [finished[request_id] for request_id in request_ids]

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Answer one conversation or several, as vLLM's ``LLM.chat``: a conversation is a list of
        ``{"role", "content"}`` messages (content a string, or OpenAI's list of ``{"type": "text", "text"}``
        parts), and ``messages`` is one conversation or a list of them. Each goes through the model's chat
        template, as the server's chat endpoint does: what a message says is plain text, so control-token text
        in it (``<|im_end|>``) never becomes a control token. ``params`` is one for all or one per
        conversation; one output per conversation, in order."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for i, conversation in enumerate(conversations):
            try:
                prompts.append(self.encode_chat(conversation))
            except ValueError as error:
                raise ValueError(f"conversation {i}: {error}") from error
        return self.generate(prompts, params, use_tqdm)

    def encode_chat(self, messages: Conversation) -> list[int]:
        """One conversation's prompt token ids, through the chat template, ending where the assistant's reply
        begins (what :meth:`chat` sends; :meth:`stream` takes it to stream a reply)."""
        return self.engine.inputs.encode_chat([_plain_message(m) for m in messages])[1]

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield outputs as tokens are produced (``delta_text`` is the new text). Closing the iterator early
        cancels the requests still running and frees their KV blocks."""
        request_ids = self._add_all(prompts, params)
        pending = set(request_ids)
        try:
            while pending:
                for output in self.engine.step():
                    if output.request_id in pending:
                        if output.finished:
                            pending.discard(output.request_id)
                        yield output
        finally:
            for request_id in pending:
                self.engine.abort_request(request_id)
            self.engine.process_aborts()

    def cancel(self, request_id: str) -> None:
        """Cancel one request; it ends with ``finish_reason="cancelled"`` at the next step."""
        self.engine.abort_request(request_id)

    def stats(self) -> dict[str, float]:
        """KV blocks total and used, prefix-cache hit rate, preemptions, running and waiting requests."""
        return self.engine.stats().as_dict()

    def close(self) -> None:
        """Stop the engine's rank processes (tensor or pipeline parallel), waiting until each has exited;
        nothing else holds an outside resource. Safe to call twice. An ``LLM`` dropped without it has its
        ranks killed and reaped when it is collected."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _add_all(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None,
        priority: int | Sequence[int] = 0,
        deadline_s: float | Sequence[float | None] | None = None,
    ) -> list[str]:
        arrival_s = time.perf_counter()  # before tokenizing: tokenization is part of every request's latency
        prompts = _as_prompt_list(prompts)
        params_list = _as_params_list(params, len(prompts))
        priorities = _per_prompt(priority, len(prompts), "priority")
        deadlines = _per_prompt(deadline_s, len(prompts), "deadline_s")
        # Every request through the input processor first, as the server's are: nothing is queued unless all
        # pass. One after another, each prompt's tokenizing timed for the trace.
        inputs, tokenize_s = [], []
        for i, (prompt, p, rank, deadline) in enumerate(zip(prompts, params_list, priorities, deadlines)):
            start_s = time.perf_counter()
            inputs.append(self.engine.inputs.process(prompt, p, index=i))
            tokenize_s.append((start_s, time.perf_counter()))
            check_request_options(rank, deadline)
        return [
            self.engine.add_request(r.prompt, r.params, None, arrival_s, r.prompt_token_ids, rank, deadline, span)
            for r, rank, deadline, span in zip(inputs, priorities, deadlines, tokenize_s, strict=True)
        ]


def _plain_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message whose content is OpenAI's list of text parts, as one string (what a template renders)."""
    content = message.get("content")
    if isinstance(content, list):
        texts = [part.get("text") for part in content if isinstance(part, dict) and part.get("type") == "text"]
        if len(texts) != len(content) or not all(isinstance(text, str) for text in texts):
            raise ValueError('a message\'s content must be a string or a list of {"type": "text", "text": …} parts')
        return {**message, "content": "".join(texts)}
    return message


def _per_prompt(value, n: int, name: str) -> list:
    """One value for all ``n`` prompts, or a sequence of exactly ``n``."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"got {len(value)} values of {name} for {n} prompts; pass one, or one per prompt")
        return list(value)
    return [value] * n


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
