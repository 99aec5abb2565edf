"""Transport: mutual-TLS streams, the framing loop around the sans-IO codec, discovery.

Imports ``meshnode_protocol`` and ``meshnode.errors`` only (plus trio, ssl, cryptography,
zeroconf).
"""
