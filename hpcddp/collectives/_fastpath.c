/* The all_reduce(SUM) plan hit in C: what hpcddp.collectives._plans.hit_py does in Python.
 *
 * A small all_reduce is mostly fixed cost: raw mpi4py takes ~0.85 us at <= 1 KiB on 2 ranks of
 * one node, and checking a plan, writing the flight-recorder entry and calling mpi4py from
 * Python added ~0.8 us more (`hpcddp bench comm`). Here the same steps cost ~0.1 us: one dict
 * lookup, the tensor's data_ptr() and numel(), the ring entry, then MPI_Allreduce with the GIL
 * released (as mpi4py releases it).
 *
 * The plan tuple is made by _plans.make_plan (its layout is documented there); this file reads
 * it and never creates one. all_reduce_sum answers False whenever anything differs from the
 * plan (other object at that id, memory, element count, group, destroyed communicator, a plan
 * with no C handles): the caller then takes the full Python path, which validates and plans.
 *
 * Built by setup.py with the MPI compiler wrapper (mpicc); optional. The handles are
 * mpi4py's (MPI._handleof), so this library and mpi4py's must be the same MPI:
 * _plans checks library_version() against mpi4py's before using this module.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <mpi.h>
#include <limits.h>
#include <stdint.h>

/* set once by configure(): the plans dict, the recorder's ring, its slot cycle, its clock,
   and mpi4py's exception class */
static PyObject *plans, *ring, *slots, *tick, *mpi_exception;
static PyObject *s_op, *s_data_ptr, *s_numel, *s_seq, *s_mpi;

enum { P_REF, P_PTR, P_GROUP, P_COMM, P_NUMEL, P_MPI, P_SHAPE, P_DTYPE, P_VIEW, P_OP,
       P_HANDLES, P_LEN };

static int same_int(PyObject *value, PyObject *planned) {
    /* 1 if VALUE (a new reference, consumed) equals the plan's int, 0 if not, -1 on error */
    if (value == NULL)
        return -1;
    int eq = PyObject_RichCompareBool(value, planned, Py_EQ);
    Py_DECREF(value);
    return eq;
}

/* the recorder's start(): [seq, "all_reduce", comm, shape, dtype, None, t_start, 0.0] into the
   ring, comm.seq + 1 (hpcddp.diagnostics.recorder.FlightRecorder._make_start) */
static PyObject *record_start(PyObject *plan) {
    PyObject *comm = PyTuple_GET_ITEM(plan, P_COMM);
    PyObject *seq = PyObject_GetAttr(comm, s_seq);
    if (seq == NULL)
        return NULL;
    PyObject *one = PyLong_FromLong(1);
    PyObject *next_seq = one ? PyNumber_Add(seq, one) : NULL;
    Py_DECREF(seq);
    Py_XDECREF(one);
    if (next_seq == NULL || PyObject_SetAttr(comm, s_seq, next_seq) < 0)
        goto fail;
    PyObject *slot = PyIter_Next(slots);
    if (slot == NULL)
        goto fail;
    Py_ssize_t i = PyLong_AsSsize_t(slot);
    Py_DECREF(slot);
    if (i == -1 && PyErr_Occurred())
        goto fail;
    PyObject *entry = PyList_New(8);
    PyObject *t_end = PyFloat_FromDouble(0.0);
    if (entry == NULL || t_end == NULL) {
        Py_XDECREF(entry);
        Py_XDECREF(t_end);
        goto fail;
    }
    PyObject *borrowed[] = {s_op, comm, PyTuple_GET_ITEM(plan, P_SHAPE),
                            PyTuple_GET_ITEM(plan, P_DTYPE), Py_None, PyList_GET_ITEM(tick, 0)};
    PyList_SET_ITEM(entry, 0, next_seq);  /* steals */
    for (int k = 0; k < 6; k++) {
        Py_INCREF(borrowed[k]);
        PyList_SET_ITEM(entry, k + 1, borrowed[k]);
    }
    PyList_SET_ITEM(entry, 7, t_end);
    Py_INCREF(entry);                     /* one for the ring, one for us */
    if (PyList_SetItem(ring, i, entry) < 0) {
        Py_DECREF(entry);
        return NULL;
    }
    return entry;
fail:
    Py_XDECREF(next_seq);
    return NULL;
}

static PyObject *run_plan(PyObject *plan, PyObject *tensor, PyObject *group);

static PyObject *all_reduce_sum(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "all_reduce_sum(tensor, group): expected 2 arguments, "
                     "got %zd", nargs);
        return NULL;
    }
    PyObject *key = PyLong_FromVoidPtr(args[0]);   /* id(tensor) */
    if (key == NULL)
        return NULL;
    PyObject *plan = PyDict_GetItemWithError(plans, key);   /* borrowed */
    Py_DECREF(key);
    if (plan == NULL) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_FALSE;
    }
    /* held while we run: data_ptr() and the allocations below may run a finalizer, or let
       another thread in, that replaces this tensor's plan or clears them all */
    Py_INCREF(plan);
    PyObject *done = run_plan(plan, args[0], args[1]);
    Py_DECREF(plan);
    return done;
}

static PyObject *run_plan(PyObject *plan, PyObject *tensor, PyObject *group) {
    if (!PyTuple_Check(plan) || PyTuple_GET_SIZE(plan) != P_LEN
            || PyTuple_GET_ITEM(plan, P_HANDLES) == Py_None
            || PyWeakref_GetObject(PyTuple_GET_ITEM(plan, P_REF)) != tensor
            || (PyTuple_GET_ITEM(plan, P_GROUP) != group
                && PyTuple_GET_ITEM(plan, P_COMM) != group))
        Py_RETURN_FALSE;
    PyObject *mpi = PyObject_GetAttr(PyTuple_GET_ITEM(plan, P_COMM), s_mpi);
    if (mpi == NULL)
        return NULL;
    Py_DECREF(mpi);                       /* only its identity is compared */
    if (mpi != PyTuple_GET_ITEM(plan, P_MPI))
        Py_RETURN_FALSE;                  /* destroyed (COMM_NULL) or replaced */
    int eq = same_int(PyObject_CallMethodNoArgs(tensor, s_data_ptr), PyTuple_GET_ITEM(plan, P_PTR));
    if (eq == 1)
        eq = same_int(PyObject_CallMethodNoArgs(tensor, s_numel), PyTuple_GET_ITEM(plan, P_NUMEL));
    if (eq < 0)
        return NULL;
    if (eq == 0)
        Py_RETURN_FALSE;
    /* the plan holds: this object, this memory, this many elements, this live communicator */
    PyObject *h = PyTuple_GET_ITEM(plan, P_HANDLES);   /* (comm, datatype, op) as ints */
    void *buf = PyLong_AsVoidPtr(PyTuple_GET_ITEM(plan, P_PTR));
    long long count = PyLong_AsLongLong(PyTuple_GET_ITEM(plan, P_NUMEL));
    intptr_t hcomm = (intptr_t)PyLong_AsVoidPtr(PyTuple_GET_ITEM(h, 0));
    intptr_t htype = (intptr_t)PyLong_AsVoidPtr(PyTuple_GET_ITEM(h, 1));
    intptr_t hop = (intptr_t)PyLong_AsVoidPtr(PyTuple_GET_ITEM(h, 2));
    if (PyErr_Occurred())
        return NULL;
    if (count < 0 || count > INT_MAX)
        Py_RETURN_FALSE;                  /* MPI's int count: the Python path cuts it up */
    PyObject *entry = record_start(plan);
    if (entry == NULL)
        return NULL;
    int rc;
    /* handles are pointers in Open MPI and ints in MPICH: the casts compile for both */
    Py_BEGIN_ALLOW_THREADS
    rc = MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, (MPI_Datatype)htype, (MPI_Op)hop,
                       (MPI_Comm)hcomm);
    Py_END_ALLOW_THREADS
    if (rc != MPI_SUCCESS) {              /* the entry stays in flight, as in Python */
        Py_DECREF(entry);
        PyObject *code = PyLong_FromLong(rc);
        if (code != NULL) {
            PyErr_SetObject(mpi_exception, code);   /* mpi4py's MPI.Exception(rc) */
            Py_DECREF(code);
        }
        return NULL;
    }
    PyObject *t_end = PyList_GET_ITEM(tick, 0);      /* the recorder's end() */
    Py_INCREF(t_end);
    PyList_SetItem(entry, 7, t_end);
    Py_DECREF(entry);
    Py_RETURN_TRUE;
}

static PyObject *configure(PyObject *self, PyObject *args) {
    PyObject *p, *r, *s, *t, *e;
    if (!PyArg_ParseTuple(args, "O!O!OO!O:configure", &PyDict_Type, &p, &PyList_Type, &r, &s,
                          &PyList_Type, &t, &e))
        return NULL;
    if (!PyIter_Check(s) || PyList_GET_SIZE(t) < 1) {
        PyErr_SetString(PyExc_TypeError, "configure: slots must be an iterator and tick a "
                        "non-empty list");
        return NULL;
    }
    Py_XSETREF(plans, Py_NewRef(p));
    Py_XSETREF(ring, Py_NewRef(r));
    Py_XSETREF(slots, Py_NewRef(s));
    Py_XSETREF(tick, Py_NewRef(t));
    Py_XSETREF(mpi_exception, Py_NewRef(e));
    Py_RETURN_NONE;
}

static PyObject *library_version(PyObject *self, PyObject *unused) {
    char text[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    MPI_Get_library_version(text, &len);  /* callable before MPI_Init */
    return PyUnicode_DecodeLatin1(text, len, "replace");
}

static PyMethodDef methods[] = {
    {"all_reduce_sum", (PyCFunction)(void (*)(void))all_reduce_sum, METH_FASTCALL,
     "all_reduce_sum(tensor, group) -> bool: run the planned SUM all_reduce of TENSOR in "
     "place and return True, or return False (no plan, or it no longer holds)."},
    {"configure", configure, METH_VARARGS,
     "configure(plans, ring, slots, tick, mpi_exception): what all_reduce_sum reads."},
    {"library_version", library_version, METH_NOARGS,
     "MPI_Get_library_version() of the MPI this module was built and linked with."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastpath",
                                    "The all_reduce(SUM) plan hit in C.", -1, methods};

PyMODINIT_FUNC PyInit__fastpath(void) {
    s_op = PyUnicode_InternFromString("all_reduce");
    s_data_ptr = PyUnicode_InternFromString("data_ptr");
    s_numel = PyUnicode_InternFromString("numel");
    s_seq = PyUnicode_InternFromString("seq");
    s_mpi = PyUnicode_InternFromString("mpi");
    if (!s_op || !s_data_ptr || !s_numel || !s_seq || !s_mpi)
        return NULL;
    return PyModule_Create(&module);
}
