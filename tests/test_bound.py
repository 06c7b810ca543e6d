"""Contribution bounding: at most k records per unit, a uniformly chosen subset, order-independent."""
from __future__ import annotations

import itertools
import os

import numpy as np
import pyarrow as pa
from scipy import stats

from dprelease.transforms.bound import bound_contributions, record_keys


def _units(n_units: int, sizes: np.ndarray) -> pa.Array:
    return pa.array(np.repeat(np.arange(n_units), sizes))


def test_keeps_at_most_k_per_unit():
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 12, 2000)
    units = _units(2000, sizes)
    keys = rng.integers(0, 50, len(units)).astype(np.uint64)
    for k in [1, 3, 7]:
        keep = bound_contributions(units, keys, k, os.urandom(32))
        kept_per_unit = np.bincount(np.asarray(units)[keep], minlength=2000)
        assert kept_per_unit.max() <= k
        assert np.array_equal(kept_per_unit, np.minimum(sizes, k))


def test_keys_made_on_demand_keep_what_every_record_s_key_keeps():
    """Keys given as a function of positions (made for the records of units over k only) keep the records the
    full key array keeps; when no unit is over k no key is made."""
    rng = np.random.default_rng(4)
    units = _units(500, rng.integers(1, 6, 500))
    codes = [rng.integers(0, 7, len(units)), rng.integers(0, 3, len(units))]
    secret, asked = os.urandom(32), []

    def keys(positions):
        asked.append(positions.size)
        return record_keys([c[positions] for c in codes], [7, 3], positions.size)

    for k in (1, 2, 4):
        whole = bound_contributions(units, record_keys(codes, [7, 3], len(units)), k, secret)
        assert np.array_equal(bound_contributions(units, keys, k, secret), whole)
    assert 0 < max(asked) < len(units)
    asked.clear()
    assert bound_contributions(units, keys, 10, secret).all() and asked == []


def test_string_units_are_grouped_exactly():
    units = pa.array(["a", "b", "a", "c", "a", "b"])
    keep = bound_contributions(units, np.arange(6, dtype=np.uint64), 1, os.urandom(32))
    assert keep.sum() == 3


def test_selection_is_uniform():
    """A unit of 5 distinct records, k = 2: each of the 10 pairs equally likely over fresh keys."""
    units = pa.array([0] * 5)
    keys = np.arange(5, dtype=np.uint64)
    pairs = {pair: 0 for pair in itertools.combinations(range(5), 2)}
    trials = 6000
    for _ in range(trials):
        kept = tuple(np.flatnonzero(bound_contributions(units, keys, 2, os.urandom(32))))
        pairs[kept] += 1
    _, p_value = stats.chisquare(list(pairs.values()))
    assert p_value > 1e-6


def test_duplicates_are_selected_uniformly():
    """Records A, A, B with k = 1: A must be kept 2/3 of the time (uniform over records)."""
    units = pa.array([0, 0, 0])
    keys = np.array([7, 7, 9], dtype=np.uint64)
    trials = 6000
    kept_a = sum(int(bound_contributions(units, keys, 1, os.urandom(32))[:2].any()) for _ in range(trials))
    assert stats.binomtest(kept_a, trials, 2 / 3).pvalue > 1e-6


def test_kept_multiset_does_not_depend_on_order():
    rng = np.random.default_rng(1)
    unit_values = rng.integers(0, 300, 5000)
    codes = [rng.integers(0, 4, 5000), rng.integers(0, 3, 5000)]
    keys = record_keys(codes, [4, 3], 5000)
    secret = os.urandom(32)
    keep = bound_contributions(pa.array(unit_values), keys, 2, secret)
    order = rng.permutation(5000)
    keep_shuffled = bound_contributions(pa.array(unit_values[order]), keys[order], 2, secret)
    before = sorted(zip(unit_values[keep], keys[keep]))
    after = sorted(zip(unit_values[order][keep_shuffled], keys[order][keep_shuffled]))
    assert before == after


def test_unit_shards_are_keyed_and_keep_a_units_records_together():
    from dprelease.transforms.bound import shard_salt, unit_shards
    from dprelease.transforms.csprng import ReleaseKey

    units = pa.array([f"person-{i % 500}" for i in range(5_000)])
    a, b = (unit_shards(units, 16, shard_salt(ReleaseKey.generate())) for _ in range(2))
    for shards in (a, b):
        assert shards.min() >= 0 and shards.max() < 16
        assert all(len(set(shards[i::500])) == 1 for i in range(500))  # every record of a unit, one shard
    assert (a != b).mean() > 0.8  # another key, another assignment (15/16 expected)
