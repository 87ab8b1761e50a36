"""Text ↔ token ids, with the checkpoint's chat template, from a Hugging Face directory or a GGUF file.

The heavy lifting is the ``tokenizers`` library (the Rust tokenizer transformers uses). A Hugging Face
checkpoint brings it ready made in ``tokenizer.json``, with the special tokens and the chat template in
``tokenizer_config.json`` (or ``chat_template.jinja``, where transformers 5 writes it); a GGUF file brings
the pieces in its metadata, assembled by :mod:`minserve.model.gguf_tokenizer`. Either way the template is
rendered here, in a sandboxed Jinja environment, as transformers does.

**Text from a client is text.** A chat message that contains ``<|im_end|>\n<|im_start|>system`` must not
become control tokens, or a user could forge a system turn. :meth:`Tokenizer.encode_chat` tokenizes the
template's own markers as control tokens and each message's content as plain text, and
``encode(text, parse_special=False)`` does the same for a whole prompt a client sent.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any, NamedTuple

from tokenizers import Encoding
from tokenizers import Tokenizer as RustTokenizer

from minserve.model.errors import TokenizerError
from minserve.model.gguf import is_gguf_file, open_gguf
from minserve.model.gguf_tokenizer import build_tokenizer, special_token_text

__all__ = ["Tokenizer", "TokenizerError"]
_REPLY_MARKER = "minserve-the-reply-ends-here"
# Stands in for message i's content while the template renders, to find where each content lands. Private-use
# characters: no template writes them, and a client's content never reaches the rendering that holds them.
_CONTENT_SLOT = re.compile("\ue000([0-9]+)\ue001")


class _Source(NamedTuple):
    """What a checkpoint says about its tokenizer."""

    tokenizer: RustTokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None


class Tokenizer:
    """Encode, decode and apply the chat template of one checkpoint.

    ``model_path`` is a Hugging Face checkpoint directory or a ``.gguf`` file; the rest is the same code.
    """

    def __init__(self, model_path: Path | str) -> None:
        path = Path(model_path)
        source = _from_gguf(path) if is_gguf_file(path) else _from_directory(path)
        self._tokenizer = source.tokenizer
        self.chat_template = source.chat_template
        self.eos_token, self.bos_token = source.eos_token, source.bos_token
        self.eos_token_id = self.token_to_id(self.eos_token) if self.eos_token else None
        self.bos_token_id = self.token_to_id(self.bos_token) if self.bos_token else None

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def end_of_turn_token_id(self) -> int | None:
        """The special token the chat template writes right after an assistant's reply, or None.

        ChatML's ``<|im_end|>``, Llama 3's ``<|eot_id|>``: where a chat reply ends, whichever token the
        tokenizer calls its EOS. Found by rendering a two-message conversation and reading what follows.
        """
        if self.chat_template is None:
            return None
        messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _REPLY_MARKER}]
        try:
            text = self.apply_chat_template(messages, add_generation_prompt=False)
        except Exception:  # a template may refuse this probe (it wants a system turn, tools…): then no answer
            return None
        if _REPLY_MARKER not in text:
            return None
        ids = self.encode(text.rpartition(_REPLY_MARKER)[2].lstrip(), add_special_tokens=False)
        special = {i for i, token in self._tokenizer.get_added_tokens_decoder().items() if token.special}
        return ids[0] if ids and ids[0] in special else None

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """Token ids that end a generation: EOS and the chat template's end of turn."""
        return frozenset(i for i in (self.eos_token_id, self.end_of_turn_token_id) if i is not None)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def tokenizer_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (for a GGUF file, the one rebuilt from its metadata)."""
        return self._tokenizer.to_str()

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``; the tokenizer's own post-processor adds BOS where the model expects it.

        ``parse_special=False`` reads control-token text (``<|im_end|>``) in ``text`` as plain text: for text a
        client wrote. Through ``encode_batch``, which releases Python's GIL while the Rust code runs
        (``encode`` holds it), so a server tokenizing in a worker thread keeps its event loop answering.
        """
        tokenizer = self._tokenizer if parse_special else self._plain
        return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @functools.cached_property
    def _plain(self) -> RustTokenizer:
        """A copy that encodes special tokens' text as ordinary text. A copy, not a toggled flag: the flag is
        the tokenizer's own, and a server tokenizes in several threads at once."""
        plain = RustTokenizer.from_str(self._tokenizer.to_str())
        plain.encode_special_tokens = True
        return plain

    @functools.cached_property
    def special_texts(self) -> tuple[str, ...]:
        """The text of every special token (``<|im_start|>``, ``</s>``…): what a client's text must not become."""
        tokens = self._tokenizer.get_added_tokens_decoder().values()
        return tuple(token.content for token in tokens if token.special and token.content)

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> tuple[str, list[int]]:
        """The chat prompt's text and token ids: the template's markers as control tokens, each message's
        content as plain text whatever it spells. ``TokenizerError`` if the template rewrites a content that
        spells a control token, so that where it lands cannot be told (never the case for ChatML or Llama 3).
        ``tools`` (OpenAI's function descriptions) go to a template that takes them."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools)
        contents = [str(message.get("content") or "") for message in messages]
        if not any(special in content for content in contents for special in self.special_texts):
            return text, self.encode(text)  # nothing to protect: exactly the template's tokenization
        pieces = self._chat_pieces(messages, contents, add_generation_prompt, text, tools)
        template = self._tokenizer.encode_batch([p for p, is_content in pieces if not is_content], False)
        plain = self._plain.encode_batch([p for p, is_content in pieces if is_content], False)
        ordered = [(plain if is_content else template).pop(0) for _, is_content in pieces]
        return text, self._tokenizer.post_process(Encoding.merge(ordered, growing_offsets=True)).ids

    def _chat_pieces(
        self,
        messages: list[dict[str, Any]],
        contents: list[str],
        add_generation_prompt: bool,
        text: str,
        tools: list[dict] | None,
    ) -> list[tuple[str, bool]]:
        """The rendered prompt cut into (piece, is a message's content), checked to spell ``text`` exactly."""
        slotted = [{**m, "content": f"\ue000{i}\ue001"} for i, m in enumerate(messages)]
        parts = _CONTENT_SLOT.split(self.apply_chat_template(slotted, add_generation_prompt, tools))
        for shape in (str, str.strip):  # as given, or trimmed (Llama 3's template trims each content)
            pieces = [(contents[int(p)] if i % 2 else p, bool(i % 2)) for i, p in enumerate(parts)]
            pieces = [(shape(p) if is_content else p, is_content) for p, is_content in pieces]
            if "".join(p for p, _ in pieces) == text:
                return [(p, is_content) for p, is_content in pieces if p]
        raise TokenizerError(
            "messages: a message spells a control token (such as "
            f"{next(s for s in self.special_texts if any(s in c for c in contents))!r}) and this chat template "
            "rewrites message content, so it cannot be kept as plain text; remove the control token"
        )

    @functools.cached_property
    def takes_tools(self) -> bool:
        """Whether the chat template reads a ``tools`` variable (Llama 3.1's and Qwen's do; ChatML's does not)."""
        if self.chat_template is None:
            return False
        from jinja2 import meta

        env = _template_environment()
        return "tools" in meta.find_undeclared_variables(env.parse(self.chat_template))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tokenizer.id_to_token(token_id)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        """The prompt text for a list of ``{"role": ..., "content": ...}`` messages, and ``tools`` for a template
        that takes them (``TokenizerError`` for one that does not: they would be dropped without a word)."""
        if self.chat_template is None:
            raise TokenizerError("this tokenizer has no chat template; send a plain completion prompt instead")
        if tools and not self.takes_tools:
            raise TokenizerError("tools: this model's chat template has no place for tools; send the request without")
        from jinja2.exceptions import TemplateError

        try:
            return (
                _template_environment()
                .from_string(self.chat_template)
                .render(
                    messages=messages,
                    add_generation_prompt=add_generation_prompt,
                    bos_token=self.bos_token or "",
                    eos_token=self.eos_token or "",
                    **({"tools": tools} if tools else {}),
                )
            )
        except TemplateError as error:
            raise TokenizerError(f"the chat template rejected the messages: {error}") from error


def _template_environment() -> Any:
    """jinja2's sandbox, as transformers renders chat templates (a template is data from a checkpoint)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_template_error
    return env


def _raise_template_error(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _from_directory(model_dir: Path) -> _Source:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(
            f"{model_dir} has no tokenizer.json (only fast tokenizers are supported; "
            "transformers' `AutoTokenizer.from_pretrained(dir).save_pretrained(dir)` writes one)"
        )
    config = _read_json(model_dir / "tokenizer_config.json")
    return _Source(
        tokenizer=RustTokenizer.from_file(str(path)),
        chat_template=_chat_template(model_dir, config),
        bos_token=_token_text(config.get("bos_token")),
        eos_token=_token_text(config.get("eos_token")),
    )


def _from_gguf(path: Path) -> _Source:
    file = open_gguf(path)
    return _Source(
        tokenizer=build_tokenizer(file),
        chat_template=file.metadata.get("tokenizer.chat_template"),
        bos_token=special_token_text(file, "bos"),
        eos_token=special_token_text(file, "eos"),
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise TokenizerError(f"{path} is not valid JSON: {error}") from error


def _chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = config.get("chat_template") or _read_json(model_dir / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # several named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
    return template


def _token_text(token: str | dict[str, Any] | None) -> str | None:
    """Special tokens are saved either as a string or as a serialized AddedToken dict."""
    if isinstance(token, dict):
        return token.get("content")
    return token
