"""Exception types shared by the package.

Where torch's FSDP2 raises another type for the same mistake, fullshard raises
a class that is both: code written for FSDP2 catches it, and so does code that
catches this package's documented type.
"""

from __future__ import annotations


class UsageError(ValueError, AssertionError):
    """Misuse that torch's FSDP2 reports with ``AssertionError``.

    Both a ``ValueError`` (what misuse raises in this package) and an
    ``AssertionError`` (what code written for FSDP2 may catch).
    """


class AlreadyShardedError(UsageError):
    """``fully_shard`` was applied to a module twice."""


class UnsupportedError(ValueError, NotImplementedError):
    """A model that torch's FSDP2 rejects with ``NotImplementedError`` (also a ``ValueError``)."""


class MetaParameterError(ValueError, RuntimeError):
    """A parameter still on the meta device at the first forward (FSDP2 raises ``RuntimeError``)."""
