"""The JSON the server sends back: completion and chat bodies, stream chunks, usage, log-probabilities.

Shapes follow OpenAI's API, so its clients parse them unchanged: a completion's ``logprobs`` is
``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``; a chat choice's is ``{"content": [{"token",
"logprob", "bytes", "top_logprobs"}]}``. A stream chunk carries the log-probabilities of the tokens that
arrived since the previous chunk.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from minserve.engine.outputs import RequestOutput
from minserve.model.tokenizer import Tokenizer
from minserve.serve.protocol import finish_reason

COMPLETION, CHAT = "text_completion", "chat.completion"


@dataclass
class Reply:
    """What every body of one request shares: its id, kind, model, and whether it asked for logprobs."""

    request_id: str
    kind: str  # COMPLETION or CHAT
    model: str
    tokenizer: Tokenizer
    logprobs: bool = False
    include_usage: bool = False
    tokens_sent: int = 0  # in a stream: tokens whose logprobs earlier chunks carried
    chars_sent: int = 0  # and the characters of those tokens (a completion's text_offset counts from here)

    def envelope(self, chunk: bool) -> dict:
        obj = f"{self.kind}.chunk" if chunk and self.kind == CHAT else self.kind
        return {"id": self.request_id, "object": obj, "created": int(time.time()), "model": self.model}

    def body(self, output: RequestOutput) -> dict:
        """The whole answer of a request that did not stream."""
        if self.kind == CHAT:
            choice = {"index": 0, "message": {"role": "assistant", "content": output.text}}
        else:
            choice = {"index": 0, "text": output.text}
        choice["logprobs"] = self._logprobs(output, 0)
        choice["finish_reason"] = finish_reason(output)
        return {**self.envelope(chunk=False), "choices": [choice], "usage": usage(output)}

    def chunk(self, output: RequestOutput, first: bool) -> dict:
        """One stream event: the text (and tokens) that arrived since the previous one."""
        if self.kind == CHAT:  # as OpenAI does, only the first delta names the role
            delta = {"role": "assistant", "content": output.delta_text} if first else {"content": output.delta_text}
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": output.delta_text}
        choice["logprobs"] = self._logprobs(output, self.tokens_sent)
        self.tokens_sent = len(output.token_ids)
        choice["finish_reason"] = finish_reason(output)
        return {**self.envelope(chunk=True), "choices": [choice]}

    def usage_chunk(self, output: RequestOutput) -> dict:
        return {**self.envelope(chunk=True), "choices": [], "usage": usage(output)}

    def _logprobs(self, output: RequestOutput, start: int) -> dict | None:
        if not self.logprobs or output.logprobs is None:
            return None
        ids, values = output.token_ids[start:], output.logprobs[start:]
        tops = (output.top_logprobs or [])[start:] or [{} for _ in ids]
        if self.kind == CHAT:
            return {"content": [self._chat_entry(t, v, top) for t, v, top in zip(ids, values, tops)]}
        tokens = [self._text(t) for t in ids]
        offsets = []
        for token in tokens:
            offsets.append(self.chars_sent)
            self.chars_sent += len(token)
        named_tops = [{self._text(t): v for t, v in top.items()} for top in tops]
        return {
            "tokens": tokens,
            "token_logprobs": values,
            "top_logprobs": named_tops if output.top_logprobs else None,
            "text_offset": offsets,
        }

    def _chat_entry(self, token: int, logprob: float, top: dict[int, float]) -> dict:
        text = self._text(token)
        entry = {"token": text, "logprob": logprob, "bytes": list(text.encode())}
        entry["top_logprobs"] = [{"token": self._text(t), "logprob": v, "bytes": list(self._text(t).encode())}
                                 for t, v in top.items()]  # fmt: skip
        return entry

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)


def usage(output: RequestOutput) -> dict:
    prompt, completion = len(output.prompt_token_ids), len(output.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def sse_event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
