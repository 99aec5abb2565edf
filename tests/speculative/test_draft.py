"""Draft loading: vocabulary compatibility, default layer-skip depth, proposer behaviour."""

from __future__ import annotations

import json

import numpy as np
import pytest

from meshnode.engine.backend import cpu_backend
from meshnode.engine.config import ModelConfig
from meshnode.engine.model import Stage
from meshnode.engine.sampling import CounterRandom, SamplingParams
from meshnode.speculative.draft import (
    DraftIncompatibleError,
    StageProposer,
    VocabInfo,
    check_vocab,
    draft_model_stage,
    layer_skip_layers,
    vocab_info,
)
from tests.speculative.tinymodel import TinySource, tiny_config


def tokenizer_json(vocab: dict[str, int]) -> str:
    return json.dumps({"model": {"type": "BPE", "vocab": vocab}, "added_tokens": []})


def test_vocab_size_mismatch_names_both_models() -> None:
    with pytest.raises(DraftIncompatibleError, match=r"draft model tiny-draft .* target big"):
        check_vocab(VocabInfo("big", 49152), VocabInfo("tiny-draft", 32000))


def test_token_map_mismatch_names_both_models() -> None:
    target = VocabInfo("big", 3, {"a": 0, "b": 1, "c": 2})
    draft = VocabInfo("small", 3, {"a": 0, "b": 2, "c": 1})
    with pytest.raises(DraftIncompatibleError, match="small and target big map tokens"):
        check_vocab(target, draft)
    check_vocab(target, VocabInfo("twin", 3, {"a": 0, "b": 1, "c": 2}))
    check_vocab(target, VocabInfo("unknown map", 3, None))


def test_draft_model_stage_checks_at_load() -> None:
    vocab = {f"t{i}": i for i in range(16)}
    target = TinySource(tiny_config(16, 2), seed=1, tokenizer_json=tokenizer_json(vocab))
    good = TinySource(tiny_config(16, 1), seed=2, tokenizer_json=tokenizer_json(vocab))
    shuffled = {**vocab, "t0": 1, "t1": 0}
    bad = TinySource(tiny_config(16, 1), seed=2, tokenizer_json=tokenizer_json(shuffled))
    info = vocab_info("target.gguf", target)
    stage = draft_model_stage(info, "draft.gguf", good, cpu_backend())
    assert (stage.start, stage.end, stage.head) == (0, 1, True)
    with pytest.raises(DraftIncompatibleError, match=r"draft\.gguf .* target\.gguf"):
        draft_model_stage(info, "draft.gguf", bad, cpu_backend())


def test_layer_skip_depth() -> None:
    config = ModelConfig.from_hf(tiny_config(16, 30))
    assert layer_skip_layers(config, None) == 27
    assert layer_skip_layers(config, 8) == 8
    with pytest.raises(ValueError, match=r"1\.\.29"):
        layer_skip_layers(config, 30)


def test_sampled_drafts_carry_their_distribution(draft: Stage) -> None:
    params = SamplingParams(temperature=0.8, top_k=5)
    proposer = StageProposer(draft, params, capacity=64, random=CounterRandom(0))
    proposal = proposer.propose([1, 2, 3], 4)
    assert len(proposal.tokens) == 4
    assert proposal.probs is not None
    assert proposal.probs.shape == (4, draft.config.vocab_size)
    np.testing.assert_allclose(proposal.probs.sum(axis=1), 1.0)
    for token, row in zip(proposal.tokens, proposal.probs, strict=True):
        assert row[token] > 0
        assert (row > 0).sum() <= 5  # top-k applies to q as to p


def test_proposal_respects_capacity(draft: Stage) -> None:
    proposer = StageProposer(draft, SamplingParams(temperature=0.0), capacity=8)
    assert len(proposer.propose([1, 2, 3, 4, 5], 6).tokens) == 3
    assert proposer.propose([1, 2, 3, 4, 5, 6, 7, 8], 2).tokens == ()
