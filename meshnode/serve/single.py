"""Single-node serving: the whole model in this process, behind the OpenAI API.

``meshnode join --model REF`` calls :func:`build_single_node_service` when the mesh is one
node (and tests call it directly); the multi-node coordinator builds the same
:class:`~meshnode.serve.service.ServeService` with a remote pipeline instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from meshnode.engine.backend import Backend, cpu_backend
from meshnode.engine.constraint import Grammars
from meshnode.engine.loader import DEFAULT_MODEL, load_model, resolve_source
from meshnode.engine.tokenizer import (
    ChatTemplate,
    IncrementalDetokenizer,
    NoTokenizerError,
    Tokenizer,
)
from meshnode.generation.records import DEFAULT_PREFILL_CHUNK_TOKENS, Speculation
from meshnode.generation.state import Detokenizer
from meshnode.node.local import LocalPipeline
from meshnode.node.stage import StageRunner, default_context
from meshnode.serve.errors import BadRequestError
from meshnode.serve.scheduler import DEFAULT_MAX_IN_FLIGHT, SchedulerLimits
from meshnode.serve.service import ServeService
from meshnode.serve.speculation import SpeculationHost, speculation_host
from meshnode.serve.toolparse import ToolFormat
from meshnode.serve.tools import ToolSpec, render_chat, tool_format
from meshnode.speculative.settings import SpeculativeFlags


class EngineCodec:
    """The engine's tokenizer and chat template, as the service's ``TextCodec``."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate | None, vocab_size: int):
        self.tokenizer = tokenizer
        self.template = template
        self._vocab_size = vocab_size

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str, *, add_special: bool = True) -> list[int]:
        try:
            if add_special:
                return self.tokenizer.encode_prompt(text)
            return self.tokenizer.encode(text)
        except NoTokenizerError:
            raise BadRequestError(
                "This model has no tokenizer: send /v1/completions a prompt of token ids "
                "(prompt: [int]).",
                param="prompt",
            ) from None

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[ToolSpec] = (),
        *,
        add_generation_prompt: bool = True,
    ) -> str:
        return render_chat(
            self.template, messages, tools, add_generation_prompt=add_generation_prompt
        )

    def special_token_id(self, text: str) -> int | None:
        token = self.tokenizer.token_to_id(text)
        return token if token in self.tokenizer.special_ids else None

    @property
    def tool_format(self) -> ToolFormat:
        if self.template is None:
            return tool_format(None, reads_tools=False)
        return tool_format(self.template.source, self.template.reads_tools)

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def detokenizer(self) -> Detokenizer:
        # Special tokens are control marks, not reply text (vLLM and llama.cpp skip them too).
        return IncrementalDetokenizer(self.tokenizer, skip_special=True)


def model_id_for(model_ref: str) -> str:
    """The id a model is served under: the alias, or the file or folder name."""
    path = Path(model_ref)
    return path.stem if path.suffix == ".gguf" else path.name or model_ref


def build_single_node_service(
    model_ref: str | None = None,
    *,
    model_id: str | None = None,
    context_size: int | None = None,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    speculation: Speculation | None = None,
    speculative: SpeculativeFlags | None = None,
    speculative_tables: Mapping[str, Any] | None = None,
    draft_memory_bytes: int | None = None,
    chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS,
    backend: Backend | None = None,
) -> ServeService:
    """A ready service running every layer of ``model_ref`` in this process.

    ``model_ref`` is anything ``meshnode.engine.loader.resolve_source`` accepts (None: the
    default model). ``context_size`` defaults to the model's limit capped at
    ``meshnode.node.stage.DEFAULT_MAX_CONTEXT``. Speculation is either fixed
    (``speculation``) or resolved like ``meshnode join`` does when ``speculative`` flags
    or config ``speculative_tables`` are given (package block included;
    ``draft_memory_bytes`` overrides the memory a draft model may find available).
    Raises ``ModelLoadError`` for a bad reference or model, ``ConfigError`` for a bad
    speculative setting.
    """
    ref = model_ref or DEFAULT_MODEL
    backend = backend or cpu_backend()
    model = load_model(ref, backend)
    config = model.config
    context = context_size or default_context(config)
    grammars = Grammars(model.tokenizer.to_json, config.vocab_size, config.eos_token_ids)
    runner = StageRunner(
        model.stage, context_size=context, max_sequences=max_in_flight, grammars=grammars
    )
    served_id = model_id or model_id_for(ref)
    spec_host: SpeculationHost | None = None
    if speculative is not None or speculative_tables is not None:
        source = resolve_source(ref)
        spec_host = speculation_host(
            speculative or SpeculativeFlags(),
            speculative_tables or {},
            model_id=served_id,
            model_ref=ref,
            source=source,
            backend=backend,
            available_bytes=draft_memory_bytes,
        )
        spec_host.attach_stage0(model.stage, lambda: source)
    return ServeService(
        model_id=served_id,
        aliases=[ref],
        codec=EngineCodec(model.tokenizer, model.chat_template, config.vocab_size),
        context_size=context,
        eos_token_ids=frozenset(config.eos_token_ids),
        pipeline=LocalPipeline(runner),
        limits=SchedulerLimits(max_in_flight=max_in_flight),
        speculation=speculation,
        spec_host=spec_host,
        chunk_tokens=chunk_tokens,
        generation_defaults=model.sampling_defaults,
    )
