"""Exact, fast samplers of discrete Laplace and discrete Gaussian noise for ranges of cells.

The algorithms are those of Canonne, Kamath, Steinke, "The Discrete Gaussian for Differential
Privacy" (NeurIPS 2020), run by a C kernel (`_exact.c`) one cell at a time on that cell's own
bit stream: integer arithmetic only, so the output distribution is exactly the target one.

Randomness layout (see `dprelease.transforms.csprng`): cell c owns WORDS_PER_CELL words of
keystream per round; its bit stream is round 0, then round 1, ... A cell that needs more bits
than the rounds it was given is re-run from scratch with twice as many rounds: it reads the
same prefix, so its value is exactly the one an unbounded stream gives. Hence the noise of
(key, table, cell) does not depend on batch sizes, chunking, workers or engine.

Exactness, with one stated deviation: a Bernoulli(exp(-gamma)) step whose gamma exceeds 2^62 (or, in the
discrete Gaussian, > 2^40 with a 64-bit overflow) draws Bernoulli(exp(-2^62)) instead; both are below
exp(-2^40), so each draw's distribution is within exp(-2^40) times the expected number of proposals of the
exact one in total variation (see `_exact.c`).
`dprelease.transforms.samplers_reference` is a bit-identical numpy implementation.
"""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from . import _exact
from .csprng import WORDS_PER_CELL, CellStream

CHUNK_CELLS = 1 << 16
KINDS = {"discrete_laplace": 0, "discrete_gaussian": 1}


def _kernel_parameters(kind: str, parameter: Fraction) -> tuple[int, int, int]:
    if kind not in KINDS:
        raise ValueError(f"kind ({kind!r}) must be one of {sorted(KINDS)}")
    if parameter <= 0:
        raise ValueError(f"parameter ({parameter}) must be > 0")
    if kind == "discrete_gaussian":
        a, b = parameter.numerator, parameter.denominator
        t = math.isqrt(a // b) + 1
        if 2 * a * b * t * t >= 2**86:
            raise ValueError(f"sigma2 ({parameter}) too large for exact 64-bit sampling; see calibrate_gaussian")
    elif parameter.numerator > 2**62 or parameter.denominator > 2**62:
        raise ValueError(f"scale ({parameter}) has too large a numerator or denominator")
    return KINDS[kind], parameter.numerator, parameter.denominator


def _words_for_rounds(stream: CellStream, cells: np.ndarray, rounds: int, chunk: tuple[int, int],
                      round0: np.ndarray) -> np.ndarray:
    """Rounds 0..rounds-1 of each cell, concatenated per cell: shape (len(cells), rounds * W)."""
    start, stop = chunk
    parts = [round0[cells - start]]
    bulk = cells.size * 256 > stop - start  # one bulk round beats ~256 single-cell ciphers
    for r in range(1, rounds):
        if bulk:
            parts.append(stream.block(r, start, stop)[cells - start])
        else:
            parts.append(np.stack([stream.block(r, int(c), int(c) + 1)[0] for c in cells]))
    return np.ascontiguousarray(np.concatenate(parts, axis=1))


def _run_lanes(stream: CellStream, start: int, stop: int, kernel) -> np.ndarray:
    """Run `kernel(words, words_per_lane, lanes, out, status)` on lanes [start, stop) with round 0, then
    re-run every lane that ran out of bits with twice the rounds until none does (same prefix: the value
    an unbounded stream gives)."""
    round0 = stream.block(0, start, stop)
    out = np.empty(stop - start, dtype=np.int64)
    status = np.zeros(stop - start, dtype=np.uint8)
    kernel(round0, WORDS_PER_CELL, np.arange(stop - start), out, status)
    missing = np.flatnonzero(status) + start
    rounds = 1
    while missing.size:
        rounds *= 2
        words = _words_for_rounds(stream, missing, rounds, (start, stop), round0)
        values = np.empty(missing.size, dtype=np.int64)
        again = np.zeros(missing.size, dtype=np.uint8)
        kernel(words, rounds * WORDS_PER_CELL, missing - start, values, again)
        done = again == 0
        out[missing[done] - start] = values[done]
        missing = missing[~done]
    return out


def _sample_chunk(stream: CellStream, start: int, stop: int, kind: int, p1: int, p2: int) -> np.ndarray:
    def kernel(words, per_lane, lanes, out, status):
        _exact.sample(kind, words, per_lane, p1, p2, out, status)

    return _run_lanes(stream, start, stop, kernel)


def sample_cells(stream: CellStream, start: int, stop: int, kind: str, parameter: Fraction) -> np.ndarray:
    """Noise for cells [start, stop) of one table: `kind` is discrete_laplace (parameter = scale)
    or discrete_gaussian (parameter = sigma2). The same cells give the same values in any batching."""
    code, p1, p2 = _kernel_parameters(kind, parameter)
    out = np.empty(stop - start, dtype=np.int64)
    for chunk_start in range(start, stop, CHUNK_CELLS):
        chunk_stop = min(chunk_start + CHUNK_CELLS, stop)
        out[chunk_start - start: chunk_stop - start] = _sample_chunk(stream, chunk_start, chunk_stop, code, p1, p2)
    return out


PROPOSALS_PER_CANDIDATE = 16
"""A selection among m candidates makes at least 16m proposals (see `select_cells`)."""
SELECTION_BITS_PER_PROPOSAL = 12
"""Bits a proposal's acceptance step reads, generously (its mean is a few bits); with twice the uniform
draw's bits this sizes a lane's stream so that running out (and a re-run) is rare."""
SELECTION_CHUNK_BYTES = 64 << 20


def selection_rounds(m: int) -> int:
    """Keystream rounds given to each lane of a selection among m candidates: enough for its padded
    proposals with a wide margin (a public function of m only)."""
    bits = PROPOSALS_PER_CANDIDATE * m * (2 * max(1, (m - 1).bit_length()) + SELECTION_BITS_PER_PROPOSAL)
    return -(-(bits + 256) // (64 * WORDS_PER_CELL))


def select_cells(stream: CellStream, start: int, stop: int, scores: np.ndarray, epsilon: Fraction,
                 sensitivity: int) -> np.ndarray:
    """Exponential mechanism for lanes [start, stop): lane i picks j in 0..m-1 with probability proportional
    to exp(-epsilon * (scores[i, j] - min_j scores[i]) / (2 * sensitivity)), exactly, from its own stream.

    Running time independent of the scores: each lane makes at least PROPOSALS_PER_CANDIDATE * m
    proposals (uniform candidate, exact Bernoulli acceptance), keeping the first accepted one, so the
    number of proposals differs between inputs only when no proposal among the first 16m is accepted
    (probability below exp(-16) = 1.1e-7, as each is accepted with probability >= 1/m), and every lane's
    stream is sized from m alone. What still varies with the scores is the cost of each acceptance step
    (none when a cell's candidates all score alike, as in an empty cell; up to 2x per selection, measured in
    `benchmarks/selection_timing.py`): not eliminated, stated in the README. The value is the one the unpadded rejection
    sampler returns on the same bits (`samplers_reference.select_cells_reference`)."""
    scores = np.ascontiguousarray(scores, dtype=np.int64)
    num, den = epsilon.numerator, 2 * sensitivity * epsilon.denominator
    if num > 2**62 or den > 2**62:
        raise ValueError(f"epsilon {epsilon} and sensitivity {sensitivity} exceed the selection kernel's 62 bits")
    m = scores.shape[1]
    proposals = PROPOSALS_PER_CANDIDATE * m
    rounds = selection_rounds(m)
    chunk = max(1, min(CHUNK_CELLS, SELECTION_CHUNK_BYTES // (rounds * WORDS_PER_CELL * 8)))
    out = np.empty(stop - start, dtype=np.int64)
    for chunk_start in range(start, stop, chunk):
        chunk_stop = min(chunk_start + chunk, stop)
        block = scores[chunk_start - start: chunk_stop - start]

        def kernel(words, per_lane, lanes, values, status, block=block):
            _exact.select(words, per_lane, np.ascontiguousarray(block[lanes]), m, num, den, values, status, proposals)

        out[chunk_start - start: chunk_stop - start] = _run_sized_lanes(stream, chunk_start, chunk_stop, rounds,
                                                                        kernel)
    return out


def _run_sized_lanes(stream: CellStream, start: int, stop: int, rounds: int, kernel) -> np.ndarray:
    """`_run_lanes` starting from `rounds` rounds per lane (one cipher call), doubling for the rare lane
    that runs out: the same values, since a lane's bit stream has the same prefix at any length."""
    out = np.empty(stop - start, dtype=np.int64)
    lanes = np.arange(stop - start)
    while lanes.size:
        if lanes.size == stop - start:
            words = stream.lane_rounds(start, stop, rounds)
        else:
            words = np.concatenate([stream.lane_rounds(start + lane, start + lane + 1, rounds) for lane in lanes.tolist()])
        values = np.empty(lanes.size, dtype=np.int64)
        status = np.zeros(lanes.size, dtype=np.uint8)
        kernel(words, rounds * WORDS_PER_CELL, lanes, values, status)
        done = status == 0
        out[lanes[done]] = values[done]
        lanes = lanes[~done]
        rounds *= 2
    return out


def table_noise(key, table: str, mechanism, start: int, stop: int) -> np.ndarray:
    """Noise of cells [start, stop) of one table: from the table's own keyed stream, for its
    calibrated mechanism (`dprelease.accounting.mechanisms`)."""
    return sample_cells(CellStream.for_table(key, table), start, stop, mechanism.kind, mechanism.parameter)


FAIL_FIRST_ATTEMPT_ENV = "DPRELEASE_TEST_FAIL_FIRST_ATTEMPT"
"""Test hook, read when a job is built: makes the noise stage fail on first attempts (Spark: 'noise';
Beam: 'noise:DIR', a marker file per range in DIR), or (Spark: 'groups') every post-processing group's first
attempt after it wrote its parts, to show that retries change nothing."""
