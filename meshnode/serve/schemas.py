"""Request and response models of the OpenAI-compatible API.

Requests are lenient about what they do not know and strict about what they do: unknown
fields are ignored (SDK wrappers and agent frameworks routinely send ``store``,
``metadata`` and the like, which llama-server, vLLM and Ollama accept too; each ignored
name is logged once at debug level), while a known field with a wrong type or value is a
400 naming it. Fields that OpenAI defines but this server does not implement are accepted
only at the value that means "off" (``n=1``, no ``logit_bias``); anything else is refused by
:meth:`ChatCompletionRequest.check_supported` with a message naming the parameter. Text
that is not valid Unicode (a lone surrogate, which JSON can carry) is a 400 too.
Responses are plain pydantic models dumped to JSON; the ``meshnode`` field is our
extension (speculation telemetry), which the official clients keep as an extra.
``tools``, ``tool_choice``, ``response_format`` and other servers' output constraints
(vLLM's ``guided_*`` and ``structured_outputs``, llama-server's ``json_schema`` and
``grammar``) arrive as plain objects and are checked where they are compiled
(:mod:`meshnode.serve.tools`, :mod:`meshnode.serve.structured`).
"""

from __future__ import annotations

import dataclasses
import logging
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal

from annotated_types import BaseMetadata, Ge, Gt, Le
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    create_model,
    model_validator,
)

from meshnode.engine.sampling import MIN_LOGIT_DIVISOR, SamplingParams
from meshnode.serve.errors import BadRequestError

#: OpenAI caps ``stop`` at four sequences; each one is scanned at every committed token.
MAX_STOP_SEQUENCES = 4
#: OpenAI's limit for ``top_logprobs`` on chat completions.
MAX_TOP_LOGPROBS = 20
#: OpenAI's limit for ``logprobs`` on (legacy) completions.
MAX_COMPLETION_LOGPROBS = 5

log = logging.getLogger(__name__)

PositiveInt = Annotated[StrictInt, Field(ge=1)]


def _unicode(text: str) -> str:
    # JSON may carry a lone surrogate ("\ud800"); no tokenizer can encode it.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError("text is not valid Unicode (a lone surrogate)") from exc
    return text


#: Text from the client: any string that is valid Unicode.
Text = Annotated[StrictStr, AfterValidator(_unicode)]

#: Unknown field names already logged, so a client that always sends one logs it once.
_IGNORED_LOGGED: set[str] = set()
#: Bound on that set: a client inventing names cannot grow it without limit.
MAX_IGNORED_NAMES_LOGGED = 256


class _Strict(BaseModel):
    # Unknown keys are ignored (see the module docstring); scalars use the Strict* types
    # instead of strict=True on the model, which would also refuse dicts for nested models.
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _log_unknown(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in data.keys() - cls.model_fields.keys():
                if name not in _IGNORED_LOGGED and len(_IGNORED_LOGGED) < MAX_IGNORED_NAMES_LOGGED:
                    _IGNORED_LOGGED.add(name)
                    log.debug("ignoring unknown request field %r (%s)", name, cls.__name__)
        return data


#: The base of every request model: unknown fields ignored (and logged once), known ones strict.
RequestModel = _Strict


# -- the sampling fields, generated from the one sampling record -----------------------------

#: The API type of each type a field of :class:`SamplingParams` has.
_API_TYPES: dict[str, Any] = {
    "float": StrictFloat,
    "int": StrictInt,
    "int | None": StrictInt | None,
}


def _zero_or_divisor(value: float) -> float:
    if 0 < value < MIN_LOGIT_DIVISOR:
        raise ValueError(f"must be 0 (greedy) or at least {MIN_LOGIT_DIVISOR:g}")
    return value


#: The ranges the API checks with a 400 before the record would raise: the record's own
#: (a top_p of 0 keeps nothing, a temperature or top_k below 0 means nothing), and OpenAI's
#: documented limits for its own knobs (temperature up to 2, penalties within ±2).
_API_RANGES: dict[str, tuple[BaseMetadata | AfterValidator, ...]] = {
    "temperature": (Ge(0.0), Le(2.0), AfterValidator(_zero_or_divisor)),
    "top_p": (Gt(0.0), Le(1.0)),
    "top_k": (Ge(0),),
    "min_p": (Ge(0.0), Le(1.0)),
    "repetition_penalty": (Ge(MIN_LOGIT_DIVISOR),),
    "presence_penalty": (Ge(-2.0), Le(2.0)),
    "frequency_penalty": (Ge(-2.0), Le(2.0)),
    # Any 64-bit seed, signed or not (llama.cpp's clients send -1); the sampler folds it
    # into its generator's range, and a larger integer is a 400 rather than an overflow.
    "seed": (Ge(-(2**63)), Le(2**64 - 1)),
}
#: Names of the sampling fields every completion endpoint accepts.
SAMPLING_FIELDS = frozenset(spec.name for spec in dataclasses.fields(SamplingParams))


def _sampling_field(spec: dataclasses.Field[Any]) -> tuple[Any, Any]:
    kind = _API_TYPES[str(spec.type)]
    ranges = _API_RANGES.get(spec.name, ())
    return (Annotated[(kind, *ranges)] if ranges else kind), spec.default


if TYPE_CHECKING:
    _SamplingKnobs = _Strict  # the fields below are generated, so unknown to mypy
else:
    _SamplingKnobs = create_model(
        "_SamplingKnobs",
        __base__=_Strict,
        **{spec.name: _sampling_field(spec) for spec in dataclasses.fields(SamplingParams)},
    )


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class TextPart(_Strict):
    """A content part; only ``text`` parts are read (others are refused by name)."""

    type: StrictStr
    text: Text | None = None


class ToolCallFunction(_Strict):
    name: Text
    arguments: Text


class ToolCall(_Strict):
    """A call an assistant message made, as clients send the history back."""

    id: Text
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    refusal: Text | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Text | None = None

    def text(self) -> str:
        """The content as one string (text parts joined, as OpenAI does); raises
        BadRequestError for a part that is not text (an image, audio, a file)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        for part in self.content:
            if part.type == "text" and part.text is None:
                raise BadRequestError("A text part needs its text.", param="messages")
            if part.type != "text":
                raise BadRequestError(
                    f"Content parts of type {part.type!r} are not supported (only text).",
                    param="messages",
                    code="unsupported",
                )
        return "".join(part.text or "" for part in self.content)

    def as_dict(self) -> dict[str, Any]:
        """The message as :func:`meshnode.serve.tools.render_chat` takes it."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatTemplateOptions(_Strict):
    """vLLM's chat-template options, on ``/v1/chat/completions`` and ``/tokenize``:
    ``add_generation_prompt: false`` leaves the assistant's turn unopened, and
    ``continue_final_message: true`` leaves the final assistant message open, so the
    reply continues it (a prefill). Asking both is a 400; with ``continue_final_message``
    an ``add_generation_prompt`` left out counts as false (vLLM would refuse it)."""

    add_generation_prompt: StrictBool | None = None  # vLLM's default: true
    continue_final_message: StrictBool = False

    def template_turns(self, turns: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str, bool]:
        """``turns`` without a continued final message, that message's text (the reply's
        prefill, '' if none) and whether the assistant's turn is opened; raises
        BadRequestError for options that do not fit the turns."""
        if not self.continue_final_message:
            return turns, "", self.add_generation_prompt is not False
        if self.add_generation_prompt:
            raise BadRequestError(
                "add_generation_prompt and continue_final_message cannot both be true.",
                param="continue_final_message",
            )
        if not turns or turns[-1]["role"] != "assistant" or turns[-1].get("tool_calls"):
            raise BadRequestError(
                "continue_final_message needs a final assistant message of text.",
                param="continue_final_message",
            )
        return turns[:-1], str(turns[-1]["content"]), True


class _SamplingFields(_SamplingKnobs):
    """Parameters shared by both endpoints: the sampling record's fields (OpenAI's, plus
    ``top_k``, ``min_p`` and ``repetition_penalty`` as llama.cpp and vLLM accept them)
    and these."""

    model: StrictStr
    max_tokens: PositiveInt | None = None
    stop: Text | list[Text] | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Other servers' output constraints (meshnode.serve.structured.OTHER_FIELDS), checked
    # where they are compiled.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    structured_outputs: dict[str, Any] | None = None
    cache_prompt: StrictBool = True  # llama-server's: false opts out of the prefix cache
    json_schema: dict[str, Any] | None = None
    grammar: Text | None = None

    def other_constraints(self) -> dict[str, Any]:
        """The output constraints the request gave in other servers' fields."""
        names = (
            *("guided_json", "guided_regex", "guided_choice", "guided_grammar"),
            *("structured_outputs", "json_schema", "grammar"),
        )
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def sampling(self) -> SamplingParams:
        """The request's sampling record, OpenAI's defaults for what it omits."""
        return SamplingParams(**self.model_dump(include=set(SAMPLING_FIELDS)))

    def sampling_fields(self) -> dict[str, Any]:
        """The sampling fields the request gave (``null`` counts as omitted), for
        :meth:`meshnode.serve.service.ServeService.sampling` to fill in the rest."""
        given = self.model_dump(include=set(SAMPLING_FIELDS), exclude_unset=True)
        return {name: value for name, value in given.items() if value is not None}

    def stop_list(self) -> list[str]:
        """``stop`` as a list without empty strings; raises BadRequestError if too many."""
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if len(stops) > MAX_STOP_SEQUENCES:
            raise BadRequestError(
                f"At most {MAX_STOP_SEQUENCES} stop sequences are allowed.", param="stop"
            )
        return [s for s in stops if s]

    def _check_common(self) -> None:
        if self.n != 1:
            raise BadRequestError("Only n=1 is supported.", param="n", code="unsupported")
        if self.stream_options is not None and not self.stream:
            raise BadRequestError(
                "stream_options is only allowed when stream is true.", param="stream_options"
            )


class ChatCompletionRequest(_SamplingFields, ChatTemplateOptions):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None
    # OpenAI's deprecated names for tools: refused rather than ignored, which would drop
    # the caller's functions without a word.
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None

    def check_supported(self) -> None:
        """Raise BadRequestError for parameters this server does not implement."""
        self._check_common()
        for name in ("functions", "function_call"):
            if getattr(self, name) not in (None, [], "none"):
                raise BadRequestError(
                    f"{name} is OpenAI's deprecated form of tools; send tools and "
                    "tool_choice instead.",
                    param=name,
                    code="unsupported",
                )
        # tools, tool_choice and response_format are checked where they are compiled
        # (meshnode.serve.tools and meshnode.serve.structured).
        if self.logit_bias:
            raise BadRequestError(
                "logit_bias is not supported.", param="logit_bias", code="unsupported"
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequestError(
                "top_logprobs requires logprobs to be true.", param="top_logprobs"
            )

    def token_limit(self) -> int | None:
        """The completion-token cap: ``max_completion_tokens`` wins over ``max_tokens``."""
        return self.max_completion_tokens or self.max_tokens

    def logprob_count(self) -> int | None:
        """None for no logprobs, else how many alternatives to report per token."""
        return (self.top_logprobs or 0) if self.logprobs else None


#: A prompt for /v1/completions: text, token ids, or a one-element batch of either.
CompletionPrompt = Text | list[StrictInt] | list[Text] | list[list[StrictInt]]


class CompletionRequest(_SamplingFields):
    prompt: CompletionPrompt
    max_tokens: PositiveInt | None = 16  # OpenAI's default for this endpoint
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    echo: StrictBool = False
    suffix: str | None = None
    best_of: StrictInt | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extension: the response carries the prompt's and the reply's token ids.
    return_token_ids: StrictBool = False
    response_format: dict[str, Any] | None = None  # as vLLM takes it here too

    def check_supported(self) -> None:
        """Raise BadRequestError for parameters this server does not implement."""
        self._check_common()
        if self.echo:
            raise BadRequestError("echo is not supported.", param="echo", code="unsupported")
        if self.suffix:
            raise BadRequestError("suffix is not supported.", param="suffix", code="unsupported")
        if self.best_of not in (None, 1):
            raise BadRequestError(
                "Only best_of=1 is supported.", param="best_of", code="unsupported"
            )
        if self.logit_bias:
            raise BadRequestError(
                "logit_bias is not supported.", param="logit_bias", code="unsupported"
            )

    def single_prompt(self) -> str | list[int]:
        """The one prompt, as text or token ids; raises BadRequestError for a batch."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        if not prompt:
            raise BadRequestError("prompt must not be empty.", param="prompt")
        if all(isinstance(item, int) for item in prompt):
            return [int(item) for item in prompt]  # type: ignore[arg-type]
        if len(prompt) != 1:
            raise BadRequestError(
                "Only one prompt per request is supported.", param="prompt", code="unsupported"
            )
        only = prompt[0]
        return only if isinstance(only, str) else [int(t) for t in only]  # type: ignore[union-attr]


# ---------------------------------------------------------------------------------------
# Responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # of prompt_tokens, resumed from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: StrictStr
    choices: list[ChatChoice]
    usage: Usage
    meshnode: dict[str, Any] | None = None


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str = ""


class ToolCallDelta(BaseModel):
    """A piece of a streamed tool call: id, type and name come with its first piece."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: StrictStr
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    meshnode: dict[str, Any] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    # With return_token_ids (vLLM's names): the prompt's ids (first chunk when streaming)
    # and the ids of this choice's text (of this chunk when streaming).
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: StrictStr
    choices: list[CompletionChoice]
    usage: Usage | None = None
    meshnode: dict[str, Any] | None = None


class ModelCard(BaseModel):
    """The served model in the fields of both OpenAI's and Anthropic's model objects (each
    client reads its own and ignores the others'), so that either SDK lists it."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "meshnode"
    context_length: int
    # Anthropic's names: ``created_at`` is RFC 3339, ``max_input_tokens`` the context.
    type: Literal["model"] = "model"
    display_name: str
    created_at: str
    max_input_tokens: int

    @classmethod
    def of(cls, model_id: str, created: int, context: int) -> ModelCard:
        """The card of ``model_id``, served since ``created`` (Unix seconds)."""
        stamp = datetime.fromtimestamp(created, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return cls(
            id=model_id,
            created=created,
            context_length=context,
            display_name=model_id,
            created_at=stamp,
            max_input_tokens=context,
        )


class ModelList(BaseModel):
    """OpenAI's list, with Anthropic's paging fields (one page)."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None

    @classmethod
    def of(cls, cards: list[ModelCard]) -> ModelList:
        """A one-page list of ``cards``."""
        ids = [card.id for card in cards]
        return cls(data=cards, first_id=ids[0] if ids else None, last_id=ids[-1] if ids else None)
