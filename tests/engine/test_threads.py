"""`--threads`: the BLAS thread cap a node or `meshnode generate` runs with."""

from __future__ import annotations

import pytest
from threadpoolctl import threadpool_info

from meshnode.engine.backend import BackendError, limit_cpu_threads
from meshnode.node.config import load_config


def blas_threads() -> list[int]:
    return [int(i["num_threads"]) for i in threadpool_info() if i["user_api"] == "blas"]


def test_the_cap_holds_while_referenced_and_lifts_after() -> None:
    before = blas_threads()
    assert before  # NumPy's BLAS is loaded
    handle = limit_cpu_threads(1)
    assert blas_threads() == [1] * len(before)
    assert handle is not None
    handle.restore_original_limits()  # type: ignore[attr-defined]
    assert blas_threads() == before


def test_no_cap_means_the_library_default() -> None:
    before = blas_threads()
    assert limit_cpu_threads(None) is None
    assert blas_threads() == before


def test_a_cap_below_one_is_refused() -> None:
    with pytest.raises(BackendError, match="at least 1"):
        limit_cpu_threads(0)


def test_threads_come_from_flags_env_and_file() -> None:
    assert load_config(env={}).threads is None
    assert load_config(env={"MESHNODE_THREADS": "2"}).threads == 2
    assert load_config(env={"MESHNODE_THREADS": "2"}, flags={"threads": 1}).threads == 1
