"""A numpy reference of the exact samplers, bit-for-bit identical to the C kernel (`_exact.c`).

Each function runs the same algorithm on a whole array of lanes, with the rejection loops
over masked subsets; a lane reads the same bits in the same order as the C kernel, so both
give identical noise for the same keystream. Slower than the kernel: the tests use it as an
independent second implementation of the same algorithms, demanding identical output.
"""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from .csprng import WORDS_PER_CELL, CellStream

GAMMA_CAP = 2**62


class LaneBits:
    """The bit streams of cells [start, stop): lane i reads round 0, 1, ... of cell start+i."""

    def __init__(self, stream: CellStream, start: int, stop: int):
        self._stream = stream
        self._start = start
        self._round0 = stream.block(0, start, stop)
        self._later: dict[tuple[int, int], np.ndarray] = {}
        self.position = np.zeros(stop - start, dtype=np.int64)

    def _words(self, lanes: np.ndarray, index: np.ndarray) -> np.ndarray:
        out = np.empty(lanes.size, dtype=np.uint64)
        rounds, offsets = np.divmod(index, WORDS_PER_CELL)
        first = rounds == 0
        out[first] = self._round0[lanes[first], offsets[first]]
        for i in np.flatnonzero(~first):
            key = (int(lanes[i]), int(rounds[i]))
            if key not in self._later:
                cell = self._start + key[0]
                self._later[key] = self._stream.block(key[1], cell, cell + 1)[0]
            out[i] = self._later[key][offsets[i]]
        return out

    def take(self, lanes: np.ndarray, nbits) -> np.ndarray:
        """The next `nbits` (1..63, per lane) bits of each lane, least significant first."""
        nbits = np.broadcast_to(np.asarray(nbits, dtype=np.int64), lanes.shape)
        position = self.position[lanes]
        index, offset = np.divmod(position, 64)
        value = self._words(lanes, index) >> offset.astype(np.uint64)
        straddle = np.flatnonzero(offset + nbits > 64)
        if straddle.size:
            high = self._words(lanes[straddle], index[straddle] + 1)
            value[straddle] |= high << (64 - offset[straddle]).astype(np.uint64)
        self.position[lanes] = position + nbits
        return value & ((np.uint64(1) << nbits.astype(np.uint64)) - np.uint64(1))


def uniform_below(src: LaneBits, lanes: np.ndarray, bound) -> np.ndarray:
    """Uniform on {0..m-1} (m <= 2^63): bit_length(m-1) bits per try, reject values >= m."""
    bound = np.broadcast_to(np.asarray(bound, dtype=np.uint64), lanes.shape)
    out = np.zeros(lanes.size, dtype=np.uint64)
    nbits = np.array([int(m - 1).bit_length() if m > 1 else 0 for m in bound.tolist()], dtype=np.int64)
    pending = np.flatnonzero(bound > 1)
    while pending.size:
        values = src.take(lanes[pending], nbits[pending])
        accepted = values < bound[pending]
        out[pending[accepted]] = values[accepted]
        pending = pending[~accepted]
    return out


def bernoulli_fraction(src: LaneBits, lanes: np.ndarray, num, den) -> np.ndarray:
    """Bernoulli(num/den): compare a uniform's bits with the binary expansion of num/den."""
    num = np.broadcast_to(np.asarray(num, dtype=np.uint64), lanes.shape)
    den = np.broadcast_to(np.asarray(den, dtype=np.uint64), lanes.shape)
    result = (num >= den) & (num > 0)
    remainder = num.copy()
    pending = np.flatnonzero((num > 0) & (num < den))
    while pending.size:
        r = remainder[pending] << np.uint64(1)
        p_bit = r >= den[pending]
        r = np.where(p_bit, r - den[pending], r)
        remainder[pending] = r
        u_bit = src.take(lanes[pending], 1) == 1
        differ = u_bit != p_bit
        result[pending[differ]] = (p_bit & ~u_bit)[differ]
        pending = pending[~differ & (r != 0)]
    return result


def bernoulli_exp_fraction(src: LaneBits, lanes: np.ndarray, num, den) -> np.ndarray:
    """Bernoulli(exp(-num/den)) for 0 <= num <= den (CKS20 Algorithm 1)."""
    num = np.broadcast_to(np.asarray(num, dtype=np.uint64), lanes.shape)
    den = np.broadcast_to(np.asarray(den, dtype=np.uint64), lanes.shape)
    result = np.empty(lanes.size, dtype=bool)
    k = np.ones(lanes.size, dtype=np.uint64)
    pending = np.arange(lanes.size)
    while pending.size:
        success = bernoulli_fraction(src, lanes[pending], num[pending], den[pending])
        needs_k = np.flatnonzero(success & (k[pending] > 1))
        if needs_k.size:
            idx = pending[needs_k]
            success[needs_k] = bernoulli_fraction(src, lanes[idx], 1, k[idx])
        stopped = pending[~success]
        result[stopped] = (k[stopped] % np.uint64(2)) == 1
        pending = pending[success]
        k[pending] += np.uint64(1)
    return result


def _bernoulli_fraction_one(src: LaneBits, lane: int, num: int, den: int) -> bool:
    """Bernoulli(num/den) for one lane, in Python integers (any size): the kernel's 128-bit path."""
    if num == 0:
        return False
    if num >= den:
        return True
    r = num
    while True:
        r <<= 1
        p_bit = r >= den
        if p_bit:
            r -= den
        u_bit = bool(src.take(np.array([lane]), 1)[0])
        if u_bit != p_bit:
            return p_bit and not u_bit
        if r == 0:
            return False


def _bernoulli_exp_fraction_one(src: LaneBits, lane: int, num: int, den: int) -> bool:
    """Bernoulli(exp(-num/den)) for one lane (CKS20 Algorithm 1), Python integers."""
    k = 1
    while True:
        success = _bernoulli_fraction_one(src, lane, num, den)
        if success and k > 1:
            success = _bernoulli_fraction_one(src, lane, 1, k)
        if not success:
            return k % 2 == 1
        k += 1


def bernoulli_exp(src: LaneBits, lanes: np.ndarray, whole, num, den) -> np.ndarray:
    """Bernoulli(exp(-(whole + num/den))), 0 <= num < den (den beyond 64 bits: lane by lane)."""
    if int(den) >= 2**63:
        whole = np.broadcast_to(np.asarray(whole, dtype=np.int64), lanes.shape)
        nums = list(num) if isinstance(num, (list, np.ndarray)) else [num] * lanes.size
        out = np.empty(lanes.size, dtype=bool)
        for i, lane in enumerate(lanes.tolist()):
            alive = True
            for _ in range(int(whole[i])):
                if not _bernoulli_exp_fraction_one(src, lane, 1, 1):
                    alive = False
                    break
            out[i] = alive and _bernoulli_exp_fraction_one(src, lane, int(nums[i]), int(den))
        return out
    result = np.ones(lanes.size, dtype=bool)
    remaining = np.broadcast_to(np.asarray(whole, dtype=np.int64), lanes.shape).copy()
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


def discrete_laplace(src: LaneBits, lanes: np.ndarray, scale: Fraction) -> np.ndarray:
    """Discrete Laplace, P(x) proportional to exp(-|x|/scale) (CKS20 Algorithm 2)."""
    t, s = scale.numerator, scale.denominator
    out = np.empty(lanes.size, dtype=np.int64)
    pending = np.arange(lanes.size)
    while pending.size:
        u = uniform_below(src, lanes[pending], t)
        kept = bernoulli_exp_fraction(src, lanes[pending], u, t)
        retry = pending[~kept]
        pending, u = pending[kept], u[kept].astype(np.int64)
        v = np.zeros(pending.size, dtype=np.int64)
        geometric = np.arange(pending.size)
        while geometric.size:
            more = bernoulli_exp_fraction(src, lanes[pending[geometric]], 1, 1)
            geometric = geometric[more]
            v[geometric] += 1
        negative = src.take(lanes[pending], 1) == 1
        y = (u + t * v) // s
        rejected = negative & (y == 0)
        out[pending[~rejected]] = np.where(negative, -y, y)[~rejected]
        pending = np.sort(np.concatenate((retry, pending[rejected])))
    return out


def _split_gamma(abs_y: np.ndarray, a: int, b: int, t: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(floor(gamma) capped at 2^62, numerator of its fractional part, D) for
    gamma = (|Y| - sigma2/t)^2 / (2 sigma2) = e^2 / D, e = |Y| b t - a, D = 2 a b t^2."""
    d = 2 * a * b * t * t
    whole = np.empty(abs_y.size, dtype=np.int64)
    frac = np.empty(abs_y.size, dtype=np.uint64 if d < 2**63 else object)
    for i, z in enumerate(abs_y.tolist()):
        e = abs(z * b * t - a)
        if e >= 2**63:
            whole[i], frac[i] = GAMMA_CAP, 0
        else:
            w, r = divmod(e * e, d)
            whole[i], frac[i] = min(w, GAMMA_CAP), r
    return whole, frac, d


def discrete_gaussian(src: LaneBits, lanes: np.ndarray, sigma2: Fraction) -> np.ndarray:
    """Discrete Gaussian, P(x) proportional to exp(-x^2/(2 sigma2)) (CKS20 Algorithm 3)."""
    a, b = sigma2.numerator, sigma2.denominator
    t = math.isqrt(a // b) + 1
    out = np.empty(lanes.size, dtype=np.int64)
    pending = np.arange(lanes.size)
    while pending.size:
        y = discrete_laplace(src, lanes[pending], Fraction(t))
        whole, frac, d = _split_gamma(np.abs(y), a, b, t)
        accepted = bernoulli_exp(src, lanes[pending], whole, frac, d)
        out[pending[accepted]] = y[accepted]
        pending = pending[~accepted]
    return out


def exponential_select(src: LaneBits, lanes: np.ndarray, scores: np.ndarray, num: int, den: int) -> np.ndarray:
    """Index j of each lane's row of `scores`, with probability proportional to exp(-(score_j - min) num/den):
    propose j uniformly, accept with an exact Bernoulli(exp(-(score_j - min) num / den))."""
    m = scores.shape[1]
    best = scores.min(axis=1)
    out = np.empty(lanes.size, dtype=np.int64)
    pending = np.arange(lanes.size)
    while pending.size:
        j = uniform_below(src, lanes[pending], m).astype(np.int64)
        gammas = [int(scores[p, c] - best[p]) * num for p, c in zip(pending.tolist(), j.tolist())]
        whole = np.array([min(g // den, GAMMA_CAP) for g in gammas], dtype=np.int64)
        frac = np.array([g % den for g in gammas], dtype=np.uint64)
        accepted = bernoulli_exp(src, lanes[pending], whole, frac, den)
        out[pending[accepted]] = j[accepted]
        pending = pending[~accepted]
    return out


def select_cells_reference(stream: CellStream, start: int, stop: int, scores: np.ndarray, epsilon: Fraction,
                           sensitivity: int) -> np.ndarray:
    """The exponential mechanism for lanes [start, stop), computed by the numpy reference."""
    src = LaneBits(stream, start, stop)
    return exponential_select(src, np.arange(stop - start), np.asarray(scores, dtype=np.int64),
                              epsilon.numerator, 2 * sensitivity * epsilon.denominator)


def sample_cells_reference(stream: CellStream, start: int, stop: int, kind: str, parameter: Fraction) -> np.ndarray:
    """Noise of cells [start, stop), computed by the numpy reference."""
    src = LaneBits(stream, start, stop)
    lanes = np.arange(stop - start)
    if kind == "discrete_laplace":
        return discrete_laplace(src, lanes, parameter)
    return discrete_gaussian(src, lanes, parameter)
