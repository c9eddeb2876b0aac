/* One-pass kernels for the parameter server's hot loops, with the GIL released.
 *
 * Every ~1 MiB chunk of a 64 MB push used to be read twice on each end, in
 * separate GIL-releasing calls: the sender copied it into the message (a
 * join, GIL held) and then checksummed the copy (ISA-L's Adler-32); the
 * receiver checksummed it and then tested every value for finiteness
 * (NumPy). Those calls and the GIL hand-offs around them sat on the cores
 * the gRPC stream keeps busy. Here each is one pass:
 *
 *   chunk_message(prefix, data, adler=1) -> (prefix + data as bytes,
 *                                            adler32 continued over data)
 *       data is copied and checksummed in the same pass, without the GIL.
 *   copy_into(dst, data, adler=1) -> adler32 continued over data
 *       dst[:] = data (a pulled chunk into the model's buffer), checksummed in
 *       the same pass, without the GIL.
 *   check_chunk(data, itemsize, adler) -> (adler32 continued over data,
 *                                          index of the first non-finite
 *                                          element or -1)
 *       IEEE 754 binary16/32/64 non-finite = all exponent bits set.
 *
 * Adler-32 (RFC 1950) with AVX2 follows the scheme of zlib-ng's
 * adler32_avx2 (sums of 32-byte vectors: s1 by _mm256_sad_epu8, s2 by
 * _mm256_maddubs_epi16 with weights 32..1 plus 32 x the running s1), reduced
 * modulo 65521 every NMAX bytes; other CPUs take the scalar loop of zlib.
 * pserver.common.codec falls back to ISA-L and NumPy when this module is not built.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_AVX2_PATH 1
#endif

#define BASE 65521u
#define NMAX 5552 /* largest n with 255 n (n + 1) / 2 + (n + 1) (BASE - 1) <= 2^32 - 1 */

static uint32_t adler32_scalar(uint32_t adler, const uint8_t *buf, size_t len) {
    uint32_t s1 = adler & 0xffff, s2 = adler >> 16;
    while (len) {
        size_t k = len < NMAX ? len : NMAX;
        len -= k;
        while (k--) {
            s1 += *buf++;
            s2 += s1;
        }
        s1 %= BASE;
        s2 %= BASE;
    }
    return s1 | (s2 << 16);
}

/* Exponent masks per element width; an element is non-finite iff (x & m) == m. */
static int64_t first_nonfinite_scalar(const uint8_t *buf, size_t n, int itemsize) {
    for (size_t i = 0; i < n; i++) {
        if (itemsize == 4) {
            uint32_t x;
            memcpy(&x, buf + 4 * i, 4);
            if ((x & 0x7f800000u) == 0x7f800000u) return (int64_t)i;
        } else if (itemsize == 8) {
            uint64_t x;
            memcpy(&x, buf + 8 * i, 8);
            if ((x & 0x7ff0000000000000ull) == 0x7ff0000000000000ull) return (int64_t)i;
        } else {
            uint16_t x;
            memcpy(&x, buf + 2 * i, 2);
            if ((x & 0x7c00u) == 0x7c00u) return (int64_t)i;
        }
    }
    return -1;
}

#ifdef HAVE_AVX2_PATH
__attribute__((target("avx2")))
static inline uint32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return (uint32_t)_mm_cvtsi128_si32(s);
}

__attribute__((target("avx2")))
static inline __m256i nonfinite_lanes(__m256i v, int itemsize) {
    if (itemsize == 4) {
        const __m256i m = _mm256_set1_epi32(0x7f800000);
        return _mm256_cmpeq_epi32(_mm256_and_si256(v, m), m);
    }
    if (itemsize == 8) {
        const __m256i m = _mm256_set1_epi64x(0x7ff0000000000000ll);
        return _mm256_cmpeq_epi64(_mm256_and_si256(v, m), m);
    }
    const __m256i m = _mm256_set1_epi16(0x7c00);
    return _mm256_cmpeq_epi16(_mm256_and_si256(v, m), m);
}

/* Adler-32 of src (and, if dst, a copy of it into dst); if itemsize, also
 * whether any element is non-finite (*bad), all in one pass. */
__attribute__((target("avx2")))
static uint32_t adler32_avx2(uint32_t adler, const uint8_t *src, uint8_t *dst, size_t len,
                             int itemsize, int *bad) {
    uint32_t s1 = adler & 0xffff, s2 = adler >> 16;
    const __m256i weights = _mm256_setr_epi8(32, 31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21,
                                             20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8,
                                             7, 6, 5, 4, 3, 2, 1);
    const __m256i ones = _mm256_set1_epi16(1), zero = _mm256_setzero_si256();
    __m256i flags = zero;
    while (len >= 32) {
        size_t k = len < NMAX ? len : NMAX;
        k -= k % 32;
        len -= k;
        __m256i vs1 = _mm256_setr_epi32((int)s1, 0, 0, 0, 0, 0, 0, 0);
        __m256i vs2 = _mm256_setr_epi32((int)s2, 0, 0, 0, 0, 0, 0, 0);
        __m256i vs1_prev = vs1, vs3 = zero; /* vs3: sum of s1 before each vector */
        for (; k; k -= 32, src += 32) {
            __m256i v = _mm256_loadu_si256((const __m256i *)src);
            if (dst) {
                _mm256_storeu_si256((__m256i *)dst, v);
                dst += 32;
            }
            if (itemsize) flags = _mm256_or_si256(flags, nonfinite_lanes(v, itemsize));
            vs3 = _mm256_add_epi32(vs3, vs1_prev);
            vs1 = _mm256_add_epi32(vs1, _mm256_sad_epu8(v, zero));
            vs2 = _mm256_add_epi32(vs2, _mm256_madd_epi16(_mm256_maddubs_epi16(v, weights), ones));
            vs1_prev = vs1;
        }
        vs2 = _mm256_add_epi32(vs2, _mm256_slli_epi32(vs3, 5));
        s1 = hsum_epi32(vs1) % BASE;
        s2 = hsum_epi32(vs2) % BASE;
    }
    if (!_mm256_testz_si256(flags, flags)) *bad = 1;
    if (dst) memcpy(dst, src, len); /* the last len < 32 bytes */
    if (itemsize && first_nonfinite_scalar(src, len / itemsize, itemsize) >= 0) *bad = 1;
    return adler32_scalar(s1 | (s2 << 16), src, len);
}
#endif

/* AVX2 when the CPU has it and DTLAB_KERNELS_SCALAR is not set (the tests set it to
 * check the scalar loops against the same references). */
static int have_avx2(void) {
#ifdef HAVE_AVX2_PATH
    static int cached = -1;
    if (cached < 0) {
        const char *scalar = getenv("DTLAB_KERNELS_SCALAR");
        cached = __builtin_cpu_supports("avx2") && !(scalar && *scalar) ? 1 : 0;
    }
    return cached;
#else
    return 0;
#endif
}

/* One pass over len bytes; returns the Adler-32 continued from `adler`. */
static uint32_t pass(uint32_t adler, const uint8_t *src, uint8_t *dst, size_t len, int itemsize,
                     int *bad) {
#ifdef HAVE_AVX2_PATH
    if (have_avx2()) return adler32_avx2(adler, src, dst, len, itemsize, bad);
#endif
    if (dst) memcpy(dst, src, len);
    if (itemsize && first_nonfinite_scalar(src, len / itemsize, itemsize) >= 0) *bad = 1;
    return adler32_scalar(adler, src, len);
}

static PyObject *chunk_message(PyObject *self, PyObject *args) {
    Py_buffer prefix, data;
    unsigned int adler = 1;
    if (!PyArg_ParseTuple(args, "y*y*|I:chunk_message", &prefix, &data, &adler)) return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, prefix.len + data.len);
    if (out) {
        uint8_t *dst = (uint8_t *)PyBytes_AS_STRING(out);
        memcpy(dst, prefix.buf, (size_t)prefix.len);
        int unused = 0;
        Py_BEGIN_ALLOW_THREADS
        adler = pass(adler, (const uint8_t *)data.buf, dst + prefix.len, (size_t)data.len, 0,
                     &unused);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&prefix);
    PyBuffer_Release(&data);
    if (!out) return NULL;
    return Py_BuildValue("(NI)", out, adler);
}

static PyObject *copy_into(PyObject *self, PyObject *args) {
    Py_buffer dst, data;
    unsigned int adler = 1;
    if (!PyArg_ParseTuple(args, "w*y*|I:copy_into", &dst, &data, &adler)) return NULL;
    if (dst.len != data.len) {
        PyErr_Format(PyExc_ValueError, "copy_into: %zd bytes into a %zd-byte buffer", data.len,
                     dst.len);
        PyBuffer_Release(&dst);
        PyBuffer_Release(&data);
        return NULL;
    }
    int unused = 0;
    Py_BEGIN_ALLOW_THREADS
    adler = pass(adler, (const uint8_t *)data.buf, (uint8_t *)dst.buf, (size_t)data.len, 0,
                 &unused);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLong(adler);
}

static PyObject *check_chunk(PyObject *self, PyObject *args) {
    Py_buffer data;
    int itemsize;
    unsigned int adler;
    if (!PyArg_ParseTuple(args, "y*iI:check_chunk", &data, &itemsize, &adler)) return NULL;
    if (itemsize != 2 && itemsize != 4 && itemsize != 8) {
        PyBuffer_Release(&data);
        PyErr_Format(PyExc_ValueError, "itemsize %d: only 2, 4 and 8 byte floats", itemsize);
        return NULL;
    }
    if (data.len % itemsize) {
        PyBuffer_Release(&data);
        PyErr_Format(PyExc_ValueError, "%zd bytes is not a whole number of %d-byte elements",
                     data.len, itemsize);
        return NULL;
    }
    int bad = 0;
    int64_t first = -1;
    Py_BEGIN_ALLOW_THREADS
    adler = pass(adler, (const uint8_t *)data.buf, NULL, (size_t)data.len, itemsize, &bad);
    if (bad)
        first = first_nonfinite_scalar((const uint8_t *)data.buf, (size_t)data.len / itemsize,
                                       itemsize);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    return Py_BuildValue("(IL)", adler, (long long)first);
}

static PyObject *adler32(PyObject *self, PyObject *args) {
    Py_buffer data;
    unsigned int adler = 1;
    if (!PyArg_ParseTuple(args, "y*|I:adler32", &data, &adler)) return NULL;
    int unused = 0;
    Py_BEGIN_ALLOW_THREADS
    adler = pass(adler, (const uint8_t *)data.buf, NULL, (size_t)data.len, 0, &unused);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLong(adler);
}

static PyMethodDef methods[] = {
    {"chunk_message", chunk_message, METH_VARARGS,
     "chunk_message(prefix, data, adler=1) -> (prefix + data, adler32 continued over data)"},
    {"copy_into", copy_into, METH_VARARGS,
     "copy_into(dst, data, adler=1) -> adler32 continued over data, with dst[:] = data"},
    {"check_chunk", check_chunk, METH_VARARGS,
     "check_chunk(data, itemsize, adler) -> (adler32 continued, first non-finite index or -1)"},
    {"adler32", adler32, METH_VARARGS, "adler32(data, value=1) -> zlib.adler32's value"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "pserver.common._kernels",
                                    "One-pass copy, Adler-32 and finiteness kernels.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
