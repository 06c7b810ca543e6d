"""The engine interface: what an engine must do, and nothing about how.

An engine turns the input into one noisy count vector per planned table:
encode -> bound contributions -> aggregate over the public domain -> add noise.
True counts never leave the engine. Post-processing and writing are engine-neutral
and happen in `dprelease.pipelines.release`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Callable

import numpy as np

from dprelease.transforms.csprng import ReleaseKey

from ..plan import Plan
from ..source import InputSource

if TYPE_CHECKING:
    from ..validation import ValidationOutcome

ProgressHook = Callable[[str, int, int], None]
"""progress(stage, done, total): called with public quantities only (files, tables, cell chunks)."""


def no_progress(stage: str, done: int, total: int) -> None:
    return None


class Engine(ABC):
    name: str

    @abstractmethod
    def noisy_measurements(
        self, plan: Plan, source: InputSource, key: ReleaseKey, progress: ProgressHook = no_progress
    ) -> dict[str, np.ndarray]:
        """One int64 noisy count vector per table of `plan`, in the table's cell order.

        Privacy: the result must be exactly counts(bounded input) + noise(key, table, cell).
        """

    def check_input_schema(self, source: InputSource) -> None:
        """Refuse (InputSchemaError, exit 2) input column types this engine cannot read; called before any
        budget is reserved. Privacy: looks at file schemas only (public), never at values."""

    def validate_input(self, plan: Plan, source: InputSource, runner) -> "ValidationOutcome":
        """Run the value-level expectations over every record (default: pandas batches).

        Privacy: the outcome is confidential; the caller writes it to the internal directory only.
        """
        import pyarrow as pa

        from ..validation import VALIDATION_ROWS, ValidationOutcome, value_frame

        outcome = ValidationOutcome(runner.expectations)
        for path in source.files():  # batches merge within a file (one schema), up to VALIDATION_ROWS
            pending: list = []
            for batch in source.batches(path):
                pending.append(batch)
                if sum(b.num_rows for b in pending) >= VALIDATION_ROWS:
                    outcome.add(runner.validate(value_frame(pa.Table.from_batches(pending), plan), "value"))
                    pending = []
            if pending:
                outcome.add(runner.validate(value_frame(pa.Table.from_batches(pending), plan), "value"))
        return outcome
