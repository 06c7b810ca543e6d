"""The C kernels of encoding (`transforms/_encoding.c`), counting (`transforms/_counting.c`) and the joint fit
(`transforms/_joint.c`) against plain numpy references: the same codes and counts exactly, the same fit to
rounding, each unit's fit the same bits in any batch, and every out-of-domain input refused with an error that
names no value."""
from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest

from dprelease.transforms import _counting, _encoding, _joint, encode
from dprelease.transforms.domains import CategoricalDomain, IntegerDomain, MeasureDomain
from dprelease.transforms.encode import ColumnEncoder
from dprelease.transforms.aggregate import TableLayout, quantile_buckets
from dprelease.transforms.units import joint as joint_fit

# ---- counting -----------------------------------------------------------------------------------------------------


def _layout_and_codes(rng, rows, dtypes, sizes, lookup_size, statistic, measured):
    """A table over len(sizes) columns (the first through a lookup of `lookup_size` codes when given) and random
    codes of `dtypes`; a measure of 40 values (code 40: no value) for `statistic`."""
    columns = tuple(f"c{i}" for i in range(len(sizes)))
    lookups = tuple(rng.integers(0, sizes[0], lookup_size) if i == 0 and lookup_size else None
                    for i in range(len(sizes)))
    codes = {c: rng.integers(0, lookup_size if lookups[i] is not None else sizes[i], rows).astype(dtypes[i])
             for i, c in enumerate(columns)}
    layout = TableLayout("t", columns, lookups, tuple(sizes), statistic=statistic,
                         measure="m" if measured else None, lower=-7, invalid=40,
                         candidates=(-7, 0, 3, 20) if statistic == "quantile" else ())
    codes["m"] = rng.integers(0, 41, rows).astype(np.int16)
    return layout, codes


def _reference(layout, codes, rows):
    index = np.zeros(rows, dtype=np.int64)
    for column, lookup, size in zip(layout.columns, layout.lookups, layout.sizes):
        values = codes[column].astype(np.int64)
        index = index * size + (values if lookup is None else lookup[values])
    if layout.measure is None:
        return np.bincount(index, minlength=layout.n_cells)
    values = codes["m"].astype(np.int64)
    valid = values != layout.invalid
    if layout.statistic == "count":
        return np.bincount(index[valid], minlength=layout.n_cells)
    if layout.statistic == "sum":
        sums = np.zeros(layout.n_cells, dtype=np.int64)
        np.add.at(sums, index[valid], values[valid] + layout.lower)
        return sums
    buckets = quantile_buckets(layout.candidates, values[valid] + layout.lower)
    return np.bincount(index[valid] * layout.buckets + buckets, minlength=layout.n_measured)


@pytest.mark.parametrize("rows", [0, 1, 3, 4095, 4096, 4097, 20011])
@pytest.mark.parametrize("statistic, measured", [("count", False), ("count", True), ("sum", True),
                                                 ("quantile", True)])
@pytest.mark.parametrize("shape", ["small", "large", "total"])
def test_the_counting_kernel_counts_what_numpy_counts(rows, statistic, measured, shape):
    """Every kind (count, a measure's count, sum, quantile) over int8/int16/int32 codes, with a lookup, on a table
    small enough for the interleaved copies and on one too large for them, and a total (no column), across the
    kernel's block boundaries."""
    rng = np.random.default_rng(rows + 7 * len(statistic) + len(shape))
    sizes, dtypes, lookup = {"small": ((5, 3), (np.int8, np.int16), 0),
                             "large": ((300, 22, 3), (np.int32, np.int8, np.int16), 1000),
                             "total": ((), (), 0)}[shape]
    layout, codes = _layout_and_codes(rng, rows, dtypes, sizes, lookup, statistic, measured)
    found = layout.measure_vector(codes, rows)
    assert found.dtype == np.int64 and found.tolist() == _reference(layout, codes, rows).tolist()


def test_a_total_with_no_column_counts_every_record():
    layout = TableLayout("all", (), (), ())
    assert layout.measure_vector({}, 9).tolist() == [9]


@pytest.mark.parametrize("case", ["negative code", "code past its size", "code past the lookup",
                                  "looked-up code past its size", "measure past its no-value code",
                                  "negative measure"])
def test_an_out_of_domain_code_is_refused_naming_no_value(case):
    """An encoder's bug, never a data value: the count stops, and its message holds no code."""
    rng = np.random.default_rng(1)
    rows = 5000
    lookup = np.arange(10) % 4
    codes = {"a": rng.integers(0, 10, rows).astype(np.int32), "b": rng.integers(0, 3, rows).astype(np.int8),
             "m": rng.integers(0, 41, rows).astype(np.int16)}
    statistic = "sum" if "measure" in case else "count"
    if case == "looked-up code past its size":
        lookup = lookup.copy()
        lookup[7] = 4
    layout = TableLayout("t", ("a", "b"), (lookup, None), (4, 3), statistic=statistic,
                         measure="m" if statistic == "sum" else None, invalid=40)
    position = 4321
    if case == "negative code":
        codes["b"][position] = -1
    elif case == "code past its size":
        codes["b"][position] = 3
    elif case == "code past the lookup":
        codes["a"][position] = 10
    elif case == "looked-up code past its size":
        codes["a"][position] = 7
    elif case == "measure past its no-value code":
        codes["m"][position] = 41
    else:
        codes["m"][position] = -5
    with pytest.raises(ValueError) as raised:
        layout.measure_vector(codes, rows)
    assert "(an encoding error)" in str(raised.value) and not any(ch.isdigit() for ch in str(raised.value))


def test_the_counting_kernel_refuses_inconsistent_arguments():
    out = np.zeros(6, dtype=np.int64)
    column = np.zeros(4, dtype=np.int8)
    for args in [((column,), (None,), np.array([5]), 4, out, _counting.COUNT, None, 0, 0, None),  # out too long
                 ((column,), (None,), np.array([6]), 5, out, _counting.COUNT, None, 0, 0, None),  # rows
                 ((column,), (None,), np.array([6]), 4, out, _counting.SUM, None, 0, 0, None),  # no measure
                 ((column.astype(np.int64),), (None,), np.array([6]), 4, out, _counting.COUNT, None, 0, 0, None),
                 ((column,), (None,), np.array([6]), 4, np.zeros(12, dtype=np.int64), _counting.QUANTILE, column, 3,
                  0, np.array([0, 1, 2], dtype=np.int32))]:  # a bucket past the 2 entries per cell
        with pytest.raises(ValueError):
            _counting.count(*args)


# ---- the joint fit ------------------------------------------------------------------------------------------------

def _margin(joint, sizes, axes):
    other = tuple(a for a in range(len(sizes)) if a not in axes)
    margin = joint.reshape(sizes).sum(axis=other) if other else joint.reshape(sizes)
    kept = sorted(axes)
    return np.transpose(margin, [kept.index(a) for a in axes]).ravel()


def _reference_mirror_descent(sizes, axes, noisy, variances, total, start, iterations):
    """One unit's fit as `_joint.mirror_descent` states it, in plain numpy (the specification of the kernel)."""
    cells = math.prod(sizes)
    joint = np.maximum(start, joint_fit.START_FLOOR * total / cells)
    joint = joint * (total / joint.sum() if joint.sum() > 0 else 0.0)

    def loss_and_gradients(candidate, scale):
        margins = [_margin(candidate, sizes, a) * scale for a in axes]
        loss = sum(((m - y) ** 2).sum() / v for m, y, v in zip(margins, noisy, variances))
        return loss, [2 * (m - y) / v for m, y, v in zip(margins, noisy, variances)]

    loss, gradients = loss_and_gradients(joint, 1.0)
    step = 1.0 / max(sum(np.abs(g).max() for g in gradients), 1e-12)
    scale = 1.0
    for _ in range(iterations):
        factor = np.ones(sizes)
        for a, g in zip(axes, gradients):
            e = np.clip(-step * g, -joint_fit.EXPONENT_CLIP, joint_fit.EXPONENT_CLIP)
            e = np.exp(e - e.max()).reshape([sizes[x] for x in a])
            kept = sorted(a)
            e = np.transpose(e, [a.index(x) for x in kept])
            factor = factor * e.reshape([sizes[x] if x in a else 1 for x in range(len(sizes))])
        candidate = joint * scale * factor.ravel()
        candidate_scale = total / candidate.sum() if candidate.sum() > 0 else 0.0
        candidate_loss, candidate_gradients = loss_and_gradients(candidate, candidate_scale)
        if candidate_loss <= loss and (candidate_scale > 0 or total == 0):
            joint, loss, gradients, scale = candidate, candidate_loss, candidate_gradients, candidate_scale
            step = min(step * 1.5, joint_fit.MAX_STEP)
        else:
            step /= 2.0
    return joint * scale


def _reference_ipf(sizes, axes, targets, joint, sweeps):
    joint = joint.copy()
    for _ in range(sweeps):
        for a, target in zip(axes, targets):
            current = _margin(joint, sizes, a)
            ratio = np.where(current > 0, target / np.where(current > 0, current, 1.0), 0.0)
            kept = sorted(a)
            ratio = np.transpose(ratio.reshape([sizes[x] for x in a]), [a.index(x) for x in kept])
            joint = (joint.reshape(sizes) * ratio.reshape([sizes[x] if x in a else 1
                                                           for x in range(len(sizes))])).ravel()
    return joint


SHAPES = [((4, 3, 5), ((0, 1), (2, 0), (1, 2))),        # every table holds the last axis or not: both kinds
          ((6, 2, 3, 2), ((0, 1), (0, 2), (3, 0), (1, 2), (1, 3), (2, 3))),
          ((7,), ((0,),)),
          ((3, 4), ((1,), (0,), (1, 0)))]


def _unit_problem(rng, sizes, axes, units):
    cells = math.prod(sizes)
    totals = rng.integers(0, 400, units).astype(np.float64)
    totals[1] = 0.0  # an empty unit
    truth = rng.dirichlet(np.full(cells, 0.3), units) * totals[:, None]
    noisy = [np.stack([_margin(truth[u], sizes, a) for u in range(units)]) + rng.normal(0, 3, (units, math.prod(
        sizes[x] for x in a))) for a in axes]
    start = rng.uniform(0, 2, (units, cells)) * (totals / cells)[:, None]
    start[2, : cells // 2] = 0.0  # cells at 0: raised to the floor
    return totals, noisy, start


def _kernel_fit(sizes, axes, totals, noisy, variances, start, iterations):
    shape = joint_fit.JointShape(sizes, tuple(joint_fit.JointTable("", a, v) for a, v in zip(axes, variances)))
    fitted = np.ascontiguousarray(start, dtype=np.float64).copy()
    joint_fit._mirror_descent(shape, totals, noisy, fitted, iterations)
    return fitted


@pytest.mark.parametrize("sizes, axes", SHAPES)
def test_the_mirror_descent_kernel_is_its_plain_numpy_specification(sizes, axes):
    """Step for step (20 steps: before a converged unit's kept and undone steps turn on rounding-level differences
    of its loss, where two correct implementations part), and after 300 steps the same loss to 1e-9."""
    rng = np.random.default_rng(len(sizes) * 10 + len(axes))
    units = 11
    totals, noisy, start = _unit_problem(rng, sizes, axes, units)
    variances = rng.uniform(1, 20, len(axes))
    fitted = _kernel_fit(sizes, axes, totals, noisy, variances, start, 20)
    converged = _kernel_fit(sizes, axes, totals, noisy, variances, start, 300)
    for u in range(units):
        y = [n[u] for n in noisy]
        expected = _reference_mirror_descent(sizes, axes, y, variances, totals[u], start[u], 20)
        np.testing.assert_allclose(fitted[u], expected, rtol=1e-9, atol=1e-9 * max(totals[u], 1.0))
        assert abs(fitted[u].sum() - totals[u]) <= 1e-9 * max(totals[u], 1.0) and fitted[u].min() >= 0
        reference = _reference_mirror_descent(sizes, axes, y, variances, totals[u], start[u], 300)
        losses = [sum(((_margin(j, sizes, a) - t) ** 2).sum() / v for a, t, v in zip(axes, y, variances))
                  for j in (converged[u], reference)]
        assert losses[0] == pytest.approx(losses[1], rel=1e-9)


@pytest.mark.parametrize("sizes, axes", SHAPES)
def test_the_ipf_kernel_is_its_plain_numpy_specification(sizes, axes):
    rng = np.random.default_rng(len(sizes))
    units = 9
    totals, noisy, start = _unit_problem(rng, sizes, axes, units)
    targets = [np.abs(n) for n in noisy]
    fitted = start.copy()
    shape = joint_fit._table_axes(sizes, axes)
    _joint.ipf(fitted, shape.sizes, shape.axes, shape.axis_offsets, np.concatenate(targets, axis=1), 7)
    for u in range(units):
        expected = _reference_ipf(sizes, axes, [t[u] for t in targets], start[u], 7)
        np.testing.assert_allclose(fitted[u], expected, rtol=1e-11, atol=1e-12)


def test_a_unit_s_fit_is_the_same_bits_in_any_batch():
    """Alone, in a batch of 37 (not a multiple of the kernel's lanes), in reverse order: the same bits."""
    sizes, axes = SHAPES[1]
    rng = np.random.default_rng(5)
    totals, noisy, start = _unit_problem(rng, sizes, axes, 37)
    variances = rng.uniform(1, 20, len(axes))
    batch = _kernel_fit(sizes, axes, totals, noisy, variances, start, 50)
    reverse = _kernel_fit(sizes, axes, totals[::-1].copy(), [n[::-1].copy() for n in noisy], variances,
                          start[::-1], 50)[::-1]
    assert np.array_equal(batch, reverse)
    for u in (0, 8, 17, 36):
        alone = _kernel_fit(sizes, axes, totals[u:u + 1], [n[u:u + 1] for n in noisy], variances, start[u:u + 1], 50)
        assert np.array_equal(alone[0], batch[u])


@pytest.mark.parametrize("sizes, axes", SHAPES + [((21, 2, 7, 2), tuple((a, b) for a in range(4)
                                                                         for b in range(a + 1, 4)))])
def test_the_mirror_descent_s_two_builds_give_the_same_bits(sizes, axes):
    """The AVX2 build (where this CPU runs it) and the baseline build (`portable`): the same fit, bit for bit, on
    every shape and on a country's within-county joint (every unit a different lane position)."""
    rng = np.random.default_rng(17 + len(sizes))
    units = 29
    totals, noisy, start = _unit_problem(rng, sizes, axes, units)
    variances = rng.uniform(1, 20, len(axes))
    shape = joint_fit._table_axes(sizes, axes)
    fits = []
    for portable in (False, True):
        fitted = np.ascontiguousarray(start, dtype=np.float64).copy()
        _joint.mirror_descent(fitted, shape.sizes, shape.axes, shape.axis_offsets, np.concatenate(noisy, axis=1),
                              variances, totals, 60, joint_fit.EXPONENT_CLIP, joint_fit.MAX_STEP,
                              joint_fit.START_FLOOR, portable)
        fits.append(fitted)
    assert np.array_equal(fits[0], fits[1]) and not np.array_equal(fits[0], start)


def test_the_kernels_exponential_is_within_four_ulp():
    values = -np.random.default_rng(3).uniform(0, 708, 200_000)
    values[:5] = [0.0, -708.0, -1e-300, -0.5 * math.log(2), -200.0]
    found = np.empty_like(values)
    _joint.exp(values, found)
    expected = np.array([math.exp(v) for v in values])
    assert (np.abs(found - expected) <= 4 * np.spacing(expected)).all()
    with pytest.raises(ValueError):
        _joint.exp(np.array([0.5]), np.empty(1))


def test_the_joint_kernels_refuse_inconsistent_arguments():
    shape = joint_fit._table_axes((2, 3), ((0,), (1,)))
    joint = np.ones((2, 6))
    good = dict(sizes=shape.sizes, axes=shape.axes, axis_offsets=shape.axis_offsets, noisy=np.ones((2, 5)),
                variances=np.ones(2), totals=np.full(2, 6.0), iterations=3, clip=100.0)

    def fit(**change):
        args = {**good, **change}
        _joint.mirror_descent(joint, args["sizes"], args["axes"], args["axis_offsets"], args["noisy"],
                              args["variances"], args["totals"], args["iterations"], args["clip"], 1e200, 1e-3)

    fit()
    for change in [dict(sizes=np.array([2, 4])), dict(sizes=np.array([2, 0])), dict(axes=np.array([0, 2], np.int32)),
                   dict(axes=np.array([0, 0], np.int32)), dict(axis_offsets=np.array([0, 2, 2])),
                   dict(axis_offsets=np.array([0, 1])), dict(noisy=np.ones((2, 4))),
                   dict(variances=np.array([1.0, 0.0])), dict(totals=np.ones(3)), dict(clip=400.0),
                   dict(iterations=-1), dict(totals=np.array([6.0, np.nan])), dict(totals=np.array([-1.0, 6.0]))]:
        with pytest.raises(ValueError):
            fit(**change)
    with pytest.raises(ValueError):
        _joint.ipf(joint, shape.sizes, np.array([0, 3], np.int32), shape.axis_offsets, good["noisy"], 2)


def test_a_fit_s_memory_grows_with_its_joint_not_with_its_tables():
    """No per-cell map of every table is kept: 1,771 tables (every 1-, 2- and 3-way table of 21 binary
    attributes) over a joint of 2^21 cells fit in a few joint-sized buffers (maps would take 14 GiB)."""
    import itertools
    import tracemalloc

    sizes = (2,) * 21
    axes = tuple(a for way in (1, 2, 3) for a in itertools.combinations(range(21), way))
    shape = joint_fit._table_axes(sizes, axes)
    width = int(sum(2 ** len(a) for a in axes))
    joint = np.full((1, 2**21), 1.0)
    tracemalloc.start()
    _joint.ipf(joint, shape.sizes, shape.axes, shape.axis_offsets, np.full((1, width), 2.0**21 / 4), 0)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 8 * 2**21 * 8 * 2  # the kernel's block: the joint's cells times 8 lanes, and the targets'


@pytest.mark.parametrize("statistic, measured", [("count", False), ("count", True), ("sum", True),
                                                 ("quantile", True)])
def test_sixty_four_bit_cells_count_what_thirty_two_bit_cells_count(statistic, measured):
    """The kernel's path for tables past 2^31 entries (forced here on a small one) counts the same."""
    from dprelease.transforms.aggregate import _bucket_table

    rng = np.random.default_rng(len(statistic))
    rows = 9001
    layout, codes = _layout_and_codes(rng, rows, (np.int32, np.int8, np.int16), (300, 22, 3), 1000, statistic,
                                      measured)
    kind = {"count": _counting.COUNT_VALID if measured else _counting.COUNT, "sum": _counting.SUM,
            "quantile": _counting.QUANTILE}[statistic]
    out = np.zeros(layout.n_measured, dtype=np.int64)
    _counting.count(tuple(codes[c] for c in layout.columns),
                    tuple(None if lookup is None else lookup.astype(np.int32) for lookup in layout.lookups),
                    np.array(layout.sizes, dtype=np.int64), rows, out, kind, codes["m"] if measured else None,
                    layout.invalid, layout.lower,
                    _bucket_table(layout.candidates, layout.lower, layout.invalid) if kind == _counting.QUANTILE
                    else None, True)
    assert out.tolist() == _reference(layout, codes, rows).tolist() == layout.measure_vector(codes, rows).tolist()


def test_a_measure_past_two_to_the_thirty_one_is_summed_exactly():
    """A measure whose range needs int64 codes (the encoder's code_dtype past 2^31) sums exactly; int64 sums
    past 2^53 too."""
    rows = 20_000
    rng = np.random.default_rng(11)
    invalid = 2**40
    values = rng.integers(0, invalid + 1, rows)  # some at `invalid`: no value
    layout = TableLayout("s", ("c",), (None,), (3,), statistic="sum", measure="m", lower=-5, invalid=invalid)
    codes = {"c": rng.integers(0, 3, rows).astype(np.int8), "m": values.astype(np.int64)}
    expected = [sum(int(v) - 5 for v, c in zip(values, codes["c"]) if c == cell and v != invalid) for cell in range(3)]
    assert layout.measure_vector(codes, rows).tolist() == expected


def test_a_wide_dimension_code_is_narrowed_only_when_it_fits():
    layout = TableLayout("t", ("c",), (None,), (4,))
    assert layout.measure_vector({"c": np.array([0, 3, 3, 1], dtype=np.int64)}, 4).tolist() == [1, 1, 0, 2]
    with pytest.raises(ValueError, match="encoding error"):
        layout.measure_vector({"c": np.array([0, 2**32 + 1], dtype=np.int64)}, 2)


@pytest.mark.parametrize("column", [np.zeros(5, np.int8), np.zeros((4, 2), np.int8), np.zeros(8, np.int8)])
def test_a_code_column_not_one_code_per_record_is_refused(column):
    """Never read with a guessed code width: a column of the wrong length or shape stops the count."""
    layout = TableLayout("t", ("c",), (None,), (4,))
    with pytest.raises(ValueError, match="not one code for each"):
        layout.measure_vector({"c": column}, 4)


# ---- encoding -----------------------------------------------------------------------------------------------------


def _numpy_values(column: pa.Array) -> np.ndarray:
    """The numpy specification of an integer column's values: float64, NaN for nulls, non-finite and
    non-integral values (numpy's unchecked cast: an int64 or uint64 beyond 2^53 rounds)."""
    if pa.types.is_integer(column.type) or pa.types.is_floating(column.type):
        values = column.cast(pa.float64(), safe=False).to_numpy(zero_copy_only=False)
        return np.where(np.isfinite(values) & (values == np.floor(values)), values, np.nan)
    return encode._integer_values(column)


def _numpy_integer_codes(values: np.ndarray, domain: IntegerDomain) -> np.ndarray:
    valid = np.isfinite(values) & (values >= domain.minimum) & (values <= domain.maximum)
    safe = np.where(valid, values, domain.minimum).astype(np.int64)
    codes = (np.searchsorted(np.asarray(domain.edges), safe, side="right") - 1 if domain.edges
             else safe - domain.minimum)
    codes = np.where(valid, codes, encode.INVALID)
    return np.where(codes == encode.INVALID, domain.size - 1, codes) if domain.policy == "other" else codes


def _numpy_measure_codes(values: np.ndarray, domain: MeasureDomain) -> np.ndarray:
    valid = np.isfinite(values)
    clamped = np.clip(np.where(valid, values, domain.lower), domain.lower, domain.upper)
    return np.where(valid, clamped.astype(np.int64) - domain.lower, domain.invalid_code)


EDGE_VALUES = [0, 1, -1, 4, 5, 17, 18, 64, 65, 115, 116, -5, 2**53 - 1, 2**53, 2**53 + 1, 2**53 + 2, -2**53 - 1,
               2**62, -2**63, 2**63 - 1]


def _random_column(rng, kind: pa.DataType, n: int, nulls: bool) -> pa.Array:
    if pa.types.is_floating(kind):
        values = np.concatenate([rng.integers(-10, 130, n).astype(np.float64), [0.5, -0.0, np.inf, -np.inf, np.nan,
                                 2.0**52 + 0.5, 2.0**53, 2.0**60, 1e308, -1e308, 115.0000001]])
        with np.errstate(over="ignore"):  # float32: 1e308 becomes inf
            values = values.astype(kind.to_pandas_dtype())
    elif kind == pa.uint64():
        values = np.concatenate([rng.integers(0, 130, n).astype(np.uint64),
                                 np.array([2**53 + 1, 2**63, 2**64 - 1], dtype=np.uint64)])
    else:
        info = np.iinfo(kind.to_pandas_dtype())
        wide = [v for v in EDGE_VALUES if info.min <= v <= info.max]
        values = np.concatenate([rng.integers(max(info.min, -10), min(info.max, 130) + 1, n), wide])
        values = values.astype(kind.to_pandas_dtype())
    mask = rng.random(values.size) < 0.1 if nulls else None
    return pa.array(values, type=kind, mask=mask)


KINDS = [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16(), pa.uint32(), pa.uint64(),
         pa.float32(), pa.float64()]
DOMAINS = [IntegerDomain("age", 0, 115, (0, 5, 10, 18, 65, 116), "drop"),
           IntegerDomain("age", 0, 115, (0, 5, 10, 18, 65, 116), "other"),
           IntegerDomain("age", 5, 115, (0, 18, 116), "drop"),  # values below the first edge's bin: invalid
           IntegerDomain("n", -3, 100, None, "drop"),
           IntegerDomain("n", -3, 100, None, "other"),
           IntegerDomain("big", 2**53 - 10, 2**53, (2**53 - 10, 2**53 - 3, 2**53 + 1), "drop")]


@pytest.mark.parametrize("kind", KINDS, ids=str)
@pytest.mark.parametrize("nulls", [False, True])
@pytest.mark.parametrize("rows", [0, 9, 5000])
def test_the_encoding_kernel_codes_what_numpy_codes(kind, nulls, rows):
    """Every integer domain (binned from a lookup or by searching the edges, unbinned, policy drop or other, bounds
    at 2^53) and every measure, over every integer and float type, with nulls, non-finite and non-integral floats
    and the values where float64 rounds: the codes of the numpy specification, in the encoder's narrow type."""
    rng = np.random.default_rng(rows + len(str(kind)) + nulls)
    column = _random_column(rng, kind, rows, nulls)
    values = _numpy_values(column)
    for domain in DOMAINS:
        for batch_rows in (len(column), 10**9):  # a lookup over the range, or searched edges
            mode, _ = encode._integer_rule(domain, batch_rows)
            found = encode._kernel_codes(column, domain.minimum, domain.maximum, mode,
                                         encode._integer_rule(domain, batch_rows)[1],
                                         domain.size - 1 if domain.policy == "other" else encode.INVALID,
                                         encode.code_dtype(domain.size))
            assert found.dtype == encode.code_dtype(domain.size)
            assert found.tolist() == _numpy_integer_codes(values, domain).tolist(), (domain, mode)
        assert ColumnEncoder(domain).encode(column).tolist() == _numpy_integer_codes(values, domain).tolist()
    for lower, upper in [(0, 500000), (-40, 1000), (2**53 - 5, 2**53), (-2**53, 2**53)]:
        measure = MeasureDomain("m", "m", lower, upper)
        found = ColumnEncoder(measure).encode(column)
        assert found.dtype == encode.code_dtype(measure.size)
        assert found.tolist() == _numpy_measure_codes(values, measure).tolist(), (lower, upper)


def test_chunks_slices_text_and_null_columns_are_coded_like_one_array():
    """A chunked column (chunks sliced at odd offsets, so validity bits start mid-byte), a text column (parsed), a
    column of nulls and booleans: the codes of the numpy specification."""
    rng = np.random.default_rng(3)
    whole = _random_column(rng, pa.int64(), 3000, True)
    pieces = pa.chunked_array([whole.slice(0, 7), whole.slice(7, 1), whole.slice(8, 0), whole.slice(8, 2992),
                               whole.slice(3000)])
    texts = pa.array(["12", " 7", "x", None, "1e1", "115", "116", "-0", "65.0", "65.5", ""])
    domain = DOMAINS[0]
    for column in (pieces, texts, pa.nulls(5), pa.array([True, False, None]), texts.dictionary_encode(),
                   pa.chunked_array([], type=pa.int64())):
        values = (np.concatenate([[]] + [_numpy_values(c) for c in column.chunks])
                  if isinstance(column, pa.ChunkedArray) else _numpy_values(column))
        assert ColumnEncoder(domain).encode(column).tolist() == _numpy_integer_codes(values, domain).tolist()
        measure = MeasureDomain("m", "m", 0, 100)
        assert ColumnEncoder(measure).encode(column).tolist() == _numpy_measure_codes(values, measure).tolist()


def test_a_dictionary_column_is_coded_through_its_lookup_with_nulls_and_misses():
    """Categorical codes through the dictionary's lookup: nulls, values outside the domain, a dictionary holding a
    null, sliced chunks, an empty dictionary; policy drop and other."""
    values = ("F", "M", "X")
    column = pa.array(["M", None, "F", "Q", "X", "F", None, "M"] * 700).dictionary_encode()
    sliced = pa.chunked_array([column.slice(3, 5), column.slice(1000)])
    odd = pa.DictionaryArray.from_arrays(pa.array([0, 1, 2, None, 1], pa.int8()), pa.array(["M", None, "Z"]))
    empty = pa.DictionaryArray.from_arrays(pa.array([None, None], pa.int32()), pa.array([], pa.string()))
    for data in (column, sliced, odd, empty):
        texts = data.to_pylist() if not isinstance(data, pa.ChunkedArray) else [
            v for c in data.chunks for v in c.to_pylist()]
        expected = [values.index(t) if t in values else encode.INVALID for t in texts]
        assert encode._lookup_codes(data, values).tolist() == expected
        domain = CategoricalDomain("c", values, "other")
        assert ColumnEncoder(domain).encode(data).tolist() == [3 if e == encode.INVALID else e for e in expected]


@pytest.mark.parametrize("case", ["kind", "offset", "short values", "output length", "output width", "bounds",
                                  "bounds past 2^53", "bound one past 2^53", "mode", "lookup length",
                                  "lookup without mode", "edges not ascending", "no edges", "short validity",
                                  "code too wide", "invalid too wide", "int64 lookup", "float edges",
                                  "float output", "unsigned output"])
def test_the_encoding_kernel_refuses_inconsistent_arguments(case):
    """Each inconsistent argument (public: the domain and the buffers' shapes) raises ValueError naming no value."""
    values, out = np.arange(10, dtype=np.int64), np.empty(10, dtype=np.int8)
    args = dict(values=values, kind="q", offset=0, n=10, validity=None, validity_offset=0, minimum=0, maximum=20,
                mode=encode.IDENTITY, table=None, invalid=-1, out=out)
    changes = {"kind": dict(kind="f"), "offset": dict(offset=-1), "short values": dict(offset=1),
               "output length": dict(out=np.empty(9, np.int8)), "output width": dict(out=np.empty(30, np.int8)),
               "bounds": dict(minimum=5, maximum=4), "bounds past 2^53": dict(maximum=2**53 + 2), "mode": dict(mode=4),
               "lookup length": dict(mode=encode.LOOKUP, table=np.zeros(20, np.int32)),
               "lookup without mode": dict(table=np.zeros(21, np.int32)),
               "edges not ascending": dict(mode=encode.EDGES, table=np.array([0, 5, 5], np.int64)),
               "no edges": dict(mode=encode.EDGES, table=np.zeros(0, np.int64)),
               "short validity": dict(validity=b"\xff", validity_offset=0),
               "code too wide": dict(maximum=200), "invalid too wide": dict(invalid=128),
               "bound one past 2^53": dict(minimum=2**53 + 1, maximum=2**53 + 1),
               "int64 lookup": dict(mode=encode.LOOKUP, table=np.zeros(21, np.int64)),
               "float edges": dict(mode=encode.EDGES, table=np.array([0.0, 5.0])),
               "float output": dict(out=np.empty(10, np.float64)),
               "unsigned output": dict(out=np.empty(10, np.uint8))}
    args.update(changes[case])
    with pytest.raises(ValueError) as raised:
        _encoding.codes(*args.values())
    assert str(raised.value).startswith("codes: ")


# ---- a column looked up once for every table that reads it through one lookup ------------------------------------


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32])
@pytest.mark.parametrize("out_dtype", [np.int8, np.int16, np.int32])
def test_a_looked_up_column_is_the_lookup_of_every_code(dtype, out_dtype):
    rng = np.random.default_rng(5)
    lookup = rng.integers(0, 100, 120).astype(np.int32)
    codes = rng.integers(0, 120, 9001).astype(dtype)
    out = np.empty(codes.size, dtype=out_dtype)
    _counting.looked_up(codes, lookup, codes.size, out)
    assert out.tolist() == lookup[codes].tolist()


@pytest.mark.parametrize("case", ["negative code", "code past the lookup", "value past the output",
                                  "negative value", "wrong length", "empty lookup", "wide codes", "int64 lookup",
                                  "float output", "two-dimensional codes"])
def test_a_looked_up_code_outside_its_domain_is_refused_naming_no_value(case):
    codes, lookup, out = np.array([0, 1, 2], np.int16), np.array([0, 5, 9], np.int32), np.empty(3, np.int8)
    if case == "negative code":
        codes[1] = -1
    elif case == "code past the lookup":
        codes[2] = 3
    elif case == "value past the output":
        lookup[1] = 300
    elif case == "negative value":
        lookup[2] = -2
    elif case == "wrong length":
        out = np.empty(4, np.int8)
    elif case == "empty lookup":
        lookup = np.zeros(0, np.int32)
    elif case == "int64 lookup":
        lookup = lookup.astype(np.int64)
    elif case == "float output":
        out = np.empty(3, np.float32)
    elif case == "two-dimensional codes":
        codes = np.zeros((3, 2), np.int8)
    else:
        codes = codes.astype(np.int64)
    with pytest.raises(ValueError) as raised:
        _counting.looked_up(codes, lookup, 3, out)
    assert str(raised.value).startswith("looked_up: ") and "300" not in str(raised.value)


def test_a_shared_lookup_s_column_not_one_code_per_record_is_refused():
    """A column read through a shared lookup is refused as `_counted` refuses it, not read as wider codes."""
    from dprelease.transforms.aggregate import bounded_counts

    lookup = np.array([0, 1, 1, 0] + [0] * 300)
    layouts = [TableLayout("a", ("geo",), (lookup,), (2,)), TableLayout("b", ("geo",), (lookup,), (2,))]
    for column in (np.array([[1, 0], [2, 0], [3, 0], [0, 0]], np.int8), np.array([1, 0, 2, 0, 3, 0, 0, 0], np.int8)):
        with pytest.raises(ValueError, match="not one code for each of its 4 records"):
            bounded_counts(layouts, {"geo": column}, 4, [304], None, 1, b"k" * 32)


def test_misaligned_and_empty_columns_are_coded_as_numpy_codes_them():
    """An Arrow array over a buffer at an odd address (legal in Arrow) is read correctly; an empty column of any
    type gives no codes (an empty chunked date or decimal column could not be dictionary-encoded)."""
    import datetime
    import decimal

    data = pa.py_buffer(np.arange(11, dtype=np.int64).tobytes())
    column = pa.Array.from_buffers(pa.int64(), 10, [None, data.slice(3, 80)])
    domain = IntegerDomain("x", 0, 2**40, None, "drop")
    assert ColumnEncoder(domain).encode(column).tolist() == _numpy_integer_codes(_numpy_values(column), domain).tolist()
    category = CategoricalDomain("d", ("2020-01-01", "1.5"), "other")
    for empty in (pa.chunked_array([], pa.date32()), pa.chunked_array([], pa.decimal128(5, 2)),
                  pa.array([datetime.date(2020, 1, 1)]).slice(0, 0), pa.array([decimal.Decimal("1.5")]).slice(1)):
        assert ColumnEncoder(category).encode(empty).tolist() == []
        assert ColumnEncoder(domain).encode(empty).tolist() == []


def test_tables_sharing_a_lookup_count_what_each_counts_through_it():
    """Tables reading one column through one lookup (shared: looked up once per batch) or through their own, with
    and without a measure, in bounded_counts and kept_counts: the counts of each table counted on its own."""
    from dprelease.transforms.aggregate import bounded_counts, kept_counts, shared_lookups

    rng = np.random.default_rng(11)
    rows = 5000
    county = rng.integers(0, 40, 300)  # 300 tracts in 40 counties
    state = rng.integers(0, 3, 40)[county]
    codes = {"geo": rng.integers(0, 300, rows).astype(np.int16), "a": rng.integers(0, 4, rows).astype(np.int8),
             "m": rng.integers(0, 11, rows).astype(np.int8)}
    layouts = [TableLayout("c", ("geo",), (county,), (40,)),
               TableLayout("ca", ("geo", "a"), (county, None), (40, 4)),
               TableLayout("ac", ("a", "geo"), (None, county), (4, 40)),
               TableLayout("cs", ("geo",), (county,), (40,), statistic="sum", measure="m", lower=-3, invalid=10),
               TableLayout("s", ("geo",), (state,), (3,)),
               TableLayout("s2", ("geo", "a"), (state, None), (3, 4)),
               TableLayout("t", ("geo",), (None,), (300,)),
               TableLayout("own", ("geo",), (county.copy(),), (40,))]
    alone = [layout.measure_vector(codes, rows) for layout in layouts]
    reading, shared_codes = shared_lookups(layouts, codes, rows)
    unlooked = sum(lookup is None for layout in reading for lookup in layout.lookups)
    assert unlooked == 4 + 6  # the 4 columns read without a lookup, and 6 readers of a shared one
    assert len(shared_codes) == len(codes) + 2  # the county and the state looked up once each
    together = bounded_counts(layouts, codes, rows, [300, 4, 11], None, 1, b"k" * 32)
    assert [v.tolist() for v in together] == [v.tolist() for v in alone]
    count_layouts = [layout for layout in layouts if layout.measure is None]
    kept = kept_counts(count_layouts, [(codes, rows), (codes, rows)])
    assert [v.tolist() for v in kept] == [(2 * v).tolist() for layout, v in zip(layouts, alone)
                                          if layout.measure is None]
