"""The tiny mixture-of-experts references served on token ids: ``/v1/completions`` with
``return_token_ids`` gives each prompt's reference continuation, without speculation and
under the speculative strategies (n-gram, a draft model, layer-skip self-drafting): greedy
acceptance is exact, so every verify window must keep the reference's tokens.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

from meshnode.serve.single import build_single_node_service
from meshnode.speculative.settings import SpeculativeFlags
from tests.engine.moe_models import MODELS, MOE_DIR, golden
from tests.serve.conftest import Server, start_server

#: Client-side bound on every request in these tests (seconds).
REQUEST_TIMEOUT_S = 60.0
WINDOW = 3


def _flags(strategy: str, folder: str) -> SpeculativeFlags | None:
    if strategy == "off":
        return None
    return SpeculativeFlags(
        strategy=strategy,
        # the model drafts for itself: a draft sharing the tokenizer, every token accepted
        draft_model=folder if strategy == "draft" else None,
        layer_skip_layers=2 if strategy == "layer-skip" else None,
        ngram_min=1,  # random models repeat few longer n-grams
        window_policy="fixed",
        initial_window=WINDOW,
        max_window=WINDOW,
    )


async def _completions(
    server: Server, model: str, prompts: list[dict[str, Any]]
) -> tuple[list[Any], int]:
    """Each prompt's generated token ids, and how many draft tokens were proposed."""
    proposed = 0
    async with httpx.AsyncClient(base_url=server.base_url, timeout=REQUEST_TIMEOUT_S) as http:
        out = []
        for prompt in prompts:
            body = {
                "model": model,
                "prompt": prompt["prompt_ids"],
                "max_tokens": len(prompt["gen_ids"]),
                "temperature": 0,
                "return_token_ids": True,
            }
            reply = await http.post("/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            out.append(reply.json()["choices"][0]["token_ids"])
            proposed += reply.json()["meshnode"]["speculation"]["proposed"]
        return out, proposed


# Layer-skip drafting is not available for hybrid models (Qwen3.5 dense or MoE alike).
CASES = [
    (model, strategy)
    for model in MODELS
    for strategy in ("off", "ngram", "draft", "layer-skip")
    if (model, strategy) != ("qwen35-moe-tiny", "layer-skip")
]


@pytest.mark.parametrize(("model", "strategy"), CASES)
async def test_completions_give_the_reference_tokens(
    nursery: trio.Nursery, model: str, strategy: str
) -> None:
    folder = str(MOE_DIR / model)
    service = build_single_node_service(
        folder, model_id=model, context_size=512, speculative=_flags(strategy, folder)
    )
    server = await start_server(nursery, service)
    prompts = golden(model)["prompts"]
    tokens, proposed = await _completions(server, model, prompts)
    assert tokens == [p["gen_ids"] for p in prompts]
    assert (proposed > 0) == (strategy != "off")  # the strategy did speculate
