"""The one function that renders a location (a path, a URI, a database URL, an option's value) into text a
message, a log line, a console or a manifest may show.

Confidentiality: a location can carry a secret in its user info (`postgresql://user:PASSWORD@host/db`,
`abfs://account:TOKEN@container/x`), in its query (`?password=`, `?pass%77ord=` that SQLAlchemy decodes to
`password`, presigned `X-Amz-Signature=`, `access_token=`) or in its fragment. A denylist of secret-looking
names cannot be complete, so nothing of them is ever shown: `shown` keeps the scheme, the host and the path,
hides everything up to the last '@' (SQLAlchemy accepts '/', '?', '#' and spaces unencoded in a password; all
of it lies before that '@'), and drops the query and the fragment. Control characters (terminal escape
sequences, newlines) are shown escaped, so no value can rewrite a terminal or print a line of its own.
"""
from __future__ import annotations

import re

HIDDEN = "***"
_SCHEME = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*:(?://)?)(?P<rest>.*)$", re.DOTALL)


def printable(value: object) -> str:
    """`value` as one line of text: control characters (escape sequences and newlines included) shown escaped."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in str(value))


def shown(location: object) -> str:
    """A path, URI or URL as a message may show it: user info hidden, no query or fragment, printable.
    Text without a scheme (a local path) is shown as it is, escaped; a scheme-like prefix of a Windows drive
    (`C:`) is taken as part of a path."""
    text = str(location)
    match = _SCHEME.match(text)
    if match is None or len(match["scheme"]) <= 2:
        return printable(text)
    rest = match["rest"]
    if "@" in rest:
        rest = f"{HIDDEN}@{rest[rest.rindex('@') + 1:]}"
    rest = re.split(r"[?#]", rest, maxsplit=1)[0]
    return printable(match["scheme"] + rest)
