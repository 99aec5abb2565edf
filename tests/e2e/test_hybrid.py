"""`meshnode join --model DIR` serves the tiny Qwen3.5 hybrid folder, split over two
processes, with ``--speculative ngram`` and ``--speculative mtp``: greedy completions of
the reference's token-id prompts (``return_token_ids``) equal its continuations token for
token, and the worker's snapshot ring is sized to the host's largest window.

The folder is the reference's copy plus a ``tokenizer.json`` that spells token i as
``<i>`` (``tests/e2e/reference_mesh.py``).
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from meshnode.engine.prefix_cache import PREFIX_BLOCK_TOKENS
from tests.e2e.cluster import Node
from tests.e2e.reference_mesh import assert_greedy_matches, reference_mesh
from tests.engine.hybrid_model import HYBRID_DIR, hybrid_golden

READY_TIMEOUT_S = 150.0  # two processes start on a shared 2-core box
STRATEGIES = ("ngram", "mtp")
MAX_WINDOW = 4  # so every stage keeps MAX_WINDOW + 1 snapshots, not the default 17


@pytest.fixture(scope="module", params=STRATEGIES)
def mesh(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Node, Node, str]]:
    root = tmp_path_factory.mktemp(f"hybrid-{request.param}")
    with reference_mesh(
        root,
        HYBRID_DIR,
        "--speculative", request.param,
        "--window-policy", "fixed",
        "--initial-window", str(MAX_WINDOW),
        "--max-window", str(MAX_WINDOW),
        workers=1,
        ready_timeout_s=READY_TIMEOUT_S,
    ) as (cluster, host):  # fmt: skip
        yield host, cluster.nodes[0], request.param


def test_split_hybrid_matches_the_reference(mesh: tuple[Node, Node, str]) -> None:
    host, worker, strategy = mesh
    proposed = assert_greedy_matches(host, hybrid_golden()["prompts"])
    if strategy == "mtp":
        assert proposed > 0  # the last stage's MTP drafts reached the host and were tried
    stages = host.status()["host"]["stages"]
    assert len(stages) == 2
    assert any(stage["recurrent_bytes"] > 0 for stage in stages)
    memory = worker.status()["run"]["memory"]
    assert memory["snapshot_ring_slots"] == MAX_WINDOW + 1


def test_a_repeated_prompt_resumes_from_both_stages_snapshots(
    mesh: tuple[Node, Node, str],
) -> None:
    """Issue 30: the second request of a prompt reads all of it but the rows after its last
    block boundary from the snapshots both stages kept there, and gets the same tokens."""
    host, worker, _ = mesh
    prompt = next(p for p in hybrid_golden()["prompts"] if p["id"] == "p_long")
    ids = prompt["prompt_ids"]
    with openai.OpenAI(
        base_url=host.api + "/v1", api_key="x", max_retries=0, timeout=120
    ) as client:
        model = client.models.list().data[0].id
        for _ in range(2):  # the first may resume already (the reference test sent it)
            reply = client.completions.create(
                model=model,
                prompt=ids,
                temperature=0,
                max_tokens=len(prompt["gen_ids"]),
                extra_body={"return_token_ids": True},
            )
            token_ids = (reply.choices[0].model_extra or {})["token_ids"]
            assert token_ids == prompt["gen_ids"]
    assert reply.usage is not None
    details = reply.usage.prompt_tokens_details
    assert details is not None
    assert details.cached_tokens == (len(ids) - 1) // PREFIX_BLOCK_TOKENS * PREFIX_BLOCK_TOKENS
    kv = worker.status()["run"]["kv"]
    assert kv["prefix_snapshots"] > 0
    assert kv["prefix_hit_tokens"] >= details.cached_tokens
