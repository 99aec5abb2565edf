"""The stage-0 front end: OpenAI-compatible API, schemas, scheduler, and the host's
frontend (:mod:`meshnode.serve.frontend`), which runs each request's generation loop
(``meshnode.generation``) over a pipeline.

Imports ``meshnode.generation``, ``meshnode.node`` (pipelines, stage limits, config, the
host role's ``Frontend``), ``meshnode.speculative``, ``meshnode.engine`` (types, tokenizer,
and model sources opened through ``engine.loader``), ``meshnode.net`` (HTTP) and
``meshnode.errors``; not ``meshnode_packaging`` directly. Only ``meshnode.cli`` imports it.
"""
