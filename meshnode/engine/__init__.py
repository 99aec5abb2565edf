"""Array math for one pipeline stage: config, weights, KV cache, forward, sampling.

No sockets, no async. The array backend (NumPy or CuPy) is chosen once in
``meshnode.engine.backend``; code above the engine never imports numpy/cupy for math.
"""
