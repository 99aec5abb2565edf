"""Array math for one pipeline stage: config, weights, KV cache, forward, sampling.

No sockets, no async. The array backend (NumPy or CuPy) is chosen once in
``meshnode.engine.backend``; code above the engine never imports numpy/cupy for math.

Layering inside the package: ``config``, ``kv_cache``, ``runner``, ``cpu`` (block
kernels) at the bottom; ``weights`` (the CPU layout and its loader) and ``attention`` on
them; ``cuda`` (the device formats, kernels, weights, operations and CUDA graphs) on
those; ``backend`` (the :class:`Backend` strategies, ``CpuBackend`` and ``CudaBackend``,
which own weight loading and every array operation of the block) on both; ``model`` (the
one decoder block for every layer kind, with the hybrid's token mixers and the MTP head
beside it) on ``backend``; ``moe_config`` (which layers route to experts, and how) beside
``config``, ``moe_weights`` (the router and each expert's matrices, views of the file's
blocks) on ``cpu``, and ``moe`` (the routed feed-forward, through the backend's products)
under ``model``; ``sampling`` and ``tokenizer`` stand alone; ``generate`` (the
prefill and decode rungs) and ``loader`` (single-node use) on top.

Imports ``meshnode.errors`` and ``meshnode_packaging`` (model sources) only, plus NumPy,
numba (the CPU block kernels) and, on a CUDA backend, CuPy. ``tests/test_structure.py``
checks every package's imports against DESIGN §1's layering.
"""

from meshnode.engine.backend import Backend, BackendError, select_backend
from meshnode.engine.config import ModelConfig, ModelConfigError
from meshnode.engine.kv_cache import KVCache
from meshnode.engine.model import Stage
from meshnode.engine.sampling import Sampler, SamplingParams, logits_to_probs

__all__ = [
    "Backend",
    "BackendError",
    "KVCache",
    "ModelConfig",
    "ModelConfigError",
    "Sampler",
    "SamplingParams",
    "Stage",
    "logits_to_probs",
    "select_backend",
]
