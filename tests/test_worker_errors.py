"""What a worker's failure carries out of it: the step and the exception's type, never the exception's text
(runners log it and chain it into the driver's error); a DPReleaseError's public text passes."""
from __future__ import annotations

import traceback

import pytest

from dprelease.accounting.errors import DPReleaseError
from dprelease.transforms.worker_errors import WorkerFailed, public_failures

SECRET = "value-4711-confidential"


def _printed(error: BaseException) -> str:
    return "".join(traceback.format_exception(error))


def _fails(value):
    raise ValueError(f"could not parse {value!r}")


def _yields_then_fails(values):
    yield 1
    raise KeyError(values[0])


def test_a_function_failure_names_the_step_and_type_only():
    with pytest.raises(WorkerFailed) as raised:
        public_failures("encode", _fails)(SECRET)
    printed = _printed(raised.value)
    assert "encode failed in a worker: ValueError" in printed
    assert SECRET not in printed and raised.value.__cause__ is None and raised.value.__suppress_context__


def test_a_generator_failure_names_the_step_and_type_only():
    wrapped = public_failures("count", _yields_then_fails)
    produced = wrapped([SECRET])
    assert next(produced) == 1  # still a generator: the runner pulls its batches one by one
    with pytest.raises(WorkerFailed) as raised:
        next(produced)
    assert "count failed in a worker: KeyError" in _printed(raised.value) and SECRET not in _printed(raised.value)


def test_a_public_error_passes_without_its_cause():
    def fails():
        try:
            raise ValueError(SECRET)
        except ValueError as error:
            raise DPReleaseError("an input file changed") from error

    with pytest.raises(DPReleaseError, match="an input file changed") as raised:
        public_failures("read", fails)()
    assert SECRET not in _printed(raised.value)


def test_the_wrapper_keeps_the_signature_runners_inspect():
    import inspect

    def process(element, key, steps=3):
        return element

    assert inspect.signature(public_failures("noise", process)) == inspect.signature(process)
    assert inspect.getfullargspec(public_failures("noise", process)) == inspect.getfullargspec(process)  # pyspark's
