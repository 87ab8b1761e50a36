"""The embedded tokenizer: exact round trips, special tokens, the chat template."""

from __future__ import annotations

import pytest

from minserve.model.loader import ASSETS_DIR
from minserve.model.tokenizer import Tokenizer, TokenizerError


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(ASSETS_DIR / "minserve-tiny")


@pytest.mark.parametrize("text", ["def fib(n):\n    return n", "naïve café ✓ 日本", "\t\n  x = {'a': [1, 2]}\n"])
def test_round_trip_is_exact(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_end_of_text_is_the_eos_token(tokenizer):
    assert tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.eos_token_id == tokenizer.token_to_id("<|endoftext|>")
    assert tokenizer.decode([tokenizer.eos_token_id]) == ""
    assert tokenizer.decode([tokenizer.eos_token_id], skip_special_tokens=False) == "<|endoftext|>"


def test_chat_template_renders_roles_and_generation_prompt(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = tokenizer.apply_chat_template(messages)
    assert prompt.index("<|system|>") < prompt.index("Be brief.") < prompt.index("<|user|>") < prompt.index("Hi")
    assert prompt.rstrip().endswith("<|assistant|>")
    assert not tokenizer.apply_chat_template(messages, add_generation_prompt=False).rstrip().endswith("<|assistant|>")
    # Role markers are single special tokens, not spelled out letter by letter.
    assert tokenizer.token_to_id("<|user|>") in tokenizer.encode(prompt)


def test_chat_template_in_tokenizer_config_is_read(tmp_path, tokenizer):
    import json
    import shutil

    source = ASSETS_DIR / "minserve-tiny"
    shutil.copy(source / "tokenizer.json", tmp_path)
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"


def test_no_chat_template_is_a_clear_error(tmp_path):
    import shutil

    shutil.copy(ASSETS_DIR / "minserve-tiny" / "tokenizer.json", tmp_path)
    with pytest.raises(TokenizerError, match="no chat template"):
        Tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])
