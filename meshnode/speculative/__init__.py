"""Speculative decoding as pure logic: proposers, window policy, acceptance, telemetry.

Imports ``meshnode.engine``, ``meshnode.errors`` and ``meshnode_packaging`` (a draft
model's source) only; does no I/O and reads no clock. The loop that drives it is the one
every request uses (``meshnode.serve.generation``; in one process,
``meshnode.serve.local.generate_tokens``). Split as in vLLM's ``spec_decode``:

- proposers (``proposer``, ``ngram``, ``auto``, ``draft``): guess the next tokens;
- scorer (``scorer``): one target forward over ``[last, d_1 … d_k]``, k + 1 rows out;
- acceptance (``acceptance``): greedy and speculative-sampling rules, pure functions;
- policy and bookkeeping (``window``, ``telemetry``, ``settings``, ``factory``).
"""
