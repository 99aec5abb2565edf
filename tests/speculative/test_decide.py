"""The last stage's decision (``speculative.decide``): one sampled token, or a verify pass's
verdict, at the right sequence positions, with log-probabilities read before the mask."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest

from meshnode.engine.sampling import Sampler, SamplingParams, token_logprobs
from meshnode.speculative.acceptance import verify
from meshnode.speculative.decide import Decision, decide

F32 = npt.NDArray[np.float32]
VOCAB = 7


def _rows(n: int, seed: int = 3) -> F32:
    rows: F32 = np.random.default_rng(seed).normal(size=(n, VOCAB)).astype(np.float32)
    return rows


def test_a_plain_step_samples_the_last_row_at_end_pos() -> None:
    params = SamplingParams(temperature=0.9, seed=11)
    rows, history = _rows(3), [4, 1, 2]
    got = decide(rows, Sampler(params), history, end_pos=9, prompt_len=6)
    want = Sampler(params).sample(rows[-1], history, 9)
    assert got == Decision(0, (want,), None)
    # Another position draws another uniform: the position is the one asked for.
    others = {decide(rows, Sampler(params), history, end_pos=p, prompt_len=6) for p in range(30)}
    assert len({d.tokens for d in others}) > 1


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_verify_pass_is_the_acceptance_rule_from_the_first_draft(temperature: float) -> None:
    params = SamplingParams(temperature=temperature, seed=5)
    rows, drafts = _rows(4), (int(np.argmax(_rows(4)[0])), 2, 6)
    generated = [1, 3, *drafts]  # two generated tokens, then the drafts
    got = decide(rows, Sampler(params), generated, end_pos=12, prompt_len=7, drafts=drafts)
    # last sits at 8, d_1 at 9 = end_pos - k; d_1 is generated[2] = 9 - prompt_len
    sampler = Sampler(params)
    want = verify(rows, drafts, params, generated, 2, None, sampler.random, 9)
    assert (got.accepted, list(got.tokens)) == want
    assert got.logprobs is None


def test_a_verify_pass_without_drafts_is_not_a_plain_step() -> None:
    """``drafts=()`` runs the acceptance rule over one row; ``None`` samples."""
    params = SamplingParams(temperature=0.0)
    rows = _rows(1)
    verified = decide(rows, Sampler(params), [], end_pos=4, prompt_len=3, drafts=())
    assert verified == Decision(0, (int(np.argmax(rows[0])),), None)


def test_logprobs_come_from_the_raw_rows_not_the_masked_ones() -> None:
    raw = _rows(2)
    masked = raw.copy()
    masked[:, 0] = -np.inf  # a grammar forbids token 0
    drafts = (int(np.argmax(masked[0])),)
    got = decide(
        masked,
        Sampler(SamplingParams(temperature=0.0)),
        list(drafts),
        end_pos=5,
        prompt_len=4,
        drafts=drafts,
        raw=raw,
        top=2,
    )
    assert got.logprobs is not None
    assert len(got.logprobs) == len(got.tokens) == 2
    for i, token in enumerate(got.tokens):
        assert got.logprobs[i] == token_logprobs(raw[i], token, 2)
        assert np.isfinite(got.logprobs[i][0])
    greedy = Sampler(SamplingParams(temperature=0.0))
    with pytest.raises(ValueError, match="do not match"):
        decide(masked, greedy, [], end_pos=5, prompt_len=4, drafts=(1, 2))
