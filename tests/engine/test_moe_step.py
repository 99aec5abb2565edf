"""A mixture-of-experts layer's feed-forward half of a one-row step in one compiled call
(:mod:`meshnode.engine.cpu.moe_step`): the same logits, bit for bit, as the stage's Python
path, on every family whose experts are GGUF stacks, in both CPU modes, with the pool's
threads, alone, and with the pool's lock held by another thread.

Each case decodes the references' prompts greedily twice in one stage: once as it runs
(the one call, counted: the test fails if it never ran) and once with the stage's steps
cleared (``Stage._steps``: every layer through ``_add_norm``, ``moe_mlp`` and the backend's
calls one at a time).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from meshnode_packaging.refs import open_ref

from meshnode.engine import ModelConfig, Stage
from meshnode.engine.backend import CpuBackend
from meshnode.engine.cpu import matrix
from meshnode.engine.cpu import moe_step as cpu_moe_step
from meshnode.engine.cpu.pool import KernelPool
from tests.engine.moe_models import golden, write_gguf_twin
from tests.engine.test_kernel_pool import idle_gauge
from tests.engine.test_same_bits import solo

# Mixtral: the top k logits, then softmax over them; the same weights with Qwen3-MoE's rule
# (softmax over all logits, the top k renormalised: qwen3-moe-tiny's experts of 48 values
# are no stacks); gpt-oss: Mixtral's rule with the router's bias, biased experts and the
# clamped SwiGLU
CASES = [("mixtral-tiny", False), ("mixtral-tiny", True), ("gpt-oss-tiny", False)]


@pytest.fixture(scope="module", params=CASES, ids=["mixtral", "qwen3-moe rule", "gpt-oss"])
def twin(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, bool]:
    """The reference's GGUF twin (its experts as 3-D stacks: the compiled experts), and
    whether to route it by Qwen3-MoE's rule."""
    name, qwen3_rule = request.param
    return write_gguf_twin(name, tmp_path_factory.mktemp("twin") / f"{name}.gguf"), qwen3_rule


def _prompts(path: Path) -> list[list[int]]:
    return [p["prompt_ids"] for p in golden(path.stem)["prompts"]][:2]


@pytest.mark.parametrize("dtype", ["native", "q8"])
@pytest.mark.parametrize("how", ["two threads", "one thread", "lock held"])
def test_one_call_gives_the_python_paths_bits(
    twin: tuple[Path, bool], dtype: str, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, qwen3_rule = twin
    source = open_ref(str(path))
    config = ModelConfig.from_hf(source.config)
    if qwen3_rule:
        assert config.moe is not None
        rule = replace(config.moe, routing="softmax_topk", norm_topk_prob=True)
        config = replace(config, moe=rule)
    n = config.num_layers
    stage = Stage(config, source, 0, n, embed=True, head=True, backend=CpuBackend(dtype))  # type: ignore[arg-type]
    steps = stage._steps
    assert any(s is not None for s in steps)  # every MoE layer of these twins
    monkeypatch.setattr(matrix, "_threads", 1 if how == "one thread" else 2)
    pool = KernelPool(idle_gauge(4))  # sure of free cores: posts whatever the load
    monkeypatch.setattr(matrix, "_pool", lambda: pool)
    calls = []
    call = cpu_moe_step.MoeStep.__call__

    def counted(self: cpu_moe_step.MoeStep, *args: Any) -> Any:
        done = call(self, *args)
        if done is not None:  # a one-row step (a prefill's rows take the Python path)
            calls.append(1)
        return done

    monkeypatch.setattr(cpu_moe_step.MoeStep, "__call__", counted)
    if how == "lock held":  # another thread shares the pool: both products alone
        assert pool._lock.acquire(blocking=False)
    shared: list[int] = []  # products the one calls posted, or found declined
    counts = pool.posted_compiled

    def count(plans: Any, jobs: int, woken: int, declined: int, keep: object) -> None:
        shared.append(jobs + declined)
        counts(plans, jobs, woken, declined, keep)

    monkeypatch.setattr(pool, "posted_compiled", count)
    prompts = _prompts(path)
    one_call = [solo(stage, p) for p in prompts]
    assert calls, "the one call never ran"
    if how == "two threads":  # each step posted its router's and experts' products (or
        assert shared == [2] * len(calls)  # found a helper still in an old chunk: alone)
    else:
        assert not shared
    stage._steps = [None] * n
    python = [solo(stage, p) for p in prompts]
    stage._steps = steps
    if how == "lock held":
        pool._lock.release()
    for i, (a, b) in enumerate(zip(one_call, python, strict=True)):
        differ = int(np.count_nonzero(a != b))
        assert differ == 0, f"prompt {i}: {differ} logits differ"
