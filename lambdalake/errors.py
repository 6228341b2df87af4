"""Errors a user sees: each names what went wrong and the fix."""

from __future__ import annotations


class LambdalakeError(Exception):
    """An error to show the user as is, with the fix, instead of a traceback.

    Args:
        message: What went wrong, naming the record, service or file involved.
        fix: What the user can do about it.
    """

    def __init__(self, message: str, *, fix: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix

    def __str__(self) -> str:
        return f"{self.message}\n  fix: {self.fix}" if self.fix else self.message


class ServiceUnavailable(LambdalakeError):
    """A broker, registry or Cassandra cluster could not be reached."""


class ConfigurationError(LambdalakeError):
    """A pipeline file, schema or setting is invalid."""


class NothingToCover(ConfigurationError):
    """A batch cannot run yet: no master dataset, no files, or no epoch archived whole."""
