"""Transport: mutual-TLS streams, the framing loop around the sans-IO codec, discovery, and
the HTTP server's plumbing (hypercorn, and the guard in front of every route).

Imports ``meshnode_protocol`` and ``meshnode.errors`` only (plus trio, ssl, cryptography,
zeroconf, hypercorn and starlette's ASGI types).
"""
