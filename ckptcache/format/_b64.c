/* Strict base64 decoding of a manifest's packed columns and tensor table.
 *
 * A zero-copy load of thousands of tensors decodes a manifest's worth of base64 (the
 * records' offsets, sizes and codes, and the tensor table); CPython's binascii.a2b_base64
 * checks every character on its way. This decodes a group of four characters with four table
 * lookups and one check of all of them.
 *
 * Accepts base64 as base64.b64encode writes it: the standard alphabet, a length that is a
 * multiple of four, and at most two '=' at the very end (the bits they pad are not checked,
 * as binascii does not). Anything else raises ValueError, and the caller (b64.py) hands it to
 * binascii, which decides with its own rules and messages (it also takes more '=' after a
 * whole group): what this accepts, binascii decodes to the same bytes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* 0-63 for the alphabet, 0xff for anything else ('=' included: handled at the end only). */
static uint8_t decode_table[256];

static void fill_table(void)
{
    static const char alphabet[] =
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    memset(decode_table, 0xff, sizeof decode_table);
    for (int i = 0; i < 64; i++)
        decode_table[(uint8_t)alphabet[i]] = (uint8_t)i;
}

/* Decode ``n`` characters (n % 4 == 0, no '=') into ``out``; 0, or -1 at a bad character. */
static int decode_groups(const uint8_t *in, Py_ssize_t n, uint8_t *out)
{
    for (Py_ssize_t i = 0; i < n; i += 4, out += 3) {
        uint32_t a = decode_table[in[i]], b = decode_table[in[i + 1]];
        uint32_t c = decode_table[in[i + 2]], d = decode_table[in[i + 3]];
        if ((a | b | c | d) & 0x80)
            return -1;
        uint32_t v = a << 18 | b << 12 | c << 6 | d;
        out[0] = (uint8_t)(v >> 16), out[1] = (uint8_t)(v >> 8), out[2] = (uint8_t)v;
    }
    return 0;
}

static PyObject *b64decode(PyObject *self, PyObject *arg)
{
    const uint8_t *in;
    Py_ssize_t n;
    if (PyUnicode_Check(arg)) {
        if (!PyUnicode_IS_ASCII(arg)) {
            PyErr_SetString(PyExc_ValueError, "a character outside the base64 alphabet");
            return NULL;
        }
        in = PyUnicode_1BYTE_DATA(arg);
        n = PyUnicode_GET_LENGTH(arg);
    } else if (PyBytes_Check(arg)) {
        in = (const uint8_t *)PyBytes_AS_STRING(arg);
        n = PyBytes_GET_SIZE(arg);
    } else {
        PyErr_SetString(PyExc_TypeError, "decode() takes a str or bytes");
        return NULL;
    }
    if (n % 4 != 0) {
        PyErr_SetString(PyExc_ValueError, "a length that is not a multiple of four");
        return NULL;
    }
    Py_ssize_t pad = 0;
    if (n && in[n - 1] == '=')
        pad = in[n - 2] == '=' ? 2 : 1;
    PyObject *result = PyBytes_FromStringAndSize(NULL, n / 4 * 3 - pad);
    if (result == NULL)
        return NULL;
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(result);
    Py_ssize_t whole = pad ? n - 4 : n; /* the groups with no '=' in them */
    int bad = decode_groups(in, whole, out);
    if (!bad && pad) {
        /* The last group: two or three characters of the alphabet, then the padding. */
        const uint8_t *last = in + whole;
        uint32_t a = decode_table[last[0]], b = decode_table[last[1]];
        uint32_t c = pad == 1 ? decode_table[last[2]] : 0;
        out += whole / 4 * 3;
        if ((a | b | c) & 0x80)
            bad = 1;
        else {
            uint32_t v = a << 18 | b << 12 | c << 6;
            out[0] = (uint8_t)(v >> 16);
            if (pad == 1)
                out[1] = (uint8_t)(v >> 8);
        }
    }
    if (bad) {
        Py_DECREF(result);
        PyErr_SetString(PyExc_ValueError, "not strict base64");
        return NULL;
    }
    return result;
}

static PyMethodDef methods[] = {
    {"decode", b64decode, METH_O,
     "decode(text) -> bytes: strict base64 (as base64.b64decode(text, validate=True)); "
     "ValueError where it is not, TypeError for anything but str or bytes."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_b64", "Strict base64 decoding of a manifest's packed fields.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__b64(void)
{
    fill_table();
    return PyModule_Create(&module);
}
