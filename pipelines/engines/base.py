"""The engine interface: what an engine must do, and nothing about how.

An engine turns the input into one noisy count vector per planned table:
encode -> bound contributions -> aggregate over the public domain -> add noise.
True counts never leave the engine. Post-processing and writing are engine-neutral: the driver runs
them (`pipelines.postprocessing`, `pipelines.release`) or, for a release whose tables form a tree of
units, a distributed engine runs the same kernels in its workers (`release_parts`, `pipelines.dataflow`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from dprelease.transforms.csprng import ReleaseKey

from ..plan import Plan
from ..source import InputSource

if TYPE_CHECKING:
    from ..layout import Layout
    from ..validation import ValidationOutcome

ProgressHook = Callable[[str, int, int], None]
"""progress(stage, done, total): called with public quantities only (files, tables, cell chunks)."""


def no_progress(stage: str, done: int, total: int) -> None:
    return None


def kept_records_signature(plan: Plan, source: InputSource, key: ReleaseKey) -> tuple:
    """What the bounded records a selection keeps between passes depend on: the input, the bounding subkey and the
    encoded columns (bounding is keyed by the key and the codes of every encoded column). A pass whose signature
    differs must bound afresh."""
    return id(source), key.derive("dprelease/bound"), tuple(plan.encoded_columns())


def checked_scores(found: dict[str, tuple[int, int]], expected_ranges: dict[str, int], what: str) -> dict[str, int]:
    """Each candidate's score from `found` (name -> (score, ranges scored)), once every one of its ranges was
    scored (a count of public ranges, so the message is public); DPReleaseError naming the table and `what`
    scored it (the Spark job, the Beam pipeline) otherwise."""
    from dprelease.accounting.errors import DPReleaseError

    scores = {}
    for name, expected in expected_ranges.items():
        score, ranges = found.get(name, (0, 0))
        if ranges != expected:
            raise DPReleaseError(f"table {name}: {what} scored {ranges} of its {expected} ranges")
        scores[name] = int(score)
    return scores


class Engine(ABC):
    name: str

    @abstractmethod
    def noisy_measurements(
        self, plan: Plan, source: InputSource, key: ReleaseKey, progress: ProgressHook = no_progress
    ) -> dict[str, np.ndarray]:
        """One int64 noisy count vector per table of `plan`, in the table's cell order.

        Privacy: the result must be exactly counts(bounded input) + noise(key, table, cell).
        """

    scores_candidates: bool = False
    """Whether the engine scores the candidate tables of a selection (`score_candidates`)."""

    def score_candidates(self, plan: Plan, counting: list, one_way: list, estimates, source: InputSource,
                         key: ReleaseKey, progress: ProgressHook = no_progress) -> dict[str, int]:
        """For the selection stage (`pipelines.selection`) only: the records bounded as for `counting` (the
        plan's tables and the selections' candidates), the `one_way` tables released (the values the release
        will publish), `estimates(noisy one-way values by name)` -> each candidate's (totals, share_a, share_b)
        (post-processing), and each candidate's score, `transforms.mst.range_score` summed over its cells.
        Private: the scores feed the exponential mechanism and nothing else; no true count leaves the worker
        that holds it."""
        raise NotImplementedError(f"the {self.name} engine does not score candidate tables")

    writes_parts: bool = False
    """Whether the engine runs the post-processing and writing stages of a tree of units in its workers
    (`release_parts`); else the driver post-processes the noisy vectors (`pipelines.postprocessing`)."""

    def release_parts(self, plan: Plan, source: InputSource, key: ReleaseKey, staging: Path | str,
                      staging_token: str, layout: "Layout",
                      progress: ProgressHook = no_progress) -> tuple[list[dict], dict]:
        """Noise, post-processing and every table part written into `staging` by the workers
        (`pipelines.dataflow`): a directory every worker reaches, or the URI of the run's staging prefix in the
        release's store (`storage.staging`). Each worker first checks that it holds `staging_token` (it is the
        driver's, so nothing is written where the driver could not check and remove it); returns (file
        entries, variance summaries), all the driver receives.

        Privacy: the same bytes as the embedded engine's release: noise(key, table, cell) on the bounded
        counts, then post-processing of the noisy values only."""
        raise NotImplementedError(f"the {self.name} engine post-processes on the driver")

    copies_parts: bool = False
    """Whether the engine's workers copy the parts staged in a store into the release and read them back
    (`copy_parts`: Spark's and Beam's); else the driver does (`storage.upload_release`), every byte read through
    it."""

    def copy_parts(self, release_uri: str, release_path: str, parts: Sequence[tuple[str, str, str]]
                   ) -> list[tuple[str, str]]:
        """Each staged part (its path in the store, its name in the release, its writer's SHA-256) copied inside
        the store into the release at `release_uri` (whose path in the store is `release_path`: the workers copy
        nothing where it opens elsewhere) and read back by the workers (`storage.copy_checked`):
        (name, SHA-256 of the copy) for each, which the driver checks. Public: names and digests of noisy values
        the release publishes."""
        raise NotImplementedError(f"the {self.name} engine's driver copies the staged parts")

    def close(self) -> None:
        """Release what the engine started for this run (a run calls it once, whatever the outcome)."""

    def temp_inside(self, release_uri: str) -> bool:
        """Whether the engine's own location for the run's confidential files (key files, noisy values, kept
        records) lies in the release's prefix `release_uri` (a store URI without options), where they would be
        uploaded with it: the run refuses that before anything is charged. None but Beam's store --temp_location
        can."""
        return False

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
