/* xfer._native: the per-call host work of a block copy, in C (issue 32).
 *
 * Optional: setup.py builds it where a C compiler and Python's headers are present; without it
 * every caller takes the pure-Python path, which computes the same results (tests compare the two).
 * Needs no CUDA headers and links no CUDA library: the four driver entry points the launch path
 * calls are looked up in libcuda.so.1 the first time one is needed (the process has loaded it by
 * then: torch has). Nothing here keeps state besides those pointers.
 *
 *   id_stats(ids, out, num_blocks, unique) -> (lo, hi, repeats) | None
 *       the range of a list of Python ints or a contiguous int64 buffer, and (ids in range and
 *       ``unique`` only) whether one repeats; a list is also written into ``out`` (int64 buffer).
 *       None: not handled here (another type, a bool, an overflow): the caller's Python path decides.
 *   same_tensors(refs, tensors, ptrs, data_ptr) -> bool
 *       every weak reference of ``refs`` names the object at the same index of ``tensors`` and
 *       ``data_ptr(tensor)`` equals ``ptrs[i]``.
 *   put_ids(host, cap, src_ids, dst_ids, sort, dev, stream, device) -> None
 *       write ``[src..., dst...]`` (pairs ordered by destination id when ``sort``) into the pinned
 *       host buffer at ``host`` (``cap`` int64 words), then queue its copy to the device buffer at
 *       ``dev`` on ``stream`` of CUDA device ``device`` (cuMemcpyHtoDAsync); ``dev`` 0: write only.
 *   driver() -> bool
 *       whether libcuda.so.1 and the entry points below were found (looked up once).
 *   launch(spec, ids_dev, stream) -> None | bytes
 *       launch the compiled kernel ``spec`` names (bytes from ``pack_spec``) with the ids at
 *       ``ids_dev``; ``stream`` None: launch nothing, return the packed parameter values (tests).
 *   pack_spec(function, table, grid, threads, shared, device, ints, wide) -> bytes
 *       the launch's fixed part: CUfunction, the table's device address, the grid and block sizes,
 *       dynamic shared memory, the device ordinal, the integer arguments and which are 64-bit.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUfunc_st *CUfunction;
typedef unsigned long long CUdeviceptr;

static CUresult (*p_launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                            CUstream, void **, void **);
static CUresult (*p_htod)(CUdeviceptr, const void *, size_t, CUstream);
static CUresult (*p_ctx_get)(CUcontext *);
static CUresult (*p_ctx_set)(CUcontext);
static CUresult (*p_retain)(CUcontext *, CUdevice);
static int driver_state; /* 0: not looked up, 1: found, -1: missing */

static int load_driver(void) {
    if (driver_state)
        return driver_state > 0;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == NULL)
        lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib != NULL) {
        *(void **)&p_launch = dlsym(lib, "cuLaunchKernel");
        *(void **)&p_htod = dlsym(lib, "cuMemcpyHtoDAsync_v2");
        *(void **)&p_ctx_get = dlsym(lib, "cuCtxGetCurrent");
        *(void **)&p_ctx_set = dlsym(lib, "cuCtxSetCurrent");
        *(void **)&p_retain = dlsym(lib, "cuDevicePrimaryCtxRetain");
    }
    driver_state = (lib && p_launch && p_htod && p_ctx_get && p_ctx_set && p_retain) ? 1 : -1;
    if (driver_state < 0)
        PyErr_SetString(PyExc_RuntimeError, "xfer._native: libcuda.so.1 or one of its entry points not found");
    return driver_state > 0;
}

/* A thread that has made no CUDA call yet has no current context: make the device's primary one
 * current, as the runtime API (and Triton's launcher) would. Called with the GIL released. */
static CUresult ensure_context(int device) {
    CUcontext ctx = NULL;
    CUresult rc = p_ctx_get(&ctx);
    if (rc != 0 || ctx != NULL)
        return rc;
    rc = p_retain(&ctx, device);
    return rc != 0 ? rc : p_ctx_set(ctx);
}

static int cuda_error(const char *what, CUresult rc) {
    PyErr_Format(PyExc_RuntimeError, "xfer._native: %s failed with CUDA error %d", what, rc);
    return -1;
}

/* ---- id_stats ---------------------------------------------------------------------------- */

/* 1 when an id in [0, num_blocks) repeats; ids are known to lie in [lo, hi] with lo >= 0 */
static int has_repeat(const int64_t *ids, Py_ssize_t n, int64_t lo, int64_t hi) {
    uint64_t span = (uint64_t)(hi - lo) + 1;
    if (span <= (1u << 16)) { /* a bitmap of the range: 8 KiB at most, on the stack */
        uint8_t bits[1 << 13];
        memset(bits, 0, (size_t)((span + 7) / 8));
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t k = (uint64_t)(ids[i] - lo);
            uint8_t m = (uint8_t)(1u << (k & 7));
            if (bits[k >> 3] & m)
                return 1;
            bits[k >> 3] |= m;
        }
        return 0;
    }
    /* open addressing, -1 marks a free slot (every id is >= 0) */
    size_t size = 16;
    while (size < (size_t)n * 2)
        size <<= 1;
    int64_t *table = malloc(size * sizeof(int64_t));
    if (table == NULL)
        return -1;
    memset(table, 0xff, size * sizeof(int64_t));
    int found = 0;
    for (Py_ssize_t i = 0; i < n && !found; i++) {
        uint64_t h = (uint64_t)ids[i] * 0x9E3779B97F4A7C15ull;
        size_t at = (size_t)(h >> 20) & (size - 1);
        while (table[at] != -1) {
            if (table[at] == ids[i]) {
                found = 1;
                break;
            }
            at = (at + 1) & (size - 1);
        }
        table[at] = ids[i];
    }
    free(table);
    return found;
}

static PyObject *stats_result(const int64_t *ids, Py_ssize_t n, int64_t num_blocks, int unique) {
    int64_t lo = ids[0], hi = ids[0];
    for (Py_ssize_t i = 1; i < n; i++) {
        if (ids[i] < lo)
            lo = ids[i];
        if (ids[i] > hi)
            hi = ids[i];
    }
    int repeats = 0;
    if (unique && lo >= 0 && hi < num_blocks) {
        repeats = has_repeat(ids, n, lo, hi);
        if (repeats < 0)
            return PyErr_NoMemory();
    }
    return Py_BuildValue("(LLO)", (long long)lo, (long long)hi, repeats ? Py_True : Py_False);
}

static int int64_buffer(PyObject *obj, Py_buffer *view, int writable) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        PyErr_Clear(); /* (numpy says ValueError for a strided array): one type for every refusal */
        PyErr_SetString(PyExc_TypeError, "xfer._native: a 1-D contiguous int64 buffer is needed");
        return -1;
    }
    const char *f = view->format;
    if (f != NULL && (*f == '<' || *f == '=' || *f == '@'))
        f++;
    if (view->ndim != 1 || view->itemsize != 8 || f == NULL || !(f[0] == 'l' || f[0] == 'q') || f[1] != '\0') {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_TypeError, "xfer._native: a 1-D contiguous int64 buffer is needed");
        return -1;
    }
    return 0;
}

static PyObject *id_stats(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "id_stats(ids, out, num_blocks, unique)");
        return NULL;
    }
    PyObject *ids = args[0], *out = args[1];
    long long num_blocks = PyLong_AsLongLong(args[2]);
    int unique = PyObject_IsTrue(args[3]);
    if ((num_blocks == -1 && PyErr_Occurred()) || unique < 0)
        return NULL;
    if (PyList_CheckExact(ids)) {
        Py_ssize_t n = PyList_GET_SIZE(ids);
        Py_buffer view;
        if (n == 0 || out == Py_None)
            Py_RETURN_NONE;
        if (int64_buffer(out, &view, 1) < 0)
            return NULL;
        if (view.shape[0] != n) {
            PyBuffer_Release(&view);
            PyErr_SetString(PyExc_ValueError, "xfer._native: out must hold one int64 per id");
            return NULL;
        }
        int64_t *dst = view.buf;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *item = PyList_GET_ITEM(ids, i);
            if (!PyLong_CheckExact(item)) { /* bools, numpy scalars, floats: the Python path decides */
                PyBuffer_Release(&view);
                Py_RETURN_NONE;
            }
            int overflow = 0;
            long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
            if (overflow) {
                PyBuffer_Release(&view);
                Py_RETURN_NONE;
            }
            dst[i] = v;
        }
        PyObject *r = stats_result(dst, n, num_blocks, unique);
        PyBuffer_Release(&view);
        return r;
    }
    Py_buffer view;
    if (int64_buffer(ids, &view, 0) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject *r = view.shape[0] ? stats_result(view.buf, view.shape[0], num_blocks, unique) : Py_NewRef(Py_None);
    PyBuffer_Release(&view);
    return r;
}

/* ---- same_tensors ------------------------------------------------------------------------ */

static PyObject *same_tensors(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyTuple_CheckExact(args[0]) || !PyList_CheckExact(args[1]) || !PyList_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError, "same_tensors(refs: tuple, tensors: list, ptrs: list, data_ptr)");
        return NULL;
    }
    PyObject *refs = args[0], *tensors = args[1], *ptrs = args[2], *data_ptr = args[3];
    Py_ssize_t n = PyTuple_GET_SIZE(refs);
    if (PyList_GET_SIZE(tensors) != n || PyList_GET_SIZE(ptrs) != n)
        Py_RETURN_FALSE;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *ref = PyTuple_GET_ITEM(refs, i), *t = PyList_GET_ITEM(tensors, i);
        if (!PyWeakref_Check(ref)) {
            PyErr_SetString(PyExc_TypeError, "same_tensors: refs must hold weak references");
            return NULL;
        }
#if PY_VERSION_HEX >= 0x030D0000
        PyObject *obj = NULL;
        if (PyWeakref_GetRef(ref, &obj) < 0)
            return NULL;
        Py_XDECREF(obj); /* identity only: the caller's list holds the tensor */
#else
        PyObject *obj = PyWeakref_GetObject(ref);
#endif
        if (obj != t)
            Py_RETURN_FALSE;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *p = PyObject_CallOneArg(data_ptr, PyList_GET_ITEM(tensors, i));
        if (p == NULL)
            return NULL;
        int eq = PyObject_RichCompareBool(p, PyList_GET_ITEM(ptrs, i), Py_EQ);
        Py_DECREF(p);
        if (eq <= 0)
            return eq < 0 ? NULL : Py_NewRef(Py_False);
    }
    Py_RETURN_TRUE;
}

/* ---- put_ids ----------------------------------------------------------------------------- */

typedef struct {
    int64_t key, val;
} pair_t;

/* stable merge sort of n pairs by key; tmp holds n pairs */
static void sort_pairs(pair_t *a, pair_t *tmp, Py_ssize_t n) {
    for (Py_ssize_t i = 1; i < n; i++) { /* runs of 8 by insertion */
        if (i % 8 == 0)
            continue;
        pair_t x = a[i];
        Py_ssize_t j = i;
        while (j % 8 != 0 && a[j - 1].key > x.key) {
            a[j] = a[j - 1];
            j--;
        }
        a[j] = x;
    }
    pair_t *src = a, *dst = tmp;
    for (Py_ssize_t width = 8; width < n; width *= 2) {
        for (Py_ssize_t lo = 0; lo < n; lo += 2 * width) {
            Py_ssize_t mid = lo + width < n ? lo + width : n, hi = lo + 2 * width < n ? lo + 2 * width : n;
            Py_ssize_t i = lo, j = mid, k = lo;
            while (i < mid && j < hi)
                dst[k++] = src[j].key < src[i].key ? src[j++] : src[i++];
            while (i < mid)
                dst[k++] = src[i++];
            while (j < hi)
                dst[k++] = src[j++];
        }
        pair_t *t = src;
        src = dst;
        dst = t;
    }
    if (src != a)
        memcpy(a, src, (size_t)n * sizeof(pair_t));
}

static PyObject *put_ids(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "put_ids(host, cap, src_ids, dst_ids, sort, dev, stream, device)");
        return NULL;
    }
    int64_t *host = PyLong_AsVoidPtr(args[0]);
    Py_ssize_t cap = PyLong_AsSsize_t(args[1]);
    int sort = PyObject_IsTrue(args[4]);
    unsigned long long dev = PyLong_AsUnsignedLongLong(args[5]);
    void *stream = PyLong_AsVoidPtr(args[6]);
    int device = (int)PyLong_AsLong(args[7]);
    if (PyErr_Occurred() || sort < 0)
        return NULL;
    Py_buffer s, d;
    if (int64_buffer(args[2], &s, 0) < 0)
        return NULL;
    if (int64_buffer(args[3], &d, 0) < 0) {
        PyBuffer_Release(&s);
        return NULL;
    }
    Py_ssize_t n = s.shape[0];
    PyObject *result = NULL;
    if (d.shape[0] != n || 2 * n > cap || host == NULL) {
        PyErr_Format(PyExc_ValueError, "xfer._native.put_ids: %zd source and %zd destination ids for %zd words",
                     n, d.shape[0], cap);
        goto done;
    }
    const int64_t *sv = s.buf, *dv = d.buf;
    int ordered = 1;
    if (sort)
        for (Py_ssize_t i = 1; i < n && ordered; i++)
            ordered = dv[i - 1] <= dv[i];
    if (ordered) {
        memcpy(host, sv, (size_t)n * 8);
        memcpy(host + n, dv, (size_t)n * 8);
    } else {
        pair_t stack[2 * 512], *pairs = stack;
        if (n > 512 && (pairs = malloc((size_t)n * 2 * sizeof(pair_t))) == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            pairs[i].key = dv[i];
            pairs[i].val = sv[i];
        }
        sort_pairs(pairs, pairs + n, n);
        for (Py_ssize_t i = 0; i < n; i++) {
            host[i] = pairs[i].val;
            host[n + i] = pairs[i].key;
        }
        if (pairs != stack)
            free(pairs);
    }
    if (dev != 0) {
        if (!load_driver())
            goto done;
        CUresult rc;
        const char *what = "cuMemcpyHtoDAsync of the block ids";
        Py_BEGIN_ALLOW_THREADS
        rc = ensure_context(device);
        if (rc != 0)
            what = "making the device's context current";
        else
            rc = p_htod((CUdeviceptr)dev, host, (size_t)n * 16, (CUstream)stream);
        Py_END_ALLOW_THREADS
        if (rc != 0) {
            cuda_error(what, rc);
            goto done;
        }
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&s);
    PyBuffer_Release(&d);
    return result;
}

/* ---- launch ------------------------------------------------------------------------------ */

#define MAX_INTS 16

typedef struct {
    uint64_t function, table;
    uint32_t grid, threads, shared, device;
    uint32_t nints, wide; /* bit i of wide: integer i is 64-bit, else 32-bit */
    int64_t ints[MAX_INTS];
} spec_t;

static PyObject *pack_spec(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8 || !PyTuple_Check(args[6])) {
        PyErr_SetString(PyExc_TypeError, "pack_spec(function, table, grid, threads, shared, device, ints: tuple, wide)");
        return NULL;
    }
    spec_t spec;
    memset(&spec, 0, sizeof spec);
    spec.function = PyLong_AsUnsignedLongLong(args[0]);
    spec.table = PyLong_AsUnsignedLongLong(args[1]);
    spec.grid = (uint32_t)PyLong_AsUnsignedLong(args[2]);
    spec.threads = (uint32_t)PyLong_AsUnsignedLong(args[3]);
    spec.shared = (uint32_t)PyLong_AsUnsignedLong(args[4]);
    spec.device = (uint32_t)PyLong_AsUnsignedLong(args[5]);
    spec.wide = (uint32_t)PyLong_AsUnsignedLong(args[7]);
    if (PyErr_Occurred())
        return NULL;
    Py_ssize_t k = PyTuple_GET_SIZE(args[6]);
    if (k > MAX_INTS) {
        PyErr_Format(PyExc_ValueError, "pack_spec: at most %d integers, got %zd", MAX_INTS, k);
        return NULL;
    }
    spec.nints = (uint32_t)k;
    for (Py_ssize_t i = 0; i < k; i++) {
        spec.ints[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(args[6], i));
        if (spec.ints[i] == -1 && PyErr_Occurred())
            return NULL;
        if (!(spec.wide >> i & 1) && (spec.ints[i] < INT32_MIN || spec.ints[i] > INT32_MAX)) {
            PyErr_Format(PyExc_ValueError, "pack_spec: integer %zd (%lld) does not fit 32 bits", i,
                         (long long)spec.ints[i]);
            return NULL;
        }
    }
    return PyBytes_FromStringAndSize((const char *)&spec, sizeof spec);
}

static PyObject *launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyBytes_CheckExact(args[0]) || PyBytes_GET_SIZE(args[0]) != (Py_ssize_t)sizeof(spec_t)) {
        PyErr_SetString(PyExc_TypeError, "launch(spec: bytes from pack_spec, ids_dev, stream)");
        return NULL;
    }
    const spec_t *spec = (const spec_t *)PyBytes_AS_STRING(args[0]);
    uint64_t ids = PyLong_AsUnsignedLongLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    /* the kernel's parameters: table, ids, the integers at their widths, then two NULL scratch
     * pointers (Triton's global and profile scratch; a kernel declaring fewer ignores the rest) */
    uint64_t table = spec->table, scratch[2] = {0, 0};
    int32_t narrow[MAX_INTS];
    void *params[2 + MAX_INTS + 2];
    int k = 0;
    params[k++] = &table;
    params[k++] = &ids;
    for (uint32_t i = 0; i < spec->nints; i++) {
        if (spec->wide >> i & 1) {
            params[k++] = (void *)&spec->ints[i];
        } else {
            narrow[i] = (int32_t)spec->ints[i];
            params[k++] = &narrow[i];
        }
    }
    params[k++] = &scratch[0];
    params[k++] = &scratch[1];
    if (args[2] == Py_None) { /* a dry run: the parameter values, packed (tests) */
        PyObject *out = PyBytes_FromStringAndSize(NULL, 0);
        for (int i = 0; i < k && out != NULL; i++) {
            size_t size = (i >= 2 && i < 2 + (int)spec->nints && !(spec->wide >> (i - 2) & 1)) ? 4 : 8;
            PyObject *piece = PyBytes_FromStringAndSize(params[i], (Py_ssize_t)size);
            PyBytes_ConcatAndDel(&out, piece);
        }
        return out;
    }
    void *stream = PyLong_AsVoidPtr(args[2]);
    if (PyErr_Occurred() || !load_driver())
        return NULL;
    CUresult rc;
    const char *what = "cuLaunchKernel";
    Py_BEGIN_ALLOW_THREADS
    rc = ensure_context((int)spec->device);
    if (rc != 0)
        what = "making the device's context current";
    else
        rc = p_launch((CUfunction)(uintptr_t)spec->function, spec->grid, 1, 1, spec->threads, 1, 1, spec->shared,
                      (CUstream)stream, params, NULL);
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        cuda_error(what, rc);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *driver(PyObject *self, PyObject *unused) {
    if (load_driver())
        Py_RETURN_TRUE;
    PyErr_Clear();
    Py_RETURN_FALSE;
}

static PyMethodDef methods[] = {
    {"driver", driver, METH_NOARGS, "whether libcuda.so.1 and the entry points the launch path calls were found"},
    {"id_stats", (PyCFunction)(void (*)(void))id_stats, METH_FASTCALL, "(lo, hi, repeats) of block ids, or None"},
    {"same_tensors", (PyCFunction)(void (*)(void))same_tensors, METH_FASTCALL, "the same live tensors at the same addresses"},
    {"put_ids", (PyCFunction)(void (*)(void))put_ids, METH_FASTCALL, "write block ids to pinned memory and queue their upload"},
    {"pack_spec", (PyCFunction)(void (*)(void))pack_spec, METH_FASTCALL, "the fixed part of a kernel launch"},
    {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL, "launch a compiled copy kernel"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "xfer._native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
