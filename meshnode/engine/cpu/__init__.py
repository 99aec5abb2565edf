"""CPU weights in their GGUF block formats and the compiled kernels that multiply them.

Layering: ``formats`` (one row per block format: geometry, kernel id, the names of its
decoders; pure Python) at the bottom; ``simd`` (eight-lane vector types for numba, as LLVM
vector IR) and ``atomics`` (atomic words, raw pointers, indirect calls) beside it;
``blocks`` (block decoders on those vectors, bit-exact, and the lookup of a row's decoders
while compiling) on them, ``wide`` (the quantized formats' sixteen-lane decoders) and
``fp4`` (MXFP4's decoders) beside it; ``pool`` (kernel threads that claim chunks of a
product) on ``atomics``; ``kernels`` (k-row products, gathers, whole-matrix decode) on
``blocks`` and ``pool``'s word layout; ``tiles`` (prefill's products: tiles of decoded
rows through BLAS, shared by threads) on ``kernels``; ``matrix`` (:class:`BlockMatrix`,
what a stage holds) on top, which imports numba only at the first product so that
importing the engine stays cheap. Beside ``matrix``: ``q8`` (the opt-in 8-bit-activation
products, ``--dtype q8``) over ``q8_kernels`` (quantizing activations, the row tiles),
``q8_blocks`` (a weight chunk unpacked to bytes), ``simd_int`` (byte vectors and the
integer dot product) and ``simd_q8`` (vectors whose lanes are rows, the 512-bit dot
product). ``attention`` (one layer's attention for all short sequences of a batch, in one
call; used by ``meshnode.engine.attention``) on ``attention_rows`` (a block of query rows
over one KV head: dot products, softmax, weighted sums; also the softmax of a long
segment's block of scores), ``simd`` and ``atomics``;
``norms`` (RMSNorm in one call, ``CpuBackend.rms_norm``) on ``simd``; ``warmup``
(compiling the attention ahead in a worker process at a first start) on ``pool``;
``moe_step`` (a mixture-of-experts layer's feed-forward half of a one-row step in one
compiled call, ``CpuBackend.moe_step``) on ``experts``, ``norms`` and ``pool``.
"""

from meshnode.engine.cpu.matrix import (
    MAX_KERNEL_ROWS,
    BlockMatrix,
    configure_numba,
    dense_product,
    set_kernel_threads,
    supported,
)

# Before any module of this package that imports numba can be imported on its own
# (``pool``, ``kernels``, ``q8_kernels``...): numba reads its cache folder only then.
configure_numba()

__all__ = ["MAX_KERNEL_ROWS", "BlockMatrix", "dense_product", "set_kernel_threads", "supported"]
