"""Model-based proposers: a small draft model, or the target's own first layers.

Both run a stage with embeddings and head on stage 0 with a KV cache of their own. The
proposer remembers which tokens that cache holds; on each ``propose`` it keeps the
longest prefix shared with the committed history (rejected drafts fall off by
truncation, via ``forward``'s ``start_pos``), feeds the missing tokens in one catch-up
forward that computes only its last row's logits, then decodes one draft at a time.

At temperature 0 drafts are the draft model's argmax and the proposal is one-hot
(``probs=None``); otherwise each draft is sampled from the draft's processed
distribution and the rows are returned for the acceptance rule.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from meshnode_packaging.sources import ModelSource

from meshnode.engine.backend import Backend
from meshnode.engine.config import ModelConfig
from meshnode.engine.kv_cache import KVCache
from meshnode.engine.model import Stage
from meshnode.engine.sampling import (
    CounterRandom,
    Draw,
    SamplingParams,
    logits_to_probs,
    random_seed,
)
from meshnode.engine.weights import StageWeights, norm_weight
from meshnode.errors import ModelError
from meshnode.speculative.acceptance import sample_row
from meshnode.speculative.proposer import EMPTY_PROPOSAL, Proposal, common_prefix
from meshnode.speculative.scorer import forward_rows


class DraftIncompatibleError(ModelError):
    """The draft model cannot propose for the target (the message names both models)."""


@dataclass(frozen=True, slots=True)
class VocabInfo:
    """What makes token ids mean the same thing: the embedding rows and the token map."""

    name: str
    vocab_size: int
    token_to_id: Mapping[str, int] | None = None


def check_vocab(target: VocabInfo, draft: VocabInfo) -> None:
    """Raise ``DraftIncompatibleError`` unless ``draft`` shares ``target``'s vocabulary.

    The sizes must match (the draft's probability rows are compared with the target's
    index by index) and, when both token maps are known, every token must have the
    same id.
    """
    if target.vocab_size != draft.vocab_size:
        raise DraftIncompatibleError(
            f"draft model {draft.name} has a vocabulary of {draft.vocab_size} tokens, "
            f"target {target.name} has {target.vocab_size}"
        )
    if target.token_to_id is None or draft.token_to_id is None:
        return
    if target.token_to_id != draft.token_to_id:
        differ = sorted(set(target.token_to_id.items()) ^ set(draft.token_to_id.items()))
        raise DraftIncompatibleError(
            f"draft model {draft.name} and target {target.name} map tokens to different "
            f"ids ({len(differ)} entries differ, e.g. {differ[0]!r})"
        )


class StageProposer:
    """Drafts by greedy or sampled decoding on a stage with its own KV cache."""

    def __init__(
        self,
        stage: Stage,
        params: SamplingParams,
        capacity: int,
        random: CounterRandom | None = None,
    ) -> None:
        self.stage = stage
        self.params = params
        self.capacity = capacity
        self.cache: KVCache = stage.new_cache(capacity)
        self.cached: list[int] = []  # the tokens whose K/V the cache holds, in order
        # Sampled drafts draw from the request's seed (their own draw at each position), so
        # a replayed request is offered the same drafts.
        seed = random_seed() if params.seed is None else params.seed
        self.random = random if random is not None else CounterRandom(seed)

    @property
    def greedy(self) -> bool:
        """Whether drafts are argmax picks (one-hot proposals)."""
        return self.params.greedy

    def propose(self, history: Sequence[int], max_tokens: int) -> Proposal:
        """Up to ``max_tokens`` drafts decoded after ``history``."""
        count = min(max_tokens, self.capacity - len(history))
        if count <= 0 or not history:
            return EMPTY_PROPOSAL
        logits = self.sync(history)
        context = list(history)
        drafts: list[int] = []
        rows: list[np.ndarray] = []
        while True:
            probs = logits_to_probs(logits, self.params, context)
            token = int(np.argmax(probs)) if self.greedy else self._draw(probs, len(context))
            drafts.append(token)
            rows.append(probs)
            context.append(token)
            if len(drafts) == count:
                break
            logits = self._step(token)
        return Proposal(tuple(drafts), None if self.greedy else np.stack(rows))

    def _draw(self, probs: np.ndarray, position: int) -> int:
        return sample_row(probs, self.random, position, Draw.DRAFT)

    def on_result(self, proposed: int, accepted: int, *, seconds: float | None = None) -> None:
        """Rollback happens lazily at the next ``propose`` (it sees the committed history)."""

    def sync(self, history: Sequence[int]) -> npt.NDArray[np.float32]:
        """Roll the cache back to the prefix it shares with ``history`` and catch up.

        Returns the logits after ``history``. The last history token is always
        recomputed (its logits are what the first draft is drawn from), in the same
        forward as any other missing tokens, of which only the last row is computed.
        """
        keep = min(common_prefix(self.cached, history), len(history) - 1)
        del self.cached[keep:]
        missing = list(history[keep:])
        logits: npt.NDArray[np.float32] = forward_rows(self.stage, missing, keep, self.cache, 1)[0]
        self.cached += missing
        return logits

    def _step(self, token: int) -> npt.NDArray[np.float32]:
        logits: npt.NDArray[np.float32] = forward_rows(
            self.stage, [token], len(self.cached), self.cache, 1
        )[0]
        self.cached.append(token)
        return logits


# -- building the drafting stages ---------------------------------------------------------

# Share of the target's layers a layer-skip draft runs when no setting says otherwise.
# SmolLM2-135M was not trained to exit early: on the golden prompts (greedy, window 2-4)
# the first 15 of 30 layers get 3 % of drafts accepted, 20 get 5 %, 24 get 32 % and 27
# get 42 %. Only the deep end drafts usefully, so the default keeps nine tenths.
DEFAULT_LAYER_SKIP_FRACTION = 0.9


def vocab_info(name: str, source: ModelSource) -> VocabInfo:
    """The vocabulary facts of ``source`` (token map read from its tokenizer.json)."""
    token_to_id: dict[str, int] | None = None
    try:
        document = json.loads(source.tokenizer_json or "")
        token_to_id = dict(document["model"]["vocab"])
        token_to_id.update({t["content"]: t["id"] for t in document.get("added_tokens", [])})
    except (ValueError, KeyError, TypeError):
        token_to_id = None  # no readable token map: compare sizes only
    return VocabInfo(name, int(source.config["vocab_size"]), token_to_id)


def draft_model_stage(
    target: VocabInfo, draft_name: str, draft: ModelSource, backend: Backend
) -> Stage:
    """A whole-model stage for ``draft``; raises ``DraftIncompatibleError`` on a vocab mismatch."""
    check_vocab(target, vocab_info(draft_name, draft))
    config = ModelConfig.from_hf(draft.config)
    return Stage(config, draft, 0, config.num_layers, embed=True, head=True, backend=backend)


def layer_skip_layers(config: ModelConfig, layers: int | None) -> int:
    """The layer count a layer-skip draft uses (``layers`` or the default share)."""
    count = layers if layers is not None else round(config.num_layers * DEFAULT_LAYER_SKIP_FRACTION)
    if not 1 <= count < config.num_layers:
        raise ValueError(f"layer-skip needs 1..{config.num_layers - 1} layers, got {count}")
    return count


def layer_skip_stage(target: Stage, layers: int, source: ModelSource | None = None) -> Stage:
    """The target's first ``layers`` layers plus its final norm and head, as one stage.

    Shares the weight arrays ``target`` (the stage-0 stage, which embeds) already holds;
    only a head that stage 0 does not hold is loaded from ``source`` (the final norm, and
    ``lm_head`` when the head is not tied to the embedding). Raises ``ValueError`` when
    ``target`` does not hold those layers or the head cannot be found.
    """
    w = target.weights
    if target.start != 0 or not target.embed or layers > target.end:
        raise ValueError(
            f"layer-skip over {layers} layers needs stage 0 holding them, "
            f"got [{target.start}, {target.end})"
        )
    norm, head_t = w.norm, w.head_t
    if not target.head:
        if source is None:
            raise ValueError("stage 0 has no head: layer-skip needs the model source")
        tied = target.config.tie_word_embeddings or "lm_head.weight" not in source.tensor_names()
        if tied:
            norm = target.backend.asarray(norm_weight(source, target.config, "norm.weight"))
        else:
            head = target.backend.load_weights(
                source, target.config, layers, layers, embed=False, head=True
            )
            norm, head_t = head.norm, head.head_t
    shared = StageWeights(0, layers, w.layers[:layers], w.embed_t, norm, head_t)
    return Stage(target.config, shared, 0, layers, embed=True, head=True, backend=target.backend)
