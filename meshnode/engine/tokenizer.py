"""Text <-> token ids (Hugging Face ``tokenizers``), streaming detokenization, chat templates."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jinja2
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from meshnode.errors import ModelError

__all__ = [
    "ChatTemplate",
    "IncrementalDetokenizer",
    "NoTokenizerError",
    "TemplateError",
    "Tokenizer",
]


class NoTokenizerError(ModelError):
    """The model has no tokenizer: it takes token ids and gives token ids, no text."""


class Tokenizer:
    """A ``tokenizer.json`` tokenizer; special tokens in text are parsed by default.

    Built from None, it stands for a model without a tokenizer (a checkpoint folder with
    no ``tokenizer.json``): :meth:`encode` raises :class:`NoTokenizerError` and ids
    decode to no text, so such a model is served and checked on token ids alone.
    """

    def __init__(self, tokenizer_json: str | None) -> None:
        self._tok = None if tokenizer_json is None else HFTokenizer.from_str(tokenizer_json)
        decoder = {} if self._tok is None else self._tok.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in decoder.items() if t.special)
        self.prefix_ids = () if self._tok is None else self._prefix_ids(self._tok)
        # encode_special_tokens is a setting of the shared tokenizer: prompts are encoded in
        # worker threads, so setting it and encoding with it must not interleave.
        self._encoding = threading.Lock()

    @property
    def has_text(self) -> bool:
        """Whether text can be encoded (False: token ids only)."""
        return self._tok is not None

    @staticmethod
    def _prefix_ids(tok: HFTokenizer) -> tuple[int, ...]:
        """The ids the tokenizer's post-processor puts before a text (BOS, where the model's
        tokenizer says to add one: ``add_bos_token``)."""
        tok.encode_special_tokens = True
        plain = tok.encode("a", add_special_tokens=False).ids
        marked = tok.encode("a", add_special_tokens=True).ids
        for n in range(len(marked) - len(plain) + 1):
            if marked[n : n + len(plain)] == plain:
                return tuple(marked[:n])
        return ()

    def _text(self) -> HFTokenizer:
        if self._tok is None:
            raise NoTokenizerError("the model has no tokenizer: give the prompt as token ids")
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (0 without a tokenizer)."""
        return 0 if self._tok is None else int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``; no BOS/EOS added. With ``parse_special`` False, text
        such as ``<|im_end|>`` is encoded as plain characters. Raises
        :class:`NoTokenizerError` for a model without a tokenizer."""
        tok = self._text()
        with self._encoding:
            tok.encode_special_tokens = not parse_special
            # encode_batch_fast, not encode: it releases the GIL while it works (encode holds
            # it, so a prompt of megabytes tokenized in a worker thread would still stall the
            # event loop for seconds), and it skips the character offsets, whose freeing
            # alone holds the GIL for ~0.3 s after a 2 MiB prompt.
            encoding = tok.encode_batch_fast([text], add_special_tokens=False)[0]
        return list(encoding.ids)

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a whole prompt: special tokens parsed, and the ids the model expects
        first (:attr:`prefix_ids`, its BOS) added once: a chat template that wrote the BOS
        itself does not get a second one (llama.cpp's server drops the duplicate too).
        Raises :class:`NoTokenizerError` for a model without a tokenizer."""
        ids = self.encode(text)
        prefix = list(self.prefix_ids)
        if prefix and ids[: len(prefix)] != prefix:
            ids = prefix + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """The text of ``ids`` (empty without a tokenizer)."""
        if self._tok is None:
            return ""
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special))

    def to_json(self) -> str | None:
        """The ``tokenizer.json`` document (None without a tokenizer)."""
        return None if self._tok is None else str(self._tok.to_str())

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary entry, or None."""
        found = None if self._tok is None else self._tok.token_to_id(token)
        return None if found is None else int(found)


class IncrementalDetokenizer:
    """Turns a stream of ids into a stream of text without splitting a UTF-8 character.

    Byte-level BPE tokens can end inside a multi-byte character; the decoder then yields
    U+FFFD. Text is held back until the pending ids decode cleanly (the scheme of Hugging
    Face text-generation-inference: decode from a ``prefix`` offset a few tokens back so
    that merges with the previous token see their context).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self._tok = tokenizer
        self._skip = skip_special
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token_id: int) -> str:
        """Add one id; return the text that is now complete (maybe empty)."""
        self._ids.append(token_id)
        before = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        now = self._tok.decode(self._ids[self._prefix :], self._skip)
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return now[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (a trailing incomplete character decodes as U+FFFD)."""
        before = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        now = self._tok.decode(self._ids[self._prefix :], self._skip)
        self._prefix = self._read = len(self._ids)
        return now[len(before) :]


class TemplateError(ModelError):
    """The chat template failed to render (or raised on purpose via raise_exception)."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' ``tojson``: keys in their given order and no HTML escaping (jinja's own
    # sorts keys and escapes ``<``), which is what templates that print tools expect.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class ChatTemplate:
    """A model's jinja2 chat template rendered in a sandbox, as transformers does.

    The sandbox (``ImmutableSandboxedEnvironment``) keeps a template shipped with a model
    from touching Python internals or mutating its inputs.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise_exception
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(source)
            variables = meta.find_undeclared_variables(env.parse(source))
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(f"chat template: {exc}") from exc
        self._special = dict(special_tokens or {})
        self.source = source
        #: Whether the template reads ``tools`` (renders a tool list); if not, tools given
        #: to :meth:`render` would be dropped silently, so callers use a fallback prompt.
        self.reads_tools = "tools" in variables

    def render(
        self,
        messages: Iterable[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text for ``messages`` (dicts with ``role`` and ``content``), with
        ``tools`` (OpenAI's tool list) for a template that reads them."""
        extra = {} if tools is None else {"tools": tools}
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **self._special,
                **extra,
            )
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template: {exc}") from exc
