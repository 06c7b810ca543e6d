"""Exact, vectorized samplers of the discrete Laplace and discrete Gaussian distributions.

Algorithms 1-3 of Canonne, Kamath, Steinke, "The Discrete Gaussian for Differential
Privacy" (NeurIPS 2020), run on whole arrays of lanes (one lane per cell) with the
rejection loops over masked subsets of lanes. Only integer arithmetic on uniform words
from the keyed stream is used: the output distribution is exactly the target one
(no floating point anywhere). Each lane reads only its own cell's words, in a fixed
order, so a cell's value does not depend on which other cells share its batch.
"""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from .csprng import WORDS_PER_CELL, CellStream

_U64_MAX = np.uint64(2**64 - 1)
CHUNK_CELLS = 1 << 16


class LaneWords:
    """Uniform 64-bit words for the cells [start, stop): lane i reads cell start+i's slice."""

    def __init__(self, stream: CellStream, start: int, stop: int):
        self._stream = stream
        self._start = start
        self._words = stream.block(0, start, stop)
        self._cursor = np.zeros(stop - start, dtype=np.int64)
        self._round = np.zeros(stop - start, dtype=np.int64)

    def take(self, lanes: np.ndarray) -> np.ndarray:
        """The next word of each lane in `lanes` (distinct lane indices)."""
        cursor = self._cursor[lanes]
        exhausted = cursor >= WORDS_PER_CELL
        if exhausted.any():
            for lane in lanes[exhausted]:
                self._round[lane] += 1
                cell = self._start + int(lane)
                self._words[lane] = self._stream.block(int(self._round[lane]), cell, cell + 1)[0]
                self._cursor[lane] = 0
            cursor = self._cursor[lanes]
        self._cursor[lanes] = cursor + 1
        return self._words[lanes, cursor]


def uniform_below(src: LaneWords, lanes: np.ndarray, bound) -> np.ndarray:
    """Uniform integers in [0, bound) per lane (bound <= 2^63), by rejection of 64-bit words."""
    bound = np.broadcast_to(np.asarray(bound, dtype=np.uint64), lanes.shape)
    remainder = (_U64_MAX % bound + np.uint64(1)) % bound
    threshold = _U64_MAX - remainder
    out = np.empty(lanes.size, dtype=np.uint64)
    pending = np.arange(lanes.size)
    while pending.size:
        words = src.take(lanes[pending])
        accepted = words <= threshold[pending]
        done = pending[accepted]
        out[done] = words[accepted] % bound[done]
        pending = pending[~accepted]
    return out


def bernoulli_exp_fraction(src: LaneWords, lanes: np.ndarray, num, den) -> np.ndarray:
    """Bernoulli(exp(-num/den)) for 0 <= num <= den < 2^63 (CKS20 Algorithm 1).

    K = 1; repeat A ~ Bernoulli(gamma / K) until A = 0; return K odd. Bernoulli(gamma/K)
    is drawn as Bernoulli(num/den) AND Bernoulli(1/K), independent, which keeps every
    integer below 2^63.
    """
    num = np.broadcast_to(np.asarray(num, dtype=np.uint64), lanes.shape)
    den = np.broadcast_to(np.asarray(den, dtype=np.uint64), lanes.shape)
    result = np.empty(lanes.size, dtype=bool)
    k = np.ones(lanes.size, dtype=np.uint64)
    pending = np.arange(lanes.size)
    while pending.size:
        success = uniform_below(src, lanes[pending], den[pending]) < num[pending]
        needs_k = success & (k[pending] > 1)
        if needs_k.any():
            idx = pending[needs_k]
            success[needs_k] = uniform_below(src, lanes[idx], k[idx]) == 0
        stopped = pending[~success]
        result[stopped] = (k[stopped] % np.uint64(2)) == 1
        pending = pending[success]
        k[pending] += np.uint64(1)
    return result


def bernoulli_exp(src: LaneWords, lanes: np.ndarray, whole: np.ndarray, num, den) -> np.ndarray:
    """Bernoulli(exp(-(whole + num/den))) with 0 <= num < den (CKS20 Algorithm 1, gamma > 1).

    `whole` Bernoulli(exp(-1)) trials must all succeed, then one Bernoulli(exp(-num/den)).
    """
    result = np.ones(lanes.size, dtype=bool)
    remaining = np.asarray(whole, dtype=np.int64).copy()
    pending = np.flatnonzero(remaining > 0)
    while pending.size:
        ok = bernoulli_exp_fraction(src, lanes[pending], 1, 1)
        result[pending[~ok]] = False
        pending = pending[ok]
        remaining[pending] -= 1
        pending = pending[remaining[pending] > 0]
    alive = np.flatnonzero(result)
    num = np.broadcast_to(np.asarray(num, dtype=np.uint64), lanes.shape)
    den = np.broadcast_to(np.asarray(den, dtype=np.uint64), lanes.shape)
    result[alive] = bernoulli_exp_fraction(src, lanes[alive], num[alive], den[alive])
    return result


def discrete_laplace_lanes(src: LaneWords, lanes: np.ndarray, scale: Fraction) -> np.ndarray:
    """Discrete Laplace with P(x) proportional to exp(-|x|/scale) (CKS20 Algorithm 2).

    With scale = t/s: U ~ Uniform{0..t-1}; reject unless Bernoulli(exp(-U/t)); V ~ Geometric
    (Bernoulli(exp(-1)) successes); X = U + tV; Y = floor(X/s); B a fair bit; reject B=1, Y=0;
    return (1-2B) Y.
    """
    t, s = scale.numerator, scale.denominator
    out = np.empty(lanes.size, dtype=np.int64)
    pending = np.arange(lanes.size)
    while pending.size:
        u = uniform_below(src, lanes[pending], t).astype(np.int64)
        kept = bernoulli_exp(src, lanes[pending], np.zeros(pending.size, np.int64), u, t)
        retry = pending[~kept]
        pending, u = pending[kept], u[kept]
        v = np.zeros(pending.size, dtype=np.int64)
        geometric = np.arange(pending.size)
        while geometric.size:
            more = bernoulli_exp_fraction(src, lanes[pending[geometric]], 1, 1)
            geometric = geometric[more]
            v[geometric] += 1
        y = (u + t * v) // s
        negative = uniform_below(src, lanes[pending], 2) == 1
        rejected = negative & (y == 0)
        accepted = ~rejected
        out[pending[accepted]] = np.where(negative, -y, y)[accepted]
        pending = np.sort(np.concatenate((retry, pending[rejected])))
    return out


def _split_gamma(abs_y: np.ndarray, a: int, b: int, t: int) -> tuple[np.ndarray, np.ndarray, int]:
    """gamma = (|Y| - sigma2/t)^2 / (2 sigma2) = e^2 / D with e = |Y| b t - a, D = 2 a b t^2.

    Returns (floor(gamma), numerator of the fractional part, D), exactly; lanes whose e^2
    would overflow 64 bits are computed with Python integers.
    """
    denominator = 2 * a * b * t * t
    whole = np.empty(abs_y.size, dtype=np.int64)
    frac = np.empty(abs_y.size, dtype=np.uint64)
    small = abs_y < (2**31) // (b * t)
    e = abs_y[small] * (b * t) - a
    e_abs = np.abs(e).astype(np.uint64)
    fits = e_abs < np.uint64(2**32)
    sq = e_abs[fits] * e_abs[fits]
    idx = np.flatnonzero(small)
    whole[idx[fits]] = (sq // np.uint64(denominator)).astype(np.int64)
    frac[idx[fits]] = sq % np.uint64(denominator)
    for lane in np.concatenate((np.flatnonzero(~small), idx[~fits])):
        e_big = int(abs_y[lane]) * b * t - a
        w, r = divmod(e_big * e_big, denominator)
        whole[lane] = min(w, 2**62)
        frac[lane] = r
    return whole, frac, denominator


def discrete_gaussian_lanes(src: LaneWords, lanes: np.ndarray, sigma2: Fraction) -> np.ndarray:
    """Discrete Gaussian with P(x) proportional to exp(-x^2/(2 sigma2)) (CKS20 Algorithm 3).

    t = floor(sigma) + 1; Y ~ DLap(t); accept with probability exp(-(|Y| - sigma2/t)^2 / (2 sigma2)).
    """
    a, b = sigma2.numerator, sigma2.denominator
    t = math.isqrt(a // b) + 1
    out = np.empty(lanes.size, dtype=np.int64)
    pending = np.arange(lanes.size)
    while pending.size:
        y = discrete_laplace_lanes(src, lanes[pending], Fraction(t))
        whole, frac, denominator = _split_gamma(np.abs(y), a, b, t)
        accepted = bernoulli_exp(src, lanes[pending], whole, frac, denominator)
        out[pending[accepted]] = y[accepted]
        pending = pending[~accepted]
    return out


def sample_cells(stream: CellStream, start: int, stop: int, kind: str, parameter: Fraction) -> np.ndarray:
    """Noise for cells [start, stop) of one table: `kind` is discrete_laplace (parameter = scale)
    or discrete_gaussian (parameter = sigma2). Same cells give the same values in any batching."""
    sampler = {"discrete_laplace": discrete_laplace_lanes, "discrete_gaussian": discrete_gaussian_lanes}[kind]
    out = np.empty(stop - start, dtype=np.int64)
    for chunk_start in range(start, stop, CHUNK_CELLS):
        chunk_stop = min(chunk_start + CHUNK_CELLS, stop)
        src = LaneWords(stream, chunk_start, chunk_stop)
        lanes = np.arange(chunk_stop - chunk_start)
        out[chunk_start - start: chunk_stop - start] = sampler(src, lanes, parameter)
    return out
