"""`meshnode join --model DIR` serves the tiny gpt-oss reference (every layer a mixture of
experts, with attention sinks and sliding windows) split over three processes: greedy
completions of the reference's token-id prompts (``return_token_ids``) equal its
continuations token for token, with n-gram speculation sending verify windows through
every stage.

The folder is the reference's copy plus a ``tokenizer.json`` that spells token i as
``<i>`` (``tests/e2e/reference_mesh.py``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from tests.e2e.cluster import Node
from tests.e2e.reference_mesh import assert_greedy_matches, reference_mesh
from tests.engine.moe_models import MOE_DIR, golden

READY_TIMEOUT_S = 180.0  # three processes start on a shared 2-core box
MODEL = "gpt-oss-tiny"


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    root = tmp_path_factory.mktemp("moe")
    with reference_mesh(
        root,
        MOE_DIR / MODEL,
        "--speculative", "ngram",
        workers=2,
        ready_timeout_s=READY_TIMEOUT_S,
    ) as (_, host):  # fmt: skip
        yield host


def test_three_stage_moe_matches_the_reference(host: Node) -> None:
    assert_greedy_matches(host, golden(MODEL)["prompts"])
    # three stages, every cut between two MoE layers
    layers = [stage["layers"] for stage in host.status()["host"]["stages"]]
    assert len(layers) == 3
    assert [layers[0][0], layers[-1][1]] == [0, 4]
    assert all(a[1] == b[0] for a, b in itertools.pairwise(layers))
