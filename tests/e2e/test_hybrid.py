"""`meshnode join --model DIR` serves the tiny Qwen3.5 hybrid folder, split over two
processes, with ``--speculative ngram`` and ``--speculative mtp``: greedy completions of
the reference's token-id prompts (``return_token_ids``) equal its continuations token for
token, and the worker's snapshot ring is sized to the host's largest window.

The folder is the reference's copy plus a ``tokenizer.json`` that spells token i as
``<i>`` (the reference has none; its prompts are token ids), so the completion text gives
the token ids back too.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from tests.e2e.cluster import (
    HEARTBEAT_ENV,
    SINGLE_THREAD_ENV,
    Cluster,
    Node,
    init_token,
    start_split_mesh,
)
from tests.engine.hybrid_model import HYBRID_DIR, hybrid_golden

READY_TIMEOUT_S = 150.0  # two processes start on a shared 2-core box
STRATEGIES = ("ngram", "mtp")
MAX_WINDOW = 4  # so every stage keeps MAX_WINDOW + 1 snapshots, not the default 17


def _folder(root: Path) -> Path:
    folder = root / "qwen35-hybrid-tiny"
    shutil.copytree(HYBRID_DIR, folder)
    vocab = {f"<{i}>": i for i in range(512)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.Split(r"<\d+>", behavior="isolated")
    tok.decoder = decoders.Fuse()
    (folder / "tokenizer.json").write_text(tok.to_str())
    return folder


@pytest.fixture(scope="module", params=STRATEGIES)
def mesh(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Node, Node, str]]:
    root = tmp_path_factory.mktemp(f"hybrid-{request.param}")
    token = init_token(root / "mesh.token")
    folder = str(_folder(root))
    with Cluster(root, env={**HEARTBEAT_ENV, **SINGLE_THREAD_ENV}) as cluster:
        host = start_split_mesh(
            cluster,
            token,
            "--model", folder,
            "--split", "2",
            "--context", "512",
            "--wire-dtype", "f32",
            "--speculative", request.param,
            "--window-policy", "fixed",
            "--initial-window", str(MAX_WINDOW),
            "--max-window", str(MAX_WINDOW),
            workers=1,
            ready_timeout_s=READY_TIMEOUT_S,
            worker_args=("--local-model", folder),  # the worker opens the host's path
        )  # fmt: skip
        yield host, cluster.nodes[0], request.param


def test_split_hybrid_matches_the_reference(mesh: tuple[Node, Node, str]) -> None:
    host, worker, strategy = mesh
    with openai.OpenAI(
        base_url=host.api + "/v1", api_key="x", max_retries=0, timeout=120
    ) as client:
        model = client.models.list().data[0].id
        proposed = 0
        for prompt in hybrid_golden()["prompts"]:
            reply = client.completions.create(
                model=model,
                prompt=prompt["prompt_ids"],
                temperature=0,
                max_tokens=len(prompt["gen_ids"]),
                extra_body={"return_token_ids": True},
            )
            choice = reply.choices[0]
            assert (choice.model_extra or {})["token_ids"] == prompt["gen_ids"], prompt["id"]
            text_ids = [int(i) for i in re.findall(r"<(\d+)>", choice.text)]
            assert text_ids == prompt["gen_ids"], prompt["id"]
            extra = reply.model_extra or {}
            proposed += extra["meshnode"]["speculation"]["proposed"]
        if strategy == "mtp":
            assert proposed > 0  # the last stage's MTP drafts reached the host and were tried
    stages = host.status()["host"]["stages"]
    assert len(stages) == 2
    assert any(stage["recurrent_bytes"] > 0 for stage in stages)
    memory = worker.status()["run"]["memory"]
    assert memory["snapshot_ring_slots"] == MAX_WINDOW + 1
