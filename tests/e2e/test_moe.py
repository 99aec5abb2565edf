"""`meshnode join --model DIR` serves the tiny gpt-oss reference (every layer a mixture of
experts, with attention sinks and sliding windows) split over three processes: greedy
completions of the reference's token-id prompts (``return_token_ids``) equal its
continuations token for token, with n-gram speculation sending verify windows through
every stage.

The folder is the reference's copy plus a ``tokenizer.json`` that spells token i as
``<i>`` (the reference has none), so the completion text gives the token ids back too.
"""

from __future__ import annotations

import itertools
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
from tests.engine.moe_models import MOE_DIR, golden

READY_TIMEOUT_S = 180.0  # three processes start on a shared 2-core box
MODEL = "gpt-oss-tiny"


def _folder(root: Path) -> Path:
    folder = root / MODEL
    shutil.copytree(MOE_DIR / MODEL, folder)
    vocab = {f"<{i}>": i for i in range(512)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.Split(r"<\d+>", behavior="isolated")
    tok.decoder = decoders.Fuse()
    (folder / "tokenizer.json").write_text(tok.to_str())
    return folder


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    root = tmp_path_factory.mktemp("moe")
    token = init_token(root / "mesh.token")
    folder = str(_folder(root))
    with Cluster(root, env={**HEARTBEAT_ENV, **SINGLE_THREAD_ENV}) as cluster:
        yield start_split_mesh(
            cluster,
            token,
            "--model", folder,
            "--split", "3",
            "--context", "512",
            "--wire-dtype", "f32",
            "--speculative", "ngram",
            workers=2,
            ready_timeout_s=READY_TIMEOUT_S,
            worker_args=("--local-model", folder),  # the workers open the host's path
        )  # fmt: skip


def test_three_stage_moe_matches_the_reference(host: Node) -> None:
    with openai.OpenAI(
        base_url=host.api + "/v1", api_key="x", max_retries=0, timeout=120
    ) as client:
        model = client.models.list().data[0].id
        for prompt in golden(MODEL)["prompts"]:
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
    # three stages, every cut between two MoE layers
    layers = [stage["layers"] for stage in host.status()["host"]["stages"]]
    assert len(layers) == 3
    assert [layers[0][0], layers[-1][1]] == [0, 4]
    assert all(a[1] == b[0] for a, b in itertools.pairwise(layers))
