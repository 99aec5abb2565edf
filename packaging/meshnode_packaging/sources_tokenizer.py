"""Build a Hugging Face ``tokenizer.json`` from a GGUF file's vocabulary and merges.

Only byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``) are supported. The
pre-tokenizer follows ``tokenizer.ggml.pre``, the name llama.cpp gives to each model
family's splitting rules (llama.cpp ``llama-vocab.cpp``): ``smollm`` splits every digit on
its own before the GPT-2 byte-level regex, exactly as the original SmolLM2
``tokenizer.json`` does (``Digits(individual_digits=True)`` then ``ByteLevel``).
"""

from __future__ import annotations

import json
from typing import Any

import gguf

__all__ = ["UnsupportedTokenizerError", "gguf_tokenizer_json"]


class UnsupportedTokenizerError(ValueError):
    """The GGUF's tokenizer kind or pre-tokenizer is one meshnode cannot rebuild."""


_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True}

# Llama 3's split regex (llama.cpp LLAMA_VOCAB_PRE_TYPE_LLAMA3, HF tokenizer.json).
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's split regex: as Llama 3's but digits one at a time.
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _regex_then_bytes(pattern: str) -> dict[str, Any]:
    return {
        "type": "Sequence",
        "pretokenizers": [
            {
                "type": "Split",
                "pattern": {"Regex": pattern},
                "behavior": "Isolated",
                "invert": False,
            },
            {**_BYTE_LEVEL, "use_regex": False},
        ],
    }


# tokenizer.ggml.pre -> Hugging Face pre_tokenizer.
PRE_TOKENIZERS: dict[str, dict[str, Any]] = {
    "gpt2": {**_BYTE_LEVEL, "use_regex": True},
    "default": {**_BYTE_LEVEL, "use_regex": True},
    "smollm": {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {**_BYTE_LEVEL, "use_regex": True},
        ],
    },
    "llama-bpe": _regex_then_bytes(_LLAMA3_REGEX),
    "qwen2": _regex_then_bytes(_QWEN2_REGEX),
}

# gguf token types (llama.cpp llama_token_type): which become "added tokens".
_CONTROL = 3
_USER_DEFINED = 4


def _array(reader: gguf.GGUFReader, key: str) -> list[Any]:
    field = reader.fields.get(key)
    if field is None:
        return []
    values = field.contents()
    return list(values) if isinstance(values, list) else [values]


def gguf_tokenizer_json(reader: gguf.GGUFReader) -> str:
    """The ``tokenizer.json`` document equivalent to the GGUF's tokenizer metadata.

    Raises :class:`UnsupportedTokenizerError` for SentencePiece (``llama``) vocabularies and
    for pre-tokenizers not in :data:`PRE_TOKENIZERS`.
    """
    kind = reader.fields.get("tokenizer.ggml.model")
    model = None if kind is None else kind.contents()
    if model != "gpt2":
        raise UnsupportedTokenizerError(
            f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2')"
        )
    pre_field = reader.fields.get("tokenizer.ggml.pre")
    pre = "default" if pre_field is None else str(pre_field.contents())
    if pre not in PRE_TOKENIZERS:
        raise UnsupportedTokenizerError(f"GGUF pre-tokenizer {pre!r} is not supported")
    tokens = [str(t) for t in _array(reader, "tokenizer.ggml.tokens")]
    types = [int(t) for t in _array(reader, "tokenizer.ggml.token_type")] or [1] * len(tokens)
    merges = [str(m) for m in _array(reader, "tokenizer.ggml.merges")]
    added = [
        {
            "id": i,
            "content": tok,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": ty == _CONTROL,
        }
        for i, (tok, ty) in enumerate(zip(tokens, types, strict=True))
        if ty in (_CONTROL, _USER_DEFINED)
    ]
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": PRE_TOKENIZERS[pre],
        "post_processor": None,
        "decoder": {**_BYTE_LEVEL, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {tok: i for i, tok in enumerate(tokens)},
            "merges": merges,
        },
    }
    return json.dumps(doc, ensure_ascii=False)
