"""The one exception hierarchy of dprelease, with the CLI exit code of each class."""
from __future__ import annotations


class DPReleaseError(Exception):
    """Base class of every error dprelease raises on purpose. Exit code 1."""

    exit_code = 1


class SpecError(DPReleaseError):
    """The release spec, a public file it names, or the CLI arguments are invalid. Exit code 2.

    Holds one message per invalid field; each names the field path, the value
    and what is allowed. Such errors depend on public things only.
    """

    exit_code = 2

    def __init__(self, messages: list[str] | str):
        self.messages = [messages] if isinstance(messages, str) else list(messages)
        super().__init__("\n".join(self.messages))


class InputSchemaError(SpecError):
    """The input's schema (column names/types, a public property) does not match the spec."""


class BudgetError(DPReleaseError):
    """A budget would be exceeded or is inconsistent. Exit code 3."""

    exit_code = 3


class VerificationError(DPReleaseError):
    """A published release does not match its manifest. Exit code 1."""


class KeyReuseError(SpecError):
    """A release key is already bound (in the ledger) to another release, spec or input. Exit code 2."""


class PublishError(DPReleaseError):
    """The release was charged in the ledger but could not be renamed into place. Exit code 1."""
