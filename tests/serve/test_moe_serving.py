"""The tiny mixture-of-experts references served on token ids: ``/v1/completions`` with
``return_token_ids`` gives each prompt's reference continuation, without speculation and
under the speculative strategies (n-gram, a draft model, layer-skip self-drafting, and
Qwen3.5-MoE's own MTP module with experts): greedy acceptance is exact, so every verify
window must keep the reference's tokens.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import trio
from safetensors.numpy import save_file

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
) -> tuple[list[Any], int, set[str]]:
    """Each prompt's generated token ids, how many draft tokens were proposed, and by
    which strategies."""
    proposed, strategies = 0, set()
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
            speculation = reply.json()["meshnode"]["speculation"]
            proposed += speculation["proposed"]
            strategies.add(speculation["strategy"])
        return out, proposed, strategies


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
    tokens, proposed, strategies = await _completions(server, model, prompts)
    assert tokens == [p["gen_ids"] for p in prompts]
    assert (proposed > 0) == (strategy != "off")  # the strategy did speculate
    assert strategies == {strategy}


def _with_moe_mtp(root: Path) -> Path:
    """A copy of the Qwen3.5-MoE reference with a random MTP module whose layer routes
    to experts, as Qwen3.5-MoE's does (names as the checkpoint's ``mtp.*``)."""
    folder = root / "qwen35-moe-mtp"
    shutil.copytree(MOE_DIR / "qwen35-moe-tiny", folder)
    rng = np.random.default_rng(5)
    e, ffn, shared, experts = 64, 48, 64, 8

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    p = "mtp.layers.0."
    tensors = {
        "mtp.fc.weight": w(e, 2 * e),
        "mtp.norm.weight": w(e),
        "mtp.pre_fc_norm_embedding.weight": w(e),
        "mtp.pre_fc_norm_hidden.weight": w(e),
        p + "input_layernorm.weight": w(e),
        p + "post_attention_layernorm.weight": w(e),
        p + "self_attn.q_proj.weight": w(2 * 4 * 16, e),  # query and gate, 4 heads of 16
        p + "self_attn.k_proj.weight": w(2 * 16, e),
        p + "self_attn.v_proj.weight": w(2 * 16, e),
        p + "self_attn.o_proj.weight": w(e, 4 * 16),
        p + "self_attn.q_norm.weight": w(16),
        p + "self_attn.k_norm.weight": w(16),
        p + "mlp.gate.weight": w(experts, e),
        p + "mlp.shared_expert.gate_proj.weight": w(shared, e),
        p + "mlp.shared_expert.up_proj.weight": w(shared, e),
        p + "mlp.shared_expert.down_proj.weight": w(e, shared),
        p + "mlp.shared_expert_gate.weight": w(1, e),
    }
    for n in range(experts):
        q = f"{p}mlp.experts.{n}."
        tensors |= {
            q + "gate_proj.weight": w(ffn, e),
            q + "up_proj.weight": w(ffn, e),
            q + "down_proj.weight": w(e, ffn),
        }
    save_file(tensors, str(folder / "mtp.safetensors"))
    return folder


async def test_moe_mtp_drafts_keep_the_reference_tokens(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    folder = str(_with_moe_mtp(tmp_path))
    flags = SpeculativeFlags(
        strategy="mtp", window_policy="fixed", initial_window=WINDOW, max_window=WINDOW
    )
    service = build_single_node_service(
        folder, model_id="moe-mtp", context_size=512, speculative=flags
    )
    server = await start_server(nursery, service)
    prompts = golden("qwen35-moe-tiny")["prompts"]
    tokens, proposed, strategies = await _completions(server, "moe-mtp", prompts)
    assert tokens == [p["gen_ids"] for p in prompts]
    assert proposed > 0
    assert strategies == {"mtp"}
