"""Fixtures for the serving tests: a tiny random model and a real hypercorn server.

The server runs in the test's own trio loop (pytest-trio's ``nursery`` fixture), so the
tests drive it with the async ``openai`` and ``httpx`` clients.

The tiny model is a Llama-family checkpoint folder with random weights but the real
SmolLM2 tokenizer and chat template, so prompts, templates and detokenization are real
while a forward pass costs well under a millisecond.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from meshnode_packaging.sources import open_source
from safetensors.numpy import save_file

from meshnode.net.http_guard import ApiAccess, BodyLimits
from meshnode.node.config import Address
from meshnode.serve.app import create_app, serve_api
from meshnode.serve.openai_api import mount_openai
from meshnode.serve.service import ServeService
from meshnode.serve.single import build_single_node_service
from tests.conftest import smollm2_gguf_path

TINY_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 49152,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
TINY_MODEL_ID = "tiny-serve-model"
#: Context of the tiny model's service: small, so an oversize prompt is cheap to build.
TINY_CONTEXT = 256
#: Seconds any test waits for the server to start or stop.
SERVER_START_TIMEOUT_S = 20.0


def _tiny_weights(config: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    q = config["num_attention_heads"] * config["head_dim"]

    def w(*shape: int) -> np.ndarray:
        scaled: np.ndarray = rng.standard_normal(shape) / np.sqrt(shape[-1])
        return scaled.astype(np.float32)

    tensors = {
        "model.embed_tokens.weight": w(vocab, hidden),
        "model.norm.weight": np.ones(hidden, np.float32),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": np.ones(hidden, np.float32),
            p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
            p + "self_attn.q_proj.weight": w(q, hidden),
            p + "self_attn.k_proj.weight": w(kv, hidden),
            p + "self_attn.v_proj.weight": w(kv, hidden),
            p + "self_attn.o_proj.weight": w(hidden, q),
            p + "mlp.gate_proj.weight": w(inter, hidden),
            p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
        }
    return tensors


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama checkpoint folder with SmolLM2's tokenizer and template."""
    folder = tmp_path_factory.mktemp("tiny-serve-model")
    real = open_source(smollm2_gguf_path())
    (folder / "config.json").write_text(json.dumps(TINY_CONFIG))
    assert real.tokenizer_json is not None
    (folder / "tokenizer.json").write_text(real.tokenizer_json)
    assert real.chat_template is not None
    (folder / "chat_template.jinja").write_text(real.chat_template)
    save_file(_tiny_weights(TINY_CONFIG, seed=7), str(folder / "model.safetensors"))
    return folder


@dataclass(frozen=True)
class Server:
    """The node's real app (``meshnode.serve.app``) served by hypercorn on loopback."""

    service: ServeService
    address: Address

    @property
    def base_url(self) -> str:
        return f"http://{self.address}"


async def start_server(
    nursery: trio.Nursery,
    service: ServeService,
    *,
    access: ApiAccess | None = None,
    limits: BodyLimits | None = None,
) -> Server:
    """Serve ``service`` in ``nursery`` on a free loopback port; returns once it listens.

    ``access`` and ``limits`` default to those of a loopback bind without a key."""
    app = create_app(lambda: {"node": {"node_id": "test"}}, access=access, limits=limits)
    mount_openai(app, service)
    with trio.fail_after(SERVER_START_TIMEOUT_S):
        address = await nursery.start(serve_api, app, Address("127.0.0.1", 0))
    return Server(service, address)


@pytest.fixture
def serve_service(tiny_model_dir: Path) -> ServeService:
    """A fresh single-node service on the tiny model."""
    return build_single_node_service(
        str(tiny_model_dir), model_id=TINY_MODEL_ID, context_size=TINY_CONTEXT
    )


@pytest.fixture
async def server(nursery: trio.Nursery, serve_service: ServeService) -> Server:
    """A running API server on loopback over ``serve_service``, stopped with the test."""
    return await start_server(nursery, serve_service)


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Poll ``predicate`` every 20 ms for at most ``timeout_s``; its last value."""
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return True
        await trio.sleep(0.02)
    return predicate()
