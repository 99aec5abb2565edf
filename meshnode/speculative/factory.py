"""From resolved settings to a per-request proposer.

The node loads a draft stage once (``draft_model_stage`` or ``layer_skip_stage``); each
request then gets a fresh proposer with its own n-gram index or draft KV cache.
"""

from __future__ import annotations

from meshnode.engine.model import Stage
from meshnode.engine.sampling import SamplingParams
from meshnode.speculative.auto import AutoNgramProposer
from meshnode.speculative.draft import StageProposer
from meshnode.speculative.mtp import MtpProposer
from meshnode.speculative.ngram import NgramProposer
from meshnode.speculative.proposer import Proposer
from meshnode.speculative.settings import SpeculativeSettings


def build_proposer(
    settings: SpeculativeSettings,
    params: SamplingParams,
    *,
    capacity: int,
    draft_stage: Stage | None = None,
) -> Proposer | None:
    """A proposer for one request, or ``None`` when speculation is off.

    ``capacity`` bounds the draft cache (the request's context size). Raises
    ``ValueError`` for a draft or layer-skip strategy without ``draft_stage``: the node
    resolves again with ``draft_unavailable`` when it could not load one.
    """
    strategy = settings.strategy
    if strategy == "off":
        return None
    if strategy == "auto":
        return AutoNgramProposer(settings.ngram)
    if strategy == "ngram":
        return NgramProposer(settings.ngram)
    if strategy == "mtp":  # drafts come from the last stage with each prediction
        return MtpProposer()
    if draft_stage is None:
        raise ValueError(f"strategy {strategy} needs a loaded draft stage")
    return StageProposer(draft_stage, params, capacity)
