"""meshnode: one large language model across the machines you already have.

Packages by role; dependencies point one way, lower never imports higher:

- ``meshnode.engine``: array math only (config, weights, KV cache, layer-range forward,
  sampling, tokenizer). NumPy on CPU, CuPy on CUDA, chosen in one place.
- ``meshnode.speculative``: speculative decoding as pure logic (proposers, windows, acceptance).
- ``meshnode.net``: transport (TLS streams, framing around ``meshnode_protocol``, discovery).
- ``meshnode.node``: the daemon's state (membership, planner, coordinator, stage host).
- ``meshnode.serve``: the stage-0 front end (OpenAI API, scheduler, generation loop).
- ``meshnode.cli``: the typer app; builds a config object and calls one ``run(config)``.

The sibling distributions ``meshnode_protocol`` (wire codec) and ``meshnode_packaging``
(layer packages, model sources) sit below all of these.
"""

__version__ = "0.2.0"
