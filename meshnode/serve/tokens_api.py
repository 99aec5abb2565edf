"""``POST /tokenize`` and ``POST /detokenize``: the served model's tokenizer over HTTP.

Both accept the request shapes of vLLM and of llama-server, and answer with the fields of
both, so the clients written for either work unchanged:

- tokenize a text: vLLM's ``{"prompt": str, "add_special_tokens": bool = true}`` or
  llama-server's ``{"content": str, "add_special": bool = false, "with_pieces": bool}``;
  a chat: vLLM's ``{"messages": [...], "tools": [...]}``, rendered with the model's
  template exactly as ``/v1/chat/completions`` renders it, assistant turn opened (so
  ``count`` is the prompt a chat request would prefill). As in vLLM,
  ``add_generation_prompt: false`` leaves the assistant's turn unopened and
  ``continue_final_message: true`` leaves the final assistant message open for the model
  to continue (the two exclude each other: asking both is a 400, and with
  ``continue_final_message`` an ``add_generation_prompt`` left out counts as false).
  The answer is vLLM's ``{"count", "max_model_len", "tokens", "token_strs"}``;
  ``token_strs`` (vLLM's ``return_token_strs``) and llama-server's ``with_pieces`` both
  list each token's text.
- detokenize: ``{"tokens": [int]}`` → ``{"prompt": str, "content": str}`` (vLLM's and
  llama-server's names for the same text); an id outside the vocabulary is a 400.

``model``, when given, must name the served model (404 otherwise), as on every route.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter
from pydantic import BaseModel, Field, StrictBool, StrictInt, StrictStr

from meshnode.serve import schemas as s
from meshnode.serve.errors import BadRequestError
from meshnode.serve.service import ServeService
from meshnode.serve.tools import tool_specs

__all__ = ["tokens_router"]

#: Ids one detokenize request may carry: a whole context of the largest models served
#: (128k positions) with room to spare; a longer list is no prompt this server could hold.
MAX_DETOKENIZE_TOKENS = 262_144


class TokenizeRequest(s.ChatTemplateOptions):
    model: StrictStr | None = None
    prompt: s.Text | None = None
    content: s.Text | None = None  # llama-server's name for ``prompt``
    messages: list[s.ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None
    # vLLM adds the model's special prefix (BOS) by default, llama-server does not:
    # whichever name the client sent decides, vLLM's default otherwise.
    add_special_tokens: StrictBool | None = None
    add_special: StrictBool | None = None
    return_token_strs: StrictBool = False
    with_pieces: StrictBool = False

    def text(self) -> str | None:
        """The text to tokenize (``prompt`` or ``content``), None for a chat."""
        return self.prompt if self.prompt is not None else self.content

    def adds_special(self) -> bool:
        """Whether the model's special prefix (BOS) is added to a text."""
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        if self.add_special is not None:
            return self.add_special
        return self.content is None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(s.RequestModel):
    model: StrictStr | None = None
    tokens: Annotated[list[StrictInt], Field(max_length=MAX_DETOKENIZE_TOKENS)]


class DetokenizeResponse(BaseModel):
    prompt: str
    content: str


def tokens_router(service: ServeService) -> APIRouter:
    """The routes of the module docstring over ``service``."""
    router = APIRouter()

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        if body.model is not None:
            service.require_model(body.model)
        ids, strs = await service.tokenize(lambda: _tokenize_with_strs(service, body))
        return TokenizeResponse(
            count=len(ids), max_model_len=service.context_size, tokens=ids, token_strs=strs
        )

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        if body.model is not None:
            service.require_model(body.model)
        service.check_token_ids(body.tokens, param="tokens")
        text = await service.tokenize(lambda: service.codec.decode(body.tokens))
        return DetokenizeResponse(prompt=text, content=text)

    return router


def _tokenize_with_strs(
    service: ServeService, body: TokenizeRequest
) -> tuple[list[int], list[str] | None]:
    ids = _tokenize(service, body)
    strs = None
    if body.return_token_strs or body.with_pieces:
        strs = [service.codec.token_text(t) for t in ids]
    return ids, strs


def _tokenize(service: ServeService, body: TokenizeRequest) -> list[int]:
    text = body.text()
    if (text is None) == (body.messages is None):
        raise BadRequestError(
            "Give exactly one of prompt (or content) and messages.", param="prompt"
        )
    if body.messages is not None:
        return _chat_ids(service, body, body.messages)
    assert text is not None
    return service.codec.encode(text, add_special=body.adds_special())


def _chat_ids(
    service: ServeService, body: TokenizeRequest, messages: list[s.ChatMessage]
) -> list[int]:
    specs = tool_specs(body.tools)
    turns, prefill, opened = body.template_turns([m.as_dict() for m in messages])
    return service.chat_prompt(turns, specs, continue_with=prefill, add_generation_prompt=opened)
