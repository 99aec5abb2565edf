"""The generation loop of one request, with no HTTP: a pure state machine over committed
tokens and text (:mod:`~meshnode.generation.state`, stop strings in
:mod:`~meshnode.generation.stops`), and the async driver that runs it over a pipeline
(:mod:`~meshnode.generation.driver`), replaying a request on a new pipeline when a stage
is lost (:mod:`~meshnode.generation.replay`).

The API (``meshnode.serve``), ``meshnode generate`` (``meshnode.cli``), the benchmarks and
the tests drive it alike. Imports ``meshnode.node`` (the pipeline and its records),
``meshnode.speculative`` (proposers, the window, telemetry) and ``meshnode.engine``
(sampling records and the recurrent state's rollback error); never ``meshnode.serve``.
"""
