/*
 * Cell counts of a table from its records' code columns: each record's cell is the C-order index of its codes
 * (a column's code first mapped through its lookup, tract -> county say), and its cell's entry is raised by one
 * (or by its measure's value, or in its value's quantile bucket). Cells are computed a block of records at a
 * time, column by column (vectorised), then counted: no index array over all records is made (numpy's
 * multiply-add per column and bincount made about four passes per column over the records, and an int64 index
 * array per table).
 *
 * Exact: integer arithmetic only (cells in 32 bits for a table of fewer than 2^31 entries, else 64). Every code
 * and every looked-up code is checked against its domain before it is used; an out-of-domain code (an encoder's
 * bug, never a data value: encoding maps every value into its public domain) stops the count with an error that
 * names no value.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_signed_buffer.h"

#define MAX_COLUMNS 32
#define SMALL_TABLE 4096 /* cells of a table counted in four interleaved copies */
#define BLOCK 4096       /* records whose cells are computed column by column before they are counted */

enum { COUNT, COUNT_VALID, SUM, QUANTILE };

/* A table and the records to count into it (see `count`). */
typedef struct {
    Py_ssize_t k, rows, per_cell;
    int kind;
    const char *code[MAX_COLUMNS]; /* each column's codes, width[i] bytes each */
    Py_ssize_t width[MAX_COLUMNS];
    const int32_t *map[MAX_COLUMNS]; /* a column's lookup or NULL */
    int32_t limit[MAX_COLUMNS];      /* codes of column i are in [0, limit[i]) */
    int32_t size[MAX_COLUMNS];       /* its dimension's size: cell codes in [0, size[i]) */
    int64_t cells;
    const char *measure; /* measure codes (measure_width bytes each) for the kinds that read one */
    Py_ssize_t measure_width;
    int64_t invalid, lower;
    const int32_t *bucket; /* QUANTILE: each measure code's bucket */
    int64_t *counts, *partial;
} table_t;

static inline int64_t code_at(const char *values, Py_ssize_t width, Py_ssize_t r)
{
    return width == 1 ? ((const int8_t *)values)[r]
         : width == 2 ? ((const int16_t *)values)[r]
         : width == 4 ? ((const int32_t *)values)[r] : ((const int64_t *)values)[r];
}

/* Each record's cell so far (cell[0..n)) times the dimension's size plus its code in that dimension: the column's
 * code, through `map` when given; 1 when a code or looked-up code is outside its domain. One function per code
 * width (the encoder's int8, int16 or int32 codes) and cell width. */
#define ADD_COLUMN(name, type, cell_type)                                                                      \
    static int name(const type *restrict values, Py_ssize_t n, const int32_t *restrict map, int32_t limit,    \
                    int32_t size, cell_type *restrict cell)                                                 \
    {                                                                                                       \
        int outside = 0;                                                                                    \
        cell_type dimension = (cell_type)size;                                                              \
        if (map != NULL && limit == 0)                                                                      \
            return n > 0;                                                                                   \
        if (map == NULL) {                                                                                  \
            for (Py_ssize_t r = 0; r < n; r++) {                                                            \
                int32_t value = values[r];                                                                  \
                outside |= (value < 0) | (value >= limit);                                                  \
                cell[r] = cell[r] * dimension + (cell_type)(uint32_t)value;                                 \
            }                                                                                               \
            return outside;                                                                                 \
        }                                                                                                   \
        for (Py_ssize_t r = 0; r < n; r++) {                                                                \
            int32_t code = values[r]; /* checked, then used as read */                                    \
            int wrong = (code < 0) | (code >= limit);                                                       \
            int32_t value = map[wrong ? 0 : code];                                                          \
            outside |= wrong | (value < 0) | (value >= size);                                               \
            cell[r] = cell[r] * dimension + (cell_type)(uint32_t)value;                                     \
        }                                                                                                   \
        return outside;                                                                                     \
    }
ADD_COLUMN(add_int8_32, int8_t, uint32_t)
ADD_COLUMN(add_int16_32, int16_t, uint32_t)
ADD_COLUMN(add_int32_32, int32_t, uint32_t)
ADD_COLUMN(add_int8_64, int8_t, uint64_t)
ADD_COLUMN(add_int16_64, int16_t, uint64_t)
ADD_COLUMN(add_int32_64, int32_t, uint64_t)

/* A block of measure codes (n, from record `first`) as int64 in `out`; 1 when one is outside [0, invalid]
 * (invalid: the code for no value). */
static int read_measure(const table_t *t, Py_ssize_t first, Py_ssize_t n, int64_t *out)
{
    int outside = 0;
    for (Py_ssize_t r = 0; r < n; r++) {
        int64_t value = code_at(t->measure, t->measure_width, first + r);
        outside |= (value < 0) | (value > t->invalid);
        out[r] = value;
    }
    return outside;
}

/* Count every record of `t` (see `count`) with cells of `cell_type`; 1 when a code is outside its domain (counts
 * then incomplete: the caller discards them). */
#define COUNT_TABLE(name, cell_type, add8, add16, add32)                                                       \
    static int name(const table_t *t)                                                                       \
    {                                                                                                       \
        cell_type cell[BLOCK];                                                                              \
        int64_t value[BLOCK];                                                                               \
        int64_t *counts = t->counts, *partial = t->partial, cells = t->cells;                               \
        uint64_t *sums = (uint64_t *)t->counts;                                                             \
        for (Py_ssize_t first = 0; first < t->rows; first += BLOCK) {                                       \
            Py_ssize_t n = t->rows - first < BLOCK ? t->rows - first : BLOCK;                               \
            for (Py_ssize_t r = 0; r < n; r++)                                                              \
                cell[r] = 0;                                                                                \
            for (Py_ssize_t i = 0; i < t->k; i++) {                                                         \
                const char *codes = t->code[i] + first * t->width[i];                                       \
                int outside = t->width[i] == 1                                                              \
                    ? add8((const int8_t *)codes, n, t->map[i], t->limit[i], t->size[i], cell)              \
                    : t->width[i] == 2                                                                      \
                    ? add16((const int16_t *)codes, n, t->map[i], t->limit[i], t->size[i], cell)            \
                    : add32((const int32_t *)codes, n, t->map[i], t->limit[i], t->size[i], cell);           \
                if (outside)                                                                                \
                    return 1;                                                                               \
            }                                                                                               \
            if (t->kind == COUNT && partial == NULL) {                                                      \
                for (Py_ssize_t r = 0; r < n; r++)                                                          \
                    counts[cell[r]] += 1;                                                                   \
            } else if (t->kind == COUNT) { /* a small table: four interleaved copies, so repeats of one   \
                                              cell do not wait on each other */                             \
                Py_ssize_t r = 0;                                                                           \
                for (; r + 4 <= n; r += 4) {                                                                \
                    partial[cell[r]] += 1;                                                                  \
                    partial[cells + cell[r + 1]] += 1;                                                      \
                    partial[2 * cells + cell[r + 2]] += 1;                                                  \
                    partial[3 * cells + cell[r + 3]] += 1;                                                  \
                }                                                                                           \
                for (; r < n; r++)                                                                          \
                    partial[cell[r]] += 1;                                                                  \
            } else {                                                                                        \
                if (read_measure(t, first, n, value))                                                       \
                    return 1;                                                                               \
                for (Py_ssize_t r = 0; r < n; r++) {                                                        \
                    if (value[r] == t->invalid)                                                             \
                        continue;                                                                           \
                    if (t->kind == COUNT_VALID)                                                             \
                        counts[cell[r]] += 1;                                                               \
                    else if (t->kind == SUM) /* int64 wrapping, as numpy's */                               \
                        sums[cell[r]] += (uint64_t)value[r] + (uint64_t)t->lower;                           \
                    else                                                                                    \
                        counts[(int64_t)cell[r] * t->per_cell + t->bucket[value[r]]] += 1;                  \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
        if (partial != NULL)                                                                                \
            for (int64_t c = 0; c < cells; c++)                                                             \
                counts[c] += partial[c] + partial[cells + c] + partial[2 * cells + c] + partial[3 * cells + c]; \
        return 0;                                                                                           \
    }
COUNT_TABLE(count_table_32, uint32_t, add_int8_32, add_int16_32, add_int32_32)
COUNT_TABLE(count_table_64, uint64_t, add_int8_64, add_int16_64, add_int32_64)

/* count(columns: tuple of (i8, i16 or i32)[rows], lookups: tuple of (i32[n] or None), sizes i64[k], rows,
 * out i64[prod(sizes) * B], kind, measure (i8, i16, i32 or i64)[rows] or None, invalid, lower,
 * buckets i32[invalid] or None): per record, by kind,
 *   COUNT        its cell of `out` plus one (no measure);
 *   COUNT_VALID  its cell plus one when its measure code is not `invalid` (a measure's count);
 *   SUM          its cell plus its value, measure code + lower, when it has one (int64, wrapping as numpy does);
 *   QUANTILE     entry cell * B + buckets[code] plus one when it has a value (B entries per cell: `out`'s length
 *                over the cells; every bucket in [0, B), checked).
 * `wide` (optional, for tests): 64-bit cells whatever the table's size. */
static PyObject *py_count(PyObject *self, PyObject *args)
{
    PyObject *columns, *lookups, *measure_object, *buckets_object;
    Py_buffer sizes, out, measure = {0}, buckets = {0};
    Py_buffer column[MAX_COLUMNS], lookup[MAX_COLUMNS];
    table_t t = {0};
    long long invalid, lower;
    int wide = 0;
    if (!PyArg_ParseTuple(args, "O!O!y*nw*iOLLO|p", &PyTuple_Type, &columns, &PyTuple_Type, &lookups, &sizes,
                          &t.rows, &out, &t.kind, &measure_object, &invalid, &lower, &buckets_object, &wide))
        return NULL;
    int has_measure = 0, has_buckets = 0, has_lookup[MAX_COLUMNS] = {0};
    Py_ssize_t opened = 0, opened_lookups = 0;
    PyObject *result = NULL;
    const int64_t *size = (const int64_t *)sizes.buf;
    t.k = PyTuple_GET_SIZE(columns);
    t.invalid = invalid;
    t.lower = lower;
    if (t.k > MAX_COLUMNS || PyTuple_GET_SIZE(lookups) != t.k || sizes.len != t.k * (Py_ssize_t)sizeof(int64_t) ||
        t.rows < 0) {
        PyErr_SetString(PyExc_ValueError, "count: columns, lookups and sizes do not match");
        goto done;
    }
    t.cells = 1;
    for (Py_ssize_t i = 0; i < t.k; i++) {
        if (size[i] < 1 || size[i] > INT32_MAX || t.cells > PY_SSIZE_T_MAX / (Py_ssize_t)sizeof(int64_t) / size[i]) {
            PyErr_SetString(PyExc_ValueError, "count: a dimension's size or the table's cells out of range");
            goto done;
        }
        t.size[i] = (int32_t)size[i];
        t.cells *= size[i];
    }
    if (t.kind < COUNT || t.kind > QUANTILE || (t.kind == COUNT) != (measure_object == Py_None) ||
        (t.kind == QUANTILE) != (buckets_object != Py_None) || invalid < 0 ||
        (t.kind == QUANTILE && invalid > INT32_MAX)) {
        PyErr_SetString(PyExc_ValueError, "count: the kind, measure and buckets do not match");
        goto done;
    }
    if (measure_object != Py_None) {
        if (PyObject_GetBuffer(measure_object, &measure, PyBUF_SIMPLE) < 0)
            goto done;
        has_measure = 1;
    }
    if (buckets_object != Py_None) {
        if (PyObject_GetBuffer(buckets_object, &buckets, PyBUF_SIMPLE) < 0)
            goto done;
        has_buckets = 1;
    }
    t.per_cell = t.kind == QUANTILE ? out.len / (Py_ssize_t)sizeof(int64_t) / t.cells : 1;
    if (t.per_cell < 1 || t.cells > PY_SSIZE_T_MAX / (Py_ssize_t)sizeof(int64_t) / t.per_cell ||
        out.len != t.cells * t.per_cell * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "count: the output does not hold every cell");
        goto done;
    }
    t.measure_width = has_measure ? (t.rows > 0 ? measure.len / t.rows : 4) : 0;
    if (has_measure && ((t.measure_width != 1 && t.measure_width != 2 && t.measure_width != 4 &&
                         t.measure_width != 8) || measure.len != t.rows * t.measure_width)) {
        PyErr_SetString(PyExc_ValueError, "count: the measure has the wrong length");
        goto done;
    }
    t.measure = has_measure ? (const char *)measure.buf : NULL;
    t.bucket = has_buckets ? (const int32_t *)buckets.buf : NULL;
    if (has_buckets) {
        if (buckets.len != invalid * (Py_ssize_t)sizeof(int32_t)) {
            PyErr_SetString(PyExc_ValueError, "count: the buckets do not cover the measure's codes");
            goto done;
        }
        for (long long v = 0; v < invalid; v++)
            if (t.bucket[v] < 0 || t.bucket[v] >= t.per_cell) {
                PyErr_SetString(PyExc_ValueError, "count: a bucket is outside the cell's entries");
                goto done;
            }
    }
    for (; opened < t.k; opened++)
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(columns, opened), &column[opened], PyBUF_SIMPLE) < 0)
            goto done;
    for (; opened_lookups < t.k; opened_lookups++) {
        PyObject *item = PyTuple_GET_ITEM(lookups, opened_lookups);
        if (item != Py_None) {
            if (PyObject_GetBuffer(item, &lookup[opened_lookups], PyBUF_SIMPLE) < 0)
                goto done;
            has_lookup[opened_lookups] = 1;
        }
    }
    for (Py_ssize_t i = 0; i < t.k; i++) {
        t.width[i] = t.rows > 0 ? column[i].len / t.rows : 4;
        if ((t.width[i] != 1 && t.width[i] != 2 && t.width[i] != 4) || column[i].len != t.rows * t.width[i] ||
            (has_lookup[i] && (lookup[i].len % (Py_ssize_t)sizeof(int32_t) != 0 ||
                               lookup[i].len / (Py_ssize_t)sizeof(int32_t) > INT32_MAX))) {
            PyErr_SetString(PyExc_ValueError, "count: a column or lookup has the wrong length");
            goto done;
        }
        t.code[i] = (const char *)column[i].buf;
        t.map[i] = has_lookup[i] ? (const int32_t *)lookup[i].buf : NULL;
        t.limit[i] = (int32_t)(has_lookup[i] ? lookup[i].len / (Py_ssize_t)sizeof(int32_t) : size[i]);
    }
    t.counts = (int64_t *)out.buf;
    if (t.kind == COUNT && t.cells <= SMALL_TABLE && t.rows >= 4 * t.cells) {
        t.partial = PyMem_RawCalloc(4 * (size_t)t.cells, sizeof(int64_t));
        if (t.partial == NULL) {
            PyErr_NoMemory();
            goto done;
        }
    }
    int bad;
    Py_BEGIN_ALLOW_THREADS
    bad = t.cells * t.per_cell <= INT32_MAX && !wide ? count_table_32(&t) : count_table_64(&t);
    Py_END_ALLOW_THREADS
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "count: a code is outside its column's domain (an encoding error)");
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyMem_RawFree(t.partial);
    for (Py_ssize_t i = 0; i < opened; i++)
        PyBuffer_Release(&column[i]);
    for (Py_ssize_t i = 0; i < opened_lookups; i++)
        if (has_lookup[i])
            PyBuffer_Release(&lookup[i]);
    if (has_measure)
        PyBuffer_Release(&measure);
    if (has_buckets)
        PyBuffer_Release(&buckets);
    PyBuffer_Release(&sizes);
    PyBuffer_Release(&out);
    return result;
}

/* looked_up(codes (i8, i16 or i32)[rows], lookup i32[n], rows, out (i8, i16 or i32)[rows]): out[r] =
 * lookup[codes[r]], every code checked in [0, n) and every looked-up code in [0, the largest out holds]; a column
 * looked up once for every table that reads it through this lookup (a record's county, from its tract). */
#define LOOK_UP(name, in_type)                                                                                  \
    static int name(const in_type *restrict codes, Py_ssize_t rows, const int32_t *restrict lookup, int32_t n,  \
                    int32_t top, char *out, Py_ssize_t width)                                                   \
    {                                                                                                           \
        int outside = 0;                                                                                        \
        for (Py_ssize_t start = 0; start < rows; start += BLOCK) {                                              \
            Py_ssize_t m = rows - start < BLOCK ? rows - start : BLOCK;                                         \
            int32_t value[BLOCK];                                                                               \
            for (Py_ssize_t r = 0; r < m; r++) {                                                                \
                int32_t code = (int32_t)codes[start + r];                                                       \
                int inside = code >= 0 && code < n;                                                             \
                outside |= !inside;                                                                             \
                value[r] = lookup[inside ? code : 0];                                                           \
                outside |= value[r] < 0 || value[r] > top;                                                      \
            }                                                                                                   \
            for (Py_ssize_t r = 0; r < m; r++) {                                                                \
                if (width == 1)                                                                                 \
                    ((int8_t *)out)[start + r] = (int8_t)value[r];                                              \
                else if (width == 2)                                                                            \
                    ((int16_t *)out)[start + r] = (int16_t)value[r];                                            \
                else                                                                                            \
                    ((int32_t *)out)[start + r] = value[r];                                                     \
            }                                                                                                   \
        }                                                                                                       \
        return outside;                                                                                         \
    }
LOOK_UP(look_up_int8, int8_t)
LOOK_UP(look_up_int16, int16_t)
LOOK_UP(look_up_int32, int32_t)

#define LOOKED_UP_TYPES                                                                                          \
    "looked_up: codes, lookup and output must be signed integers of 1, 2 or 4 bytes (the lookup 4), aligned"

static PyObject *py_looked_up(PyObject *self, PyObject *args)
{
    PyObject *codes_object, *lookup_object, *out_object;
    Py_buffer codes, lookup, out;
    Py_ssize_t rows;
    if (!PyArg_ParseTuple(args, "OOnO", &codes_object, &lookup_object, &rows, &out_object))
        return NULL;
    if (!open_signed_buffer(codes_object, &codes, 0, 0, 4, LOOKED_UP_TYPES))
        return NULL;
    if (!open_signed_buffer(lookup_object, &lookup, 0, 4, 4, LOOKED_UP_TYPES)) {
        PyBuffer_Release(&codes);
        return NULL;
    }
    if (!open_signed_buffer(out_object, &out, 1, 0, 4, LOOKED_UP_TYPES)) {
        PyBuffer_Release(&codes);
        PyBuffer_Release(&lookup);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t width = codes.itemsize, out_width = out.itemsize, n = lookup.len / (Py_ssize_t)sizeof(int32_t);
    if (rows < 0 || codes.len != rows * width || out.len != rows * out_width || n < 1 || n > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "looked_up: the codes, lookup or output have the wrong length");
        goto done;
    }
    int32_t top = out_width == 1 ? INT8_MAX : out_width == 2 ? INT16_MAX : INT32_MAX;
    int bad;
    Py_BEGIN_ALLOW_THREADS
    bad = width == 1 ? look_up_int8((const int8_t *)codes.buf, rows, lookup.buf, (int32_t)n, top, out.buf, out_width)
        : width == 2 ? look_up_int16((const int16_t *)codes.buf, rows, lookup.buf, (int32_t)n, top, out.buf, out_width)
                     : look_up_int32((const int32_t *)codes.buf, rows, lookup.buf, (int32_t)n, top, out.buf, out_width);
    Py_END_ALLOW_THREADS
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "looked_up: a code is outside its lookup's domain (an encoding error)");
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&codes);
    PyBuffer_Release(&lookup);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"looked_up", py_looked_up, METH_VARARGS,
     "looked_up(codes, lookup, rows, out): out[r] = lookup[codes[r]] (int8, int16 or int32 codes; an int32 lookup;\n"
     "int8, int16 or int32 out), every code checked in the lookup's range and every result in out's."},
    {"count", py_count, METH_VARARGS,
     "count(columns, lookups, sizes, rows, out, kind, measure, invalid, lower, buckets): adds each record to `out`\n"
     "(int64, every cell of the table in C order, `buckets` entries per cell for a quantile) at its cell: its int8,\n"
     "int16 or int32 codes, each through its int32 lookup or None, checked in their domains. kind COUNT: one per\n"
     "record; COUNT_VALID: one per record with a measure value; SUM: its value (measure code + lower); QUANTILE:\n"
     "one in its value's bucket (buckets[code]). wide (optional, for tests): 64-bit cells whatever the size."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_counting", "Table cell counts (C kernel).", -1, methods};

PyMODINIT_FUNC PyInit__counting(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "COUNT", COUNT) < 0 || PyModule_AddIntConstant(m, "COUNT_VALID", COUNT_VALID) < 0 ||
        PyModule_AddIntConstant(m, "SUM", SUM) < 0 || PyModule_AddIntConstant(m, "QUANTILE", QUANTILE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
