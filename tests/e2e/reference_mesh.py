"""A reference model's folder served by a split mesh of ``meshnode join`` processes, and
its greedy completions checked token for token (``test_moe.py``, ``test_hybrid.py``).

The references have no tokenizer and their prompts are token ids: the folder is the
reference's copy plus a ``tokenizer.json`` that spells token i as ``<i>``, so the
completion text gives the token ids back too.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from tests.e2e.cluster import (
    HEARTBEAT_ENV,
    SINGLE_THREAD_ENV,
    Cluster,
    Node,
    init_token,
    start_exact_mesh,
)

VOCAB = 512  # the tiny references' vocabularies fit in it


def token_id_folder(reference: Path, root: Path) -> Path:
    """A copy of ``reference`` under ``root`` with the ``<i>`` tokenizer added."""
    folder = root / reference.name
    shutil.copytree(reference, folder)
    vocab = {f"<{i}>": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.Split(r"<\d+>", behavior="isolated")
    tok.decoder = decoders.Fuse()
    (folder / "tokenizer.json").write_text(tok.to_str())
    return folder


@contextmanager
def reference_mesh(
    root: Path, reference: Path, *host_args: str, workers: int, ready_timeout_s: float
) -> Iterator[tuple[Cluster, Node]]:
    """The cluster and its host serving ``reference`` split over ``workers`` + 1 processes
    (one thread of BLAS each, fast heartbeats, float32 on the wire, the exact mode, which
    the host's Load gives every stage), ``host_args`` added to
    the host's; every process opens the same folder."""
    token = init_token(root / "mesh.token")
    folder = str(token_id_folder(reference, root))
    with Cluster(root, env={**HEARTBEAT_ENV, **SINGLE_THREAD_ENV}) as cluster:
        host = start_exact_mesh(
            cluster,
            token,
            folder,
            *host_args,
            workers=workers,
            ready_timeout_s=ready_timeout_s,
            worker_args=("--local-model", folder),  # the workers open the host's path
            key=reference.name,
        )
        yield cluster, host


def assert_greedy_matches(host: Node, prompts: list[dict[str, Any]]) -> int:
    """Each prompt's greedy completion (``/v1/completions``, its token ids and its text)
    equals the reference's continuation; returns the drafts speculation proposed."""
    proposed = 0
    with openai.OpenAI(
        base_url=host.api + "/v1", api_key="x", max_retries=0, timeout=120
    ) as client:
        model = client.models.list().data[0].id
        for prompt in prompts:
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
            proposed += (reply.model_extra or {})["meshnode"]["speculation"]["proposed"]
    return proposed
