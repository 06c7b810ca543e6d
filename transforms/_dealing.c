/*
 * Herding a new attribute's values over the records of each group (a unit's separator value), one record at a
 * time: the record gets the value whose cells with the record's earlier values are furthest behind their
 * shares. See transforms/units/dealing.py for what it is for and what it guarantees.
 *
 * Deterministic given its inputs (the records' order and every group's first value to look at, drawn by the
 * caller from the public seed): the same records on any worker get the same values.
 * Post-processing: published tables, the attributes already drawn and a public seed only.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* One group: its records `members[0..n)` (record indices, in the order they are dealt), its `width` values with
 * `quota[v]` records each (adding up to n), the records' earlier codes `codes[j * records + r]` for j < k, the
 * first value `start` a tie goes to. `assigned` (k tables of sizes[j] x width, at `table[j]`), `seen` and `holding`
 * (k runs of sizes[j] each, at `seen[j]` and `holding[j]`) are zero on entry and left zero. Writes out[r] = the
 * record's value.
 *
 * A record with earlier values a_1..a_k gets, among the values v with quota left, the one maximising
 *     sum over j = 0..k of  (holding_j(a_j) * share_v - assigned_j(a_j, v)) / (holding_j(a_j) - seen_j(a_j))
 * where j = 0 is the group itself (one value holding all n records), share_v = quota_v / n, holding_j(a) the
 * group's records with a, seen_j(a) those dealt before this one: the sum over the tables pairing an earlier
 * attribute with the new one of the records value v still needs among those left with the record's value, as a
 * share of them. Ties go to the first value from `start` on. */
static void herd_group(const int64_t *members, int64_t n, const int64_t *quota, int64_t width,
                       const int32_t *codes, int64_t records, int64_t k, int64_t start,
                       int32_t **table, int32_t **seen, int32_t **holding, double *share, double *score,
                       int64_t *left, int64_t *out)
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
            double held = (double)holding[j][a], after = 1.0 / (double)(holding[j][a] - seen[j][a]);
            const int32_t *row = table[j] + (int64_t)a * width;
            for (int64_t v = 0; v < width; v++)
                score[v] += (held * share[v] - (double)row[v]) * after;
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
            table[j][(int64_t)a * width + best] += 1;
        }
    }
    for (int64_t i = 0; i < n; i++) { /* leave the tables zero for the next group */
        int64_t r = members[i];
        for (int64_t j = 0; j < k; j++) {
            int32_t a = codes[j * records + r];
            seen[j][a] = 0;
            holding[j][a] = 0;
            memset(table[j] + (int64_t)a * width, 0, (size_t)width * sizeof(int32_t));
        }
    }
}

/* herd(members i64[n], group_offsets i64[g+1], value_offsets i64[g+1], quota i64[values], codes i32[k*n],
 *      sizes i64[k], start i64[g], out i64[n])
 * Group s deals the values value_offsets[s]..value_offsets[s+1] (their quotas adding up to its records
 * members[group_offsets[s]..group_offsets[s+1]]); out[r] is the value's index among the group's values. */
static PyObject *py_herd(PyObject *self, PyObject *args)
{
    Py_buffer members, group_offsets, value_offsets, quota, codes, sizes, start, out;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*y*w*", &members, &group_offsets, &value_offsets, &quota, &codes,
                          &sizes, &start, &out))
        return NULL;
    PyObject *result = NULL;
    int32_t **table = NULL, **seen = NULL, **holding = NULL, *cells = NULL;
    int64_t *left = NULL;
    double *share = NULL, *score = NULL;
    Py_ssize_t n = members.len / (Py_ssize_t)sizeof(int64_t);
    Py_ssize_t groups = start.len / (Py_ssize_t)sizeof(int64_t);
    Py_ssize_t values = quota.len / (Py_ssize_t)sizeof(int64_t);
    Py_ssize_t k = sizes.len / (Py_ssize_t)sizeof(int64_t);
    const int64_t *m = members.buf, *go = group_offsets.buf, *vo = value_offsets.buf, *q = quota.buf;
    const int64_t *sz = sizes.buf, *st = start.buf;
    const int32_t *c = codes.buf;
    int64_t *o = out.buf;
    int ok = out.len == members.len && codes.len == k * n * (Py_ssize_t)sizeof(int32_t) &&
             group_offsets.len == (groups + 1) * (Py_ssize_t)sizeof(int64_t) &&
             value_offsets.len == (groups + 1) * (Py_ssize_t)sizeof(int64_t) && go[0] == 0 && go[groups] == n &&
             vo[0] == 0 && vo[groups] == values;
    int64_t widest = 0, cells_needed = 0, runs_needed = 0;
    for (Py_ssize_t s = 0; ok && s < groups; s++) {
        int64_t width = vo[s + 1] - vo[s], sum = 0;
        ok = go[s + 1] >= go[s] && width >= 0 && (width > 0 || go[s + 1] == go[s]);
        for (int64_t v = vo[s]; ok && v < vo[s + 1]; v++) {
            ok = q[v] >= 0;
            sum += q[v];
        }
        ok = ok && sum == go[s + 1] - go[s];
        if (width > widest)
            widest = width;
    }
    for (Py_ssize_t i = 0; ok && i < n; i++)
        ok = m[i] >= 0 && m[i] < n;
    for (Py_ssize_t j = 0; ok && j < k; j++) {
        ok = sz[j] > 0 && sz[j] <= INT32_MAX;
        runs_needed += sz[j];
        cells_needed += sz[j] * widest;
        for (Py_ssize_t r = 0; ok && r < n; r++)
            ok = c[j * n + r] >= 0 && c[j * n + r] < sz[j];
    }
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "herd: inconsistent arguments (offsets, quotas, or a code outside its size)");
        goto done;
    }
    table = PyMem_RawCalloc((size_t)(k ? k : 1), sizeof(int32_t *));
    seen = PyMem_RawCalloc((size_t)(k ? k : 1), sizeof(int32_t *));
    holding = PyMem_RawCalloc((size_t)(k ? k : 1), sizeof(int32_t *));
    cells = PyMem_RawCalloc((size_t)(cells_needed + 2 * runs_needed + 1), sizeof(int32_t));
    left = PyMem_RawMalloc((size_t)(widest + 1) * sizeof(int64_t));
    share = PyMem_RawMalloc((size_t)(widest + 1) * sizeof(double));
    score = PyMem_RawMalloc((size_t)(widest + 1) * sizeof(double));
    if (!table || !seen || !holding || !cells || !left || !share || !score) {
        PyErr_NoMemory();
        goto done;
    }
    int32_t *next = cells;
    for (Py_ssize_t j = 0; j < k; j++) {
        table[j] = next;
        next += sz[j] * widest;
    }
    for (Py_ssize_t j = 0; j < k; j++) {
        seen[j] = next;
        holding[j] = next + sz[j];
        next += 2 * sz[j];
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t s = 0; s < groups; s++) {
        int64_t width = vo[s + 1] - vo[s];
        if (width == 0)
            continue;
        herd_group(m + go[s], go[s + 1] - go[s], q + vo[s], width, c, n, k, ((st[s] % width) + width) % width,
                   table, seen, holding, share, score, left, o);
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyMem_RawFree(table);
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
     "herd(members, group_offsets, value_offsets, quota, codes, sizes, start, out): per group, each record's value\n"
     "by herding its cells with the earlier attributes toward their shares (transforms/units/dealing.py)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_dealing", "Dealing kernels (C).", -1, methods};

PyMODINIT_FUNC PyInit__dealing(void) { return PyModule_Create(&module); }
