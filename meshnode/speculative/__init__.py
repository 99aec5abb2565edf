"""Speculative decoding as pure logic: proposers, window policy, acceptance, telemetry.

Imports ``meshnode.engine``, ``meshnode.errors`` and ``meshnode_packaging`` (a draft
model's source, a package's speculative block) only, and NumPy for the acceptance math
over probability rows; does no I/O and reads no clock. The loop that drives it is the one
every request uses (``meshnode.generation.driver``; in one process,
``meshnode.serve.local.generate_tokens``). Split as in vLLM's ``spec_decode``:

- proposers (``proposer``, ``ngram``, ``auto``, ``draft``): guess the next tokens;
- scorer (``scorer``): one target forward over ``[last, d_1 … d_k]``, k + 1 rows out;
- acceptance (``acceptance``): greedy and speculative-sampling rules, pure functions;
- decision (``decide``): what the last stage commits for a frame's rows (one sampled
  token, or the acceptance rule over a verify pass) and their log-probabilities;
- policy and bookkeeping (``window``, ``telemetry``, ``settings``, ``factory``).
"""
