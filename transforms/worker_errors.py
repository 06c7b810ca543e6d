"""Failures inside workers (Spark executors, Beam workers), reported without their text.

A worker's exception message can quote what it was processing (a value, a row of the input), and runners print
it: Spark's executors log it (log4j, to the driver's stderr in local mode and to each worker's log on a cluster)
and chain it into the driver's exception; Beam's runners do the same. So every function the engines hand their
workers is wrapped by `public_failures`: an exception leaving it names only the step and the exception's type.

Privacy: a DPReleaseError's text is public by construction (it passes, without its cause or context); any other
exception is replaced by a WorkerFailed whose text is public (the step's name, the type's name) and which carries
neither the original exception nor its traceback (`from None`), so no log line or chained error a runner
prints can quote a confidential value.
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable, TypeVar

from dprelease.accounting.errors import DPReleaseError

Function = TypeVar("Function", bound=Callable)


class WorkerFailed(RuntimeError):
    """A worker's step failed; the text names the step and the original exception's type only."""


def public_failure(step: str, error: Exception) -> Exception:
    """What a worker raises in place of `error` (see the module's docstring)."""
    if isinstance(error, DPReleaseError):
        return error
    return WorkerFailed(f"{step} failed in a worker: {type(error).__name__} (its message may quote confidential "
                        "values and is not shown)")


def public_failures(step: str, function: Function) -> Function:
    """`function` (a plain function or a generator function), its exceptions replaced by `public_failure`. The
    wrapper states `function`'s signature (`__signature__`): runners read it to pass side inputs or to tell a
    grouped function's (data) from its (key, data)."""
    if inspect.isgeneratorfunction(function):
        @functools.wraps(function)
        def generator(*args, **kwargs):
            try:
                yield from function(*args, **kwargs)
            except Exception as error:  # noqa: BLE001 - nothing unvetted leaves a worker
                raise public_failure(step, error) from None
        generator.__signature__ = inspect.signature(function)  # type: ignore[attr-defined]
        return generator  # type: ignore[return-value]

    @functools.wraps(function)
    def call(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - nothing unvetted leaves a worker
            raise public_failure(step, error) from None
    call.__signature__ = inspect.signature(function)  # type: ignore[attr-defined]
    return call  # type: ignore[return-value]
