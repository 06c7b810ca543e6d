"""A synthetic census-like person file: nested geography, households, age, sex, race, ethnicity, income.

The geography is fixed (seeded) and public: state (2 chars) > county (5) > tract (11) (> block (15)).
The demo's is small (8 states, 137 counties, 2,975 tracts); `country_geography` builds one the size
and shape of a real country's (51 states, 3,577 counties, 44,627 tracts, optionally blocks), with
Zipf-like numbers of counties per state and tracts per county, so that costs that grow with the number
of geographic units show. Persons are generated
in household groups and written to Parquet (or CSV) in chunks, so memory stays flat for
any row count. A small share of dirty values (nulls, out-of-domain codes) exercises the
spec's invalid-value policies.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

GEOGRAPHY_SEED = 20260101
SEXES = ["F", "M"]
RACES = ["White", "Black", "AIAN", "Asian", "NHPI", "Other", "Two or more"]
RACE_SHARES = [0.60, 0.13, 0.013, 0.06, 0.002, 0.085, 0.11]
ETHNICITIES = ["Hispanic", "Not Hispanic"]
HOUSEHOLD_SIZES = np.arange(1, 8)
HOUSEHOLD_SHARES = np.array([0.28, 0.35, 0.15, 0.12, 0.06, 0.025, 0.015])
CHUNK_ROWS = 1_000_000


def demo_geography() -> list[str]:
    """The demo's public tract codes (about 3,000), identical on every call."""
    rng = np.random.default_rng(GEOGRAPHY_SEED)
    tracts = []
    for state in range(1, 9):
        for county in range(1, int(rng.integers(4, 31)) + 1):
            for tract in range(1, int(rng.integers(2, 41)) + 1):
                tracts.append(f"{state * 3:02d}{county * 2 - 1:03d}{tract * 100:06d}")
    return tracts


def _skewed_counts(rng: np.random.Generator, parents: int, children: int, exponent: float, cap: int) -> np.ndarray:
    """Children per parent: at least one each, the rest Zipf-like (weight 1/rank^exponent over a random
    order of the parents), none above `cap`."""
    if children < parents:
        raise ValueError(f"{children} children cannot give each of {parents} parents one")
    weights = 1.0 / np.arange(1, parents + 1) ** exponent
    weights = rng.permutation(weights / weights.sum())
    counts = np.ones(parents, dtype=np.int64)
    extra = children - parents
    while extra:
        room = counts < cap
        if not room.any():
            raise ValueError(f"{children} children do not fit {parents} parents of at most {cap} each")
        add = rng.multinomial(extra, np.where(room, weights, 0) / np.where(room, weights, 0).sum())
        add = np.minimum(add, cap - counts)
        counts += add
        extra -= int(add.sum())
    return counts


def country_geography(states: int, counties: int, tracts: int, blocks: int = 0,
                      seed: int = GEOGRAPHY_SEED) -> list[str]:
    """Leaf codes of a country-sized geography: SS CCC TTTTTT (BBBB), sorted, identical for the same
    arguments. Counties per state and tracts per county follow Zipf-like sizes (a few states with hundreds
    of counties, most counties with a handful of tracts), blocks per tract too."""
    if not 1 <= states <= 99 or counties > 999 * states or (blocks and blocks > 9999 * tracts):
        raise ValueError("states must be 1..99, counties at most 999 per state, blocks at most 9,999 per tract")
    rng = np.random.default_rng([seed, states, counties, tracts, blocks])
    per_state = _skewed_counts(rng, states, counties, 0.6, 999)
    per_county = _skewed_counts(rng, counties, tracts, 0.8, 9_999)
    per_tract = _skewed_counts(rng, tracts, blocks, 0.8, 9_999) if blocks else None
    state_codes = np.repeat(np.arange(1, states + 1), per_state)
    county_rank = np.arange(counties) - np.repeat(np.cumsum(per_state) - per_state, per_state)
    county_codes = np.char.add(np.char.zfill(state_codes.astype(str), 2),
                               np.char.zfill((county_rank + 1).astype(str), 3))
    tract_rank = np.arange(tracts) - np.repeat(np.cumsum(per_county) - per_county, per_county)
    codes = np.char.add(np.repeat(county_codes, per_county), np.char.zfill((100 * (tract_rank + 1)).astype(str), 6))
    # tracts: 100 * rank stays within 6 digits for up to 9,999 tracts per county
    if per_tract is not None:
        block_rank = np.arange(blocks) - np.repeat(np.cumsum(per_tract) - per_tract, per_tract)
        codes = np.char.add(np.repeat(codes, per_tract), np.char.zfill((block_rank + 1000).astype(str), 4))
    return sorted(codes.tolist())


def _age_weights() -> np.ndarray:
    ages = np.arange(116)
    weights = np.where(ages < 60, 1.0, np.exp(-(ages - 60) / 12.0))
    return weights / weights.sum()


def _households(rng: np.random.Generator, n_rows: int) -> np.ndarray:
    """Household size per household, summing to n_rows."""
    expected = int(n_rows / 2.4) + 10
    sizes = rng.choice(HOUSEHOLD_SIZES, size=expected, p=HOUSEHOLD_SHARES)
    while sizes.sum() < n_rows:
        sizes = np.concatenate((sizes, rng.choice(HOUSEHOLD_SIZES, size=expected, p=HOUSEHOLD_SHARES)))
    cumulative = np.cumsum(sizes)
    last = int(np.searchsorted(cumulative, n_rows))
    sizes = sizes[: last + 1].copy()
    sizes[-1] -= int(cumulative[last] - n_rows)
    return sizes[sizes > 0]


def _incomes(rng: np.random.Generator, age: np.ndarray) -> np.ndarray:
    """Annual personal income in dollars: 0 under 15, else a skewed (lognormal) draw with a spike at 0;
    a few are missing (null) like real survey answers."""
    income = np.rint(rng.lognormal(10.2, 1.0, age.size)).astype(np.float64)
    income[(rng.random(age.size) < 0.12) | ~(age >= 15)] = 0.0
    income[rng.random(age.size) < 0.002] = np.nan
    return income


def _chunk(rng, start_person, start_household, n_rows, tracts, tract_weights, dirty_rate,
           income_rng=None) -> pa.Table:
    sizes = _households(rng, n_rows)
    household = np.repeat(np.arange(sizes.size, dtype=np.int64) + start_household, sizes)
    tract_of_household = rng.choice(len(tracts), size=sizes.size, p=tract_weights)
    geo_index = np.repeat(tract_of_household, sizes).astype(np.int32)
    ethnicity_of_household = (rng.random(sizes.size) > 0.18).astype(np.int32)
    race_of_household = rng.choice(len(RACES), size=sizes.size, p=RACE_SHARES).astype(np.int32)
    age = rng.choice(116, size=n_rows, p=_age_weights()).astype(np.float64)
    dirty = rng.random(n_rows) < dirty_rate
    age[dirty & (rng.random(n_rows) < 0.5)] = np.nan
    geo_dictionary = pa.array(tracts + ["99999999999"])
    geo_index = np.where(dirty & (rng.random(n_rows) < 0.3), len(tracts), geo_index).astype(np.int32)
    race_index = np.repeat(race_of_household, sizes)
    race_index = np.where(dirty & (rng.random(n_rows) < 0.3), len(RACES), race_index).astype(np.int32)
    return pa.table({
        "person_id": pa.array(np.arange(n_rows, dtype=np.int64) + start_person),
        "household_id": pa.array(household),
        "geo": pa.DictionaryArray.from_arrays(pa.array(geo_index), geo_dictionary),
        "age": pa.array(age, from_pandas=True).cast(pa.int64()),
        "sex": pa.DictionaryArray.from_arrays(pa.array(rng.integers(0, 2, n_rows).astype(np.int32)), pa.array(SEXES)),
        "race": pa.DictionaryArray.from_arrays(pa.array(race_index), pa.array(RACES + ["Unknown"])),
        "ethnicity": pa.DictionaryArray.from_arrays(
            pa.array(np.repeat(ethnicity_of_household, sizes)), pa.array(ETHNICITIES)),
        # its own generator: the other columns are those of earlier versions for the same seed
        "income": pa.array(_incomes(income_rng or np.random.default_rng(0), age), from_pandas=True).cast(pa.int64()),
    })


def write_demo_data(out: Path, domain_file: Path, rows: int, overwrite: bool = False, seed: int = 1,
                    dirty_rate: float = 0.001, geography: list[str] | None = None) -> tuple[Path, Path]:
    """Write `rows` persons to `out` (a .parquet or .csv file) and the geography domain file `domain_file`
    (`geography`: leaf codes, default the demo's), each written beside its target and renamed into place (an
    existing target is replaced only with `overwrite`, whatever appears meanwhile). Returns both paths."""
    from dprelease.pipelines.storage import write_atomically

    out, domain_file = Path(out), Path(domain_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    tracts = geography or demo_geography()
    geo_rng = np.random.default_rng(GEOGRAPHY_SEED + 1)
    weights = geo_rng.lognormal(0.0, 0.6, len(tracts))
    weights /= weights.sum()
    rng = np.random.default_rng(seed)
    income_rng = np.random.default_rng([seed, 2])
    codes = "".join(t + "\n" for t in tracts).encode("ascii")
    write_atomically(domain_file, overwrite, lambda handle: handle.write(codes))
    write_atomically(out, overwrite, lambda handle: _write_persons(handle, out.suffix, rows, rng, tracts, weights,
                                                                   dirty_rate, income_rng))
    return out, domain_file


def _write_persons(handle, suffix: str, rows: int, rng, tracts, weights, dirty_rate: float, income_rng) -> None:
    """The persons, chunk by chunk, as Parquet or CSV into an open binary file."""
    writer = None
    person = household = 0
    try:
        for start in range(0, rows, CHUNK_ROWS):
            n = min(CHUNK_ROWS, rows - start)
            table = _chunk(rng, person, household, n, tracts, weights, dirty_rate, income_rng)
            person += n
            household = int(table.column("household_id")[-1].as_py()) + 1 if n else household
            if suffix == ".csv":
                table = table.cast(pa.schema([(f.name, pa.string() if pa.types.is_dictionary(f.type) else f.type)
                                              for f in table.schema]))
                if writer is None:
                    writer = pacsv.CSVWriter(handle, table.schema)
            elif writer is None:
                writer = pq.ParquetWriter(handle, table.schema, compression="zstd")
            writer.write_table(table)
        if writer is None:
            empty = _chunk(rng, 0, 0, 0, tracts, weights, dirty_rate)
            if suffix == ".csv":
                pacsv.write_csv(empty, handle)
            else:
                pq.write_table(empty, handle)
    finally:
        if writer is not None:
            writer.close()
