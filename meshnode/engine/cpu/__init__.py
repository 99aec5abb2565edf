"""CPU weights in their GGUF block formats and the compiled kernels that multiply them.

Layering: ``formats`` (block geometry, pure Python) at the bottom; ``simd`` (eight-lane
vector types for numba, as LLVM vector IR) beside it; ``blocks`` (block decoders on those
vectors, bit-exact) on them; ``kernels`` (k-row products, gathers, whole-matrix decode) on
that; ``matrix`` (:class:`BlockMatrix`, what a stage holds) on top, which imports numba
only at the first product so that importing the engine stays cheap.
"""

from meshnode.engine.cpu.matrix import MAX_KERNEL_ROWS, BlockMatrix, set_kernel_threads, supported

__all__ = ["MAX_KERNEL_ROWS", "BlockMatrix", "set_kernel_threads", "supported"]
