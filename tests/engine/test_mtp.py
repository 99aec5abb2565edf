"""The MTP module of the tiny Qwen3.5 reference: its first position written out by hand,
chunked feeding equals one pass, rollback cuts its KV, and chained drafts are its argmax."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from meshnode_packaging.quants import dequantize
from meshnode_packaging.sources import open_source

from meshnode.engine.config import ModelConfig
from meshnode.engine.deltanet import sigmoid
from meshnode.engine.model import Stage
from meshnode.engine.mtp import MtpHead
from tests.engine.hybrid_model import HYBRID_DIR, HybridFolder, hybrid_golden
from tests.engine.moe_models import write_gguf_twin

PROMPT = hybrid_golden()["prompts"][2]["prompt_ids"]  # 40 tokens


@pytest.fixture(scope="module")
def stage() -> Stage:
    source = HybridFolder()
    return Stage(ModelConfig.from_hf(source.config), source, 0, 8, embed=True, head=True)


def _mtp(stage: Stage) -> MtpHead:
    assert stage.mtp is not None
    return stage.mtp


def _hidden(stage: Stage, ids: list[int]) -> np.ndarray:
    """The final-normed hidden rows of the target over ``ids``."""
    stage.keep_hidden(True)
    stage.forward(np.asarray(ids), 0, stage.new_cache(64), out_rows=1)
    stage.keep_hidden(False)
    return np.array(stage.last_hidden, dtype=np.float32)


def _norm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    out: np.ndarray = w * x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)
    return out


def test_first_position_written_out(stage: Stage) -> None:
    """At position 0 attention sees one key: its output is sigmoid(gate) * v."""
    mtp, folder = _mtp(stage), HybridFolder()
    h = _hidden(stage, PROMPT[:1])
    out = mtp.absorb(mtp.new_cache(8), 0, h, PROMPT[:1], PROMPT[1])
    assert out is not None

    def t(name: str) -> np.ndarray:
        return folder.array(name).astype(np.float64)

    emb = t("embed_tokens.weight")[PROMPT[1]]
    x = t("mtp.fc.weight") @ np.concatenate(
        [
            _norm(emb, 1 + t("mtp.pre_fc_norm_embedding.weight")),
            _norm(h[0].astype(np.float64), 1 + t("mtp.pre_fc_norm_hidden.weight")),
        ]
    )
    p = "mtp.layers.0."
    a = _norm(x, 1 + t(p + "input_layernorm.weight"))
    gate = (t(p + "self_attn.q_proj.weight") @ a).reshape(4, 32)[:, 16:]  # [H, D]
    v = (t(p + "self_attn.v_proj.weight") @ a).reshape(2, 16)  # [Hkv, D]
    attn = np.asarray(sigmoid(np, gate)) * np.repeat(v, 2, axis=0)
    x = x + t(p + "self_attn.o_proj.weight") @ attn.reshape(-1)
    m = _norm(x, 1 + t(p + "post_attention_layernorm.weight"))
    g, u = t(p + "mlp.gate_proj.weight") @ m, t(p + "mlp.up_proj.weight") @ m
    x = x + t(p + "mlp.down_proj.weight") @ (g / (1 + np.exp(-g)) * u)
    np.testing.assert_allclose(out, _norm(x, 1 + t("mtp.norm.weight")), rtol=1e-4, atol=1e-5)


def test_chunks_and_rollback_match_one_pass(stage: Stage) -> None:
    mtp = _mtp(stage)
    h = _hidden(stage, PROMPT)
    whole = mtp.absorb(mtp.new_cache(64), 0, h[:30], PROMPT[:30], PROMPT[30])
    assert whole is not None
    cache = mtp.new_cache(64)
    mtp.absorb(cache, 0, h[:12], PROMPT[:12], None)
    assert cache.pending is not None  # row 11 waits for the token at 12
    mtp.absorb(cache, 12, h[12:36], PROMPT[12:36], PROMPT[36])  # past 30: rolled back below
    drafts = mtp.draft(cache, np.zeros(h.shape[1], np.float32), 3)  # writes chained rows
    assert len(drafts) == 3
    again = mtp.absorb(cache, 29, h[29:30], PROMPT[29:30], PROMPT[30])
    assert again is not None
    np.testing.assert_allclose(again, whole, rtol=1e-4, atol=1e-5)
    assert cache.length == 30


def test_drafts_are_the_chained_argmax(stage: Stage) -> None:
    mtp = _mtp(stage)
    h = _hidden(stage, PROMPT)
    cache = mtp.new_cache(64)
    out = mtp.absorb(cache, 0, h, PROMPT, 7)
    assert out is not None
    first = int(np.argmax(mtp.logits(out[None, :])[0]))
    drafts = mtp.draft(cache, out, 4)
    assert drafts[0] == first
    assert len(drafts) == 4
    assert cache.length == len(PROMPT) + 3  # three chained rows after the committed ones


def test_the_mtp_layers_mlp_takes_each_segments_path(stage: Stage) -> None:
    """The MTP layer's MLP (``HybridMixer.mlp``) takes the segments' sizes: rows of a
    short segment beside a long one's are the bits they have alone (a gemv each; all
    23 rows as one segment would be one long product, whose sums round otherwise), as the
    stage's own MLP layers give them. The MTP head passes its rows as one segment."""
    mtp = _mtp(stage)
    x = np.random.default_rng(5).standard_normal((23, stage.config.hidden_size))
    x = x.astype(np.float32)
    both = mtp.stage.mlp(mtp.weights.layer, x, [3, 20])
    alone = [mtp.stage.mlp(mtp.weights.layer, part) for part in (x[:3], x[3:])]
    assert np.array_equal(both, np.concatenate(alone))
    # one segment of 23 rows: a long product (sgemm, or the compiled GEMM where this
    # BLAS rounds a row by its batch), whose sums round otherwise than a gemv's
    assert not np.array_equal(both[:3], mtp.stage.mlp(mtp.weights.layer, x)[:3])


def test_the_mtp_module_loads_from_a_gguf_as_llama_cpp_writes_it(
    stage: Stage, tmp_path: Path
) -> None:
    """llama.cpp's converter writes the MTP module as one more block (``block_count`` 9,
    ``nextn_predict_layers`` 1, ``nextn.*`` beside the layer's tensors): read back as the
    checkpoint's ``mtp.*`` tensors (norms less one), the model still 8 layers, and the
    module's drafts the checkpoint's."""
    source = open_source(str(write_gguf_twin(HYBRID_DIR.name, tmp_path / "mtp.gguf", mtp=True)))
    folder = HybridFolder()
    names = sorted(n for n in folder.tensor_names() if n.startswith("mtp."))
    assert sorted(n for n in source.tensor_names() if n.startswith("mtp.")) == names
    assert not [n for n in source.tensor_names() if n.startswith("layers.8.")]
    for name in names:
        raw = source.tensor(name)
        got = np.asarray(dequantize(raw), np.float32).reshape(raw.shape)
        np.testing.assert_allclose(got, folder.array(name), atol=1e-6, err_msg=name)
    config = ModelConfig.from_hf(source.config)
    assert config.num_layers == stage.config.num_layers == 8
    twin = Stage(config, source, 0, 8, embed=True, head=True)
    h = _hidden(stage, PROMPT)
    drafts = []
    for st in (stage, twin):
        mtp = _mtp(st)
        cache = mtp.new_cache(64)
        drafts.append(mtp.draft(cache, mtp.absorb(cache, 0, h, PROMPT, 7), 4))
    assert drafts[0] == drafts[1]
