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

__all__ = ["Release", "ReleaseResult", "randomize_responses", "DEFAULT_LEDGER", "DPReleaseError", "SpecError", "InputSchemaError",
           "BudgetError", "VerificationError", "KeyReuseError", "PublishError"]

_API = ("Release", "ReleaseResult", "randomize_responses", "DEFAULT_LEDGER")


def __getattr__(name: str):
    """The API's classes, imported on first use: a worker process (Spark, Beam, the embedded engine's) that imports
    one engine module for the functions it runs does not import the API's ledger, pandas and the rest."""
    if name in _API:
        from dprelease.pipelines import api

        return getattr(api, name)
    raise AttributeError(f"module 'dprelease' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
