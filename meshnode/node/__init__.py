"""The daemon: sessions, membership, planner (pure), coordinator (its decisions pure, in
``decisions``) and the host role, worker, stage runner, pipelines; settings (one table,
``settings``) and their layers (``config``).

Imports ``meshnode.engine`` (the stage, sampling records, activations as the wire carries
them), ``meshnode.speculative`` (the last stage's decision), ``meshnode.net``,
``meshnode.errors``, ``meshnode_packaging`` and ``meshnode_protocol``. Never
``meshnode.serve``: the host's API is handed in as a :class:`~meshnode.node.host.Frontend`
by ``meshnode.cli.join``. No array math here: the package does not import NumPy.
"""
