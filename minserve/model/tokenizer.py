"""Text ↔ token ids, from a checkpoint's ``tokenizer.json``, with its chat template.

The heavy lifting is the ``tokenizers`` library (the Rust tokenizer transformers uses); this wrapper reads
the special tokens and the chat template from ``tokenizer_config.json`` (or ``chat_template.jinja``, where
transformers 5 writes it) and renders the template in a sandboxed Jinja environment, as transformers does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as RustTokenizer


class TokenizerError(ValueError):
    """A checkpoint whose tokenizer files are missing or unreadable."""


class Tokenizer:
    """Encode, decode and apply the chat template of one checkpoint."""

    def __init__(self, model_dir: Path) -> None:
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(
                f"{model_dir} has no tokenizer.json (only fast tokenizers are supported; "
                "transformers' `AutoTokenizer.from_pretrained(dir).save_pretrained(dir)` writes one)"
            )
        self._tokenizer = RustTokenizer.from_file(str(path))
        self._config = _read_json(model_dir / "tokenizer_config.json")
        self.chat_template = _chat_template(model_dir, self._config)
        self.eos_token = _token_text(self._config.get("eos_token"))
        self.bos_token = _token_text(self._config.get("bos_token"))
        self.eos_token_id = self.token_to_id(self.eos_token) if self.eos_token else None
        self.bos_token_id = self.token_to_id(self.bos_token) if self.bos_token else None

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; the tokenizer's own post-processor adds BOS where the model expects it.

        Through ``encode_batch``, which releases Python's GIL while the Rust code runs (``encode`` holds it),
        so a server tokenizing in a worker thread keeps its event loop answering meanwhile.
        """
        return self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tokenizer.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text for a list of ``{"role": ..., "content": ...}`` messages."""
        if self.chat_template is None:
            raise TokenizerError("this tokenizer has no chat template; send a plain completion prompt instead")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        try:
            return env.from_string(self.chat_template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except TemplateError as error:
            raise TokenizerError(f"the chat template rejected the messages: {error}") from error


def _raise_template_error(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


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
