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
 * several threads can step disjoint blocks at once (pserver.server.blocked).
 *
 *   sgd:       p <- p - g lr
 *   momentum:  v <- v mu + g;  t <- v mu + g if nesterov else v;  p <- p - t lr
 *   adam:      m <- m b1 + g (1-b1);  v <- v b2 + (g g)(1-b2);
 *              p <- p - (m / (sqrt(v) + eps_t)) lr_t
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
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

static void release(Py_buffer *views, int count) {
    for (int k = 0; k < count; k++) PyBuffer_Release(&views[k]);
}

/* Contiguous views of objs[0..count-1], all writable but objs[1] (the gradient), all float32
 * or all float64, of one length: returns the element size (4 or 8), or 0 with an exception
 * set and nothing held. */
static int open_views(PyObject **objs, Py_buffer *views, int count) {
    for (int k = 0; k < count; k++) {
        int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (k == 1 ? 0 : PyBUF_WRITABLE);
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
                         "fused optimizer buffers must be contiguous float32 or float64 of "
                         "one length (buffer %d: format %s, %zd bytes; buffer 0: %zd bytes)",
                         k, views[k].format, views[k].len, views[0].len);
            release(views, count);
            return 0;
        }
    }
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

static PyMethodDef methods[] = {
    {"sgd", sgd, METH_VARARGS, "sgd(p, g, lr): p -= g * lr"},
    {"momentum", momentum, METH_VARARGS,
     "momentum(p, g, v, mu, lr, nesterov): v = v mu + g; p -= (v mu + g if nesterov else v) lr"},
    {"adam", adam, METH_VARARGS,
     "adam(p, g, m, v, b1, 1-b1, b2, 1-b2, eps_t, lr_t): Adam's moments and update"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "models._fused",
                                    "One-pass optimizer updates (see models/optim.py).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__fused(void) { return PyModule_Create(&module); }
