"""meshnode's wire protocol, sans-IO: framing, typed messages, the ``Connection`` codec.

The specification is ``protocol/README.md``; golden frames are in ``protocol/vectors/``.
"""
