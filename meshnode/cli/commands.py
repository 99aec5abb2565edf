"""Imports every command module so that each registers its commands on ``app``."""

from meshnode.cli import generate  # noqa: F401
from meshnode.cli import mesh  # noqa: F401
from meshnode.cli import package  # noqa: F401
