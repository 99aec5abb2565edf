"""SentencePiece GGUF vocabularies (``tokenizer.ggml.model = llama``), Llama 2 style.

The reference is llama.cpp's SPM tokenizer written out plainly below: escape spaces as
``▁``, prefix one to each run of text that starts the input or follows a special token,
merge the adjacent pair whose concatenation scores best (leftmost on ties) until none is
in the vocabulary, and spell what is left outside it as ``<0xXX>`` byte tokens.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from meshnode_packaging.sources import open_source

from meshnode.engine.tokenizer import Tokenizer

SPACE = "\u2581"
SPECIALS = [("<unk>", 2), ("<s>", 3), ("</s>", 3)]
BYTES = [f"<0x{b:02X}>" for b in range(256)]
PIECES = [SPACE, "e", "h", "l", "o", "w", "r", "d", "a", "b", "é", "\n"]
PIECES += [SPACE + "h", "he", "ll", "llo", SPACE + "he", "lo", SPACE + "hello", "or"]
PIECES += [SPACE + "w", SPACE + "wor", "ld", SPACE + "world", "ab", "ba", "aba", SPACE + "a"]
PIECES += ["hel", "ell", "el", "wo", "ro", "dd", SPACE + SPACE]
# pieces with a plain space: the text's spaces are all "▁" before the model merges, so no
# merge may name them (nor could tokenizer.json's "left right" form of a merge)
PIECES += ["d ", "d d"]
TOOL = "<|tool|>"  # user-defined: always matched whole, like Gemma's whitespace runs
TOKENS = [t for t, _ in SPECIALS] + BYTES + PIECES + [TOOL]
TYPES = [ty for _, ty in SPECIALS] + [6] * 256 + [1] * len(PIECES) + [4]
# Scores as SentencePiece writes them: a piece's negated rank; specials and bytes at 0.
SCORES = [0.0] * (3 + 256) + [-float(i) for i in range(len(PIECES))] + [0.0]
IDS = {t: i for i, t in enumerate(TOKENS)}
BOS = 1


def reference(text: str, prefix: bool = True) -> list[int]:
    """llama.cpp's ``llm_tokenizer_spm`` on one run of plain text."""
    symbols = list((SPACE if prefix else "") + text.replace(" ", SPACE))
    while True:
        best: tuple[float, int] | None = None
        for i in range(len(symbols) - 1):
            merged = IDS.get(symbols[i] + symbols[i + 1])
            if merged is None or TYPES[merged] == 6:
                continue
            if best is None or SCORES[merged] > best[0]:
                best = (SCORES[merged], i)
        if best is None:
            break
        i = best[1]
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
    out: list[int] = []
    for s in symbols:
        out += [IDS[s]] if s in IDS else [IDS[f"<0x{b:02X}>"] for b in s.encode()]
    return out


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama 2 style GGUF: SentencePiece vocabulary, BOS added, a space prefixed."""
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list(TOKENS)
    w.add_token_types(TYPES)
    w.add_token_scores(SCORES)
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tokenizer(spm_gguf: Path) -> Tokenizer:
    source = open_source(spm_gguf)  # no longer refused for its tokenizer
    return Tokenizer(source.tokenizer_json)


@pytest.mark.parametrize(
    "text", ["hello world", "hello  world", "aba ab ba", "héllo", "ü", "😀 a", "a\nb", ""]
)
def test_examples_match_llama_cpp(tokenizer: Tokenizer, text: str) -> None:
    assert tokenizer.encode(text) == (reference(text) if text else [])
    assert tokenizer.decode(tokenizer.encode(text)) == text


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="helowrdabé \nü", max_size=24))
def test_random_text_matches_llama_cpp(tokenizer: Tokenizer, text: str) -> None:
    expected = reference(text) if text else []
    assert tokenizer.encode(text) == expected
    assert tokenizer.decode(expected) == text


def test_special_tokens_split_the_text(tokenizer: Tokenizer) -> None:
    """Control tokens only when parsing specials; user-defined always; a space prefix after
    each (llama.cpp's ``is_prev_special``)."""
    parsed = [*reference("hello"), IDS["</s>"], *reference("world")]
    assert tokenizer.encode("hello</s>world") == parsed
    assert tokenizer.encode("ab" + TOOL + "ba") == [*reference("ab"), IDS[TOOL], *reference("ba")]
    plain = tokenizer.encode("hello</s>", parse_special=False)
    assert IDS["</s>"] not in plain
    assert tokenizer.decode(plain) == "hello</s>"


def test_prompts_get_one_bos(tokenizer: Tokenizer) -> None:
    assert tokenizer.prefix_ids == (BOS,)
    assert tokenizer.encode_prompt("hello") == [BOS, *reference("hello")]
    assert tokenizer.encode_prompt("<s>hello") == [BOS, *reference("hello")]
    assert tokenizer.decode(tokenizer.encode_prompt("hello"), skip_special=True) == "hello"
