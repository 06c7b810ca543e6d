/*
 * Herding a new attribute's values over the records of each group (a unit's separator value), one record at a
 * time: each earlier value's target row is the model's expectation rounded from a random phase, and each record
 * gets the value its earlier values' targets most need. See transforms/units/dealing.py for what it is for and
 * what it guarantees.
 *
 * Deterministic given its inputs (the records' order, every group's first value to look at and the phases' seed,
 * all drawn by the caller from the public seed): the same records on any machine get the same values (built with
 * -ffp-contract=off, so no compiler fuses the scores' multiply-adds differently and flips a near-tie).
 * Post-processing: published tables, the attributes already drawn and a public seed only.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* A uniform double in [0, 1) from a 64-bit key (splitmix64's finaliser): the random phase of one earlier value's
 * target row in one group, reproducible from the public seed on any machine. */
static double phase(uint64_t seed, uint64_t group, uint64_t attribute, uint64_t value)
{
    uint64_t z = seed ^ (group * 0x9E3779B97F4A7C15ULL) ^ (attribute * 0xC2B2AE3D27D4EB4FULL) ^
                 (value * 0x165667B19E3779F9ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    return (double)(z >> 11) * (1.0 / 9007199254740992.0);
}

/* One group (`index`, for the phases): its records `members[0..n)` (record indices, in the order they are dealt),
 * its `width` values with `quota[v]` records each (adding up to n), the records' earlier codes
 * `codes[j * records + r]` for j < k, the first value `start` a tie goes to. `need` (k tables of sizes[j] x width,
 * at `need[j]`), `seen` and `holding` (k runs of sizes[j] each) are zero on entry and left zero. Writes out[r] =
 * the record's value.
 *
 * Each earlier value a of attribute j gets a target row: holding_j(a) x share_v rounded systematically from a
 * random phase (integers adding up to holding_j(a), each with expectation exactly holding_j(a) x share_v, the
 * model's; share_v = quota_v / n). A record with earlier values a_1..a_k gets, among the values v with quota
 * left, the one maximising
 *     left_v / (n - dealt) + sum over j of  need_j(a_j, v) / (holding_j(a_j) - seen_j(a_j))
 * where need_j(a, v) is the target less the records of (a, v) dealt so far: for each table pairing an earlier
 * attribute with the new one, the records of the record's earlier value that still need v, as a share of those
 * of them not dealt yet. Ties go to the first value from `start` on. */
static void herd_group(const int64_t *members, int64_t n, const int64_t *quota, int64_t width,
                       const int32_t *codes, int64_t records, int64_t k, int64_t start, uint64_t seed,
                       uint64_t index, int32_t **need, int32_t **seen, int32_t **holding, double *share,
                       double *score, int64_t *left, int64_t *out)
{
    if (n == 0)
        return;
    for (int64_t v = 0; v < width; v++) {
        left[v] = quota[v];
        share[v] = (double)quota[v] / (double)n;
    }
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < k; j++)
            holding[j][codes[j * records + members[i]]] += 1;
    for (int64_t i = 0; i < n; i++) {
        int64_t r = members[i];
        double remaining = (double)(n - i);
        for (int64_t v = 0; v < width; v++)
            score[v] = (double)left[v] / remaining;
        for (int64_t j = 0; j < k; j++) {
            int32_t a = codes[j * records + r];
            int32_t *row = need[j] + (int64_t)a * width;
            if (seen[j][a] == 0) { /* the value's target row, systematic from its phase */
                double held = (double)holding[j][a], u = phase(seed, index, (uint64_t)j, (uint64_t)a);
                double cumulative = 0.0;
                int64_t below = 0;
                for (int64_t v = 0; v < width; v++) {
                    cumulative += held * share[v];
                    int64_t upto = v == width - 1 ? holding[j][a] : (int64_t)(cumulative + u);
                    if (upto > holding[j][a])
                        upto = holding[j][a];
                    if (upto < below)
                        upto = below;
                    row[v] = (int32_t)(upto - below);
                    below = upto;
                }
            }
            double after = 1.0 / (double)(holding[j][a] - seen[j][a]);
            for (int64_t v = 0; v < width; v++)
                score[v] += (double)row[v] * after;
        }
        int64_t best = -1;
        double top = 0.0;
        for (int64_t step = 0; step < width; step++) {
            int64_t v = (start + step) % width;
            if (left[v] > 0 && (best < 0 || score[v] > top)) {
                best = v;
                top = score[v];
            }
        }
        out[r] = best;
        left[best] -= 1;
        for (int64_t j = 0; j < k; j++) {
            int32_t a = codes[j * records + r];
            seen[j][a] += 1;
            need[j][(int64_t)a * width + best] -= 1;
        }
    }
    for (int64_t i = 0; i < n; i++) { /* leave the tables zero for the next group */
        int64_t r = members[i];
        for (int64_t j = 0; j < k; j++) {
            int32_t a = codes[j * records + r];
            seen[j][a] = 0;
            holding[j][a] = 0;
            memset(need[j] + (int64_t)a * width, 0, (size_t)width * sizeof(int32_t));
        }
    }
}

/* herd(members i64[n], group_offsets i64[g+1], value_offsets i64[g+1], quota i64[values], codes i32[k*n],
 *      sizes i64[k], start i64[g], seed u64, out i64[n])
 * Group s deals the values value_offsets[s]..value_offsets[s+1] (their quotas adding up to its records
 * members[group_offsets[s]..group_offsets[s+1]], a permutation of the records over all groups); out[r] is the
 * value's index among the group's values. ValueError on inconsistent arguments, MemoryError when the tables
 * (sizes[j] x the widest group's values, three int32 per earlier value) would not fit. */
static PyObject *py_herd(PyObject *self, PyObject *args)
{
    Py_buffer members, group_offsets, value_offsets, quota, codes, sizes, start, out;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*y*Kw*", &members, &group_offsets, &value_offsets, &quota, &codes,
                          &sizes, &start, &seed, &out))
        return NULL;
    PyObject *result = NULL;
    int32_t **need = NULL, **seen = NULL, **holding = NULL, *cells = NULL;
    int64_t *left = NULL;
    double *share = NULL, *score = NULL;
    unsigned char *taken = NULL;
    Py_ssize_t n = members.len / (Py_ssize_t)sizeof(int64_t);
    Py_ssize_t groups = start.len / (Py_ssize_t)sizeof(int64_t);
    Py_ssize_t values = quota.len / (Py_ssize_t)sizeof(int64_t);
    Py_ssize_t k = sizes.len / (Py_ssize_t)sizeof(int64_t);
    const int64_t *m = members.buf, *go = group_offsets.buf, *vo = value_offsets.buf, *q = quota.buf;
    const int64_t *sz = sizes.buf, *st = start.buf;
    const int32_t *c = codes.buf;
    int64_t *o = out.buf;
    int ok = out.len == members.len && members.len % (Py_ssize_t)sizeof(int64_t) == 0 && n <= INT32_MAX &&
             codes.len == k * n * (Py_ssize_t)sizeof(int32_t) &&
             group_offsets.len == (groups + 1) * (Py_ssize_t)sizeof(int64_t) &&
             value_offsets.len == (groups + 1) * (Py_ssize_t)sizeof(int64_t) && go[0] == 0 && go[groups] == n &&
             vo[0] == 0 && vo[groups] == values;
    int64_t widest = 0, entries = 0;
    for (Py_ssize_t s = 0; ok && s < groups; s++) {
        int64_t width = vo[s + 1] - vo[s], records = go[s + 1] - go[s], sum = 0;
        ok = records >= 0 && width >= 0 && (width > 0 || records == 0);
        for (int64_t v = vo[s]; ok && v < vo[s + 1]; v++) {
            ok = q[v] >= 0 && q[v] <= records; /* no sum can wrap */
            sum += q[v];
        }
        ok = ok && sum == records;
        if (width > widest)
            widest = width;
    }
    if (ok) {
        taken = PyMem_RawCalloc((size_t)(n ? n : 1), 1);
        if (taken == NULL) {
            PyErr_NoMemory();
            goto done;
        }
    }
    for (Py_ssize_t i = 0; ok && i < n; i++) { /* a permutation: every record dealt once */
        ok = m[i] >= 0 && m[i] < n && !taken[m[i]];
        if (ok)
            taken[m[i]] = 1;
    }
    for (Py_ssize_t j = 0; ok && j < k; j++) {
        int64_t row = 0;
        ok = sz[j] > 0 && sz[j] <= INT32_MAX && !__builtin_mul_overflow(sz[j], widest + 2, &row) &&
             !__builtin_add_overflow(entries, row, &entries);
        for (Py_ssize_t r = 0; ok && r < n; r++)
            ok = c[j * n + r] >= 0 && c[j * n + r] < sz[j];
    }
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "herd: inconsistent arguments (offsets, quotas, members, or a code "
                                          "outside its size)");
        goto done;
    }
    if ((uint64_t)entries > (uint64_t)PY_SSIZE_T_MAX / sizeof(int32_t) - 1) {
        PyErr_NoMemory();
        goto done;
    }
    need = PyMem_RawCalloc((size_t)(k ? k : 1), sizeof(int32_t *));
    seen = PyMem_RawCalloc((size_t)(k ? k : 1), sizeof(int32_t *));
    holding = PyMem_RawCalloc((size_t)(k ? k : 1), sizeof(int32_t *));
    cells = PyMem_RawCalloc((size_t)entries + 1, sizeof(int32_t));
    left = PyMem_RawMalloc((size_t)(widest + 1) * sizeof(int64_t));
    share = PyMem_RawMalloc((size_t)(widest + 1) * sizeof(double));
    score = PyMem_RawMalloc((size_t)(widest + 1) * sizeof(double));
    if (!need || !seen || !holding || !cells || !left || !share || !score) {
        PyErr_NoMemory();
        goto done;
    }
    int32_t *next = cells;
    for (Py_ssize_t j = 0; j < k; j++) {
        need[j] = next;
        seen[j] = next + sz[j] * widest;
        holding[j] = next + sz[j] * (widest + 1);
        next += sz[j] * (widest + 2);
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t s = 0; s < groups; s++) {
        int64_t width = vo[s + 1] - vo[s];
        if (width == 0)
            continue;
        herd_group(m + go[s], go[s + 1] - go[s], q + vo[s], width, c, n, k, ((st[s] % width) + width) % width,
                   (uint64_t)seed, (uint64_t)s, need, seen, holding, share, score, left, o);
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyMem_RawFree(taken);
    PyMem_RawFree(need);
    PyMem_RawFree(seen);
    PyMem_RawFree(holding);
    PyMem_RawFree(cells);
    PyMem_RawFree(left);
    PyMem_RawFree(share);
    PyMem_RawFree(score);
    PyBuffer_Release(&members);
    PyBuffer_Release(&group_offsets);
    PyBuffer_Release(&value_offsets);
    PyBuffer_Release(&quota);
    PyBuffer_Release(&codes);
    PyBuffer_Release(&sizes);
    PyBuffer_Release(&start);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"herd", py_herd, METH_VARARGS,
     "herd(members, group_offsets, value_offsets, quota, codes, sizes, start, seed, out): per group, each\n"
     "record's value by herding its cells with the earlier attributes toward unbiased integer targets\n"
     "(transforms/units/dealing.py)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_dealing", "Dealing kernels (C).", -1, methods};

PyMODINIT_FUNC PyInit__dealing(void) { return PyModule_Create(&module); }
