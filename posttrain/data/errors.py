"""The data layer's error type, importable by every data module (sources, formats, generated task sets)."""

from __future__ import annotations

__all__ = ["DataError"]


class DataError(ValueError):
    """A data problem: unreadable/malformed source, empty data set, missing field."""
