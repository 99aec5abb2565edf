"""The stage-0 front end: OpenAI-compatible API, scheduler, generation loop.

Imports ``meshnode.node`` and ``meshnode.speculative``.
"""
