"""Settings → per-request proposer."""

from __future__ import annotations

import pytest

from meshnode.engine.model import Stage
from meshnode.engine.sampling import SamplingParams
from meshnode.speculative.auto import AutoNgramProposer
from meshnode.speculative.draft import StageProposer
from meshnode.speculative.factory import build_proposer
from meshnode.speculative.ngram import NgramProposer
from meshnode.speculative.settings import SpeculativeFlags, resolve_speculative


@pytest.mark.parametrize(
    ("strategy", "kind"),
    [
        ("auto", AutoNgramProposer),
        ("ngram", NgramProposer),
        ("draft", StageProposer),
        ("layer-skip", StageProposer),
    ],
)
def test_each_strategy_builds_its_proposer(strategy: str, kind: type, draft: Stage) -> None:
    flags = SpeculativeFlags(strategy=strategy, draft_model="d", ngram_max=5)
    settings = resolve_speculative(flags, {}, "m", None)
    greedy = SamplingParams(temperature=0.0)
    proposer = build_proposer(settings, greedy, capacity=64, draft_stage=draft)
    assert isinstance(proposer, kind)
    if isinstance(proposer, NgramProposer):
        assert proposer.params.max_n == 5
    # Fresh state per request.
    assert build_proposer(settings, greedy, capacity=64, draft_stage=draft) is not proposer


def test_off_builds_nothing_and_drafts_need_a_stage() -> None:
    off = resolve_speculative(SpeculativeFlags(strategy="off"), {}, "m", None)
    assert build_proposer(off, SamplingParams(temperature=0.0), capacity=64) is None
    skip = resolve_speculative(SpeculativeFlags(strategy="layer-skip"), {}, "m", None)
    with pytest.raises(ValueError, match="needs a loaded draft stage"):
        build_proposer(skip, SamplingParams(temperature=0.0), capacity=64)
