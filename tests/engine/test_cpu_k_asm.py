"""AVX2's one-row Q4_K and Q6_K passes in assembly (:mod:`meshnode.engine.cpu.k_asm`)
against the vector-IR passes they replace there: the same bits, output for output.

Both passes are compiled here, side by side, whatever :func:`.passes.one_row` picks on
this machine; the assembly's only where the CPU runs it (AVX2 and FMA)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from numba import njit
from numba.extending import overload

from meshnode.engine.cpu import passes
from meshnode.engine.cpu.formats import FORMATS
from meshnode.engine.cpu.k_asm import assembles

pytestmark = pytest.mark.skipif(not assembles(), reason="needs an x86-64 CPU with AVX2 and FMA")

N_IN = 1024  # four super-blocks a row: the scales' turns, every pair and half
# the float16 scales of a block (d, dmin for Q4_K; d for Q6_K)
_F16 = {"Q4_K": (0, 2), "Q6_K": (208,)}
# the vector IR each assembly pass stands in for on sixteen registers
_IR = {"Q4_K": passes.pass4_k_rows, "Q6_K": passes.pass4_k_buf}
_ASM = {"Q4_K": passes.pass4_k_asm, "Q6_K": passes.pass4_k_asm6}


def _runner(dtype: str, one_pass: Any) -> Any:
    # one_pass over rows 0 .. of a [n_out, bytes] matrix, its format and the eight-lane
    # form as the compile-time constants a kernel gives it (kernels._quads_typed's way)
    fmt = FORMATS[dtype].kernel_id

    def call(fmt, form, many, raw, x, out, o, hi, col, w, n_in):  # type: ignore[no-untyped-def]
        raise TypeError("for compiled code")

    @overload(call, prefer_literal=True)
    def _typed(fmt, form, many, raw, x, out, o, hi, col, w, n_in):  # type: ignore[no-untyped-def]
        return one_pass

    @njit
    def run(raw, x, out, w):  # type: ignore[no-untyped-def]
        return call(fmt, 8, 1, raw, x, out, 0, raw.shape[0], 0, w, x.shape[0])  # type: ignore[no-untyped-call]

    return run


def _blocks(dtype: str, n_out: int, rng: np.random.Generator, special: bool) -> np.ndarray:
    fmt = FORMATS[dtype]
    blocks = rng.integers(0, 256, (n_out * N_IN // 256, fmt.type_size), np.uint8)
    for off in _F16[dtype]:
        scale = rng.uniform(-0.05, 0.05, len(blocks)).astype(np.float16)
        if special:  # zeros of both signs, subnormals, the largest float16
            picks = np.array([0.0, -0.0, 6e-8, -6e-8, 65504.0, 1e-3], np.float16)
            scale[::3] = picks[rng.integers(0, len(picks), len(scale[::3]))]
        blocks[:, off : off + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n_out, -1)


@pytest.mark.parametrize("special", [False, True], ids=["random", "special-scales"])
@pytest.mark.parametrize("dtype", ["Q4_K", "Q6_K"])
def test_assembly_passes_are_the_bits_of_the_vector_ir(dtype: str, special: bool) -> None:
    rng = np.random.default_rng(7)
    n_out = 12  # three passes of four rows
    raw = _blocks(dtype, n_out, rng, special)
    x = rng.standard_normal(N_IN).astype(np.float32)
    x[5], x[700] = 0.0, -0.0
    outs = []
    for one_pass in (_IR[dtype], _ASM[dtype]):
        out = np.full((1, n_out), np.nan, np.float32)
        w = np.zeros(4 * N_IN, np.float32)
        assert _runner(dtype, one_pass)(raw, x, out, w) == n_out
        outs.append(out)
    ir, asm = outs
    assert not np.isnan(ir).any()  # every output written
    assert ir.view(np.uint32).tolist() == asm.view(np.uint32).tolist()


def test_a_portable_build_keeps_the_vector_ir() -> None:
    """Where numba compiles for another CPU than this one (``NUMBA_CPU_NAME=generic``: a
    cache meant for other machines), the assembly, which that CPU may lack, is not used."""
    code = "from meshnode.engine.cpu.k_asm import assembles; print(assembles())"
    for env, want in (({}, "True"), ({"NUMBA_CPU_NAME": "generic"}, "False")):
        run = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=120,
            env={**_base_env(), **env},
        )
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip() == want, env


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CPU")}


@pytest.mark.parametrize("asm", [True, False])
def test_one_row_picks_each_k_quant_s_pass_by_registers_and_assembly(
    asm: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the table of passes.one_row, whatever this CPU: eight-lane tiles (AVX2) take the
    # assembly where it runs, else Q4_K a row at a time and Q6_K from the scratch; sixteen
    # (AVX-512) Q4_K's scales in registers, Q6_K's from the scratch
    from numba import types

    monkeypatch.setattr(passes, "assembles", lambda: asm)
    q4, q6 = (types.IntegerLiteral(FORMATS[n].kernel_id) for n in ("Q4_K", "Q6_K"))
    eight, sixteen = types.IntegerLiteral(8), types.IntegerLiteral(16)
    want = (passes.pass4_k_asm, passes.pass4_k_asm6) if asm else _IR.values()
    assert (passes.one_row(q4, eight), passes.one_row(q6, eight)) == tuple(want)
    assert passes.one_row(q4, sixteen) is passes.pass4_k
    assert passes.one_row(q6, sixteen) is passes.pass4_k_buf
