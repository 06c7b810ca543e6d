"""The checks of every argument an entry point takes, with one message each: the parameter, the value and what
is allowed (SpecError, exit 2). The Python API applies them; the CLI, a shell over the API, inherits them."""
from __future__ import annotations

from pathlib import Path

from dprelease.accounting.errors import SpecError
from dprelease.accounting.redact import printable, shown


def _brief(value: object) -> str:
    """A value as a message shows it: a location without user info, query or control characters (`shown`)."""
    text = repr(shown(value)) if isinstance(value, str) else printable(repr(value))
    return text if len(text) <= 80 else text[:77] + "..."


def flag(value: object, name: str) -> bool:
    """A true/false option: exactly a bool (the text 'no' is no false)."""
    if not isinstance(value, bool):
        raise SpecError(f"{name} = {_brief(value)}: allowed: True or False")
    return value


def count(value: object, name: str, least: int = 1, most: int | None = None, optional: bool = True) -> int | None:
    """A whole number in [least, most] (an int, never a bool, a float or text), or None when `optional`."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < least or (most is not None and value > most):
        allowed = f"a whole number from {least:,}" + (f" to {most:,}" if most is not None else "")
        raise SpecError(f"{name} = {_brief(value)}: allowed: {allowed}" + (" or None" if optional else ""))
    return value


def number(value: object, name: str, least: float, most: float | None = None) -> float:
    """A real number in [least, most] (int or float, never a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value < least \
            or (most is not None and value > most):
        allowed = f"a number from {least:g}" + (f" to {most:g}" if most is not None else "")
        raise SpecError(f"{name} = {_brief(value)}: allowed: {allowed}")
    return float(value)


def path(value: object, name: str, optional: bool = True) -> Path | None:
    """A local path (str or Path, not empty, no NUL), or None when `optional`."""
    if value is None and optional:
        return None
    if not isinstance(value, (str, Path)) or not str(value) or "\0" in str(value):
        raise SpecError(f"{name} = {_brief(value)}: allowed: a path (str or pathlib.Path)")
    return Path(value)


def location(value: object, name: str, optional: bool = True) -> str | Path | None:
    """A local path or an object-store URI (text): a URI stays text, anything else becomes a Path."""
    from .storage import is_uri

    if value is None and optional:
        return None
    if isinstance(value, str) and is_uri(value):
        if "\0" in value:
            raise SpecError(f"{name} = {shown(value)!r}: not a URI")
        return value
    if isinstance(value, str) and value.startswith("file://"):
        from .storage import local_path

        return path(local_path(value), name, optional=False)
    return path(value, name, optional=False)


def choice(value: object, name: str, allowed: tuple[str, ...], optional: bool = True) -> str | None:
    """One of `allowed` (text), or None when `optional`."""
    if value is None and optional:
        return None
    if not isinstance(value, str) or value not in allowed:
        raise SpecError(f"{name} = {_brief(value)}: allowed: {', '.join(allowed)}")
    return value


def texts(value: object, name: str) -> list[str]:
    """A list (or tuple) of text items, e.g. Beam pipeline options."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)) or not all(isinstance(item, str) for item in value):
        raise SpecError(f"{name} = {_brief(value)}: allowed: a list of text items")
    return list(value)


def text(value: object, name: str, optional: bool = True) -> str | None:
    """A line of printable text (a master URL, a runner name), or None when `optional`."""
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value or not value.isprintable() or len(value) > 4096:
        raise SpecError(f"{name} = {_brief(value)}: allowed: a line of text")
    return value
