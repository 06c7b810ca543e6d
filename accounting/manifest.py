"""Pieces of the release manifest that are accounting: exact numbers and per-table records."""
from __future__ import annotations

import math
from fractions import Fraction

from .composition import MeasurementEvent, Totals
from .mechanisms import ExponentialSelection


def exact(value: Fraction) -> dict:
    """A budget as an exact fraction beside its decimal."""
    return {"fraction": str(value), "decimal": float(value)}


def read_exact(entry: dict) -> Fraction:
    return Fraction(entry["fraction"])


def measurement_record(event: MeasurementEvent) -> dict:
    """Mechanism, sensitivity, allocation, actual loss and expected error of one measurement (a selection's
    expected error depends on its candidates: the caller adds it)."""
    mechanism = event.mechanism
    if isinstance(mechanism, ExponentialSelection):
        return {
            "mechanism": {"kind": mechanism.kind, "parameter": mechanism.parameter_name,
                          "value": exact(mechanism.parameter), "selections": mechanism.selections,
                          "accounted_as": mechanism.accounted_as},
            "sensitivity": {"l1": event.sensitivity.l1, "l2_squared": event.sensitivity.l2_squared,
                            "derivation": event.sensitivity.derivation},
            "allocated": exact(event.allocated),
            "loss": exact(event.loss),
        }
    variance = mechanism.variance()
    return {
        "mechanism": {"kind": mechanism.kind, "parameter": mechanism.parameter_name,
                      "value": exact(mechanism.parameter)},
        "sensitivity": {"l1": event.sensitivity.l1, "l2_squared": event.sensitivity.l2_squared,
                        "derivation": event.sensitivity.derivation},
        "allocated": exact(event.allocated),
        "loss": exact(event.loss),
        "expected_error": {"variance": round(variance, 9), "std": round(math.sqrt(variance), 9),
                           "margin_95": mechanism.margin_95()},
    }


def totals_record(totals: Totals) -> dict:
    record: dict = {"definition": totals.definition, "allocated_sum": exact(totals.allocated_sum)}
    if totals.pure_epsilon is not None:
        record["epsilon"] = exact(totals.pure_epsilon)
    if totals.rho is not None:
        record["rho"] = exact(totals.rho)
        record["epsilon_at_delta"] = totals.epsilon_at_delta
        record["delta"] = totals.delta
    return record
