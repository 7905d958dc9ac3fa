"""The fleet's one-line error, importable without Ray (the CLI lists it among the known errors)."""

from __future__ import annotations

__all__ = ["FleetError"]


class FleetError(RuntimeError):
    """The fleet cannot run (Ray missing or unreachable, every worker dead): one clear line for the user."""
