"""Array math for one pipeline stage: config, weights, KV cache, forward, sampling.

No sockets, no async. The array backend (NumPy or CuPy) is chosen once in
``meshnode.engine.backend``; code above the engine never imports numpy/cupy for math.

Layering inside the package: ``config`` and ``backend`` at the bottom; ``weights`` and
``kv_cache`` on them; ``model`` (the stage forward) on those; ``sampling`` and
``tokenizer`` stand alone; ``generate`` (the prefill and decode rungs) and ``loader``
(single-node use) on top.

Imports ``meshnode.errors`` and ``meshnode_packaging`` (model sources) only.
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
