"""A GGUF file's tokenizer, rebuilt with the ``tokenizers`` library from the file's metadata.

A GGUF file has no ``tokenizer.json``. It lists the vocabulary (``tokenizer.ggml.tokens``, spelled in
byte-level characters: ``Ġ`` is a space), the BPE merges in priority order, a type for every token
(normal, control, user-defined, …), the special token ids, and the *name* of the rule that splits text
into words before the merges apply (``tokenizer.ggml.pre``; llama.cpp knows each rule by name). From
those this module assembles the pipeline a ``tokenizer.json`` would have described::

    text → control tokens matched whole → words (pre-tokenizer) → bytes as byte-level characters
         → BPE merges → ids → (BOS first, where add_bos_token)        and back: ids → bytes → text

Only byte-level BPE vocabularies (``tokenizer.ggml.model = "gpt2"``, the GPT-2 / Llama 3 / SmolLM kind) are
built; SentencePiece ones (``"llama"``, Llama 2) are refused by name.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as RustTokenizer

from minserve.model.errors import TokenizerError
from minserve.model.gguf import GGUFFile

# llama.cpp's token types (gguf.TokenType): control tokens are special (<|im_start|>), user-defined ones are
# matched whole in the text but are ordinary output.
CONTROL, USER_DEFINED = 3, 4
# Pre-tokenizers by llama.cpp name. "gpt2": GPT-2's split (contractions, letters, numbers, punctuation,
# spaces). SmolLM and StarCoder first cut every digit apart, so "2024" is four words; their merges never
# join digits.
GPT2_PRE = ("gpt2",)
DIGITS_APART_PRE = ("smollm", "starcoder")


def build_tokenizer(file: GGUFFile) -> RustTokenizer:
    """The file's tokenizer as a ``tokenizers.Tokenizer``, ready to encode and decode."""
    metadata, name = file.metadata, file.path.name
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise TokenizerError(
            f"{name}: GGUF tokenizer model {kind!r} is not supported; minserve builds byte-level BPE tokenizers "
            "(tokenizer.ggml.model = 'gpt2'), not SentencePiece ('llama') ones"
        )
    tokens: list[str] = metadata.get("tokenizer.ggml.tokens") or []
    merges: list[str] = metadata.get("tokenizer.ggml.merges") or []
    if not tokens or not merges:
        raise TokenizerError(f"{name}: the GGUF metadata has no tokenizer.ggml.tokens or tokenizer.ggml.merges")
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    tokenizer = RustTokenizer(models.BPE(vocab=vocab, merges=pairs))
    tokenizer.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre"), name)
    tokenizer.decoder = decoders.ByteLevel()
    _add_whole_tokens(tokenizer, tokens, metadata.get("tokenizer.ggml.token_type") or [])
    post_processor = _post_processor(metadata, tokens)
    if post_processor is not None:
        tokenizer.post_processor = post_processor
    return tokenizer


def special_token_text(file: GGUFFile, which: str) -> str | None:
    """The text of the ``which`` ("bos", "eos") token, or None when the file names none."""
    token_id = file.metadata.get(f"tokenizer.ggml.{which}_token_id")
    tokens = file.metadata.get("tokenizer.ggml.tokens") or []
    return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None


def _pre_tokenizer(pre: str | None, name: str) -> pre_tokenizers.PreTokenizer:
    gpt2_split = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in GPT2_PRE:
        return gpt2_split
    if pre in DIGITS_APART_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2_split])
    raise TokenizerError(
        f"{name}: GGUF pre-tokenizer {pre!r} is not supported; minserve knows {', '.join(GPT2_PRE + DIGITS_APART_PRE)}"
    )


def _add_whole_tokens(tokenizer: RustTokenizer, tokens: list[str], token_types: list[int]) -> None:
    """Control and user-defined tokens are matched whole, before the text is split; they keep their ids."""
    control = [tokens[i] for i, kind in enumerate(token_types) if kind == CONTROL]
    user_defined = [tokens[i] for i, kind in enumerate(token_types) if kind == USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])


def _post_processor(metadata: dict[str, Any], tokens: list[str]) -> processors.PostProcessor | None:
    """BOS before (and EOS after) every encoded text where the file asks for them; None when it asks neither."""
    bos, eos = metadata.get("tokenizer.ggml.bos_token_id"), metadata.get("tokenizer.ggml.eos_token_id")
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if not (add_bos or add_eos):
        return None
    before = [tokens[bos]] if add_bos else []
    after = [tokens[eos]] if add_eos else []
    specials = [(tokens[i], i) for i in dict.fromkeys([*([bos] if add_bos else []), *([eos] if add_eos else [])])]
    return processors.TemplateProcessing(
        single=[*before, "$A", *after], pair=[*before, "$A", *after, *before, "$B", *after], special_tokens=specials
    )
