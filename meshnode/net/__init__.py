"""Transport: mutual-TLS streams, the framing loop around the sans-IO codec, discovery.

Imports ``meshnode_protocol`` only (plus trio, ssl, cryptography, zeroconf).
"""
