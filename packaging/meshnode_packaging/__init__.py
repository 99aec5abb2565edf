"""meshnode layer packages: model sources, the package format, writer, validator, fetcher.

Needs no trio and no CuPy, so that a publisher can split and check a model on any CPU box.
The format's specification is ``packaging/README.md``.
"""
