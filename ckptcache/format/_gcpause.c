/* The collector held off around a save: the bookkeeping of ckptcache/format/gcpause.py.
 *
 * Written in C for one reason: a signal handler's exception (Ctrl-C) lands between any two
 * Python bytecodes that check for it, so a region kept in Python could be left with its count
 * raised (an exception after gc.disable() and before the try that undoes it) or never lowered
 * (an exception inside the finally before gc.enable()), and the process would run without a
 * collector for good. Here __enter__ and __exit__ run start to end with the GIL held and no
 * Python code in between: a `with` statement calls __enter__ and, once it has returned, is
 * sure to call __exit__, so each region that began ends exactly once. The GIL also orders the
 * regions of several threads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Regions open now, in every thread; whether the collector was on when the first began. */
static Py_ssize_t depth = 0;
static int reenable = 0;

static PyObject *paused_enter(PyObject *self, PyObject *unused)
{
    if (depth == 0)
        reenable = PyGC_Disable();
    depth++;
    Py_RETURN_NONE;
}

static PyObject *paused_exit(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (depth > 0) { /* a child forked inside starts at 0 (after_fork) */
        depth--;
        if (depth == 0 && reenable)
            PyGC_Enable();
    }
    Py_RETURN_FALSE;
}

static PyMethodDef paused_methods[] = {
    {"__enter__", paused_enter, METH_NOARGS, "Hold the collector off (regions nest)."},
    {"__exit__", (PyCFunction)(void (*)(void))paused_exit, METH_FASTCALL,
     "End the region; the last to end turns the collector back on if it was on."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject paused_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ckptcache.format._gcpause.paused",
    .tp_basicsize = sizeof(PyObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A region with no cyclic garbage collection (see gcpause.gc_paused).",
    .tp_methods = paused_methods,
    .tp_new = PyType_GenericNew,
};

static PyObject *open_regions(PyObject *module, PyObject *unused)
{
    return PyLong_FromSsize_t(depth);
}

static PyObject *after_fork(PyObject *module, PyObject *unused)
{
    /* The regions' threads may not be in the child: it collects as the parent did before. */
    if (depth && reenable)
        PyGC_Enable();
    depth = 0, reenable = 0;
    Py_RETURN_NONE;
}

static PyMethodDef functions[] = {
    {"depth", open_regions, METH_NOARGS, "How many regions are open now, in every thread."},
    {"after_fork", after_fork, METH_NOARGS, "In a forked child: no region open."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_gcpause", "The collector held off around a save.", -1, functions,
};

PyMODINIT_FUNC PyInit__gcpause(void)
{
    if (PyType_Ready(&paused_type) < 0)
        return NULL;
    PyObject *mod = PyModule_Create(&module);
    if (mod == NULL)
        return NULL;
    Py_INCREF(&paused_type);
    if (PyModule_AddObject(mod, "paused", (PyObject *)&paused_type) < 0) {
        Py_DECREF(&paused_type);
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
