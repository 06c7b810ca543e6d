"""The even deal of a new attribute's values to the records of each separator value (`units.dealing`): exact
counts, the model's expectation, and far less spread than a shuffle in the tables it makes with earlier
attributes."""
import numpy as np
import pytest

from dprelease.transforms.units.dealing import dealt_cells


def _case(rng, groups=6, width=5, earlier_sizes=(3, 4)):
    """Records of `groups` groups with earlier attributes, and each group's counts of the new cells."""
    sizes = rng.integers(0, 400, groups)
    sizes[1] = 0  # an empty group
    group = np.repeat(np.arange(groups), sizes)
    earlier = [(rng.integers(0, n, group.size), n) for n in earlier_sizes]
    counts = np.stack([rng.multinomial(n, rng.dirichlet(np.ones(width))) for n in sizes])
    return group, counts, earlier


def _pair(group, codes, cells, groups, size, width):
    table = np.zeros((groups, size, width))
    np.add.at(table, (group, codes, cells), 1)
    return table


def _expected(group, codes, counts, size):
    """The model's expectation of the (group, earlier value, new cell) table: independent given the group."""
    groups = counts.shape[0]
    earlier = np.zeros((groups, size))
    np.add.at(earlier, (group, codes), 1)
    records = np.maximum(counts.sum(axis=1), 1)[:, None, None]
    return earlier[:, :, None] * counts[:, None, :] / records


def test_the_records_tabulate_to_the_counts_exactly():
    rng = np.random.default_rng(1)
    group, counts, earlier = _case(rng)
    for seed in range(5):
        cells = dealt_cells(group, counts, earlier, np.random.default_rng(seed))
        tabulated = np.zeros_like(counts)
        np.add.at(tabulated, (group, cells), 1)
        assert np.array_equal(tabulated, counts)
    # no earlier attribute (the first clique after the root's) and a single new cell
    cells = dealt_cells(group, counts, [], rng)
    tabulated = np.zeros_like(counts)
    np.add.at(tabulated, (group, cells), 1)
    assert np.array_equal(tabulated, counts)
    one = counts.sum(axis=1, keepdims=True)
    assert (dealt_cells(group, one, earlier, rng) == 0).all()


def test_each_run_of_an_earlier_value_gets_its_share_of_every_cell_within_the_systematic_bound():
    """With one earlier attribute, its records of each value form one run in the deal's order: each new cell's
    count there is within 1 + width x n_cell / N of its proportional share (systematic sampling's bound); a shuffle
    misses it by many records."""
    rng = np.random.default_rng(2)
    group, counts, earlier = _case(rng, groups=4, width=6, earlier_sizes=(7,))
    expected = _expected(group, earlier[0][0], counts, 7)
    records = np.maximum(counts.sum(axis=1), 1)[:, None, None]
    bound = 1 + counts.shape[1] * counts[:, None, :] / records
    shuffled_worst = 0.0
    for seed in range(20):
        cells = dealt_cells(group, counts, earlier, np.random.default_rng(seed))
        assert (np.abs(_pair(group, earlier[0][0], cells, 4, 7, 6) - expected) < bound).all()
        shuffled = np.empty_like(cells)
        order = np.lexsort((np.random.default_rng(seed).random(group.size), group))
        shuffled[order] = np.repeat(np.tile(np.arange(6), 4), counts.ravel())
        shuffled_worst = max(shuffled_worst, float((np.abs(_pair(group, earlier[0][0], shuffled, 4, 7, 6) - expected)
                                                    - bound).max()))
    assert shuffled_worst > 3  # the bound is a property of the deal, not of any deal


def test_the_deal_is_unbiased_and_its_spread_is_a_fraction_of_a_shuffles():
    """Over many public seeds the mean (group, earlier value, cell) count is the model's (every earlier attribute,
    the one sorted first and the other), and the mean squared deviation from it is below a fifth of the
    hypergeometric variance a shuffle has."""
    rng = np.random.default_rng(3)
    group, counts, earlier = _case(rng, groups=3, width=4, earlier_sizes=(3, 5))
    sizes = (3, 5)
    draws = 600
    tables = [np.zeros((draws, 3, n, 4)) for n in sizes]
    for seed in range(draws):
        cells = dealt_cells(group, counts, earlier, np.random.default_rng(1000 + seed))
        for t, (codes, n) in zip(tables, earlier):
            t[seed] = _pair(group, codes, cells, 3, n, 4)
    for t, (codes, n) in zip(tables, earlier):
        expected = _expected(group, codes, counts, n)
        spread = t.std(axis=0) / np.sqrt(draws) + 1e-9
        assert (np.abs(t.mean(axis=0) - expected) < 4.5 * spread + 1e-6).all()
        records = counts.sum(axis=1)[:, None, None].astype(float)
        earlier_counts = expected.sum(axis=2, keepdims=True)
        cell_counts = counts[:, None, :].astype(float)
        hypergeometric = (earlier_counts * cell_counts * (records - earlier_counts) * (records - cell_counts)
                          / np.maximum(records ** 2 * (records - 1), 1))
        assert ((t - expected) ** 2).mean() < hypergeometric.mean() / 5


def test_blocks_of_any_number_per_group_tabulate_exactly_and_inconsistent_counts_are_refused():
    """A unit's records dealt to its sub-units (3, 1 and 4 of them, one unit without records), each sub-unit
    getting its count; blocks that do not add up to their group's records are an error, not a silent miscount."""
    from dprelease.transforms.units.dealing import dealt_blocks

    rng = np.random.default_rng(4)
    block_group = np.array([0, 0, 0, 1, 2, 2, 2, 2, 3])
    block_counts = np.array([5, 0, 12, 9, 1, 1, 30, 2, 0])
    group = np.repeat(np.arange(4), np.bincount(block_group, weights=block_counts).astype(int))
    group = group[rng.permutation(group.size)]  # records in any order
    earlier = [(rng.integers(0, 6, group.size), 6)]
    blocks_in_group = np.bincount(block_group)[block_group]
    records_in_group = np.bincount(group, minlength=4)[block_group]
    for seed in range(5):
        block = dealt_blocks(group, block_group, block_counts, earlier, np.random.default_rng(seed))
        assert np.array_equal(np.bincount(block, minlength=block_counts.size), block_counts)
        assert np.array_equal(block_group[block], group)
        # each block gets the group's mix of the earlier attribute within the systematic bound
        got = np.zeros((block_counts.size, 6))
        np.add.at(got, (block, earlier[0][0]), 1)
        mix = np.zeros((4, 6))
        np.add.at(mix, (group, earlier[0][0]), 1)
        share = mix[block_group] * (block_counts / np.maximum(records_in_group, 1))[:, None]
        bound = 1 + blocks_in_group * block_counts / np.maximum(records_in_group, 1)
        assert (np.abs(got - share) < bound[:, None]).all()
    broken = block_counts.copy()
    broken[0], broken[3] = broken[0] + 1, broken[3] - 1  # the same total, in the wrong groups
    with pytest.raises(ValueError, match="do not add up"):
        dealt_blocks(group, block_group, broken, earlier, rng)


def test_keys_too_wide_for_one_integer_deal_the_same_and_codes_outside_their_size_are_refused():
    """Earlier keys whose public sizes overflow one int64 key are sorted lexicographically instead: the same deal
    as the packed key. A code at or above its declared size would sort into another group's run: refused, not a
    silent miscount; a size given as a numpy integer does not wrap the packing test."""
    rng = np.random.default_rng(6)
    group, counts, earlier = _case(rng, groups=5, width=4, earlier_sizes=(3, 4))
    packed = dealt_cells(group, counts, earlier, np.random.default_rng(9))
    wide = [(earlier[0][0], 2 ** 61), earlier[1]]  # a larger radix sorts alike; it no longer fits the int64 key
    assert np.array_equal(dealt_cells(group, counts, wide, np.random.default_rng(9)), packed)
    assert np.array_equal(dealt_cells(group, counts, [(earlier[0][0], np.int64(2 ** 61)), earlier[1]],
                                      np.random.default_rng(9)), packed)
    outside = [(earlier[0][0] * 2, 3)]  # codes 0, 2, 4 declared as a domain of 3
    with pytest.raises(ValueError, match="another group"):
        dealt_cells(group, counts, outside, np.random.default_rng(9))


def test_a_value_rare_in_every_group_gets_each_cell_in_proportion_summed_over_groups_with_correlated_attributes():
    """The case that rejected herding (2026-11-29 review): 4-record groups with counts (2, 1, 1), one record the
    lone holder of its value in k identical earlier attributes. The model gives it the first cell with chance 1/2;
    herding gave 0.57 at k = 2 and 0.75 at k = 10, a bias that adds up over groups (summed 2-way tables several
    times worse than a shuffle's). The systematic deal gives the model's chance at every k."""
    groups = 40_000
    group = np.repeat(np.arange(groups), 4)
    rare = np.tile([0, 0, 0, 1], groups)
    counts = np.tile([2, 1, 1], (groups, 1))
    for k in (1, 4, 10):
        cells = dealt_cells(group, counts, [(rare, 2)] * k, np.random.default_rng(k))
        share = np.bincount(cells[rare == 1], minlength=3) / groups
        assert (np.abs(share - [0.5, 0.25, 0.25]) < 4.5 * np.sqrt(0.25 / groups)).all(), (k, share)
