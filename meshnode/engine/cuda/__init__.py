"""The CUDA path of a stage: CuPy arrays, the engine's own kernels, CUDA graphs.

Layering, bottom up:

- ``formats``: how a weight matrix is laid out on the device (float32, float16, raw
  bfloat16, raw GGML Q8_0 / Q4_K blocks) and the NumPy reference of its block math.
  NumPy only: imported and tested on every machine.
- ``kernels``: the CUDA C source of every kernel and each kernel's launch geometry.
  Plain text and Python: imported and compile-checked without a GPU.
- ``device``: the kernels compiled through CuPy and called with arrays (imports CuPy).
- ``weights``: a stage's weights uploaded in their device format.
- ``ops``: the array operations of ``model.Stage``'s one block on the device (products,
  norms, activations, embedding, attention), each a kernel launch or a few.
- ``graphs``: how a stage runs its forwards there: one stream, fixed input buffers, and
  the CUDA graph of the same block replayed per decode/verify shape.

Every kernel has a NumPy reference (:mod:`meshnode.engine.ops` or ``formats``); the tests
in ``tests/engine/test_gpu*.py`` compare them on a device, ``test_ops_emulated.py`` on the
CPU by compiling the same source with a C++ compiler and running each thread block on
threads; ``test_ops_cuda_*.py`` run the backend's forward on the CPU with each kernel
replaced by its reference.
"""
