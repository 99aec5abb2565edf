"""Imports every command module so that each registers its commands on ``app``."""

from meshnode.cli import generate, mesh, package

__all__ = ["generate", "mesh", "package"]
