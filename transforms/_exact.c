/*
 * Exact discrete Laplace and discrete Gaussian samplers (Canonne, Kamath, Steinke 2020,
 * Algorithms 1-3) and the exponential mechanism by exact rejection, one lane (cell) at a time,
 * reading only that lane's random bits.
 *
 * Randomness: lane i owns the bit stream words[i*W .. (i+1)*W) (little-endian 64-bit words,
 * each read from its least significant bit). A lane that needs more bits than it was given
 * stops with status 1; the caller re-runs it from scratch with a longer stream whose prefix
 * is the same, so the result is the one an unbounded stream would give.
 *
 * Exactness: only integer arithmetic. Bernoulli(num/den) compares the bits of a uniform U
 * with the binary expansion of num/den (long division) until they differ: P(U < p) = p.
 * Uniform{0..m-1} draws bit_length(m-1) bits and rejects values >= m.
 * One deviation, stated wherever the samplers claim exactness: a Bernoulli(exp(-gamma)) step whose
 * gamma exceeds GAMMA_CAP = 2^62 (or, in the discrete Gaussian, whose |z b t - a| needs more than 63 bits,
 * which implies gamma > 2^40) draws Bernoulli(exp(-2^62)) instead. Both probabilities are below
 * exp(-2^40), so the output distribution differs from the exact one in total variation by at most
 * exp(-2^40) times the sampler's expected number of proposals (a few for the noise samplers, at most m
 * for a selection among m candidates) per draw: unobservable, and far below any delta a release states.
 *
 * dprelease.transforms.samplers_reference implements the same bit-for-bit in numpy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef struct {
    const uint64_t *words;
    uint64_t nwords;
    uint64_t next;   /* index of the next word to load */
    uint64_t cache;  /* unread bits of the current word, next bit lowest */
    unsigned avail;  /* number of unread bits in cache */
    int exhausted;
} bits_t;

/* The next n (1..63) bits of the stream, the first read as the least significant. */
static inline uint64_t take(bits_t *b, unsigned n)
{
    if (n <= b->avail) {
        uint64_t v = b->cache & ((UINT64_C(1) << n) - 1);
        b->cache = n == 64 ? 0 : b->cache >> n;
        b->avail -= n;
        return v;
    }
    if (b->exhausted || b->next >= b->nwords) {
        b->exhausted = 1;
        return 0;
    }
    unsigned have = b->avail, rest = n - have;
    uint64_t w = b->words[b->next++];
    uint64_t v = (b->cache | (w << have)) & ((UINT64_C(1) << n) - 1);
    b->cache = w >> rest;
    b->avail = 64 - rest;
    return v;
}

static inline int take_bit(bits_t *b)
{
    if (b->avail) {
        int v = (int)(b->cache & 1);
        b->cache >>= 1;
        b->avail--;
        return v;
    }
    return (int)take(b, 1);
}

static inline unsigned bit_length(uint64_t x) { return x ? 64u - (unsigned)__builtin_clzll(x) : 0u; }

/* Uniform on {0, ..., m-1}, 1 <= m <= 2^63. */
static uint64_t uniform_below(bits_t *b, uint64_t m)
{
    if (m <= 1)
        return 0;
    unsigned n = bit_length(m - 1);
    for (;;) {
        uint64_t v = take(b, n);
        if (b->exhausted)
            return 0;
        if (v < m)
            return v;
    }
}

typedef unsigned __int128 u128;

/* Bernoulli(num / den) by comparing the binary expansion of num/den with uniform bits, one width per
   instance (64-bit for den <= 2^63, the hot path; 128-bit for den < 2^126): both consume the same bits
   and give the same answer for the same rational. */
#define DEFINE_BERNOULLI_FRAC(NAME, UINT)                                                              \
    static int NAME(bits_t *b, UINT num, UINT den)                                                     \
    {                                                                                                  \
        if (num == 0)                                                                                  \
            return 0;                                                                                  \
        if (num >= den)                                                                                \
            return 1;                                                                                  \
        UINT r = num;                                                                                  \
        for (;;) {                                                                                     \
            r <<= 1;                                                                                   \
            int pbit = r >= den;                                                                       \
            if (pbit)                                                                                  \
                r -= den;                                                                              \
            int ubit = take_bit(b);                                                                    \
            if (b->exhausted)                                                                          \
                return 0;                                                                              \
            if (ubit != pbit)                                                                          \
                return ubit < pbit;                                                                    \
            if (r == 0)                                                                                \
                return 0;                                                                              \
        }                                                                                              \
    }

/* Bernoulli(exp(-num/den)) for 0 <= num <= den (Algorithm 1), on the matching Bernoulli(num/den). */
#define DEFINE_BERNOULLI_EXP_FRACTION(NAME, FRAC, UINT)                                                \
    static int NAME(bits_t *b, UINT num, UINT den)                                                     \
    {                                                                                                  \
        uint64_t k = 1;                                                                                \
        for (;;) {                                                                                     \
            int a = FRAC(b, num, den);                                                                 \
            if (a && k > 1)                                                                            \
                a = bernoulli_frac(b, 1, k);                                                           \
            if (b->exhausted)                                                                          \
                return 0;                                                                              \
            if (!a)                                                                                    \
                return (int)(k & 1);                                                                   \
            k++;                                                                                       \
        }                                                                                              \
    }

DEFINE_BERNOULLI_FRAC(bernoulli_frac, uint64_t)
DEFINE_BERNOULLI_FRAC(bernoulli_frac_wide, u128)
DEFINE_BERNOULLI_EXP_FRACTION(bernoulli_exp_fraction, bernoulli_frac, uint64_t)
DEFINE_BERNOULLI_EXP_FRACTION(bernoulli_exp_fraction_wide, bernoulli_frac_wide, u128)

/* Bernoulli(exp(-(whole + num/den))), 0 <= num < den < 2^126. */
static int bernoulli_exp_wide(bits_t *b, uint64_t whole, u128 num, u128 den)
{
    for (uint64_t i = 0; i < whole; i++) {
        if (!bernoulli_exp_fraction(b, 1, 1) || b->exhausted)
            return 0;
    }
    if (!(den >> 63))
        return bernoulli_exp_fraction(b, (uint64_t)num, (uint64_t)den);
    return bernoulli_exp_fraction_wide(b, num, den);
}

/* Bernoulli(exp(-(whole + num/den))), 0 <= num < den <= 2^63. */
static int bernoulli_exp(bits_t *b, uint64_t whole, uint64_t num, uint64_t den)
{
    return bernoulli_exp_wide(b, whole, num, den);
}

/* Discrete Laplace with scale t/s (Algorithm 2). */
static int64_t discrete_laplace(bits_t *b, uint64_t t, uint64_t s)
{
    for (;;) {
        uint64_t u = uniform_below(b, t);
        if (!bernoulli_exp_fraction(b, u, t)) {
            if (b->exhausted)
                return 0;
            continue;
        }
        uint64_t v = 0;
        while (bernoulli_exp_fraction(b, 1, 1) && !b->exhausted)
            v++;
        int neg = take_bit(b);
        if (b->exhausted)
            return 0;
        uint64_t y = (u + t * v) / s;
        if (neg && y == 0)
            continue;
        return neg ? -(int64_t)y : (int64_t)y;
    }
}

#define GAMMA_CAP (UINT64_C(1) << 62)

/* Discrete Gaussian with sigma2 = a/bb (Algorithm 3); t = floor(sigma) + 1, d = 2 a bb t^2 < 2^86.
 * With d < 2^62 every quantity is the 64-bit one of earlier versions (same bits, same values). */
static int64_t discrete_gaussian(bits_t *b, uint64_t a, uint64_t bb, uint64_t t, u128 d)
{
    for (;;) {
        int64_t y = discrete_laplace(b, t, 1);
        if (b->exhausted)
            return 0;
        uint64_t z = y < 0 ? (uint64_t)(-y) : (uint64_t)y;
        __int128 e = (__int128)z * bb * t - (__int128)a;
        u128 ea = (u128)(e < 0 ? -e : e);
        uint64_t whole;
        u128 frac;
        if (ea >> 63) {
            whole = GAMMA_CAP; /* gamma >= 2^126 / d > 2^40: acceptance below exp(-2^40) either way */
            frac = 0;
        } else {
            u128 sq = ea * ea;
            u128 q = sq / d;
            whole = q > GAMMA_CAP ? GAMMA_CAP : (uint64_t)q;
            frac = sq % d;
        }
        if (bernoulli_exp_wide(b, whole, frac, d))
            return y;
        if (b->exhausted)
            return 0;
    }
}

/* The exponential mechanism over m candidates with integer scores (lower is better; min subtracted):
 * P(j) proportional to exp(-score_j * num / den). Rejection: propose j uniformly, accept with probability
 * exp(-(score_j - min) * num / den) (exact Bernoulli), so the first accepted j has exactly that distribution.
 * Running time: the proposals continue, their outcomes ignored, until at least `proposals` were made, so a
 * selection whose first acceptance comes before that does the same number of proposals whatever the scores
 * (the caller sets proposals = PROPOSALS_PER_CANDIDATE * m: each proposal is accepted with probability at least
 * 1/m, so a later first acceptance has probability below exp(-PROPOSALS_PER_CANDIDATE)). The chosen index is
 * the one the unpadded rejection sampler returns on the same bits. */
static int64_t exponential_select(bits_t *b, const uint64_t *whole, const uint64_t *frac, uint64_t m, uint64_t den,
                                  uint64_t proposals)
{
    int64_t chosen = -1;
    for (uint64_t made = 0;; made++) {
        if (chosen >= 0 && made >= proposals)
            return chosen;
        uint64_t j = uniform_below(b, m);
        if (b->exhausted)
            return 0;
        int accepted = bernoulli_exp(b, whole[j], frac[j], den);
        if (b->exhausted)
            return 0;
        if (accepted && chosen < 0)
            chosen = (int64_t)j;
    }
}

/* Each candidate's exponent (score_j - min) * num / den as whole + frac / den (whole capped at GAMMA_CAP):
 * computed once per lane, m divisions whatever the scores, so the proposals' loop divides nothing. */
static void selection_exponents(const int64_t *scores, uint64_t m, uint64_t num, uint64_t den, uint64_t *whole,
                                uint64_t *frac)
{
    int64_t best = scores[0];
    for (uint64_t j = 1; j < m; j++)
        if (scores[j] < best)
            best = scores[j];
    for (uint64_t j = 0; j < m; j++) {
        u128 gamma = (u128)(uint64_t)(scores[j] - best) * num;
        u128 q = gamma / den;
        whole[j] = q > GAMMA_CAP ? GAMMA_CAP : (uint64_t)q;
        frac[j] = (uint64_t)(gamma % den);
    }
}

static uint64_t isqrt_floor(uint64_t x)
{
    uint64_t r = (uint64_t)__builtin_sqrt((double)x);
    while (r * r > x)
        r--;
    while ((r + 1) * (r + 1) <= x)
        r++;
    return r;
}

/* sample(kind, words, words_per_lane, p1, p2, out, status) -> lanes that ran out of bits */
static PyObject *py_sample(PyObject *self, PyObject *args)
{
    int kind;
    Py_buffer words, out, status;
    Py_ssize_t per_lane;
    unsigned long long p1, p2;
    if (!PyArg_ParseTuple(args, "iy*nKKw*w*", &kind, &words, &per_lane, &p1, &p2, &out, &status))
        return NULL;
    Py_ssize_t lanes = out.len / (Py_ssize_t)sizeof(int64_t);
    PyObject *result = NULL;
    if (kind < 0 || kind > 1 || per_lane <= 0 || p1 == 0 || p2 == 0 || p1 > (UINT64_C(1) << 62) ||
        p2 > (UINT64_C(1) << 62) || words.len != lanes * per_lane * (Py_ssize_t)sizeof(uint64_t) ||
        status.len != lanes) {
        PyErr_SetString(PyExc_ValueError, "sample: inconsistent arguments");
        goto done;
    }
    const uint64_t *w = (const uint64_t *)words.buf;
    int64_t *o = (int64_t *)out.buf;
    uint8_t *st = (uint8_t *)status.buf;
    Py_ssize_t missing = 0;
    uint64_t t = 0;
    u128 d = 0;
    if (kind == 1) {
        t = isqrt_floor(p1 / p2) + 1;
        if (t >> 32) {
            PyErr_SetString(PyExc_ValueError, "sample: sigma too large");
            goto done;
        }
        d = (u128)2 * p1 * p2 * t * t;
        if (d >> 86) {
            PyErr_SetString(PyExc_ValueError, "sample: 2 a b t^2 must be below 2^86");
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < lanes; i++) {
        bits_t b = {w + i * per_lane, (uint64_t)per_lane, 0, 0, 0, 0};
        o[i] = kind == 0 ? discrete_laplace(&b, p1, p2) : discrete_gaussian(&b, p1, p2, t, d);
        st[i] = (uint8_t)b.exhausted;
        missing += b.exhausted;
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(missing);
done:
    PyBuffer_Release(&words);
    PyBuffer_Release(&out);
    PyBuffer_Release(&status);
    return result;
}

/* select(words, words_per_lane, scores, m, num, den, out, status, proposals) -> lanes that ran out of bits */
static PyObject *py_select(PyObject *self, PyObject *args)
{
    Py_buffer words, scores, out, status;
    Py_ssize_t per_lane, m;
    unsigned long long num, den, proposals;
    if (!PyArg_ParseTuple(args, "y*ny*nKKw*w*K", &words, &per_lane, &scores, &m, &num, &den, &out, &status,
                          &proposals))
        return NULL;
    Py_ssize_t lanes = out.len / (Py_ssize_t)sizeof(int64_t);
    PyObject *result = NULL;
    if (per_lane <= 0 || m <= 0 || den == 0 || den > (UINT64_C(1) << 62) ||
        words.len != lanes * per_lane * (Py_ssize_t)sizeof(uint64_t) ||
        scores.len != lanes * m * (Py_ssize_t)sizeof(int64_t) || status.len != lanes) {
        PyErr_SetString(PyExc_ValueError, "select: inconsistent arguments");
        goto done;
    }
    const uint64_t *w = (const uint64_t *)words.buf;
    const int64_t *sc = (const int64_t *)scores.buf;
    int64_t *o = (int64_t *)out.buf;
    uint8_t *st = (uint8_t *)status.buf;
    Py_ssize_t missing = 0;
    uint64_t *exponents = PyMem_RawMalloc(2 * (size_t)m * sizeof(uint64_t));
    if (exponents == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < lanes; i++) {
        bits_t b = {w + i * per_lane, (uint64_t)per_lane, 0, 0, 0, 0};
        selection_exponents(sc + i * m, (uint64_t)m, num, den, exponents, exponents + m);
        o[i] = exponential_select(&b, exponents, exponents + m, (uint64_t)m, den, proposals);
        st[i] = (uint8_t)b.exhausted;
        missing += b.exhausted;
    }
    Py_END_ALLOW_THREADS
    PyMem_RawFree(exponents);
    result = PyLong_FromSsize_t(missing);
done:
    PyBuffer_Release(&words);
    PyBuffer_Release(&scores);
    PyBuffer_Release(&out);
    PyBuffer_Release(&status);
    return result;
}

static PyMethodDef methods[] = {
    {"sample", py_sample, METH_VARARGS,
     "sample(kind, words, words_per_lane, p1, p2, out, status) -> number of lanes out of bits.\n"
     "kind 0: discrete Laplace, scale p1/p2; kind 1: discrete Gaussian, sigma2 p1/p2."},
    {"select", py_select, METH_VARARGS,
     "select(words, words_per_lane, scores, m, num, den, out, status, proposals) -> number of lanes out of bits.\n"
     "Per lane: index j of m with probability proportional to e^-((score_j - min) * num / den); at least\n"
     "`proposals` proposals are made whatever the scores (the first accepted one is returned)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_exact", "Exact integer samplers (C kernel).", -1, methods};

PyMODINIT_FUNC PyInit__exact(void) { return PyModule_Create(&module); }
