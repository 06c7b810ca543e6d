/*
 * Per-segment post-processing kernels: the least-squares projection onto {x >= 0, sum x = total} and
 * controlled rounding to integers adding up to an integer total, one contiguous segment at a time.
 *
 * Each segment is computed from its own values only, in one fixed order (index order, or its values sorted
 * by value, ties by position), so a segment's result is bit for bit the same whatever other segments the call holds:
 * a geographic unit's published values do not depend on how units are batched, on which worker or engine.
 * (A global cumulative sum over all segments, as a vectorised numpy version takes, would make a segment's
 * floating-point result depend on the segments before it.)
 * Post-processing: these read noisy estimates and public totals only.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct {
    double key;    /* sort key: larger first */
    int64_t index; /* position within the segment: smaller first on ties */
} entry_t;

static int by_key_then_index(const void *a, const void *b)
{
    const entry_t *x = (const entry_t *)a, *y = (const entry_t *)b;
    if (x->key > y->key)
        return -1;
    if (x->key < y->key)
        return 1;
    return (x->index > y->index) - (x->index < y->index);
}

/* The closest x >= 0 with sum(x) = total to values[0..n) (Duchi et al. 2008): x_i = max(v_i - tau, 0).
 * When every value stays above tau = (sum(v) - total) / n, every cell is in the support and that tau is the
 * projection's (a fitted joint already on the simplex, up to rounding): no sort. Otherwise tau from the values
 * sorted in decreasing order. Either way the result depends on this segment's values alone. */
static void project_segment(const double *values, int64_t n, double total, entry_t *scratch, double *out)
{
    if (n == 0)
        return;
    if (!(total > 0)) {
        for (int64_t i = 0; i < n; i++)
            out[i] = 0.0;
        return;
    }
    double sum = 0.0, smallest = values[0];
    for (int64_t i = 0; i < n; i++) {
        sum += values[i];
        if (values[i] < smallest)
            smallest = values[i];
    }
    double tau = (sum - total) / (double)n;
    if (!(smallest - tau > 0)) {
        for (int64_t i = 0; i < n; i++) {
            scratch[i].key = values[i];
            scratch[i].index = i;
        }
        qsort(scratch, (size_t)n, sizeof(entry_t), by_key_then_index);
        double cumulative = 0.0;
        tau = 0.0;
        for (int64_t k = 0; k < n; k++) {
            cumulative += scratch[k].key;
            double candidate = (cumulative - total) / (double)(k + 1);
            if (scratch[k].key - candidate > 0)
                tau = candidate;
        }
    }
    for (int64_t i = 0; i < n; i++) {
        double x = values[i] - tau;
        out[i] = x > 0 ? x : 0.0;
    }
}

static inline int before(const entry_t *x, const entry_t *y)
{
    return x->key > y->key || (x->key == y->key && x->index < y->index);
}

static inline void swap_entries(entry_t *a, entry_t *b)
{
    entry_t t = *a;
    *a = *b;
    *b = t;
}

/* Reorder scratch[0..n) so that its first k entries are the k first in the order of `before` (larger key,
 * then smaller index: a strict total order, so the set is unique), in O(n) expected time (quickselect,
 * median-of-three pivots, insertion sort below 16 entries). */
static void select_first(entry_t *scratch, int64_t n, int64_t k)
{
    int64_t lo = 0, hi = n - 1;
    while (hi - lo > 16) {
        int64_t mid = lo + (hi - lo) / 2;
        if (before(&scratch[mid], &scratch[lo]))
            swap_entries(&scratch[mid], &scratch[lo]);
        if (before(&scratch[hi], &scratch[lo]))
            swap_entries(&scratch[hi], &scratch[lo]);
        if (before(&scratch[hi], &scratch[mid]))
            swap_entries(&scratch[hi], &scratch[mid]);
        entry_t pivot = scratch[mid];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (before(&scratch[i], &pivot))
                i++;
            while (before(&pivot, &scratch[j]))
                j--;
            if (i <= j) {
                swap_entries(&scratch[i], &scratch[j]);
                i++;
                j--;
            }
        }
        if (k - 1 <= j)
            hi = j;
        else if (k - 1 >= i)
            lo = i;
        else
            return;
    }
    for (int64_t a = lo + 1; a <= hi; a++) {
        entry_t e = scratch[a];
        int64_t b = a - 1;
        while (b >= lo && before(&e, &scratch[b])) {
            scratch[b + 1] = scratch[b];
            b--;
        }
        scratch[b + 1] = e;
    }
}

/* Integers >= 0 adding up to `total`: floors, then +1 to the largest fractional parts (ties by position),
 * found by selection (the same cells a full sort would give: the order is strict). */
static void round_segment(const double *values, int64_t n, int64_t total, entry_t *scratch, int64_t *out)
{
    int64_t floors = 0;
    for (int64_t i = 0; i < n; i++) {
        double f = floor(values[i] + 1e-9);
        int64_t v = f > 0 ? (int64_t)f : 0;
        out[i] = v;
        floors += v;
        scratch[i].key = values[i] - (double)v;
        scratch[i].index = i;
    }
    int64_t shortfall = total - floors;
    if (shortfall <= 0 || n == 0)
        return;
    int64_t raised = shortfall < n ? shortfall : n;
    if (raised < n)
        select_first(scratch, n, raised);
    for (int64_t k = 0; k < raised; k++)
        out[scratch[k].index] += 1;
}

static int check_offsets(const int64_t *offsets, Py_ssize_t segments, Py_ssize_t n)
{
    if (segments < 0 || offsets[0] != 0 || offsets[segments] != n)
        return 0;
    for (Py_ssize_t s = 0; s < segments; s++)
        if (offsets[s + 1] < offsets[s])
            return 0;
    return 1;
}

/* project(values f64[n], offsets i64[s+1], totals f64[s], out f64[n]) */
static PyObject *py_project(PyObject *self, PyObject *args)
{
    Py_buffer values, offsets, totals, out;
    if (!PyArg_ParseTuple(args, "y*y*y*w*", &values, &offsets, &totals, &out))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = values.len / (Py_ssize_t)sizeof(double);
    Py_ssize_t segments = totals.len / (Py_ssize_t)sizeof(double);
    const int64_t *off = (const int64_t *)offsets.buf;
    if (out.len != values.len || offsets.len != (segments + 1) * (Py_ssize_t)sizeof(int64_t) ||
        !check_offsets(off, segments, n)) {
        PyErr_SetString(PyExc_ValueError, "project: inconsistent arguments");
        goto done;
    }
    entry_t *scratch = PyMem_RawMalloc((size_t)(n ? n : 1) * sizeof(entry_t));
    if (scratch == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const double *v = (const double *)values.buf, *t = (const double *)totals.buf;
    double *o = (double *)out.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t s = 0; s < segments; s++)
        project_segment(v + off[s], off[s + 1] - off[s], t[s], scratch, o + off[s]);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(scratch);
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&values);
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&totals);
    PyBuffer_Release(&out);
    return result;
}

/* round(values f64[n], offsets i64[s+1], totals i64[s], out i64[n]) */
static PyObject *py_round(PyObject *self, PyObject *args)
{
    Py_buffer values, offsets, totals, out;
    if (!PyArg_ParseTuple(args, "y*y*y*w*", &values, &offsets, &totals, &out))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = values.len / (Py_ssize_t)sizeof(double);
    Py_ssize_t segments = totals.len / (Py_ssize_t)sizeof(int64_t);
    const int64_t *off = (const int64_t *)offsets.buf;
    if (out.len != n * (Py_ssize_t)sizeof(int64_t) || offsets.len != (segments + 1) * (Py_ssize_t)sizeof(int64_t) ||
        !check_offsets(off, segments, n)) {
        PyErr_SetString(PyExc_ValueError, "round: inconsistent arguments");
        goto done;
    }
    entry_t *scratch = PyMem_RawMalloc((size_t)(n ? n : 1) * sizeof(entry_t));
    if (scratch == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const double *v = (const double *)values.buf;
    const int64_t *t = (const int64_t *)totals.buf;
    int64_t *o = (int64_t *)out.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t s = 0; s < segments; s++)
        round_segment(v + off[s], off[s + 1] - off[s], t[s], scratch, o + off[s]);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(scratch);
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&values);
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&totals);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"project", py_project, METH_VARARGS,
     "project(values, offsets, totals, out): per segment, the closest x >= 0 summing to its total."},
    {"round", py_round, METH_VARARGS,
     "round(values, offsets, totals, out): per segment, integers >= 0 summing to its integer total, by\n"
     "controlled rounding (floors, then +1 to the largest fractional parts, ties by position)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_segments", "Per-segment post-processing kernels (C).",
                                    -1, methods};

PyMODINIT_FUNC PyInit__segments(void) { return PyModule_Create(&module); }
