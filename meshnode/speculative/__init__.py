"""Speculative decoding as pure logic: proposers, window policy, acceptance, telemetry.

Imports ``meshnode.engine``, ``meshnode.errors`` and ``meshnode_packaging`` (a draft
model's source) only; does no I/O and reads no clock except in the
single-node driver (``generate``), which takes the clock as a parameter. Split as in
vLLM's ``spec_decode``:

- proposers (``proposer``, ``ngram``, ``auto``, ``draft``): guess the next tokens;
- scorer (``scorer``): one target forward over ``[last, d_1 … d_k]``, k + 1 rows out;
- acceptance (``acceptance``): greedy and speculative-sampling rules, pure functions;
- policy and bookkeeping (``window``, ``telemetry``, ``settings``, ``factory``);
- ``generate``: the single-node ladder prefill → propose → verify → accept.
"""
