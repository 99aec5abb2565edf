"""The stage-0 front end: OpenAI-compatible API, schemas, scheduler, the generation loop
over a pipeline, and the host's frontend (:mod:`meshnode.serve.frontend`).

Imports ``meshnode.node`` (pipelines, stage limits, config), ``meshnode.speculative``,
``meshnode.engine`` (types, tokenizer), ``meshnode.net`` (HTTP) and ``meshnode_packaging``
(to open a model's parts). Only ``meshnode.cli`` imports it.
"""
