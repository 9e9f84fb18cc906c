"""Exception types shared by the package."""

from __future__ import annotations


class UsageError(ValueError, AssertionError):
    """Misuse that torch's FSDP2 reports with ``AssertionError``.

    Both a ``ValueError`` (what misuse raises in this package) and an
    ``AssertionError`` (what code written for FSDP2 may catch).
    """


class AlreadyShardedError(UsageError):
    """``fully_shard`` was applied to a module twice."""
