"""A checkpoint's MTP module (``mtp.*``, Qwen3.5) in a layer package and in the plan: its
tensors travel in the head's file, the last stage fetches the embedding it reads, and the
head's footprint counts both."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from meshnode_packaging.manifest import MANIFEST_NAME, Manifest, Part
from meshnode_packaging.package import open_package
from meshnode_packaging.remote import wanted
from meshnode_packaging.writer import group_tensors, write_package

from meshnode.engine.config import ModelConfig
from meshnode.engine.hybrid_config import HybridConfig
from meshnode.engine.model import Stage
from meshnode.node.footprint import model_footprint
from tests.engine.hybrid_model import HybridFolder, hybrid_golden


def test_mtp_tensors_go_with_the_head() -> None:
    source = HybridFolder()
    embed, layers, head = group_tensors(source.tensor_names(), 8)
    mtp = sorted(n for n in source.tensor_names() if n.startswith("mtp."))
    assert mtp, "the reference carries an MTP module"
    assert sorted(n for n in head if n.startswith("mtp.")) == mtp
    assert not any(n.startswith("mtp.") for group in layers for n in group)
    assert embed == ["embed_tokens.weight"]


def test_a_ranged_last_stage_wants_the_embedding_only_when_its_head_reads_it() -> None:
    last, first = Part(4, 8, head=True), Part(0, 4, embed=True)
    assert wanted("embed_tokens.weight", "model.embed_tokens.weight", last, True)
    assert not wanted("embed_tokens.weight", "model.embed_tokens.weight", last, False)
    assert wanted("embed_tokens.weight", "model.embed_tokens.weight", first, False)
    assert wanted("mtp.fc.weight", "mtp.fc.weight", last, False)
    assert not wanted("mtp.fc.weight", "mtp.fc.weight", first, False)


def test_the_last_stage_of_a_package_runs_the_mtp_module_from_its_own_files(
    tmp_path: Path,
) -> None:
    """Only the files ``files_for`` names for the last stage (the untied head, its MTP
    module and the embedding the module reads): the stage loads, and its MTP module
    computes what the same stage built from the reference folder does."""
    folder = HybridFolder()
    write_package(folder, tmp_path / "pkg")
    manifest = Manifest.load(tmp_path / "pkg")
    assert not manifest.head_tied
    assert manifest.head_reads_embed
    last = Part(4, 8, head=True)
    files = manifest.files_for(last)
    assert manifest.data["embed"]["file"] in files
    part_dir = tmp_path / "last"
    for rel in [MANIFEST_NAME, *files]:
        (part_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(tmp_path / "pkg" / rel, part_dir / rel)
    config = ModelConfig.from_hf(folder.config)
    packaged = Stage(config, open_package(part_dir), 4, 8, embed=False, head=True)
    direct = Stage(config, folder, 4, 8, embed=False, head=True)
    assert packaged.mtp is not None
    assert direct.mtp is not None
    ids = hybrid_golden()["prompts"][2]["prompt_ids"][:12]
    hidden = np.random.default_rng(0).standard_normal((12, config.hidden_size)).astype(np.float32)
    outs = []
    for stage in (packaged, direct):
        mtp = stage.mtp
        assert mtp is not None
        cache = mtp.new_cache(32)
        out = mtp.absorb(cache, 0, hidden, ids, 7)
        outs.append((out, mtp.draft(cache, out, 3)))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    assert outs[0][1] == outs[1][1]


@pytest.mark.parametrize("tied", [False, True])
def test_the_heads_footprint_counts_the_mtp_module(tied: bool) -> None:
    """``mtp_num_hidden_layers`` (which real Qwen3.5 configs carry) adds the module's
    weights to the head, and the embedding when the head does not hold it already; the
    count is the reference's own ``mtp.*`` tensors' sizes."""
    folder = HybridFolder()
    stored = sum(folder.array(n).size for n in folder.tensor_names() if n.startswith("mtp."))
    base = {**folder.config, "tie_word_embeddings": tied}
    with_mtp = {**base, "mtp_num_hidden_layers": 1}
    hybrid = HybridConfig.from_hf(with_mtp)
    assert hybrid.mtp_layers == 1
    assert hybrid.mtp_params() == stored
    plain = model_footprint(ModelConfig.from_hf(base)).head_bytes
    config = ModelConfig.from_hf(with_mtp)
    embed = 0 if tied else config.embed_params
    assert model_footprint(config).head_bytes == plain + 4 * (stored + embed)
