"""The daemon's state: membership, planner (pure), coordinator, stage host.

Imports ``meshnode.engine``, ``meshnode.net`` and ``meshnode_packaging``.
"""
