"""Segment arithmetic on sorted keys, shared by bounding and post-processing."""
from __future__ import annotations

import numpy as np


def run_positions(*sorted_keys: np.ndarray) -> np.ndarray:
    """Position (0, 1, ...) of each element within its run of equal keys, the arrays being
    sorted together (lexicographically) so that equal key tuples are adjacent."""
    n = sorted_keys[0].size
    starts = np.ones(n, dtype=bool)
    if n:
        starts[1:] = False
        for keys in sorted_keys:
            starts[1:] |= keys[1:] != keys[:-1]
    index = np.arange(n)
    return index - np.maximum.accumulate(np.where(starts, index, 0))
