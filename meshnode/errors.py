"""meshnode's exception tree (errors the daemon raises on purpose).

    MeshnodeError
    ├── ConfigError      bad configuration or flags (the CLI prints it and exits 2)
    ├── PlanError        the model cannot be placed on the live nodes
    └── RunError         a stage failed during Claim/Prepare/Load or while serving

Codec errors live in ``meshnode_protocol`` (``RemoteProtocolError``/``LocalProtocolError``)
and package errors in ``meshnode_packaging``; they are mapped at the boundary that catches them.
"""


class MeshnodeError(Exception):
    """Base of every error meshnode raises on purpose."""


class ConfigError(MeshnodeError, ValueError):
    """An unknown key, a value of the wrong type, or an inconsistent combination."""


class PlanError(MeshnodeError):
    """No placement of the model's layers fits the live nodes."""


class RunError(MeshnodeError):
    """A run could not be brought up, or a stage failed while serving."""
