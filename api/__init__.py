"""dprelease: differentially private statistical releases. The Python API.

    import dprelease
    release = dprelease.Release.from_yaml("spec.yaml")   # or Release.from_dict({...}, base_dir=...)
    release.plan()                                        # per table: budget and expected error (pandas)
    result = release.run(frame)                           # a path, pandas/Polars, pyarrow or Spark data
    result.table("population.county")                     # a published table with its error columns
    result.verify()

Every error is a `dprelease.DPReleaseError`; its `exit_code` is the CLI's (2 spec, 3 budget, 1 other).
"""
from dprelease.accounting.errors import (BudgetError, DPReleaseError, InputSchemaError, KeyReuseError, PublishError,
                                         SpecError, VerificationError)
from dprelease.pipelines.api import DEFAULT_LEDGER, Release, ReleaseResult, randomize_responses

__all__ = ["Release", "ReleaseResult", "randomize_responses", "DEFAULT_LEDGER", "DPReleaseError", "SpecError", "InputSchemaError",
           "BudgetError", "VerificationError", "KeyReuseError", "PublishError"]
