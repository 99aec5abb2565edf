"""Build a Hugging Face ``tokenizer.json`` from a GGUF file's vocabulary.

Two kinds of GGUF vocabulary (``tokenizer.ggml.model``), as llama.cpp reads them
(``llama-vocab.cpp``):

- ``gpt2``: byte-level BPE with merges. The pre-tokenizer follows ``tokenizer.ggml.pre``,
  the name llama.cpp gives to each model family's splitting rules: ``smollm`` splits every
  digit on its own before the GPT-2 byte-level regex, exactly as the original SmolLM2
  ``tokenizer.json`` does (``Digits(individual_digits=True)`` then ``ByteLevel``).
- ``llama``: SentencePiece (Llama 2, Mistral, Gemma). llama.cpp's SPM tokenizer escapes
  spaces as ``▁``, prefixes a ``▁`` to each run of text that starts the input or follows
  a special token (when ``add_space_prefix``), then repeatedly merges the adjacent pair
  whose concatenation is the highest-scoring vocabulary entry; a character outside the
  vocabulary becomes its UTF-8 byte tokens ``<0xXX>``. That is a BPE whose merge ranks are
  the scores: the merges are listed here from the vocabulary, best score first.

Control tokens become special added tokens (parsed only when asked); user-defined ones
(Gemma's runs of spaces and newlines) are always matched whole, before the rest, as
llama.cpp does. ``add_bos_token``/``add_eos_token`` become the post-processor, so that
``encode(text, add_special_tokens=True)`` adds them as the model expects.
"""

from __future__ import annotations

import json
from typing import Any

from meshnode_packaging.gguf_file import GGUFFile

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
_UNKNOWN = 2
_CONTROL = 3
_USER_DEFINED = 4
_BYTE = 6

# SentencePiece's escaped space.
SPM_SPACE = "\u2581"


def _array(reader: GGUFFile, key: str) -> list[Any]:
    values = reader.get(key)
    if values is None:
        return []
    return list(values) if isinstance(values, list) else [values]


def gguf_tokenizer_json(reader: GGUFFile) -> str:
    """The ``tokenizer.json`` document equivalent to the GGUF's tokenizer metadata.

    Raises :class:`UnsupportedTokenizerError` for a tokenizer model other than ``gpt2`` and
    ``llama`` and for pre-tokenizers not in :data:`PRE_TOKENIZERS`.
    """
    model = reader.get("tokenizer.ggml.model")
    tokens = [str(t) for t in _array(reader, "tokenizer.ggml.tokens")]
    types = [int(t) for t in _array(reader, "tokenizer.ggml.token_type")] or [1] * len(tokens)
    if model == "gpt2":
        doc = _bpe_document(reader, tokens, types)
    elif model == "llama":
        doc = _spm_document(reader, tokens, types)
    else:
        raise UnsupportedTokenizerError(
            f"GGUF tokenizer model {model!r} is not supported "
            "(byte-level BPE 'gpt2' and SentencePiece 'llama' are)"
        )
    doc["added_tokens"] = _added_tokens(tokens, types)
    doc["post_processor"] = _post_processor(reader, tokens)
    # ASCII, other characters as \u escapes: a str holding one character above U+FFFF (an
    # emoji token) takes four bytes per character, and the document lives as long as the
    # source: Gemma 3's is 19 MiB so, and was 52 MiB.
    return json.dumps(doc)


def _added_tokens(tokens: list[str], types: list[int]) -> list[dict[str, Any]]:
    return [
        {
            "id": i,
            "content": tok,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": ty != _USER_DEFINED,
        }
        for i, (tok, ty) in enumerate(zip(tokens, types, strict=True))
        if ty in (_UNKNOWN, _CONTROL, _USER_DEFINED)
    ]


def _bpe_document(reader: GGUFFile, tokens: list[str], types: list[int]) -> dict[str, Any]:
    pre = str(reader.get("tokenizer.ggml.pre", "default"))
    if pre not in PRE_TOKENIZERS:
        raise UnsupportedTokenizerError(f"GGUF pre-tokenizer {pre!r} is not supported")
    merges = [str(m) for m in _array(reader, "tokenizer.ggml.merges")]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "normalizer": None,
        "pre_tokenizer": PRE_TOKENIZERS[pre],
        "decoder": {**_BYTE_LEVEL, "use_regex": True},
        "model": _bpe_model(tokens, merges, unk=None, byte_fallback=False),
    }


def _bpe_model(
    tokens: list[str], merges: list[Any], *, unk: str | None, byte_fallback: bool
) -> dict[str, Any]:
    return {
        "type": "BPE",
        "dropout": None,
        "unk_token": unk,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": unk is not None,
        "byte_fallback": byte_fallback,
        "ignore_merges": False,
        "vocab": {tok: i for i, tok in enumerate(tokens)},
        "merges": merges,
    }


def _spm_document(reader: GGUFFile, tokens: list[str], types: list[int]) -> dict[str, Any]:
    scores = [float(s) for s in _array(reader, "tokenizer.ggml.scores")] or [0.0] * len(tokens)
    # llama.cpp prefixes a space unless the GGUF says not to (Gemma does).
    prefix = bool(_scalar(reader, "tokenizer.ggml.add_space_prefix", True))
    unk_id = _scalar(reader, "tokenizer.ggml.unknown_token_id", None)
    normalizers: list[dict[str, Any]] = [{"type": "Prepend", "prepend": SPM_SPACE}] * prefix
    normalizers.append({"type": "Replace", "pattern": {"String": " "}, "content": SPM_SPACE})
    decoders: list[dict[str, Any]] = [
        {"type": "Replace", "pattern": {"String": SPM_SPACE}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if prefix:  # the space the encoder prefixed is not text
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": None,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": _bpe_model(
            tokens,
            spm_merges(tokens, types, scores),
            unk=None if unk_id is None else tokens[int(unk_id)],
            byte_fallback=True,
        ),
    }


def spm_merges(tokens: list[str], types: list[int], scores: list[float]) -> list[str]:
    """BPE merges that replay llama.cpp's SentencePiece merging, best first, each as
    ``"left right"``.

    llama.cpp merges the adjacent pair whose concatenation is in the vocabulary with the
    highest score (any token but the byte tokens): every split of a token into two
    vocabulary entries is a merge, ranked by that token's score (ties: lower id first).
    A token holding a space gets none: the normalizer has made every space of the text
    a ``▁`` before the model merges (user-defined tokens with spaces, Gemma's runs of
    them, are matched whole before), so no merge with a space could apply, and the rest
    take ``tokenizer.json``'s compact form of a merge, one string (Gemma 3's 514k merges:
    ~0.3 s less to read than as pairs).
    """
    vocab = set(tokens)
    order = sorted(
        (i for i, ty in enumerate(types) if ty != _BYTE and len(tokens[i]) > 1),
        key=lambda i: (-scores[i], i),
    )
    merges: list[str] = []
    add = merges.append
    for i in order:
        tok = tokens[i]
        if " " in tok:
            continue
        for cut in range(1, len(tok)):
            left = tok[:cut]
            if left in vocab:
                right = tok[cut:]
                if right in vocab:
                    add(left + " " + right)
    return merges


def _post_processor(reader: GGUFFile, tokens: list[str]) -> dict[str, Any] | None:
    """``TemplateProcessing`` adding BOS/EOS where the GGUF says the model expects them."""
    start: list[dict[str, Any]] = []
    end: list[dict[str, Any]] = []
    specials: dict[str, dict[str, Any]] = {}
    for flag, key, where in (("add_bos_token", "bos", start), ("add_eos_token", "eos", end)):
        token_id = _scalar(reader, f"tokenizer.ggml.{key}_token_id", None)
        if not _scalar(reader, f"tokenizer.ggml.{flag}", False) or token_id is None:
            continue
        token = tokens[int(token_id)]
        where.append({"SpecialToken": {"id": token, "type_id": 0}})
        specials[token] = {"id": token, "ids": [int(token_id)], "tokens": [token]}
    if not specials:
        return None
    seq_a = [{"Sequence": {"id": "A", "type_id": 0}}]
    seq_b = [{"Sequence": {"id": "B", "type_id": 1}}]
    return {
        "type": "TemplateProcessing",
        "single": start + seq_a + end,
        "pair": start + seq_a + end + start + seq_b + end,
        "special_tokens": specials,
    }


def _scalar(reader: GGUFFile, key: str, default: Any) -> Any:
    return reader.get(key, default)
