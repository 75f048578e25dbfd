"""The two errors every ``shuffledp deploy`` step raises: a failure, and a wrong parameter (a usage error)."""

from __future__ import annotations

__all__ = ["DeployError", "DeployUsageError"]


class DeployError(RuntimeError):
    """The deployment could not be prepared, started or completed; the message says which step and why."""


class DeployUsageError(DeployError):
    """A parameter of the command is wrong (the message says which and what is allowed); nothing was started or
    written. ``shuffledp deploy`` exits 2 for it, as for an argument the parser refused, and 1 for a failure."""
