"""An 8-bit product in the calling thread by the kernel threads' chunk function
(:func:`.q8_kernels.chunk_kernel`): the activations quantized, then the chunk function over
the whole product (:func:`.pool_words.run_alone`), so that a format mix compiles its chunk
function only, not a serial product function beside it (each re-optimizing the same row
loop: ~1.1 s of a SmolLM2 first start's CPU, ~2 s on the 1B shape)."""

from __future__ import annotations

from meshnode.engine.cpu.pool_words import run_alone
from meshnode.engine.cpu.q8_quant import quantized
from meshnode.engine.cpu.simd import entry

__all__ = ["alone"]


@entry()
def alone(fn, a, b, c, x, out):  # type: ignore[no-untyped-def]
    """``out`` = ``x`` (flat float32, ``out.shape[0]`` rows) times the parts ``a``, ``b``,
    ``c`` by the chunk function at address ``fn`` (:func:`.q8_kernels.chunk_kernel`'s) in
    the calling thread: ``x`` quantized, then :func:`.pool_words.run_alone` (one call from
    Python, as a serial product's)."""
    q = quantized(x, out.shape[0])
    run_alone(fn, a, b, c, q[: x.shape[0]], out)
