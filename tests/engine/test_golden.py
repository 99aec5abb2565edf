"""Golden parity with an independent implementation (tests/golden/, see its README)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from meshnode.cli.generate import GenerateConfig, complete
from meshnode.engine.generate import prefill
from meshnode.engine.loader import LoadedModel
from meshnode.engine.sampling import SamplingParams

pytestmark = pytest.mark.real_model


def _by_id(golden: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["id"]: p for p in golden["prompts"]}


def test_prompt_ids_and_greedy_tokens_match_exactly(
    smollm2: LoadedModel, golden: dict[str, Any]
) -> None:
    for prompt in golden["prompts"]:
        config = GenerateConfig(
            prompt=prompt["prompt_text"],
            raw=True,  # prompt_text is already templated
            max_tokens=golden["generation"]["max_new_tokens"],
            sampling=SamplingParams(temperature=0.0),
        )
        result = complete(smollm2, config, None)
        assert result.prompt_token_ids == prompt["prompt_ids"], prompt["id"]
        expected = [t for t in prompt["gen_ids"] if t != golden["generation"]["eos_token_id"]]
        assert result.token_ids == expected, prompt["id"]
        assert result.finish_reason == ("stop" if prompt["stopped_on_eos"] else "length")
        assert result.text == prompt["gen_text_skip_special"], prompt["id"]


def test_first_steps_top5_logits(smollm2: LoadedModel, golden: dict[str, Any]) -> None:
    stage = smollm2.stage
    for prompt in golden["prompts"]:
        ids = list(prompt["prompt_ids"])
        cache = stage.new_cache(len(ids) + 8)
        logits = prefill(stage, cache, ids)
        for step in prompt["first_steps_top5"]:
            top = [int(i) for i in np.argsort(-logits)[:5]]
            assert top == step["top_ids"], (prompt["id"], step["step"])
            np.testing.assert_allclose(logits[top], step["top_logits"], atol=1e-3)
            ids.append(top[0])
            logits = stage.backend.to_numpy(
                stage.forward(np.array(ids[-1:]), len(ids) - 1, cache)[0]
            )


def test_chat_template_reproduces_the_templated_prompts(
    smollm2: LoadedModel, golden: dict[str, Any]
) -> None:
    assert smollm2.chat_template is not None
    for prompt in golden["prompts"]:
        if prompt["kind"] != "chat":
            continue
        text = prompt["prompt_text"]
        user = text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        assert smollm2.chat_template.render([{"role": "user", "content": user}]) == text
