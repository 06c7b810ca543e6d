/*
 * Input values to public domain codes, one pass per column: an integer column's bin (or offset, or clamped
 * measure value), a dictionary column's value code through its lookup. Written straight into the encoded
 * table's narrow code type (the numpy version made about eight passes of eight bytes per value: cast, two
 * validity tests, a select, a clip, a lookup, another select, a narrowing copy).
 *
 * The codes are those of `transforms/encode.py`'s numpy specification, bit for bit (tests/test_kernels.py):
 * every value is compared as the float64 numpy would make of it (an int64 beyond 2^53 rounds as the cast
 * rounds), a float must be finite and integral, a null is invalid. An invalid value gets the caller's invalid
 * code (INVALID, the `other` cell or a measure's invalid code): never an error, so nothing here depends on the
 * data. Only the caller's arguments (public: the domain and buffer shapes) can raise.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "_signed_buffer.h"

#define BLOCK 4096 /* values coded into int64 before they are stored in the output's width */
#define EXACT_BOUND (1LL << 53) /* every integer of this magnitude or less is a float64 */
#define INTEGRAL_ALL 4503599627370496.0 /* 2^52: every float64 of this magnitude or more is an integer */

enum { IDENTITY, CLAMP, LOOKUP, EDGES };

typedef struct {
    int mode;
    int64_t minimum, invalid;
    double low, high; /* the domain's bounds as float64 (exact: at most 2^53 in magnitude) */
    const int32_t *lookup; /* LOOKUP: each value's code from minimum on; negative: invalid */
    const int64_t *edges;  /* EDGES: ascending bin edges; a value's code is the last edge at or below it */
    Py_ssize_t n_edges;
} domain_t;

static inline int bit_set(const uint8_t *bits, int64_t position)
{
    return bits == NULL || ((bits[position >> 3] >> (position & 7)) & 1);
}

/* The code of a value that is valid so far (not null, finite, integral), as float64; `mode` is a constant at
 * each call, so each loop below is compiled for its mode alone. */
static inline int64_t code_of(double value, const domain_t *d, int mode)
{
    if (mode == CLAMP) {
        value = value < d->low ? d->low : value > d->high ? d->high : value;
        return (int64_t)value - d->minimum;
    }
    if (!(value >= d->low && value <= d->high))
        return d->invalid;
    int64_t offset = (int64_t)value - d->minimum;
    if (mode == IDENTITY)
        return offset;
    if (mode == LOOKUP) {
        int32_t code = d->lookup[offset];
        return code < 0 ? d->invalid : code;
    }
    int64_t x = (int64_t)value; /* EDGES: upper bound - 1 (numpy's searchsorted(edges, x, "right") - 1) */
    Py_ssize_t lo = 0, hi = d->n_edges;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (d->edges[mid] <= x)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo == 0 ? d->invalid : (int64_t)(lo - 1);
}

/* A float is a value when finite and integral (numpy's isfinite(v) & (v == floor(v))). */
static inline int float_is_value(double value)
{
    double magnitude = fabs(value);
    if (!(magnitude < INTEGRAL_ALL))
        return magnitude <= 1.7976931348623157e308; /* false for inf and NaN */
    return value == (double)(int64_t)value;
}

#define CODE_LOOP(mode, type, is_float)                                                                             \
    for (Py_ssize_t r = 0; r < n; r++) {                                                                      \
        type raw;                                                                                             \
        memcpy(&raw, (const char *)values + r * sizeof(type), sizeof(type)); /* any alignment */             \
        double value = (double)raw;                                                                           \
        int valid = (bits == NULL || bit_set(bits, bit0 + r)) && (!(is_float) || float_is_value(value));      \
        code[r] = valid ? code_of(value, &domain, mode) : domain.invalid;                                     \
    }                                                                                                         \
    break;

#define CODE_BLOCK(name, type, is_float)                                                                      \
    static void name(const void *values, const uint8_t *bits, int64_t bit0, Py_ssize_t n,           \
                     const domain_t *d, int64_t *restrict code)                                               \
    {                                                                                                         \
        const domain_t domain = *d;                                                                           \
        switch (domain.mode) {                                                                                \
        case IDENTITY: CODE_LOOP(IDENTITY, type, is_float)                                                          \
        case CLAMP: CODE_LOOP(CLAMP, type, is_float)                                                                \
        case LOOKUP: CODE_LOOP(LOOKUP, type, is_float)                                                              \
        default: CODE_LOOP(EDGES, type, is_float)                                                                   \
        }                                                                                                     \
    }
CODE_BLOCK(code_int32, int32_t, 0)
CODE_BLOCK(code_int64, int64_t, 0)
CODE_BLOCK(code_float64, double, 1)

static void store(const int64_t *code, Py_ssize_t n, char *out, Py_ssize_t width)
{
    switch (width) {
    case 1:
        for (Py_ssize_t r = 0; r < n; r++)
            ((int8_t *)out)[r] = (int8_t)code[r];
        break;
    case 2:
        for (Py_ssize_t r = 0; r < n; r++)
            ((int16_t *)out)[r] = (int16_t)code[r];
        break;
    case 4:
        for (Py_ssize_t r = 0; r < n; r++)
            ((int32_t *)out)[r] = (int32_t)code[r];
        break;
    default:
        for (Py_ssize_t r = 0; r < n; r++)
            ((int64_t *)out)[r] = code[r];
    }
}

static void encode(const char *values, int kind, Py_ssize_t n, const uint8_t *bits, int64_t bit0,
                   const domain_t *d, char *out, Py_ssize_t width)
{
    int64_t code[BLOCK];
    for (Py_ssize_t start = 0; start < n; start += BLOCK) {
        Py_ssize_t m = n - start < BLOCK ? n - start : BLOCK;
        if (kind == 'i')
            code_int32(values + start * 4, bits, bit0 + start, m, d, code);
        else if (kind == 'q')
            code_int64(values + start * 8, bits, bit0 + start, m, d, code);
        else
            code_float64(values + start * 8, bits, bit0 + start, m, d, code);
        store(code, m, out + start * width, width);
    }
}

static int fits(int64_t code, Py_ssize_t width)
{
    int64_t top = width == 8 ? INT64_MAX : ((int64_t)1 << (8 * width - 1)) - 1;
    return code >= -1 && code <= top;
}

/* codes(values, kind, offset, n, validity, validity_offset, minimum, maximum, mode, table, invalid, out) */
static PyObject *py_codes(PyObject *self, PyObject *args)
{
    Py_buffer values, out = {0}, validity = {0}, table = {0};
    PyObject *validity_object, *table_object, *out_object;
    int kind, mode;
    Py_ssize_t offset, n, validity_offset;
    long long minimum, maximum, invalid;
    if (!PyArg_ParseTuple(args, "y*CnnOnLLiOLO", &values, &kind, &offset, &n, &validity_object, &validity_offset,
                          &minimum, &maximum, &mode, &table_object, &invalid, &out_object))
        return NULL;
    PyObject *result = NULL;
    int has_validity = 0, has_table = 0, has_out = 0;
    Py_ssize_t item = kind == 'i' ? 4 : 8;
    if (!open_signed_buffer(out_object, &out, 1, 0, 8,
                            "codes: the output must be signed integers of the right size, aligned"))
        goto done;
    has_out = 1;
    Py_ssize_t width = out.itemsize;
    if ((kind != 'i' && kind != 'q' && kind != 'd') || offset < 0 || n < 0 ||
        offset > PY_SSIZE_T_MAX / item - n || values.len < (offset + n) * item ||
        (width != 1 && width != 2 && width != 4 && width != 8) || out.len != n * width) {
        PyErr_SetString(PyExc_ValueError, "codes: the values or the output have the wrong kind or length");
        goto done;
    }
    if (mode < IDENTITY || mode > EDGES || minimum > maximum || minimum < -EXACT_BOUND || maximum > EXACT_BOUND) {
        PyErr_SetString(PyExc_ValueError, "codes: the domain's bounds or mode are out of range");
        goto done;
    }
    if ((mode == LOOKUP || mode == EDGES) != (table_object != Py_None)) {
        PyErr_SetString(PyExc_ValueError, "codes: a lookup or edges go with modes LOOKUP and EDGES only");
        goto done;
    }
    if (validity_object != Py_None) {
        if (PyObject_GetBuffer(validity_object, &validity, PyBUF_SIMPLE) < 0)
            goto done;
        has_validity = 1;
        if (validity_offset < 0 || validity_offset > PY_SSIZE_T_MAX - n - 7 ||
            validity.len < (validity_offset + n + 7) / 8) {
            PyErr_SetString(PyExc_ValueError, "codes: the validity bitmap is too short");
            goto done;
        }
    }
    domain_t d = {mode, minimum, invalid, (double)minimum, (double)maximum, NULL, NULL, 0};
    int64_t top = mode == CLAMP || mode == IDENTITY ? maximum - minimum : -1;
    if (table_object != Py_None) {
        if (!open_signed_buffer(table_object, &table, 0, mode == LOOKUP ? 4 : 8, 8,
                                mode == LOOKUP ? "codes: a lookup must be signed integers of the right size, aligned"
                                               : "codes: edges must be signed integers of the right size, aligned"))
            goto done;
        has_table = 1;
        if (mode == LOOKUP) {
            if (table.len != (maximum - minimum + 1) * (Py_ssize_t)sizeof(int32_t)) {
                PyErr_SetString(PyExc_ValueError, "codes: the lookup does not cover the domain's values");
                goto done;
            }
            d.lookup = (const int32_t *)table.buf;
            for (int64_t v = 0; v <= maximum - minimum; v++)
                top = d.lookup[v] > top ? d.lookup[v] : top;
        } else {
            d.n_edges = table.len / (Py_ssize_t)sizeof(int64_t);
            d.edges = (const int64_t *)table.buf;
            int ascending = table.len % (Py_ssize_t)sizeof(int64_t) == 0 && d.n_edges > 0;
            for (Py_ssize_t e = 1; ascending && e < d.n_edges; e++)
                ascending = d.edges[e - 1] < d.edges[e];
            if (!ascending) {
                PyErr_SetString(PyExc_ValueError, "codes: the edges are not ascending");
                goto done;
            }
            top = d.n_edges - 1;
        }
    }
    if (!fits(top, width) || !fits(invalid, width)) {
        PyErr_SetString(PyExc_ValueError, "codes: a code does not fit the output's width");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    encode((const char *)values.buf + offset * item, kind, n, has_validity ? (const uint8_t *)validity.buf : NULL,
           validity_offset, &d, (char *)out.buf, width);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    if (has_validity)
        PyBuffer_Release(&validity);
    if (has_table)
        PyBuffer_Release(&table);
    PyBuffer_Release(&values);
    if (has_out)
        PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"codes", py_codes, METH_VARARGS,
     "codes(values, kind, offset, n, validity, validity_offset, minimum, maximum, mode, table, invalid, out):\n"
     "writes the code of values[offset:offset + n] (kind 'i' int32, 'q' int64, 'd' float64) into `out` (n signed\n"
     "integers of 1, 2, 4 or 8 bytes). A value is valid when its bit in `validity` (an Arrow bitmap from bit\n"
     "validity_offset, or None) is set and it is finite and integral as float64; mode IDENTITY (0): value - minimum\n"
     "if within [minimum, maximum]; CLAMP (1): clamped into [minimum, maximum], minus minimum; LOOKUP (2):\n"
     "table[value - minimum] (int32; negative: invalid) if within the bounds; EDGES (3): the index of the last\n"
     "of `table`'s ascending int64 edges at or below the value, if within the bounds. Invalid values get `invalid`."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_encoding",
                                    "Input values to public domain codes (see transforms/encode.py).", -1, methods};

PyMODINIT_FUNC PyInit__encoding(void) { return PyModule_Create(&module); }
