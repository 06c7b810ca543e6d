"""The even deal of a new attribute's values to the records of each separator value (`units.dealing`): exact
counts; herding (`dealt_cells`) keeps every table with an earlier attribute within a few records of the model's
expectation, unbiased; the systematic deal (`dealt_blocks`) is unbiased with far less spread than a shuffle."""
import numpy as np
import pytest

from dprelease.transforms import _dealing
from dprelease.transforms.units.dealing import dealt_blocks, dealt_cells


def _systematic(group, counts, earlier, rng):
    """The systematic deal of cells (`dealt_blocks` with a group's cells as its blocks)."""
    groups, width = counts.shape
    return dealt_blocks(group, np.repeat(np.arange(groups), width), counts.ravel(), earlier, rng) % width


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


@pytest.mark.parametrize("deal", [dealt_cells, _systematic])
def test_the_records_tabulate_to_the_counts_exactly(deal):
    rng = np.random.default_rng(1)
    group, counts, earlier = _case(rng)
    group = group[rng.permutation(group.size)]  # records in any order
    earlier = [(rng.integers(0, n, group.size), n) for _, n in earlier]
    for seed in range(5):
        cells = deal(group, counts, earlier, np.random.default_rng(seed))
        tabulated = np.zeros_like(counts)
        np.add.at(tabulated, (group, cells), 1)
        assert np.array_equal(tabulated, counts)
    # no earlier attribute (the first clique after the root's) and a single new cell
    cells = deal(group, counts, [], rng)
    tabulated = np.zeros_like(counts)
    np.add.at(tabulated, (group, cells), 1)
    assert np.array_equal(tabulated, counts)
    one = counts.sum(axis=1, keepdims=True)
    assert (deal(group, one, earlier, rng) == 0).all()


def _herding_case():
    rng = np.random.default_rng(3)
    return _case(rng, groups=3, width=6, earlier_sizes=(4, 5, 6, 3))


def test_herding_keeps_every_earlier_attributes_table_within_four_records_of_the_model():
    """With four earlier attributes, every (group, earlier value, cell) count of each within 4 records of the
    model's expectation on every seed; the systematic deal misses it by 10 records and more on the attributes it
    sorts last, and a shuffle by more still."""
    group, counts, earlier = _herding_case()
    worst = {"herded": 0.0, "systematic": 0.0, "shuffled": 0.0}
    for seed in range(100):
        shuffled = np.empty_like(group)
        order = np.lexsort((np.random.default_rng(seed).random(group.size), group))
        shuffled[order] = np.repeat(np.tile(np.arange(6), 3), counts.ravel())
        deals = {"herded": dealt_cells(group, counts, earlier, np.random.default_rng(seed)),
                 "systematic": _systematic(group, counts, earlier, np.random.default_rng(seed)),
                 "shuffled": shuffled}
        for name, cells in deals.items():
            for codes, n in earlier:
                deviation = np.abs(_pair(group, codes, cells, 3, n, 6) - _expected(group, codes, counts, n)).max()
                worst[name] = max(worst[name], float(deviation))
    assert worst["herded"] < 4 < 10 < worst["systematic"] < worst["shuffled"]


def _tables(group, counts, earlier, draws, deal):
    tables = [np.zeros((draws, 3, n, 6)) for _, n in earlier]
    for seed in range(draws):
        cells = deal(group, counts, earlier, np.random.default_rng(1000 + seed))
        for t, (codes, n) in zip(tables, earlier):
            t[seed] = _pair(group, codes, cells, 3, n, 6)
    return tables


def test_herding_is_unbiased_and_its_spread_a_fraction_of_the_systematic_deals():
    """Over many public seeds the mean count of every (group, earlier value, cell) is the model's (within 4.5
    standard errors; dealt in the records' own order toward unrandomised targets, the same deal misses it), and
    the mean squared deviation from it, over the four attributes, below half the systematic deal's."""
    group, counts, earlier = _herding_case()
    draws = 400
    herded = _tables(group, counts, earlier, draws, dealt_cells)
    systematic = _tables(group, counts, earlier, draws, _systematic)

    def unrandomised(group, counts, earlier, rng):
        cells = np.empty(group.size, dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(counts.sum(axis=1))]).astype(np.int64)
        codes = np.stack([c for c, _ in earlier]).astype(np.int32)
        _dealing.herd(np.argsort(group, kind="stable").astype(np.int64), offsets,
                      np.arange(4, dtype=np.int64) * 6, counts.ravel().astype(np.int64), codes,
                      np.array([n for _, n in earlier], dtype=np.int64), np.zeros(3, dtype=np.int64), 7, cells)
        return cells

    fixed = _tables(group, counts, earlier, 2, unrandomised)
    expected = [_expected(group, codes, counts, n) for codes, n in earlier]
    for t, e in zip(herded, expected):
        assert (np.abs(t.mean(axis=0) - e) < 4.5 * t.std(axis=0) / np.sqrt(draws) + 1e-6).all()
    assert not all((np.abs(f.mean(axis=0) - e) < 1e-6).all() for f, e in zip(fixed, expected))
    spread = sum(((t - e) ** 2).mean() for t, e in zip(herded, expected))
    assert spread < sum(((t - e) ** 2).mean() for t, e in zip(systematic, expected)) / 2


def test_a_rare_earlier_value_gets_each_new_value_in_proportion_summed_over_many_groups():
    """Found by review: herding toward each group's real-valued shares gave the records of an earlier value rare
    in every group the commonest new value, a bias adding up over groups (2,000 groups of 100 records, 2% of
    them rare: 164 of the model's 401 for the rarest new value; 4-record groups [2, 2, 1, 2] with quotas (1, 1, 2):
    the lone record always got the third value, the model's chance 1/2). Each target row is now the model's
    share rounded systematically from a random phase: the totals are the model's within sampling error."""
    rng = np.random.default_rng(5)
    group = np.repeat(np.arange(2000), 100)
    rare = (rng.random(group.size) < 0.02).astype(np.int64)
    other = rng.integers(0, 4, group.size)
    counts = np.stack([rng.multinomial(100, [0.7, 0.2, 0.1]) for _ in range(2000)])
    held = np.bincount(group * 2 + rare, minlength=4000).reshape(2000, 2)[:, 1]
    model = (held[:, None] * counts / 100).sum(axis=0)
    got = np.mean([np.bincount(dealt_cells(group, counts, [(rare, 2), (other, 4)], np.random.default_rng(s))[rare == 1],
                               minlength=3) for s in range(3)], axis=0)
    assert (np.abs(got - model) < 0.08 * model).all()
    tiny = np.repeat(np.arange(5000), 4)
    codes = np.tile([2, 2, 1, 2], 5000)
    cells = dealt_cells(tiny, np.tile([1, 1, 2], (5000, 1)), [(codes, 3)], np.random.default_rng(0))
    lone_third = int(((codes == 1) & (cells == 2)).sum())
    assert abs(lone_third - 2500) < 4.5 * np.sqrt(5000 * 0.25)


def test_herding_renumbers_wide_domains_and_refuses_codes_outside_their_size_or_counts_that_do_not_add_up():
    """A domain too wide for the kernel's tables is renumbered by the values present: the same deal (it depends
    on which records share a value, not on the codes). A code outside its size, or a group whose counts do not add
    up to its records, is an error, never a silent miscount."""
    group, counts, earlier = _herding_case()
    dealt = dealt_cells(group, counts, earlier, np.random.default_rng(9))
    wide = [(earlier[0][0] * 1000 + 7, 2 ** 40), *earlier[1:]]  # every value present: renumbered as it was
    assert np.array_equal(dealt_cells(group, counts, wide, np.random.default_rng(9)), dealt)
    with pytest.raises(ValueError, match="outside its declared size"):
        dealt_cells(group, counts, [(earlier[0][0] * 2, 3)], np.random.default_rng(9))
    broken = counts.copy()
    broken[0, 0] += 1
    broken[2, 0] -= 1
    with pytest.raises(ValueError, match="do not add up"):
        dealt_cells(group, broken, earlier, np.random.default_rng(9))


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
        cells = _systematic(group, counts, earlier, np.random.default_rng(seed))
        assert (np.abs(_pair(group, earlier[0][0], cells, 4, 7, 6) - expected) < bound).all()
        shuffled = np.empty_like(cells)
        order = np.lexsort((np.random.default_rng(seed).random(group.size), group))
        shuffled[order] = np.repeat(np.tile(np.arange(6), 4), counts.ravel())
        shuffled_worst = max(shuffled_worst, float((np.abs(_pair(group, earlier[0][0], shuffled, 4, 7, 6) - expected)
                                                    - bound).max()))
    assert shuffled_worst > 3  # the bound is a property of the deal, not of any deal


def test_the_systematic_deal_is_unbiased_and_its_spread_is_a_fraction_of_a_shuffles():
    """Over many public seeds the mean (group, earlier value, cell) count is the model's (every earlier attribute,
    the one sorted first and the other), and the mean squared deviation from it is below a fifth of the
    hypergeometric variance a shuffle has."""
    rng = np.random.default_rng(3)
    group, counts, earlier = _case(rng, groups=3, width=4, earlier_sizes=(3, 5))
    sizes = (3, 5)
    draws = 600
    tables = [np.zeros((draws, 3, n, 4)) for n in sizes]
    for seed in range(draws):
        cells = _systematic(group, counts, earlier, np.random.default_rng(1000 + seed))
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
    packed = _systematic(group, counts, earlier, np.random.default_rng(9))
    wide = [(earlier[0][0], 2 ** 61), earlier[1]]  # a larger radix sorts alike; it no longer fits the int64 key
    assert np.array_equal(_systematic(group, counts, wide, np.random.default_rng(9)), packed)
    assert np.array_equal(_systematic(group, counts, [(earlier[0][0], np.int64(2 ** 61)), earlier[1]],
                                      np.random.default_rng(9)), packed)
    outside = [(earlier[0][0] * 2, 3)]  # codes 0, 2, 4 declared as a domain of 3
    with pytest.raises(ValueError, match="another group"):
        _systematic(group, counts, outside, np.random.default_rng(9))


def test_a_deal_past_the_herding_budget_is_systematic(monkeypatch):
    """Past HERD_WORK (records x earlier attributes x cells) the deal is `dealt_blocks`'s, the same records."""
    from dprelease.transforms.units import dealing

    group, counts, earlier = _herding_case()
    monkeypatch.setattr(dealing, "HERD_WORK", group.size * len(earlier) * counts.shape[1] - 1)
    assert np.array_equal(dealt_cells(group, counts, earlier, np.random.default_rng(4)),
                          _systematic(group, counts, earlier, np.random.default_rng(4)))


def test_the_kernel_refuses_what_would_leave_a_record_undealt_or_overrun_its_tables():
    """Found by review: members that are not a permutation left records unwritten, and tables whose size
    overflowed the allocation's arithmetic were written out of bounds. Refused (or MemoryError), never dealt."""
    out = np.empty(4, dtype=np.int64)
    one_group = np.array([0, 4], dtype=np.int64)
    with pytest.raises(ValueError, match="inconsistent"):
        _dealing.herd(np.array([0, 1, 1, 2], dtype=np.int64), one_group, np.array([0, 2], dtype=np.int64),
                      np.array([3, 1], dtype=np.int64), np.zeros((1, 4), dtype=np.int32), np.array([1], dtype=np.int64),
                      np.zeros(1, dtype=np.int64), 0, out)
    huge = np.full(8193, 2 ** 31 - 1, dtype=np.int64)  # 8,193 domains of 2^31 - 1 values: 2^47 bytes of tables
    with pytest.raises(MemoryError):
        _dealing.herd(np.arange(4, dtype=np.int64), one_group, np.array([0, 1], dtype=np.int64),
                      np.array([4], dtype=np.int64), np.zeros((8193, 4), dtype=np.int32), huge,
                      np.zeros(1, dtype=np.int64), 0, out)
