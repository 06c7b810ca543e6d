/*
 * Per-unit joint-fit kernels: iterative proportional fitting of a unit's joint table to table targets, and the
 * entropic mirror descent that fits it to the unit's noisy tables (transforms/units/joint.py states the problem).
 *
 * A unit's joint is `cells` doubles in C order over axes of `sizes`; table t is the margin on its axes (in the
 * table's own order, its cells in C order over them), and its values for a unit are the slice
 * [offsets[t], offsets[t + 1]) of the unit's row of `width` = offsets[T] table cells. A joint cell's cell in a
 * table is computed as the joint is walked (strides, no map per cell is stored: memory is O(tables x axes)).
 * Each unit is computed from its own row alone, in one fixed order (cells in index order, tables in order), so a
 * unit's result is bit for bit the same whatever other units the call holds, on any worker or engine.
 * One pass over the joint per sweep and table (IPF), one per mirror-descent step (update and margins fused):
 * the numpy version it replaces made about fifteen. A table that does not hold the joint's last (fastest) axis
 * sees a run of consecutive cells (the last axis's size) as one of its cells: its factor is read and its margin
 * added once per run.
 * Post-processing: these read noisy tables, their public variances and public totals only.
 */
#if defined(__FAST_MATH__) || defined(__ASSOCIATIVE_MATH__) || defined(__RECIPROCAL_MATH__) || \
    (defined(__FINITE_MATH_ONLY__) && __FINITE_MATH_ONLY__)
#error "_joint.c needs IEEE arithmetic: build it without -ffast-math or unsafe math (its exp and bits depend on it)"
#endif
/* no fused multiply-add, no reassociation: the same bits on every x86-64 and ARM build */
#pragma GCC optimize("fp-contract=off", "no-unsafe-math-optimizations")
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* The mirror descent (the hot loop) is compiled twice, for the x86-64 baseline and for AVX2, and the AVX2 build
 * runs where the CPU has it (x86-64 with GCC or clang): the same operations on the same lanes in the same order,
 * so the same bits (tested: `portable` forces the baseline), about 18% faster on a country's joints. No FMA in
 * either (fp-contract is off). INLINE makes the step's helpers part of each build. */
#if defined(__x86_64__) && defined(__GNUC__)
#define TWO_BUILDS 1
#endif
#define INLINE static inline __attribute__((always_inline))

#define LANES 8
#define PAIRS (LANES / 2)
typedef double pair_t __attribute__((vector_size(2 * sizeof(double)), aligned(sizeof(double))));
/* Units fitted side by side: every per-cell operation runs over LANES units' values at once (contiguous,
 * vectorised by the compiler), each lane computing its own unit with the same operations in the same order as
 * any other lane, so a unit's result never depends on its lane or on the other units of its block. */

typedef struct {
    double *joint, *candidate, *margins, *gradient, *candidate_gradient, *factors, *noisy;
} block_t;

/* How the tables see a joint of `cells` cells over k axes of `sizes`: table t's cells start at offsets[t] in a
 * unit's row of all tables' cells; a joint cell whose coordinates are x has cell sum_a x[a] * stride[t * k + a] in
 * table t (0 for an axis the table does not hold). The joint is walked a run at a time (`run`: the last axis's
 * size, consecutive cells); a table without the last axis is outer (one cell per run, its stride on the last axis
 * 0), the others inner, in table order (`inner`, `outer`: their indices). Moving from one run to the next raises
 * one prefix axis a by one (and returns the axes after it to 0): each table's cell of the run's first cell then
 * moves by delta[t * k + a]. `cell` and `coordinate` are a walk's scratch (one walk at a time). */
typedef struct {
    Py_ssize_t cells, run, tables, k, n_inner, n_outer;
    const int64_t *sizes;
    int64_t *offsets, *stride, *delta;
    int *inner, *outer;
    int64_t *cell, *coordinate; /* scratch of a walk: each table's cell of the run's first cell; prefix axes */
} layout_t;

/* A walk over the joint's runs, from its first: the prefix axes' coordinates at 0. */
static inline void start_walk(layout_t *layout)
{
    memset(layout->coordinate, 0, (size_t)layout->k * sizeof(int64_t));
}

/* The walk's next run: the prefix axes' coordinates raised by one (the last that can be, those after it back to
 * 0), and the run-first cells of tables t0 .. t0 + n - 1, first[0 .. n), moved with them (unchanged after the
 * last run). */
static inline void next_run(layout_t *layout, int64_t *first, Py_ssize_t t0, Py_ssize_t n)
{
    int64_t *coordinate = layout->coordinate;
    for (Py_ssize_t a = layout->k - 2; a >= 0; a--) {
        if (coordinate[a] + 1 < layout->sizes[a]) {
            coordinate[a] += 1;
            for (Py_ssize_t t = 0; t < n; t++)
                first[t] += layout->delta[(t0 + t) * layout->k + a];
            return;
        }
        coordinate[a] = 0;
    }
}

static void free_layout(layout_t *layout)
{
    PyMem_RawFree(layout->offsets);
    PyMem_RawFree(layout->inner);
    layout->offsets = NULL;
    layout->inner = NULL;
}

/* The layout of a joint over `sizes` (k axes) and tables whose axes are axes[axis_offsets[t] ..
 * axis_offsets[t + 1]): 0 with a Python error when the shape is not one (sizes < 1, cells or a table's cells out
 * of range, an axis out of range or repeated, a table with no axis) or memory runs out. */
static int build_layout(layout_t *layout, const int64_t *sizes, Py_ssize_t k, const int32_t *axes,
                        Py_ssize_t n_axes, const int64_t *axis_offsets, Py_ssize_t tables, const char *name)
{
    *layout = (layout_t){0};
    layout->k = k;
    layout->tables = tables;
    int64_t cells = 1;
    int ok = k >= 1 && tables >= 1 && axis_offsets[0] == 0 && axis_offsets[tables] == n_axes;
    for (Py_ssize_t a = 0; a < k && ok; a++) {
        ok = sizes[a] >= 1 && sizes[a] <= INT32_MAX && cells <= (PY_SSIZE_T_MAX / 64) / (LANES * sizes[a]);
        if (ok)
            cells *= sizes[a];
    }
    for (Py_ssize_t t = 0; t < tables && ok; t++)
        ok = axis_offsets[t + 1] > axis_offsets[t] && axis_offsets[t + 1] - axis_offsets[t] <= k;
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "%s: inconsistent shape", name);
        return 0;
    }
    layout->cells = cells;
    layout->run = sizes[k - 1];
    size_t n = (size_t)tables;
    layout->offsets = PyMem_RawMalloc((2 * n + 1 + 2 * n * (size_t)k + 2 * (size_t)k) * sizeof(int64_t));
    layout->inner = PyMem_RawMalloc(n * 2 * sizeof(int));
    if (layout->offsets == NULL || layout->inner == NULL) {
        free_layout(layout);
        PyErr_NoMemory();
        return 0;
    }
    layout->stride = layout->offsets + n + 1;
    layout->delta = layout->stride + n * (size_t)k;
    layout->cell = layout->delta + n * (size_t)k;
    layout->coordinate = layout->cell + n;
    int64_t *own_sizes = layout->coordinate + k; /* a copy: the caller's array is not read again */
    memcpy(own_sizes, sizes, (size_t)k * sizeof(int64_t));
    layout->sizes = own_sizes;
    sizes = own_sizes;
    layout->outer = layout->inner + n;
    memset(layout->stride, 0, 2 * n * (size_t)k * sizeof(int64_t));
    layout->offsets[0] = 0;
    for (Py_ssize_t t = 0; t < tables && ok; t++) {
        int64_t table_cells = 1, *stride = layout->stride + t * k;
        for (int64_t i = axis_offsets[t + 1] - 1; i >= axis_offsets[t] && ok; i--) {
            int32_t a = axes[i];
            ok = a >= 0 && a < k && stride[a] == 0 && table_cells <= INT32_MAX / sizes[a];
            if (ok) {
                stride[a] = table_cells;
                table_cells *= sizes[a];
            }
        }
        ok = ok && layout->offsets[t] <= INT32_MAX - table_cells;
        if (ok)
            layout->offsets[t + 1] = layout->offsets[t] + table_cells;
        for (Py_ssize_t a = 0; a + 1 < k && ok; a++) {  /* raise a, return a + 1 .. k - 2 to 0 */
            int64_t move = stride[a];
            for (Py_ssize_t b = a + 1; b + 1 < k; b++)
                move -= (sizes[b] - 1) * stride[b];
            layout->delta[t * k + a] = move;
        }
        if (stride[k - 1] == 0)
            layout->outer[layout->n_outer++] = (int)t;
        else
            layout->inner[layout->n_inner++] = (int)t;
    }
    if (!ok) {
        free_layout(layout);
        PyErr_Format(PyExc_ValueError, "%s: inconsistent shape", name);
        return 0;
    }
    return 1;
}

/* exp(x) for x in [EXP_SMALLEST, 0], from additions, multiplications and integer operations alone (no library
 * call, vectorised with the loop that calls it, the same bits on every machine and C library): x = k ln 2 + r,
 * k the nearest integer to x / ln 2 (Cody and Waite's two-part ln 2: k ln2_hi is exact), |r| <= 0.35, exp(r) by
 * its Taylor polynomial of degree 12 (truncation below 2e-16 relative), times 2^k built in the exponent bits.
 * Within 4 ulp of exp (tested; 3 at most over 10^6 values); the factors of a mirror-descent step need no more. */
#define EXP_SMALLEST (-708.0)
INLINE double exp_nonpositive(double x)
{
    const double shifter = 6755399441055744.0; /* 1.5 * 2^52: adding it rounds to an integer in the low bits */
    double t = x * 1.4426950408889634 + shifter;
    double k = t - shifter;
    double r = (x - k * 6.93147180369123816490e-01) - k * 1.90821492927058770002e-10;
    double p = 2.08767569878680989792e-09;       /* 1/12! */
    p = p * r + 2.50521083854417187751e-08;      /* 1/11! */
    p = p * r + 2.75573192239858906526e-07;      /* 1/10! */
    p = p * r + 2.75573192239858906526e-06;      /* 1/9! */
    p = p * r + 2.48015873015873015873e-05;      /* 1/8! */
    p = p * r + 1.98412698412698412698e-04;      /* 1/7! */
    p = p * r + 1.38888888888888888889e-03;      /* 1/6! */
    p = p * r + 8.33333333333333333333e-03;      /* 1/5! */
    p = p * r + 4.16666666666666666667e-02;      /* 1/4! */
    p = p * r + 1.66666666666666666667e-01;      /* 1/3! */
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    uint64_t bits, shifted;
    memcpy(&bits, &t, sizeof bits);
    memcpy(&shifted, &shifter, sizeof shifted);
    uint64_t scale_bits = (bits - shifted + 1023u) << 52;
    double scale;
    memcpy(&scale, &scale_bits, sizeof scale);
    return p * scale;
}

/* A block (n x LANES) from `lanes` units' rows of n values (units x n); lanes past the last unit hold zeros:
 * units of total 0, computed like any other and never read back. */
static void load_block(double *block, const double *rows, size_t n, int lanes)
{
    memset(block, 0, n * LANES * sizeof(double));
    for (int j = 0; j < lanes; j++)
        for (size_t c = 0; c < n; c++)
            block[c * LANES + j] = rows[j * n + c];
}

static void store_block(double *rows, const double *block, size_t n, int lanes)
{
    for (int j = 0; j < lanes; j++)
        for (size_t c = 0; c < n; c++)
            rows[j * n + c] = block[c * LANES + j];
}

/* Per lane: loss[j] = sum_t ||margin_t * scale_j - y_t||^2 / v_t, gradient 2 (margin * scale - y) / v. */
INLINE void block_loss(const double *margins, const double *scale, const double *noisy, const double *variances,
                       const int64_t *offsets, Py_ssize_t tables, double *gradient, double *loss)
{
    for (int j = 0; j < LANES; j++)
        loss[j] = 0.0;
    for (Py_ssize_t t = 0; t < tables; t++) {
        double table_loss[LANES] = {0.0};
        for (int64_t k = offsets[t]; k < offsets[t + 1]; k++)
            for (int j = 0; j < LANES; j++) {
                double residual = margins[k * LANES + j] * scale[j] - noisy[k * LANES + j];
                table_loss[j] += residual * residual;
                gradient[k * LANES + j] = 2.0 * residual / variances[t];
            }
        for (int j = 0; j < LANES; j++)
            loss[j] += table_loss[j] / variances[t];
    }
}

/* IPF of LANES units' joints (cells x LANES, in place) to their table targets (W x LANES): per sweep and table,
 * each cell times target / margin of its table cell (0 where the margin is 0). */
static void ipf_block(double *joint, layout_t *layout, const double *targets, int64_t sweeps, double *ratio)
{
    pair_t *cell = (pair_t *)joint, *margin = (pair_t *)ratio;
    Py_ssize_t run = layout->run, k = layout->k;
    for (int64_t s = 0; s < sweeps; s++)
        for (Py_ssize_t t = 0; t < layout->tables; t++) {
            int64_t size = layout->offsets[t + 1] - layout->offsets[t], step = layout->stride[t * k + k - 1];
            const double *target = targets + layout->offsets[t] * LANES;
            memset(ratio, 0, (size_t)size * LANES * sizeof(double));
            start_walk(layout);
            int64_t first_cell = 0;
            for (Py_ssize_t first = 0; first < layout->cells; first += run) {
                if (step == 0) { /* outer: the run's sum into one cell */
                    pair_t sum[PAIRS] = {{0.0, 0.0}};
                    for (Py_ssize_t c = first; c < first + run; c++)
                        for (int j = 0; j < PAIRS; j++)
                            sum[j] += cell[c * PAIRS + j];
                    for (int j = 0; j < PAIRS; j++)
                        margin[first_cell * PAIRS + j] += sum[j];
                } else {
                    for (Py_ssize_t c = first, x = first_cell; c < first + run; c++, x += step)
                        for (int j = 0; j < PAIRS; j++)
                            margin[x * PAIRS + j] += cell[c * PAIRS + j];
                }
                next_run(layout, &first_cell, t, 1);
            }
            for (int64_t x = 0; x < size * LANES; x++)
                ratio[x] = ratio[x] > 0 ? target[x] / ratio[x] : 0.0;
            start_walk(layout);
            first_cell = 0;
            for (Py_ssize_t first = 0; first < layout->cells; first += run) {
                for (Py_ssize_t c = first, x = first_cell; c < first + run; c++, x += step)
                    for (int j = 0; j < PAIRS; j++)
                        cell[c * PAIRS + j] *= margin[x * PAIRS + j];
                next_run(layout, &first_cell, t, 1);
            }
        }
}

/* One mirror-descent step's pass over the joint (cells x LANES): candidate = joint * (scale * the outer tables'
 * factors of its run) * the inner tables' factors of the cell, its margins (W x LANES: an outer table's from the
 * run's sum) and its sum per lane, in one pass (with factors of 1: the joint's margins, the candidate the joint). */
INLINE void step_pass(const double *joint, const double *scale, const double *factors, layout_t *layout,
                      double *candidate, double *margins, double *sum)
{
    const pair_t *in = (const pair_t *)joint, *factor = (const pair_t *)factors;
    pair_t *out = (pair_t *)candidate, *margin = (pair_t *)margins;
    const int64_t *offsets = layout->offsets, *stride = layout->stride;
    Py_ssize_t k = layout->k, tables = layout->tables;
    int64_t *first_cell = layout->cell;
    pair_t total[PAIRS];
    for (int j = 0; j < PAIRS; j++)
        total[j] = (pair_t){0.0, 0.0};
    memset(margins, 0, (size_t)offsets[tables] * LANES * sizeof(double));
    start_walk(layout);
    for (Py_ssize_t t = 0; t < tables; t++)
        first_cell[t] = offsets[t];
    for (Py_ssize_t first = 0; first < layout->cells; first += layout->run) {
        pair_t by[PAIRS], run_sum[PAIRS];
        for (int j = 0; j < PAIRS; j++) {
            by[j] = ((const pair_t *)scale)[j];
            run_sum[j] = (pair_t){0.0, 0.0};
        }
        for (Py_ssize_t i = 0; i < layout->n_outer; i++) {
            const pair_t *row = factor + first_cell[layout->outer[i]] * PAIRS;
            for (int j = 0; j < PAIRS; j++)
                by[j] *= row[j];
        }
        for (Py_ssize_t c = first, d = 0; c < first + layout->run; c++, d++) {
            pair_t v[PAIRS];
            for (int j = 0; j < PAIRS; j++)
                v[j] = in[c * PAIRS + j] * by[j];
            for (Py_ssize_t i = 0; i < layout->n_inner; i++) {
                int t = layout->inner[i];
                const pair_t *row = factor + (first_cell[t] + d * stride[t * k + k - 1]) * PAIRS;
                for (int j = 0; j < PAIRS; j++)
                    v[j] *= row[j];
            }
            for (int j = 0; j < PAIRS; j++) {
                out[c * PAIRS + j] = v[j];
                run_sum[j] += v[j];
            }
            for (Py_ssize_t i = 0; i < layout->n_inner; i++) {
                int t = layout->inner[i];
                pair_t *row = margin + (first_cell[t] + d * stride[t * k + k - 1]) * PAIRS;
                for (int j = 0; j < PAIRS; j++)
                    row[j] += v[j];
            }
        }
        for (int j = 0; j < PAIRS; j++)
            total[j] += run_sum[j];
        for (Py_ssize_t i = 0; i < layout->n_outer; i++) {
            pair_t *row = margin + first_cell[layout->outer[i]] * PAIRS;
            for (int j = 0; j < PAIRS; j++)
                row[j] += run_sum[j];
        }
        next_run(layout, first_cell, 0, tables);
    }
    for (int j = 0; j < PAIRS; j++)
        ((pair_t *)sum)[j] = total[j];
}

/* Entropic mirror descent of LANES units' joints (b->joint, cells x LANES: the start in, the fit out) towards
 * their noisy tables (b->noisy, W x LANES), each unit's total kept: each step multiplies every cell by
 * prod_t exp(-step * gradient_t) (each table's exponents clipped to [-clip, clip] and shifted to a largest of 0
 * per unit), the joint scaled to the total; a unit's step that does not lower its loss (or leaves a joint of 0
 * to scale) is undone and its step halved, a kept one grows it 1.5x (at most max_step). */
INLINE void mirror_descent_body(block_t *b, layout_t *layout, const double *variances, const double *total,
                                 int64_t iterations, double clip, double max_step, double floor)
{
    Py_ssize_t cells = layout->cells, tables = layout->tables;
    const int64_t *offsets = layout->offsets;
    double *joint = b->joint, *candidate = b->candidate, *gradient = b->gradient;
    double *candidate_gradient = b->candidate_gradient, *margins = b->margins, *factors = b->factors;
    int64_t width = offsets[tables];
    double smallest[LANES], sum[LANES] = {0.0}, scale[LANES], loss[LANES], step[LANES];
    double candidate_scale[LANES], candidate_loss[LANES], top[LANES], largest[LANES] = {0.0};
    int better[LANES];
    for (int j = 0; j < LANES; j++)
        smallest[j] = floor * (total[j] / (double)cells);
    for (Py_ssize_t c = 0; c < cells; c++)
        for (int j = 0; j < LANES; j++) {
            double x = joint[c * LANES + j];
            x = (x >= smallest[j] || x != x) ? x : smallest[j];
            joint[c * LANES + j] = x;
            sum[j] += x;
        }
    for (int j = 0; j < LANES; j++) {
        scale[j] = sum[j] > 0 ? total[j] / sum[j] : 0.0;
        for (Py_ssize_t c = 0; c < cells; c++)
            joint[c * LANES + j] *= scale[j];
        scale[j] = 1.0;
    }
    for (int64_t x = 0; x < width * LANES; x++)
        factors[x] = 1.0;
    step_pass(joint, scale, factors, layout, candidate, margins, sum); /* the start's margins */
    block_loss(margins, scale, b->noisy, variances, offsets, tables, gradient, loss);
    for (Py_ssize_t t = 0; t < tables; t++) {
        double table_largest[LANES] = {0.0};
        for (int64_t k = offsets[t]; k < offsets[t + 1]; k++)
            for (int j = 0; j < LANES; j++) {
                double g = fabs(gradient[k * LANES + j]);
                table_largest[j] = g > table_largest[j] ? g : table_largest[j];
            }
        for (int j = 0; j < LANES; j++)
            largest[j] += table_largest[j];
    }
    for (int j = 0; j < LANES; j++)
        step[j] = 1.0 / (largest[j] > 1e-12 ? largest[j] : 1e-12);
    for (int64_t i = 0; i < iterations; i++) {
        for (Py_ssize_t t = 0; t < tables; t++) {
            for (int j = 0; j < LANES; j++)
                top[j] = -INFINITY;
            for (int64_t k = offsets[t]; k < offsets[t + 1]; k++)
                for (int j = 0; j < LANES; j++) {
                    double e = -step[j] * gradient[k * LANES + j];
                    e = e < -clip ? -clip : (e > clip ? clip : e);
                    factors[k * LANES + j] = e;
                    top[j] = e > top[j] ? e : top[j];
                }
            for (int64_t k = offsets[t]; k < offsets[t + 1]; k++)
                for (int j = 0; j < LANES; j++)
                    factors[k * LANES + j] = exp_nonpositive(factors[k * LANES + j] - top[j]);
        }
        double candidate_sum[LANES];
        step_pass(joint, scale, factors, layout, candidate, margins, candidate_sum);
        for (int j = 0; j < LANES; j++)
            candidate_scale[j] = candidate_sum[j] > 0 ? total[j] / candidate_sum[j] : 0.0;
        block_loss(margins, candidate_scale, b->noisy, variances, offsets, tables, candidate_gradient,
                   candidate_loss);
        int all = 1;
        for (int j = 0; j < LANES; j++) {
            better[j] = candidate_loss[j] <= loss[j] && (candidate_scale[j] > 0 || total[j] == 0);
            all &= better[j];
        }
        if (all) {
            double *swap = joint;
            joint = candidate;
            candidate = swap;
            swap = gradient;
            gradient = candidate_gradient;
            candidate_gradient = swap;
        } else {
            for (Py_ssize_t c = 0; c < cells; c++)
                for (int j = 0; j < LANES; j++)
                    joint[c * LANES + j] = better[j] ? candidate[c * LANES + j] : joint[c * LANES + j];
            for (int64_t k = 0; k < width; k++)
                for (int j = 0; j < LANES; j++)
                    gradient[k * LANES + j] = better[j] ? candidate_gradient[k * LANES + j] : gradient[k * LANES + j];
        }
        for (int j = 0; j < LANES; j++) {
            if (better[j]) {
                loss[j] = candidate_loss[j];
                scale[j] = candidate_scale[j];
                step[j] = step[j] * 1.5 < max_step ? step[j] * 1.5 : max_step;
            } else {
                step[j] /= 2.0;
            }
        }
    }
    for (Py_ssize_t c = 0; c < cells; c++)
        for (int j = 0; j < LANES; j++)
            b->joint[c * LANES + j] = joint[c * LANES + j] * scale[j];
}

static void mirror_descent_block(block_t *b, layout_t *layout, const double *variances, const double *total,
                                 int64_t iterations, double clip, double max_step, double floor)
{
    mirror_descent_body(b, layout, variances, total, iterations, clip, max_step, floor);
}

#ifdef TWO_BUILDS
__attribute__((target("avx2"))) static void mirror_descent_block_avx2(block_t *b, layout_t *layout,
                                                                      const double *variances, const double *total,
                                                                      int64_t iterations, double clip,
                                                                      double max_step, double floor)
{
    mirror_descent_body(b, layout, variances, total, iterations, clip, max_step, floor);
}
#endif

typedef void (*descent_t)(block_t *, layout_t *, const double *, const double *, int64_t, double, double, double);

/* The AVX2 build where the CPU runs it (unless `portable`), else the baseline's. */
static descent_t mirror_descent_build(int portable)
{
#ifdef TWO_BUILDS
    __builtin_cpu_init();
    if (!portable && __builtin_cpu_supports("avx2"))
        return mirror_descent_block_avx2;
#endif
    (void)portable;
    return mirror_descent_block;
}

/* The shared argument checks: sizes i64[k], axes i32[n], axis_offsets i64[tables + 1], joint f64[units * cells],
 * rows f64[units * width]; sets units and the layout (free it with free_layout). */
static int check_shapes(Py_buffer *sizes, Py_buffer *axes, Py_buffer *axis_offsets, Py_buffer *joint,
                        Py_buffer *rows, Py_ssize_t *units, layout_t *layout, const char *name)
{
    Py_ssize_t tables = axis_offsets->len / (Py_ssize_t)sizeof(int64_t) - 1;
    if (sizes->len % (Py_ssize_t)sizeof(int64_t) != 0 || axes->len % (Py_ssize_t)sizeof(int32_t) != 0 ||
        axis_offsets->len % (Py_ssize_t)sizeof(int64_t) != 0 || tables < 1) {
        PyErr_Format(PyExc_ValueError, "%s: inconsistent shape", name);
        return 0;
    }
    if (!build_layout(layout, (const int64_t *)sizes->buf, sizes->len / (Py_ssize_t)sizeof(int64_t),
                      (const int32_t *)axes->buf, axes->len / (Py_ssize_t)sizeof(int32_t),
                      (const int64_t *)axis_offsets->buf, tables, name))
        return 0;
    Py_ssize_t width = layout->offsets[tables];
    *units = joint->len / (layout->cells * (Py_ssize_t)sizeof(double));
    if (joint->len % (layout->cells * (Py_ssize_t)sizeof(double)) != 0 ||
        (*units > 0 && width > PY_SSIZE_T_MAX / (Py_ssize_t)sizeof(double) / *units) ||
        rows->len != *units * width * (Py_ssize_t)sizeof(double)) {
        free_layout(layout);
        PyErr_Format(PyExc_ValueError, "%s: the joints or table rows do not match the shape", name);
        return 0;
    }
    return 1;
}

/* ipf(joint f64[units * cells] (in place), sizes i64[k], axes i32[n], axis_offsets i64[T + 1],
 * targets f64[units * W], sweeps) */
static PyObject *py_ipf(PyObject *self, PyObject *args)
{
    Py_buffer joint, sizes, axes, axis_offsets, targets;
    Py_ssize_t units;
    long long sweeps;
    layout_t layout = {0};
    if (!PyArg_ParseTuple(args, "w*y*y*y*y*L", &joint, &sizes, &axes, &axis_offsets, &targets, &sweeps))
        return NULL;
    PyObject *result = NULL;
    double *memory = NULL;
    if (!check_shapes(&sizes, &axes, &axis_offsets, &joint, &targets, &units, &layout, "ipf"))
        goto done;
    if (sweeps < 0) {
        PyErr_SetString(PyExc_ValueError, "ipf: sweeps must be at least 0");
        goto done;
    }
    size_t width = (size_t)layout.offsets[layout.tables], n = (size_t)layout.cells;
    memory = PyMem_RawMalloc((n + width * 2) * LANES * sizeof(double));
    if (memory == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    double *block = memory, *block_targets = memory + n * LANES, *ratio = memory + (n + width) * LANES;
    double *fit = (double *)joint.buf;
    const double *y = (const double *)targets.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t first = 0; first < units; first += LANES) {
        int lanes = units - first < LANES ? (int)(units - first) : LANES;
        load_block(block, fit + first * (Py_ssize_t)n, n, lanes);
        load_block(block_targets, y + first * (Py_ssize_t)width, width, lanes);
        ipf_block(block, &layout, block_targets, (int64_t)sweeps, ratio);
        store_block(fit + first * (Py_ssize_t)n, block, n, lanes);
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyMem_RawFree(memory);
    free_layout(&layout);
    PyBuffer_Release(&joint);
    PyBuffer_Release(&sizes);
    PyBuffer_Release(&axes);
    PyBuffer_Release(&axis_offsets);
    PyBuffer_Release(&targets);
    return result;
}

/* mirror_descent(joint f64[units * cells] (in: the start; out: the fit), sizes i64[k], axes i32[n],
 * axis_offsets i64[T + 1], noisy f64[units * W], variances f64[T], totals f64[units], iterations, clip, max_step,
 * floor, portable = False: the baseline build even where the AVX2 build runs) */
static PyObject *py_mirror_descent(PyObject *self, PyObject *args)
{
    Py_buffer joint, sizes, axes, axis_offsets, noisy, variances, totals;
    Py_ssize_t units;
    long long iterations;
    double clip, max_step, floor;
    layout_t layout = {0};
    int portable = 0;
    if (!PyArg_ParseTuple(args, "w*y*y*y*y*y*y*Lddd|p", &joint, &sizes, &axes, &axis_offsets, &noisy, &variances,
                          &totals, &iterations, &clip, &max_step, &floor, &portable))
        return NULL;
    descent_t descent = mirror_descent_build(portable);
    PyObject *result = NULL;
    double *memory = NULL;
    if (!check_shapes(&sizes, &axes, &axis_offsets, &joint, &noisy, &units, &layout, "mirror_descent"))
        goto done;
    if (variances.len != layout.tables * (Py_ssize_t)sizeof(double) ||
        totals.len != units * (Py_ssize_t)sizeof(double)) {
        PyErr_SetString(PyExc_ValueError, "mirror_descent: variances or totals do not match");
        goto done;
    }
    if (iterations < 0 || !(clip > 0 && clip <= -EXP_SMALLEST / 2) || !(max_step > 0 && isfinite(max_step)) ||
        !(floor >= 0 && isfinite(floor))) {
        PyErr_SetString(PyExc_ValueError, "mirror_descent: iterations, clip, max_step or floor out of range");
        goto done;
    }
    for (Py_ssize_t u = 0; u < units; u++)
        if (!(((const double *)totals.buf)[u] >= 0 && isfinite(((const double *)totals.buf)[u]))) {
            PyErr_SetString(PyExc_ValueError, "mirror_descent: a unit's total is not a finite number >= 0");
            goto done;
        }
    const double *v = (const double *)variances.buf;
    for (Py_ssize_t t = 0; t < layout.tables; t++)
        if (!(v[t] > 0) || isinf(v[t])) {
            PyErr_SetString(PyExc_ValueError, "mirror_descent: a variance is not positive and finite");
            goto done;
        }
    size_t width = (size_t)layout.offsets[layout.tables], n = (size_t)layout.cells;
    memory = PyMem_RawMalloc((n * 2 + width * 5) * LANES * sizeof(double));
    if (memory == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    block_t block = {memory, memory + n * LANES, memory + 2 * n * LANES, memory + (2 * n + width) * LANES,
                     memory + (2 * n + 2 * width) * LANES, memory + (2 * n + 3 * width) * LANES,
                     memory + (2 * n + 4 * width) * LANES};
    double *fit = (double *)joint.buf;
    const double *y = (const double *)noisy.buf, *all_totals = (const double *)totals.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t first = 0; first < units; first += LANES) {
        int lanes = units - first < LANES ? (int)(units - first) : LANES;
        double total[LANES] = {0.0};
        for (int j = 0; j < lanes; j++)
            total[j] = all_totals[first + j];
        load_block(block.joint, fit + first * (Py_ssize_t)n, n, lanes);
        load_block(block.noisy, y + first * (Py_ssize_t)width, width, lanes);
        descent(&block, &layout, v, total, (int64_t)iterations, clip, max_step, floor);
        store_block(fit + first * (Py_ssize_t)n, block.joint, n, lanes);
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyMem_RawFree(memory);
    free_layout(&layout);
    PyBuffer_Release(&joint);
    PyBuffer_Release(&sizes);
    PyBuffer_Release(&axes);
    PyBuffer_Release(&axis_offsets);
    PyBuffer_Release(&noisy);
    PyBuffer_Release(&variances);
    PyBuffer_Release(&totals);
    return result;
}

/* exp(values f64[n], out f64[n]): exp_nonpositive of each value in [EXP_SMALLEST, 0] (for tests of its accuracy). */
static PyObject *py_exp(PyObject *self, PyObject *args)
{
    Py_buffer values, out;
    if (!PyArg_ParseTuple(args, "y*w*", &values, &out))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = values.len / (Py_ssize_t)sizeof(double);
    const double *x = (const double *)values.buf;
    if (out.len != values.len || values.len % (Py_ssize_t)sizeof(double) != 0) {
        PyErr_SetString(PyExc_ValueError, "exp: values and out differ in length");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (!(x[i] >= EXP_SMALLEST && x[i] <= 0)) {
            PyErr_SetString(PyExc_ValueError, "exp: a value is outside [-708, 0]");
            goto done;
        }
    for (Py_ssize_t i = 0; i < n; i++)
        ((double *)out.buf)[i] = exp_nonpositive(x[i]);
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&values);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"exp", py_exp, METH_VARARGS,
     "exp(values, out): out = exp(values) for values in [-708, 0], as the kernels compute it."},
    {"ipf", py_ipf, METH_VARARGS,
     "ipf(joint, sizes, axes, axis_offsets, targets, sweeps): per unit, iterative proportional fitting of its joint\n"
     "(in place) to its table targets."},
    {"mirror_descent", py_mirror_descent, METH_VARARGS,
     "mirror_descent(joint, sizes, axes, axis_offsets, noisy, variances, totals, iterations, clip, max_step,\n"
     "floor, portable=False):\n"
     "per unit, the entropic mirror descent of its joint (in place: the start in, the fit out) towards its noisy\n"
     "tables, its total kept; `portable`: by the baseline build even where the AVX2 build runs (the same bits)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_joint", "Per-unit joint-fit kernels (C).", -1, methods};

PyMODINIT_FUNC PyInit__joint(void) { return PyModule_Create(&module); }
