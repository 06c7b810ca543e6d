"""The C kernels of counting (`transforms/_counting.c`) and of the joint fit (`transforms/_joint.c`) against
plain numpy references: the same counts exactly, the same fit to rounding, each unit's fit the same bits in any
batch, and every out-of-domain input refused with an error that names no value."""
from __future__ import annotations

import math

import numpy as np
import pytest

from dprelease.transforms import _counting, _joint
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
