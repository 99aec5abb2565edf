"""Fixtures for the serving tests: a tiny random model and a real hypercorn server.

The tiny model is a Llama-family checkpoint folder with random weights but the real
SmolLM2 tokenizer and chat template, so prompts, templates and detokenization are real
while a forward pass costs well under a millisecond.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from meshnode_packaging.sources import open_source
from safetensors.numpy import save_file

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
    (folder / "tokenizer.json").write_text(real.tokenizer_json)
    assert real.chat_template is not None
    (folder / "chat_template.jinja").write_text(real.chat_template)
    save_file(_tiny_weights(TINY_CONFIG, seed=7), str(folder / "model.safetensors"))
    return folder


class ServerThread:
    """The node's real app (``meshnode.serve.app``) on hypercorn, in a trio thread."""

    def __init__(self, service: ServeService):
        self.service = service
        self.address: Address | None = None
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._scope: trio.CancelScope | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="serve-test", daemon=True)

    @property
    def base_url(self) -> str:
        assert self.address is not None
        return f"http://{self.address}"

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(SERVER_START_TIMEOUT_S):
            raise TimeoutError("the API server did not start")
        if self._error is not None:
            raise RuntimeError("the API server failed to start") from self._error

    def __enter__(self) -> ServerThread:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self._token is not None and self._scope is not None:
            trio.from_thread.run_sync(self._scope.cancel, trio_token=self._token)
        self._thread.join(SERVER_START_TIMEOUT_S)

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # reported to the test thread by start()
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        app = create_app(lambda: {"node": {"node_id": "test"}})
        mount_openai(app, self.service)
        self._token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            self._scope = nursery.cancel_scope
            self.address = await nursery.start(serve_api, app, Address("127.0.0.1", 0))
            self._ready.set()


@pytest.fixture
def serve_service(tiny_model_dir: Path) -> ServeService:
    """A fresh single-node service on the tiny model."""
    return build_single_node_service(
        str(tiny_model_dir), model_id=TINY_MODEL_ID, context_size=TINY_CONTEXT
    )


@pytest.fixture
def server(serve_service: ServeService) -> Iterator[ServerThread]:
    """A running API server on loopback over ``serve_service``."""
    thread = ServerThread(serve_service)
    thread.start()
    try:
        yield thread
    finally:
        thread.stop()


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Poll ``predicate`` every 20 ms for at most ``timeout_s``; its last value."""
    deadline = threading.Event()
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return True
        deadline.wait(0.02)
    return predicate()
