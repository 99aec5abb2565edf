"""The daemon: sessions, membership, planner (pure), coordinator and the host role, worker,
stage runner, pipelines.

Imports ``meshnode.engine``, ``meshnode.speculative`` (the acceptance rules the last stage
applies), ``meshnode.net``, ``meshnode_packaging`` and ``meshnode_protocol``. Never
``meshnode.serve``: the host's API is handed in as a :class:`~meshnode.node.host.Frontend`
by ``meshnode.cli.join``.
"""
