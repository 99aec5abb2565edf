"""Speculative decoding as pure logic: proposers, window policy, acceptance, telemetry.

Imports ``meshnode.engine`` only; does no I/O.
"""
