"""Gemma 3 270M (Q4_K_M GGUF from the wheels) against transformers' float32 reference.

``tests/golden/gemma3/gemma3-270m-greedy.json`` (see ``tests/golden/README.md``): three
raw prompts with BOS, 40 greedy tokens each. ``g_long_window`` is 1,108 tokens, longer
than the local layers' 512-token window, and its answer changes if the window is ignored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshnode.cli.generate import GenerateConfig, complete
from meshnode.engine.backend import cpu_backend
from meshnode.engine.generate import prefill
from meshnode.engine.loader import LoadedModel, load_model
from meshnode.engine.sampling import SamplingParams

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def gemma3(gemma3_gguf: Path) -> LoadedModel:
    """The model as ``join`` runs it by default: weights in their GGUF blocks (Q4_K, Q5_0,
    Q6_K, Q8_0 multiplied by the block kernels)."""
    return load_model(str(gemma3_gguf), cpu_backend("native"))


def test_config_read_from_the_gguf(gemma3: LoadedModel, gemma3_golden: dict[str, Any]) -> None:
    config = gemma3.config
    expected = gemma3_golden["config"]
    assert [config.window(i) for i in range(config.num_layers)] == [
        expected["sliding_window"] if t == "sliding_attention" else None
        for t in expected["layer_types"]
    ]
    assert config.vocab_size == expected["vocab_size"]
    assert config.tie_word_embeddings
    assert config.bos_token_id == gemma3_golden["bos_token_id"]


def test_prompt_ids_and_greedy_tokens_match_exactly(
    gemma3: LoadedModel, gemma3_golden: dict[str, Any]
) -> None:
    for prompt in gemma3_golden["prompts"]:
        config = GenerateConfig(
            prompt=prompt["prompt_text"],
            raw=True,  # the GGUF has no chat template; BOS comes from add_bos_token
            max_tokens=gemma3_golden["generation"]["max_new_tokens"],
            sampling=SamplingParams(temperature=0.0),
        )
        result = complete(gemma3, config, None)
        assert result.prompt_token_ids == prompt["prompt_ids"], prompt["id"]
        assert result.token_ids == prompt["gen_ids"], prompt["id"]
        assert result.text == prompt["gen_text"], prompt["id"]


def test_first_step_logits(gemma3: LoadedModel, gemma3_golden: dict[str, Any]) -> None:
    """The prompt's next-token top 5, ids and logits, on the two short prompts."""
    for prompt in gemma3_golden["prompts"][:2]:
        ids = prompt["prompt_ids"]
        logits = prefill(gemma3.stage, gemma3.stage.new_cache(len(ids) + 1), ids)
        top_ids, top_logits = prompt["first_steps_top5"][0]
        assert [int(i) for i in np.argsort(-logits)[:5]] == top_ids, prompt["id"]
        np.testing.assert_allclose(logits[top_ids], top_logits, atol=1e-3)
