/* One-pass optimizer updates on float32/float64 NumPy buffers (optional; see models/optim.py).
 *
 * NumPy runs an update as a sequence of whole-array passes through a scratch
 * buffer: SGD `p -= g * lr` is two, Adam's update ten, each reading and
 * writing memory. These loops do the same arithmetic element by element in
 * one pass: every operation in the order NumPy does it, each rounded to the
 * array's type (scalars are cast to it first, as NumPy casts a Python float
 * against a float32 array), and compiled with -ffp-contract=off so that no
 * multiply-add is fused: the results are bit-identical to the NumPy lines in
 * models/optim.py (tests/test_optim_fused.py). The GIL is released, so
 * several threads can step disjoint blocks at once (pserver.server.cache_blocked).
 *
 *   sgd:       p <- p - g lr
 *   momentum:  v <- v mu + g;  t <- v mu + g if nesterov else v;  p <- p - t lr
 *   adam:      m <- m b1 + g (1-b1);  v <- v b2 + (g g)(1-b2);
 *              p <- p - (m / (sqrt(v) + eps_t)) lr_t
 *
 * and, in the same way, the polynomial passes of GELU's tanh form (models/layers.py), whose
 * tanh stays NumPy's own pass so that it is the same function:
 *
 *   gelu_u:    u <- ((x x) ck + c) x                                 (tanh(u) is NumPy's)
 *   gelu_y:    y <- ((t + 1) x) 0.5
 *   gelu_dx:   d <- ((x x) 3ck + c) x;  dx <- ((((d - (t t) d) + t) + 1) 0.5) dy
 *
 * and LayerNorm's rows (models/layers.py), their means and sums as NumPy's pairwise summation
 * adds them (pairwise_f32/f64 below):
 *
 *   norm_forward:   mu <- sum(x) / d;  xhat <- x - mu;  var <- sum(xhat xhat) / d + eps;
 *                   r <- 1 / sqrt(var);  xhat <- xhat r;  y <- xhat g + b       (per row)
 *   norm_backward:  gx <- dy xhat;  dx <- dy g;  m1 <- sum(dx) / d;  m2 <- sum(dx xhat) / d;
 *                   dx <- (dx - (xhat m2 + m1)) r                                (per row)
 *
 * and the embedding's gradient scatter (models/layers.py), in the order np.add.at adds:
 *
 *   rows_add:  t[index[i]] <- t[index[i]] + rows[i]   for i = 0 .. N-1     (rows of d; an
 *              index below 0 counts from the end, as NumPy's indexing does)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

/* Each loop built for AVX-512, AVX2 and the baseline, the CPU's best picked at load: with no
 * multiply-add fused (-ffp-contract=off) and IEEE sqrt and division in every one, they give
 * the same bits. */
#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VECTOR_CLONES
#endif

#define DEFINE_KERNELS(T, S, SQRT)                                                              \
    VECTOR_CLONES static void sgd_##S(T *restrict p, const T *restrict g, Py_ssize_t n,         \
                                      T lr) {                                                   \
        for (Py_ssize_t i = 0; i < n; i++) {                                                    \
            T t = g[i] * lr;                                                                    \
            p[i] = p[i] - t;                                                                    \
        }                                                                                       \
    }                                                                                           \
    VECTOR_CLONES static void momentum_##S(T *restrict p, const T *restrict g, T *restrict v,   \
                                           Py_ssize_t n, T mu, T lr, int nesterov) {            \
        for (Py_ssize_t i = 0; i < n; i++) {                                                    \
            T vi = v[i] * mu;                                                                   \
            vi = vi + g[i];                                                                     \
            v[i] = vi;                                                                          \
            T t = nesterov ? (vi * mu) + g[i] : vi;                                             \
            t = t * lr;                                                                         \
            p[i] = p[i] - t;                                                                    \
        }                                                                                       \
    }                                                                                           \
    VECTOR_CLONES static void adam_##S(T *restrict p, const T *restrict g, T *restrict m,       \
                                       T *restrict v, Py_ssize_t n, T b1, T c1, T b2, T c2,     \
                                       T eps, T lr) {                                           \
        for (Py_ssize_t i = 0; i < n; i++) {                                                    \
            T mi = m[i] * b1;                                                                   \
            mi = mi + g[i] * c1;                                                                \
            m[i] = mi;                                                                          \
            T sq = g[i] * g[i];                                                                 \
            sq = sq * c2;                                                                       \
            T vi = v[i] * b2;                                                                   \
            vi = vi + sq;                                                                       \
            v[i] = vi;                                                                          \
            T d = SQRT(vi);                                                                     \
            d = d + eps;                                                                        \
            d = mi / d;                                                                         \
            d = d * lr;                                                                         \
            p[i] = p[i] - d;                                                                    \
        }                                                                                       \
    }

DEFINE_KERNELS(float, f32, sqrtf)
DEFINE_KERNELS(double, f64, sqrt)

#define DEFINE_GELU(T, S)                                                                       \
    VECTOR_CLONES static void gelu_u_##S(T *restrict u, const T *restrict x, Py_ssize_t n,      \
                                         T ck, T c) {                                           \
        for (Py_ssize_t i = 0; i < n; i++) {                                                    \
            T t = x[i] * x[i];                                                                  \
            t = t * ck;                                                                         \
            t = t + c;                                                                          \
            u[i] = t * x[i];                                                                    \
        }                                                                                       \
    }                                                                                           \
    VECTOR_CLONES static void gelu_y_##S(T *restrict y, const T *restrict x,                    \
                                         const T *restrict t, Py_ssize_t n) {                   \
        for (Py_ssize_t i = 0; i < n; i++) {                                                    \
            T s = t[i] + (T)1;                                                                  \
            s = s * x[i];                                                                       \
            y[i] = s * (T)0.5;                                                                  \
        }                                                                                       \
    }                                                                                           \
    VECTOR_CLONES static void gelu_dx_##S(T *restrict dx, const T *restrict dy,                 \
                                          const T *restrict x, const T *restrict t,             \
                                          Py_ssize_t n, T ck3, T c) {                           \
        for (Py_ssize_t i = 0; i < n; i++) {                                                    \
            T d = x[i] * x[i];                                                                  \
            d = d * ck3;                                                                        \
            d = d + c;                                                                          \
            d = d * x[i];                                                                       \
            T tt = t[i] * t[i];                                                                 \
            tt = tt * d;                                                                        \
            d = d - tt;                                                                         \
            d = d + t[i];                                                                       \
            d = d + (T)1;                                                                       \
            d = d * (T)0.5;                                                                     \
            dx[i] = d * dy[i];                                                                  \
        }                                                                                       \
    }

DEFINE_GELU(float, f32)
DEFINE_GELU(double, f64)

/* NumPy's pairwise summation of a[0..n-1] (numpy/_core/src/umath/loops_utils.h.src), the sum
 * a float add.reduce along a contiguous axis computes: blocks of up to 128 summed in 8 running
 * partial sums, longer runs split in two halves of multiples of 8. A row's np.sum is (0 + this). */
#define DEFINE_PAIRWISE(T, S)                                                                   \
    static T pairwise_##S(const T *a, Py_ssize_t n) {                                           \
        if (n < 8) {                                                                            \
            T res = -(T)0;                                                                      \
            for (Py_ssize_t i = 0; i < n; i++) res = res + a[i];                                \
            return res;                                                                         \
        }                                                                                       \
        if (n <= 128) {                                                                         \
            T r[8];                                                                             \
            Py_ssize_t i;                                                                       \
            for (int j = 0; j < 8; j++) r[j] = a[j];                                            \
            for (i = 8; i < n - (n % 8); i += 8)                                                \
                for (int j = 0; j < 8; j++) r[j] = r[j] + a[i + j];                             \
            T res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));          \
            for (; i < n; i++) res = res + a[i];                                                \
            return res;                                                                         \
        }                                                                                       \
        Py_ssize_t n2 = n / 2;                                                                  \
        n2 -= n2 % 8;                                                                           \
        return pairwise_##S(a, n2) + pairwise_##S(a + n2, n - n2);                              \
    }

DEFINE_PAIRWISE(float, f32)
DEFINE_PAIRWISE(double, f64)

#define DEFINE_NORM(T, S, SQRT)                                                                 \
    VECTOR_CLONES static void norm_forward_##S(T *restrict y, T *restrict xhat,                 \
                                               T *restrict rstd, const T *restrict x,           \
                                               const T *restrict g, const T *restrict b,        \
                                               Py_ssize_t rows, Py_ssize_t d, T eps) {          \
        for (Py_ssize_t i = 0; i < rows; i++) {                                                 \
            const T *xr = x + i * d;                                                            \
            T *hr = xhat + i * d, *yr = y + i * d; /* yr holds the squares until y is made */   \
            T mean = ((T)0 + pairwise_##S(xr, d)) / (T)d;                                       \
            for (Py_ssize_t j = 0; j < d; j++) {                                                \
                T c = xr[j] - mean;                                                             \
                hr[j] = c;                                                                      \
                yr[j] = c * c;                                                                  \
            }                                                                                   \
            T var = ((T)0 + pairwise_##S(yr, d)) / (T)d;                                        \
            var = var + eps;                                                                    \
            T r = (T)1 / SQRT(var);                                                             \
            rstd[i] = r;                                                                        \
            for (Py_ssize_t j = 0; j < d; j++) {                                                \
                T h = hr[j] * r;                                                                \
                hr[j] = h;                                                                      \
                T s = h * g[j];                                                                 \
                yr[j] = s + b[j];                                                               \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    VECTOR_CLONES static void norm_backward_##S(T *restrict gx, T *restrict dx,                 \
                                                T *restrict scratch, const T *restrict dy,      \
                                                const T *restrict xhat, const T *restrict rstd, \
                                                const T *restrict g, Py_ssize_t rows,           \
                                                Py_ssize_t d) {                                 \
        for (Py_ssize_t i = 0; i < rows; i++) {                                                 \
            const T *dyr = dy + i * d, *hr = xhat + i * d;                                      \
            T *gr = gx + i * d, *dr = dx + i * d;                                               \
            for (Py_ssize_t j = 0; j < d; j++) {                                                \
                gr[j] = dyr[j] * hr[j];                                                         \
                dr[j] = dyr[j] * g[j];                                                          \
            }                                                                                   \
            T m1 = ((T)0 + pairwise_##S(dr, d)) / (T)d;                                         \
            for (Py_ssize_t j = 0; j < d; j++) scratch[j] = dr[j] * hr[j];                      \
            T m2 = ((T)0 + pairwise_##S(scratch, d)) / (T)d;                                    \
            T r = rstd[i];                                                                      \
            for (Py_ssize_t j = 0; j < d; j++) {                                                \
                T t = hr[j] * m2;                                                               \
                t = t + m1;                                                                     \
                T v = dr[j] - t;                                                                \
                dr[j] = v * r;                                                                  \
            }                                                                                   \
        }                                                                                       \
    }

DEFINE_NORM(float, f32, sqrtf)
DEFINE_NORM(double, f64, sqrt)

#define DEFINE_ROWS_ADD(T, S)                                                                   \
    VECTOR_CLONES static void rows_add_##S(T *restrict t, const Py_ssize_t *restrict index,     \
                                           const T *restrict rows, Py_ssize_t n,                \
                                           Py_ssize_t v, Py_ssize_t d) {                        \
        for (Py_ssize_t i = 0; i < n; i++) {                                                    \
            T *tr = t + (index[i] < 0 ? index[i] + v : index[i]) * d;                           \
            const T *rr = rows + i * d;                                                         \
            for (Py_ssize_t j = 0; j < d; j++) tr[j] = tr[j] + rr[j];                           \
        }                                                                                       \
    }

DEFINE_ROWS_ADD(float, f32)
DEFINE_ROWS_ADD(double, f64)

static void release(Py_buffer *views, int count) {
    for (int k = 0; k < count; k++) PyBuffer_Release(&views[k]);
}

/* Contiguous views of objs[0..count-1], writable those whose bit is set in `writable`
 * (the optimizers: all but objs[1], the gradient), all float32 or all float64, of one length:
 * returns the element size (4 or 8), or 0 with an exception set and nothing held. */
static int open_some_views(PyObject **objs, Py_buffer *views, int count, unsigned writable) {
    for (int k = 0; k < count; k++) {
        int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | ((writable >> k) & 1 ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(objs[k], &views[k], flags) < 0) {
            release(views, k);
            return 0;
        }
    }
    Py_ssize_t itemsize = views[0].itemsize;
    for (int k = 0; k < count; k++) {
        const char *f = views[k].format;
        if (f[0] == '<' || f[0] == '=' || f[0] == '@') f++;
        if (!((f[0] == 'f' && itemsize == 4) || (f[0] == 'd' && itemsize == 8)) || f[1] != '\0'
            || views[k].itemsize != itemsize || views[k].len != views[0].len) {
            PyErr_Format(PyExc_ValueError,
                         "fused kernel buffers must be contiguous float32 or float64 of "
                         "one length (buffer %d: format %s, %zd bytes; buffer 0: %zd bytes)",
                         k, views[k].format, views[k].len, views[0].len);
            release(views, count);
            return 0;
        }
    }
    return (int)itemsize;
}

static int open_views(PyObject **objs, Py_buffer *views, int count) {
    return open_some_views(objs, views, count, ~2u);
}

/* LayerNorm's buffers: objs[k] of rows x d elements where kinds[k] is 'm' (a matrix), of rows
 * where 'r' (one per row), of d where 'c' (one per column), writable where 'w' follows; all of
 * one float type, contiguous. Returns the element size, or 0 with an exception set. */
static int open_norm_views(PyObject **objs, Py_buffer *views, int count, const char **kinds,
                           Py_ssize_t *rows, Py_ssize_t *d) {
    for (int k = 0; k < count; k++) {
        int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (kinds[k][1] == 'w' ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(objs[k], &views[k], flags) < 0) {
            release(views, k);
            return 0;
        }
    }
    Py_ssize_t itemsize = views[0].itemsize, n = views[0].len / itemsize, nr = -1, nc = -1;
    for (int k = 0; k < count; k++) {
        if (kinds[k][0] == 'r') nr = views[k].len / itemsize;
        if (kinds[k][0] == 'c') nc = views[k].len / itemsize;
    }
    if (nr < 0) nr = nc > 0 ? n / nc : 0;
    if (nc < 0) nc = nr > 0 ? n / nr : 0;
    for (int k = 0; k < count; k++) {
        const char *f = views[k].format;
        if (f[0] == '<' || f[0] == '=' || f[0] == '@') f++;
        Py_ssize_t want = kinds[k][0] == 'm' ? n : kinds[k][0] == 'r' ? nr : nc;
        if (!((f[0] == 'f' && itemsize == 4) || (f[0] == 'd' && itemsize == 8)) || f[1] != '\0'
            || views[k].itemsize != itemsize || views[k].len / itemsize != want
            || nr * nc != n) {
            PyErr_Format(PyExc_ValueError,
                         "fused kernel buffers must be contiguous float32 or float64 of rows x "
                         "columns, rows or columns (buffer %d: format %s, %zd bytes)", k,
                         views[k].format, views[k].len);
            release(views, count);
            return 0;
        }
    }
    *rows = nr;
    *d = nc;
    return (int)itemsize;
}

static PyObject *sgd(PyObject *self, PyObject *args) {
    PyObject *objs[2];
    double lr;
    Py_buffer b[2];
    int size;
    if (!PyArg_ParseTuple(args, "OOd", &objs[0], &objs[1], &lr) || !(size = open_views(objs, b, 2)))
        return NULL;
    Py_ssize_t n = b[0].len / size;
    Py_BEGIN_ALLOW_THREADS
    if (size == 4) sgd_f32(b[0].buf, b[1].buf, n, (float)lr);
    else sgd_f64(b[0].buf, b[1].buf, n, lr);
    Py_END_ALLOW_THREADS
    release(b, 2);
    Py_RETURN_NONE;
}

static PyObject *momentum(PyObject *self, PyObject *args) {
    PyObject *objs[3];
    double mu, lr;
    int nesterov, size;
    Py_buffer b[3];
    if (!PyArg_ParseTuple(args, "OOOddp", &objs[0], &objs[1], &objs[2], &mu, &lr, &nesterov)
        || !(size = open_views(objs, b, 3)))
        return NULL;
    Py_ssize_t n = b[0].len / size;
    Py_BEGIN_ALLOW_THREADS
    if (size == 4) momentum_f32(b[0].buf, b[1].buf, b[2].buf, n, (float)mu, (float)lr, nesterov);
    else momentum_f64(b[0].buf, b[1].buf, b[2].buf, n, mu, lr, nesterov);
    Py_END_ALLOW_THREADS
    release(b, 3);
    Py_RETURN_NONE;
}

static PyObject *adam(PyObject *self, PyObject *args) {
    PyObject *objs[4];
    double b1, c1, b2, c2, eps, lr;
    Py_buffer b[4];
    int size;
    if (!PyArg_ParseTuple(args, "OOOOdddddd", &objs[0], &objs[1], &objs[2], &objs[3], &b1, &c1,
                          &b2, &c2, &eps, &lr)
        || !(size = open_views(objs, b, 4)))
        return NULL;
    Py_ssize_t n = b[0].len / size;
    Py_BEGIN_ALLOW_THREADS
    if (size == 4)
        adam_f32(b[0].buf, b[1].buf, b[2].buf, b[3].buf, n, (float)b1, (float)c1, (float)b2,
                 (float)c2, (float)eps, (float)lr);
    else adam_f64(b[0].buf, b[1].buf, b[2].buf, b[3].buf, n, b1, c1, b2, c2, eps, lr);
    Py_END_ALLOW_THREADS
    release(b, 4);
    Py_RETURN_NONE;
}

static PyObject *gelu_u(PyObject *self, PyObject *args) {
    PyObject *objs[2];
    double ck, c;
    Py_buffer b[2];
    int size;
    if (!PyArg_ParseTuple(args, "OOdd", &objs[0], &objs[1], &ck, &c)
        || !(size = open_some_views(objs, b, 2, 1u)))
        return NULL;
    Py_ssize_t n = b[0].len / size;
    Py_BEGIN_ALLOW_THREADS
    if (size == 4) gelu_u_f32(b[0].buf, b[1].buf, n, (float)ck, (float)c);
    else gelu_u_f64(b[0].buf, b[1].buf, n, ck, c);
    Py_END_ALLOW_THREADS
    release(b, 2);
    Py_RETURN_NONE;
}

static PyObject *gelu_y(PyObject *self, PyObject *args) {
    PyObject *objs[3];
    Py_buffer b[3];
    int size;
    if (!PyArg_ParseTuple(args, "OOO", &objs[0], &objs[1], &objs[2])
        || !(size = open_some_views(objs, b, 3, 1u)))
        return NULL;
    Py_ssize_t n = b[0].len / size;
    Py_BEGIN_ALLOW_THREADS
    if (size == 4) gelu_y_f32(b[0].buf, b[1].buf, b[2].buf, n);
    else gelu_y_f64(b[0].buf, b[1].buf, b[2].buf, n);
    Py_END_ALLOW_THREADS
    release(b, 3);
    Py_RETURN_NONE;
}

static PyObject *gelu_dx(PyObject *self, PyObject *args) {
    PyObject *objs[4];
    double ck3, c;
    Py_buffer b[4];
    int size;
    if (!PyArg_ParseTuple(args, "OOOOdd", &objs[0], &objs[1], &objs[2], &objs[3], &ck3, &c)
        || !(size = open_some_views(objs, b, 4, 1u)))
        return NULL;
    Py_ssize_t n = b[0].len / size;
    Py_BEGIN_ALLOW_THREADS
    if (size == 4) gelu_dx_f32(b[0].buf, b[1].buf, b[2].buf, b[3].buf, n, (float)ck3, (float)c);
    else gelu_dx_f64(b[0].buf, b[1].buf, b[2].buf, b[3].buf, n, ck3, c);
    Py_END_ALLOW_THREADS
    release(b, 4);
    Py_RETURN_NONE;
}

static PyObject *norm_forward(PyObject *self, PyObject *args) {
    PyObject *o[6];
    Py_buffer b[6];
    const char *kinds[6] = {"mw", "mw", "rw", "m", "c", "c"};
    Py_ssize_t rows, d;
    double eps;
    int size;
    if (!PyArg_ParseTuple(args, "OOOOOOd", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &eps)
        || !(size = open_norm_views(o, b, 6, kinds, &rows, &d)))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (size == 4)
        norm_forward_f32(b[0].buf, b[1].buf, b[2].buf, b[3].buf, b[4].buf, b[5].buf, rows, d,
                         (float)eps);
    else
        norm_forward_f64(b[0].buf, b[1].buf, b[2].buf, b[3].buf, b[4].buf, b[5].buf, rows, d,
                         eps);
    Py_END_ALLOW_THREADS
    release(b, 6);
    Py_RETURN_NONE;
}

static PyObject *norm_backward(PyObject *self, PyObject *args) {
    PyObject *o[6];
    Py_buffer b[6];
    const char *kinds[6] = {"mw", "mw", "m", "m", "r", "c"};
    Py_ssize_t rows, d;
    int size;
    if (!PyArg_ParseTuple(args, "OOOOOO", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5])
        || !(size = open_norm_views(o, b, 6, kinds, &rows, &d)))
        return NULL;
    void *scratch = PyMem_Malloc(d > 0 ? (size_t)d * size : 1);  /* one row of dxhat xhat */
    if (scratch == NULL) {
        release(b, 6);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    if (size == 4)
        norm_backward_f32(b[0].buf, b[1].buf, scratch, b[2].buf, b[3].buf, b[4].buf, b[5].buf,
                          rows, d);
    else
        norm_backward_f64(b[0].buf, b[1].buf, scratch, b[2].buf, b[3].buf, b[4].buf, b[5].buf,
                          rows, d);
    Py_END_ALLOW_THREADS
    PyMem_Free(scratch);
    release(b, 6);
    Py_RETURN_NONE;
}

/* A float32/float64 format ('f' of 4 bytes or 'd' of 8, any byte-order mark): its size, else 0. */
static int float_size(const Py_buffer *view) {
    const char *f = view->format;
    if (f[0] == '<' || f[0] == '=' || f[0] == '@') f++;
    if (f[1] != '\0') return 0;
    return (f[0] == 'f' && view->itemsize == 4) || (f[0] == 'd' && view->itemsize == 8)
               ? (int)view->itemsize : 0;
}

/* rows_add(table (V, d), index (N,) intp, rows (N, d)): every index is checked against V
 * first, so that nothing is written when one is out of range (np.add.at's IndexError). */
static PyObject *rows_add(PyObject *self, PyObject *args) {
    PyObject *o[3];
    Py_buffer b[3];
    const int flags[3] = {PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE,
                          PyBUF_C_CONTIGUOUS | PyBUF_FORMAT, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT};
    if (!PyArg_ParseTuple(args, "OOO", &o[0], &o[1], &o[2])) return NULL;
    for (int k = 0; k < 3; k++) {
        if (PyObject_GetBuffer(o[k], &b[k], flags[k]) < 0) {
            release(b, k);
            return NULL;
        }
    }
    const char *f = b[1].format;
    if (f[0] == '<' || f[0] == '=' || f[0] == '@') f++;
    int size = float_size(&b[0]);
    if (!size || float_size(&b[2]) != size || b[0].ndim != 2 || b[2].ndim != 2
        || b[0].shape[1] != b[2].shape[1] || b[1].ndim != 1 || b[1].shape[0] != b[2].shape[0]
        || b[1].itemsize != (Py_ssize_t)sizeof(Py_ssize_t) || (f[0] != 'l' && f[0] != 'q')
        || f[1] != '\0') {
        PyErr_SetString(PyExc_ValueError, "rows_add takes a (V, d) table, an (N,) intp index "
                                          "and (N, d) rows, contiguous, of one float type");
        release(b, 3);
        return NULL;
    }
    Py_ssize_t v = b[0].shape[0], d = b[0].shape[1], n = b[1].shape[0];
    const Py_ssize_t *index = b[1].buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (index[i] < -v || index[i] >= v) {
            PyErr_Format(PyExc_IndexError, "rows_add: index %zd is out of bounds for %zd rows",
                         index[i], v);
            release(b, 3);
            return NULL;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    if (size == 4) rows_add_f32(b[0].buf, index, b[2].buf, n, v, d);
    else rows_add_f64(b[0].buf, index, b[2].buf, n, v, d);
    Py_END_ALLOW_THREADS
    release(b, 3);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"sgd", sgd, METH_VARARGS, "sgd(p, g, lr): p -= g * lr"},
    {"momentum", momentum, METH_VARARGS,
     "momentum(p, g, v, mu, lr, nesterov): v = v mu + g; p -= (v mu + g if nesterov else v) lr"},
    {"adam", adam, METH_VARARGS,
     "adam(p, g, m, v, b1, 1-b1, b2, 1-b2, eps_t, lr_t): Adam's moments and update"},
    {"gelu_u", gelu_u, METH_VARARGS, "gelu_u(u, x, ck, c): u = ((x x) ck + c) x"},
    {"gelu_y", gelu_y, METH_VARARGS, "gelu_y(y, x, t): y = ((t + 1) x) 0.5"},
    {"gelu_dx", gelu_dx, METH_VARARGS,
     "gelu_dx(dx, dy, x, t, 3ck, c): GELU's input gradient from x and t = tanh(u)"},
    {"norm_forward", norm_forward, METH_VARARGS,
     "norm_forward(y, xhat, rstd, x, g, b, eps): LayerNorm's rows, mean and variance included"},
    {"norm_backward", norm_backward, METH_VARARGS,
     "norm_backward(gx, dx, dy, xhat, rstd, g): gx = dy xhat; dx: LayerNorm's input gradient"},
    {"rows_add", rows_add, METH_VARARGS,
     "rows_add(t, index, rows): t[index[i]] += rows[i] for each i in order"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "models._fused",
                                    "One-pass optimizer updates, GELU and LayerNorm passes "
                                    "(see models/optim.py, models/layers.py).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__fused(void) { return PyModule_Create(&module); }
