"""Redaction of secrets from text that may reach a manifest, a log or a console.

Privacy/confidentiality: a published manifest records the command line (provenance); a database URL
on it (`--ledger postgresql+psycopg://user:PASSWORD@host/db`) must not publish the password.
"""
from __future__ import annotations

import re

_URL_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/?#@\s]*)@")
_SECRET_QUERY = re.compile(r"(?i)(?P<name>[?&;](?:password|passwd|pwd|secret|token|key|sslpassword)=)[^&;#\s]*")
REDACTED = "***"


def redact_url(text: str) -> str:
    """`text` with the user-info of every URL in it (user:password@) and secret-looking query parameters
    (password=, token=, ...) replaced by ***; the scheme, host and path stay readable."""
    text = _URL_CREDENTIALS.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", text)
    return _SECRET_QUERY.sub(lambda m: f"{m.group('name')}{REDACTED}", text)


def redact_command_line(arguments: list[str]) -> list[str]:
    """A command line fit for publication: credentials in every argument redacted."""
    return [redact_url(str(argument)) for argument in arguments]
