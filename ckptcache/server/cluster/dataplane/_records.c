/* A data-plane record's Poly1305 tag, and the xxh3 digests of the storages it carries, in one
 * pass over the record with the interpreter lock released.
 *
 * A received record is read twice otherwise: once by the tag check, once by the digest of the
 * storages it completes. Walking it in chunks that stay in the core's cache, tagging a chunk and
 * then hashing the same chunk, reads it from memory once. Releasing the interpreter lock lets the
 * receiving thread take the next record off the socket while this one is checked (the Poly1305
 * of `cryptography` holds the lock for its whole pass).
 *
 * Poly1305 is OpenSSL's (EVP_MAC, its vectorised code); the xxh3 functions are those of the
 * `xxhash` module the digests already come from, bound at import by `_tagging.py` (their
 * addresses), so both ends of every digest run the same code.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <openssl/evp.h>
#include <stdint.h>
#include <string.h>

/* Bytes tagged, then hashed, before the next ones: small enough to stay in a core's L2. */
#define CHUNK ((Py_ssize_t)128 << 10)
#define KEY_BYTES 32
#define TAG_BYTES 16

typedef void *(*xxh_create_fn)(void);
typedef int (*xxh_free_fn)(void *);
typedef int (*xxh_reset_fn)(void *);
typedef int (*xxh_update_fn)(void *, const void *, size_t);
typedef uint64_t (*xxh_digest_fn)(const void *);

static EVP_MAC *poly1305;
static xxh_create_fn xxh_create;
static xxh_free_fn xxh_free;
static xxh_reset_fn xxh_reset;
static xxh_update_fn xxh_update;
static xxh_digest_fn xxh_digest;

static const char STATE_NAME[] = "ckptcache.xxh3_state";

/* One span of a record to hash: [lo, hi) of the record, and whether a storage ends at hi. */
typedef struct {
    Py_ssize_t lo, hi;
    int ends;
} span_t;

static PyObject *bind_xxh3(PyObject *self, PyObject *args)
{
    unsigned long long c, f, r, u, d;
    if (!PyArg_ParseTuple(args, "KKKKK", &c, &f, &r, &u, &d))
        return NULL;
    xxh_create = (xxh_create_fn)(uintptr_t)c;
    xxh_free = (xxh_free_fn)(uintptr_t)f;
    xxh_reset = (xxh_reset_fn)(uintptr_t)r;
    xxh_update = (xxh_update_fn)(uintptr_t)u;
    xxh_digest = (xxh_digest_fn)(uintptr_t)d;
    Py_RETURN_NONE;
}

static void state_free(PyObject *capsule)
{
    void *state = PyCapsule_GetPointer(capsule, STATE_NAME);
    if (state != NULL && xxh_free != NULL)
        xxh_free(state);
}

static PyObject *xxh3_state(PyObject *self, PyObject *noargs)
{
    if (xxh_create == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "xxh3 functions not bound");
        return NULL;
    }
    void *state = xxh_create();
    if (state == NULL)
        return PyErr_NoMemory();
    xxh_reset(state);
    PyObject *capsule = PyCapsule_New(state, STATE_NAME, state_free);
    if (capsule == NULL)
        xxh_free(state);
    return capsule;
}

/* Tag head + data[0:n) under key and feed the spans to state, chunk by chunk; digests[k] gets
 * the digest of the k-th span that ends a storage. 0 on success, -1 on an OpenSSL failure. */
static int run(const unsigned char *key, const unsigned char *head, Py_ssize_t head_len,
               const unsigned char *data, Py_ssize_t n, const span_t *spans, Py_ssize_t nspans,
               void *state, uint64_t *digests, unsigned char *tag)
{
    int ok = 0;
    size_t tag_len = 0;
    EVP_MAC_CTX *ctx = EVP_MAC_CTX_new(poly1305);
    if (ctx == NULL || !EVP_MAC_init(ctx, key, KEY_BYTES, NULL) ||
        !EVP_MAC_update(ctx, head, (size_t)head_len))
        goto done;
    Py_ssize_t s = 0, ended = 0, pos = 0;
    do {
        Py_ssize_t end = pos + CHUNK < n ? pos + CHUNK : n;
        if (end > pos && !EVP_MAC_update(ctx, data + pos, (size_t)(end - pos)))
            goto done;
        /* The spans this chunk completes or reaches into, in order. */
        for (; s < nspans; s++) {
            Py_ssize_t lo = spans[s].lo > pos ? spans[s].lo : pos;
            Py_ssize_t hi = spans[s].hi < end ? spans[s].hi : end;
            if (hi > lo)
                xxh_update(state, data + lo, (size_t)(hi - lo));
            if (spans[s].hi > end)
                break; /* goes on in the next chunk */
            if (spans[s].ends) {
                digests[ended++] = xxh_digest(state);
                xxh_reset(state);
            }
        }
        pos = end;
    } while (pos < n);
    ok = EVP_MAC_final(ctx, tag, &tag_len, TAG_BYTES) && tag_len == TAG_BYTES;
done:
    EVP_MAC_CTX_free(ctx);
    return ok ? 0 : -1;
}

static int parse_spans(PyObject *seq, Py_ssize_t n, span_t **out, Py_ssize_t *count,
                       Py_ssize_t *ends)
{
    PyObject *fast = PySequence_Fast(seq, "spans must be a sequence");
    if (fast == NULL)
        return -1;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(fast);
    span_t *spans = PyMem_Malloc(sizeof(span_t) * (size_t)(m ? m : 1));
    if (spans == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t last = 0, ended = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(fast, i);
        if (!PyArg_ParseTuple(item, "nnp", &spans[i].lo, &spans[i].hi, &spans[i].ends))
            goto bad;
        if (spans[i].lo < last || spans[i].hi < spans[i].lo || spans[i].hi > n) {
            PyErr_SetString(PyExc_ValueError, "spans must be ordered and inside the record");
            goto bad;
        }
        last = spans[i].hi;
        ended += spans[i].ends != 0;
    }
    Py_DECREF(fast);
    *out = spans, *count = m, *ends = ended;
    return 0;
bad:
    Py_DECREF(fast);
    PyMem_Free(spans);
    return -1;
}

static PyObject *tag_and_hash(PyObject *self, PyObject *args)
{
    Py_buffer key, head, data;
    PyObject *spans_obj = Py_None, *capsule = Py_None;
    if (!PyArg_ParseTuple(args, "y*y*y*|OO", &key, &head, &data, &spans_obj, &capsule))
        return NULL;
    PyObject *result = NULL;
    span_t *spans = NULL;
    uint64_t *digests = NULL;
    Py_ssize_t nspans = 0, nends = 0;
    void *state = NULL;
    unsigned char tag[TAG_BYTES];
    if (key.len != KEY_BYTES) {
        PyErr_SetString(PyExc_ValueError, "the one-time key is 32 bytes");
        goto out;
    }
    if (spans_obj != Py_None) {
        if ((state = PyCapsule_GetPointer(capsule, STATE_NAME)) == NULL)
            goto out;
        if (parse_spans(spans_obj, data.len, &spans, &nspans, &nends) < 0)
            goto out;
        if ((digests = PyMem_Malloc(sizeof(uint64_t) * (size_t)(nends ? nends : 1))) == NULL) {
            PyErr_NoMemory();
            goto out;
        }
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = run(key.buf, head.buf, head.len, data.buf, data.len, spans, nspans, state, digests, tag);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        PyErr_SetString(PyExc_RuntimeError, "OpenSSL's Poly1305 failed");
        goto out;
    }
    PyObject *list = PyList_New(nends);
    if (list == NULL)
        goto out;
    for (Py_ssize_t i = 0; i < nends; i++) {
        PyObject *d = PyLong_FromUnsignedLongLong(digests[i]);
        if (d == NULL) {
            Py_DECREF(list);
            goto out;
        }
        PyList_SET_ITEM(list, i, d);
    }
    result = Py_BuildValue("(y#N)", (const char *)tag, (Py_ssize_t)TAG_BYTES, list);
out:
    PyMem_Free(spans);
    PyMem_Free(digests);
    PyBuffer_Release(&key);
    PyBuffer_Release(&head);
    PyBuffer_Release(&data);
    return result;
}

static PyMethodDef methods[] = {
    {"bind_xxh3", bind_xxh3, METH_VARARGS,
     "bind_xxh3(create, free, reset, update, digest): the xxh3 functions' addresses."},
    {"xxh3_state", xxh3_state, METH_NOARGS, "xxh3_state() -> a fresh xxh3-64 state."},
    {"tag_and_hash", tag_and_hash, METH_VARARGS,
     "tag_and_hash(key, head, data, spans=None, state=None) -> (tag, digests)\n\n"
     "The Poly1305 tag of head + data under the 32-byte one-time key; each (lo, hi, ends)\n"
     "span of data fed to state in order, its digest taken (and state reset) where ends."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_records", NULL, -1, methods};

PyMODINIT_FUNC PyInit__records(void)
{
    poly1305 = EVP_MAC_fetch(NULL, "POLY1305", NULL);
    if (poly1305 == NULL) {
        PyErr_SetString(PyExc_ImportError, "OpenSSL has no Poly1305");
        return NULL;
    }
    return PyModule_Create(&module);
}
