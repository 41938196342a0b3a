/* The plan hits in C: what hpcddp.collectives._plans.hit_py and xhit_py do in Python.
 *
 * A small all_reduce is mostly fixed cost: raw mpi4py takes ~0.85 us at <= 1 KiB on 2 ranks of
 * one node, and checking a plan, writing the flight-recorder entry and calling mpi4py from
 * Python added ~0.8 us more (`hpcddp bench comm`). Here the same steps cost ~0.1 us: one dict
 * lookup, the tensor's data_ptr(), numel() and is_contiguous(), the ring entry, then
 * MPI_Allreduce with the GIL released (as mpi4py releases it).
 *
 * exchange() does the same for the blocking all_to_all_single (even blocks), all_gather and
 * all_to_all (list forms) and all_gather_into_tensor called again on the same tensors: every tensor of the call checked
 * against the plan, the entry, then the plan's program (MPI_Ialltoallv + MPI_Wait, or the own
 * block's memmove and MPI_Sendrecv steps) with the GIL released.
 *
 * broadcast() does it for a blocking broadcast of a tensor broadcast before from the same root:
 * the plan's checks, the entry (with the root as its peer), MPI_Bcast with the GIL released;
 * reduce_sum() for a blocking SUM reduce of a tensor reduced before onto the same root
 * (MPI_Reduce, in place on the root). Both are rooted hits (rooted_hit).
 *
 * p2p() starts (or runs, when blocking) a planned isend/irecv/send/recv of a tensor used before
 * with the same peer, tag and group; the non-blocking ones return a P2PWork, a Work whose
 * wait() and is_completed() are MPI_Wait and MPI_Test here: a Python Work cost ~2.8 us to
 * make and wait, as much as the rest of the call (docs/benchmarks.md, "Point-to-point plans").
 * A completed receive's count is checked as hpcddp.collectives.work.check_count does: another
 * size than the tensor's (a longer message: MPI_ERR_TRUNCATE) raises work.count_error's error.
 *
 * Every plan is a Plan (below), the one plan type: _plans makes them through its constructor
 * (the module's small API), which checks the program once and unpacks it into C fields; the
 * hits read those fields and never make a plan. Both hits answer False whenever anything
 * differs from the plan (other object at that id, memory, element count, contiguity, group,
 * destroyed communicator, a plan with no C program): the caller then takes the full Python
 * path, which validates and plans.
 *
 * Built by setup.py with the MPI compiler wrapper (mpicc); optional. The handles are
 * mpi4py's (MPI._handleof), so this library and mpi4py's must be the same MPI:
 * _plans checks library_version() against mpi4py's before using this module
 * (_mpi_library.h).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <pythread.h>
#include <mpi.h>
#include "_mpi_library.h"
#include <limits.h>
#include <stdint.h>
#include <string.h>

/* set once by configure(): the all_reduce plans dict, the exchange plans (a tuple of dicts,
   one per kind), the recorder's ring, its slot cycle, its clock, and mpi4py's exception class */
static PyObject *plans, *xplans, *ring, *slots, *tick, *mpi_exception;
/* the broadcast and the reduce plans (dicts, keyed as the all_reduce plans) */
static PyObject *bplans, *rplans;
/* and the p2p plans (a tuple: send plans, recv plans), the recorder's p2p sequence numbers
   (a dict: communicator uid -> last number), hpcddp.collectives.work.future_of and
   work.count_error */
static PyObject *pplans, *p2p_seq, *future_of, *count_error;
static PyObject *s_op, *s_broadcast, *s_reduce, *s_data_ptr, *s_numel, *s_is_contiguous, *s_dtype, *s_seq, *s_mpi;

/* a plan's program (_plans: ALLTOALLV...; NO_PROGRAM: only the Python hit runs it) and the
   ops p2p() runs (_plans: ISEND...) */
enum { NO_PROGRAM = -1, ALLTOALLV, SENDRECV, ALLREDUCE, POINT_TO_POINT, BROADCAST, ALLGATHER,
       REDUCE_SCATTER, REDUCE };
enum { ISEND, IRECV, SEND, RECV };

/* -- Plan: the one plan type -----------------------------------------------------------------
 * What a call's checks found, for the next identical call: the tensors (weak references, the
 * first one's is the plan's key in its table), their memory and sizes, the group as passed,
 * its Communicator and that one's mpi4py communicator, what the flight recorder writes, and
 * the program: (ALLREDUCE, comm, datatype, op), (ALLTOALLV, comm, datatype, int32 table, tag),
 * (SENDRECV, comm, datatype, int64 table, tag), (POINT_TO_POINT, comm, datatype, count, MPI
 * peer), (BROADCAST, comm, datatype, root), (ALLGATHER, comm, datatype, count: each rank's
 * block), (REDUCE_SCATTER, comm, datatype, count: each rank's block, op[, int64 table of the
 * list form's copies into one buffer: dst, src, bytes per block]) or (REDUCE, comm,
 * datatype, op, root, this rank is the root), the handles as mpi4py's MPI._handleof ints;
 * None where C cannot run it. */
typedef struct {
    PyObject_HEAD
    PyObject *refs, *ptrs, *numels;       /* tuples, one item per tensor of the call */
    PyObject *group, *comm, *mpi;
    PyObject *op, *shape, *dtype;         /* the recorder's op name, shape and dtype */
    PyObject *peer, *tag, *uid;           /* point-to-point: group rank (None: any), tag, comm.uid */
    PyObject *run, *prog;                 /* the Python hit's MPI work; the program as given */
    /* the program, unpacked once */
    int code, count, mpi_peer, mpi_tag;
    MPI_Comm hcomm;
    MPI_Datatype htype;
    MPI_Op hop;
    void *buf, *in;                       /* the first (second) tensor's memory; REDUCE: what
                                             the rank sends (MPI_IN_PLACE on the root) */
    const char *table;                    /* in prog's bytes; ROWS: ranks or steps */
    Py_ssize_t rows;
} Plan;

static PyTypeObject PlanType;

static int plan_traverse(Plan *p, visitproc visit, void *arg) {
    Py_VISIT(p->refs); Py_VISIT(p->ptrs); Py_VISIT(p->numels); Py_VISIT(p->group);
    Py_VISIT(p->comm); Py_VISIT(p->mpi); Py_VISIT(p->op); Py_VISIT(p->shape);
    Py_VISIT(p->dtype); Py_VISIT(p->peer); Py_VISIT(p->tag); Py_VISIT(p->uid);
    Py_VISIT(p->run); Py_VISIT(p->prog);
    return 0;
}

static int plan_clear(Plan *p) {
    Py_CLEAR(p->refs); Py_CLEAR(p->ptrs); Py_CLEAR(p->numels); Py_CLEAR(p->group);
    Py_CLEAR(p->comm); Py_CLEAR(p->mpi); Py_CLEAR(p->op); Py_CLEAR(p->shape);
    Py_CLEAR(p->dtype); Py_CLEAR(p->peer); Py_CLEAR(p->tag); Py_CLEAR(p->uid);
    Py_CLEAR(p->run); Py_CLEAR(p->prog);
    p->code = NO_PROGRAM;
    return 0;
}

static void plan_dealloc(Plan *p) {
    PyObject_GC_UnTrack(p);
    plan_clear(p);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

/* the handle at PROG[I] (an int from MPI._handleof) */
static void *handle_at(PyObject *prog, Py_ssize_t i) {
    return PyLong_AsVoidPtr(PyTuple_GET_ITEM(prog, i));
}

/* the program's table (PROG[AT]): its bytes as WIDTH-byte ints, their count in *COUNT */
static const char *table_of(PyObject *prog, Py_ssize_t at, Py_ssize_t width,
                            Py_ssize_t *count) {
    PyObject *b = PyTuple_GET_ITEM(prog, at);
    if (!PyBytes_Check(b) || PyBytes_GET_SIZE(b) % width)
        return NULL;
    *count = PyBytes_GET_SIZE(b) / width;
    return PyBytes_AS_STRING(b);
}

static int refuse_program(const char *why) {
    PyErr_Format(PyExc_ValueError, "Plan: the program %s", why);
    return -1;
}

/* unpack P's program into its C fields (0), or raise (-1): a program C cannot run at all is
   a caller's error; one over MPI's int count is left to the Python path (NO_PROGRAM) */
static int unpack_program(Plan *p) {
    PyObject *prog = p->prog;
    Py_ssize_t n = PyTuple_GET_SIZE(p->refs);
    p->code = NO_PROGRAM;
    if (prog == Py_None)
        return 0;
    if (!PyTuple_Check(prog) || PyTuple_GET_SIZE(prog) < 4 || n < 1
            || PyTuple_GET_SIZE(p->ptrs) != n || PyTuple_GET_SIZE(p->numels) != n)
        return refuse_program("must be a tuple (code, comm, datatype, ...) and the tensors, "
                              "pointers and counts as many");
    long code = PyLong_AsLong(PyTuple_GET_ITEM(prog, 0));
    p->hcomm = (MPI_Comm)(intptr_t)handle_at(prog, 1);   /* pointers in Open MPI, ints in */
    p->htype = (MPI_Datatype)(intptr_t)handle_at(prog, 2);   /* MPICH: both casts compile */
    p->buf = PyLong_AsVoidPtr(PyTuple_GET_ITEM(p->ptrs, 0));
    p->in = n > 1 ? PyLong_AsVoidPtr(PyTuple_GET_ITEM(p->ptrs, 1)) : NULL;
    long long count = PyLong_AsLongLong(PyTuple_GET_ITEM(p->numels, 0));
    if (PyErr_Occurred())
        return -1;
    switch (code) {
    case ALLGATHER:
    case REDUCE_SCATTER: {
        /* a reduce_scatter of a list: (output, *input_list) and the copies into one buffer */
        int list = code == REDUCE_SCATTER && PyTuple_GET_SIZE(prog) == 6;
        if (PyTuple_GET_SIZE(prog) != (code == ALLGATHER ? 4 : 5 + list)
                || (list ? n < 2 : n != 2))
            return refuse_program("of an all_gather_into_tensor is (ALLGATHER, comm, datatype, "
                                  "count) and of a reduce_scatter_tensor (REDUCE_SCATTER, comm, "
                                  "datatype, count, op), on (output, input); of a reduce_scatter "
                                  "(REDUCE_SCATTER, comm, datatype, count, op, copies), on "
                                  "(output, *input_list)");
        count = PyLong_AsLongLong(PyTuple_GET_ITEM(prog, 3));   /* each rank's block */
        if (code == REDUCE_SCATTER)
            p->hop = (MPI_Op)(intptr_t)handle_at(prog, 4);
        if (PyErr_Occurred())
            return -1;
        p->table = NULL;
        p->rows = 0;
        if (list) {         /* int64 (dst, src, bytes) per block; the first dst: the buffer */
            p->table = table_of(prog, 5, sizeof(int64_t), &p->rows);
            if (p->table == NULL || p->rows < 3 || p->rows % 3)
                return refuse_program("copies do not fit a reduce_scatter");
            p->rows /= 3;
            p->in = (void *)(intptr_t)((const int64_t *)p->table)[0];
        }
        if (count < 0 || count > INT_MAX)
            return 0;
        p->count = (int)count;
        break;
    }
    case ALLREDUCE:
    case BROADCAST:
    case POINT_TO_POINT:
        if (PyTuple_GET_SIZE(prog) != (code == POINT_TO_POINT ? 5 : 4))
            return refuse_program("of an all_reduce is (ALLREDUCE, comm, datatype, op), of a "
                                  "broadcast (BROADCAST, comm, datatype, root) and of a "
                                  "send/recv (POINT_TO_POINT, comm, datatype, count, peer)");
        if (code == ALLREDUCE)
            p->hop = (MPI_Op)(intptr_t)handle_at(prog, 3);
        else if (code == BROADCAST)
            p->mpi_peer = (int)PyLong_AsLong(PyTuple_GET_ITEM(prog, 3));
        else {
            count = PyLong_AsLongLong(PyTuple_GET_ITEM(prog, 3));
            p->mpi_peer = (int)PyLong_AsLong(PyTuple_GET_ITEM(prog, 4));
            p->mpi_tag = (int)PyLong_AsLong(p->tag);
        }
        if (PyErr_Occurred())
            return -1;
        if (count < 0 || count > INT_MAX)
            return 0;                     /* MPI's int count: the Python path cuts it up */
        p->count = (int)count;
        break;
    case REDUCE: {
        if (PyTuple_GET_SIZE(prog) != 6 || n != 1)
            return refuse_program("of a reduce is (REDUCE, comm, datatype, op, root, is_root), "
                                  "on one tensor");
        p->hop = (MPI_Op)(intptr_t)handle_at(prog, 3);
        p->mpi_peer = (int)PyLong_AsLong(PyTuple_GET_ITEM(prog, 4));
        int is_root = PyObject_IsTrue(PyTuple_GET_ITEM(prog, 5));
        if (is_root < 0 || PyErr_Occurred())
            return -1;
        p->in = is_root ? MPI_IN_PLACE : p->buf;
        if (count < 0 || count > INT_MAX)
            return 0;
        p->count = (int)count;
        break;
    }
    case ALLTOALLV:
    case SENDRECV:
        if (PyTuple_GET_SIZE(prog) != 5)
            return refuse_program("of an exchange is (code, comm, datatype, table, tag)");
        p->mpi_tag = (int)PyLong_AsLong(PyTuple_GET_ITEM(prog, 4));
        if (PyErr_Occurred())
            return -1;
        if (code == ALLTOALLV)
            p->table = table_of(prog, 3, 4 * sizeof(int), &p->rows);      /* rows: ranks */
        else {
            p->table = table_of(prog, 3, sizeof(int64_t), &p->rows);
            p->rows = (p->rows >= 3 && (p->rows - 3) % 6 == 0) ? (p->rows - 3) / 6 : -1;
        }
        if (p->table == NULL || p->rows < 0 || (code == ALLTOALLV && n != 2))
            return refuse_program("table does not fit its code");
        break;
    default:
        return refuse_program("code is not ALLTOALLV, SENDRECV, ALLREDUCE, POINT_TO_POINT, "
                              "BROADCAST, ALLGATHER, REDUCE_SCATTER or REDUCE");
    }
    p->code = (int)code;
    return 0;
}

static PyObject *plan_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *names[] = {"refs", "ptrs", "numels", "group", "comm", "mpi", "op", "shape",
                            "dtype", "run", "prog", "peer", "tag", "uid", NULL};
    PyObject *o[14] = {NULL};
    o[11] = o[12] = o[13] = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!O!O!OOOOOOOO|OOO:Plan", names, &PyTuple_Type,
                                     &o[0], &PyTuple_Type, &o[1], &PyTuple_Type, &o[2], &o[3],
                                     &o[4], &o[5], &o[6], &o[7], &o[8], &o[9], &o[10], &o[11],
                                     &o[12], &o[13]))
        return NULL;
    Plan *p = (Plan *)type->tp_alloc(type, 0);
    if (p == NULL)
        return NULL;
    PyObject **field[] = {&p->refs, &p->ptrs, &p->numels, &p->group, &p->comm, &p->mpi, &p->op,
                          &p->shape, &p->dtype, &p->run, &p->prog, &p->peer, &p->tag, &p->uid};
    for (int k = 0; k < 14; k++)
        *field[k] = Py_NewRef(o[k]);
    if (unpack_program(p) < 0) {
        Py_DECREF(p);
        return NULL;
    }
    return (PyObject *)p;
}

static PyMemberDef plan_members[] = {
    {"refs", T_OBJECT, offsetof(Plan, refs), READONLY, "weak references to the call's tensors"},
    {"ptrs", T_OBJECT, offsetof(Plan, ptrs), READONLY, "their data_ptr() as planned"},
    {"numels", T_OBJECT, offsetof(Plan, numels), READONLY, "their numel() as planned"},
    {"group", T_OBJECT, offsetof(Plan, group), READONLY, "the group as passed"},
    {"comm", T_OBJECT, offsetof(Plan, comm), READONLY, "its Communicator"},
    {"mpi", T_OBJECT, offsetof(Plan, mpi), READONLY, "that one's mpi4py communicator"},
    {"op", T_OBJECT, offsetof(Plan, op), READONLY, "the recorder's op name"},
    {"shape", T_OBJECT, offsetof(Plan, shape), READONLY, "the recorder's shape"},
    {"dtype", T_OBJECT, offsetof(Plan, dtype), READONLY, "the tensors' dtype"},
    {"peer", T_OBJECT, offsetof(Plan, peer), READONLY, "send/recv: the group rank"},
    {"tag", T_OBJECT, offsetof(Plan, tag), READONLY, "send/recv: the tag"},
    {"uid", T_OBJECT, offsetof(Plan, uid), READONLY, "send/recv: the Communicator's uid"},
    {"run", T_OBJECT, offsetof(Plan, run), READONLY, "the MPI work, for the Python hit"},
    {"prog", T_OBJECT, offsetof(Plan, prog), READONLY, "the program, as given"},
    {NULL}};

static PyTypeObject PlanType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hpcddp.collectives._fastpath.Plan",
    .tp_doc = "Plan(refs, ptrs, numels, group, comm, mpi, op, shape, dtype, run, prog, "
              "peer=None, tag=None, uid=None): a planned call (hpcddp.collectives._plans).",
    .tp_basicsize = sizeof(Plan),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = plan_new,
    .tp_dealloc = (destructor)plan_dealloc,
    .tp_traverse = (traverseproc)plan_traverse,
    .tp_clear = (inquiry)plan_clear,
    .tp_members = plan_members,
};

static int same_int(PyObject *value, PyObject *planned) {
    /* 1 if VALUE (a new reference, consumed) equals the plan's int, 0 if not, -1 on error */
    if (value == NULL)
        return -1;
    int eq = PyObject_RichCompareBool(value, planned, Py_EQ);
    Py_DECREF(value);
    return eq;
}

/* 1 if T is the tensor REF refers to, with memory PTR, NUMEL elements and one block of
   memory (an in-place as_strided_ keeps the first two); 0 if not; -1 on error */
static int tensor_holds(PyObject *t, PyObject *ref, PyObject *ptr, PyObject *numel) {
    if (PyWeakref_GetObject(ref) != t)
        return 0;
    int eq = same_int(PyObject_CallMethodNoArgs(t, s_data_ptr), ptr);
    if (eq == 1)
        eq = same_int(PyObject_CallMethodNoArgs(t, s_numel), numel);
    if (eq == 1) {
        PyObject *c = PyObject_CallMethodNoArgs(t, s_is_contiguous);
        if (c == NULL)
            return -1;
        eq = PyObject_IsTrue(c);
        Py_DECREF(c);
    }
    return eq;
}

/* 1 if OBJ.NAME is PLANNED (identity), 0 if not, -1 on error */
static int same_attr(PyObject *obj, PyObject *name, PyObject *planned) {
    PyObject *now = PyObject_GetAttr(obj, name);
    if (now == NULL)
        return -1;
    Py_DECREF(now);                       /* only its identity is compared */
    return now == planned;
}

/* 1 if COMM (a plan's Communicator) still has the mpi4py communicator MPI it was planned on
   (destroyed: COMM_NULL; replaced), 0 if not, -1 on error */
static int comm_alive(PyObject *comm, PyObject *mpi) {
    return same_attr(comm, s_mpi, mpi);
}

static void raise_mpi(int rc) {           /* mpi4py's MPI.Exception(rc) */
    PyObject *code = PyLong_FromLong(rc);
    if (code != NULL) {
        PyErr_SetObject(mpi_exception, code);
        Py_DECREF(code);
    }
}

/* a recorder entry [SEQ, op, comm, shape, dtype, peer, t_start, 0.0] (the five after SEQ
   given in ITEMS, borrowed; SEQ stolen, also on failure) put in the ring's next slot: a new
   reference, or NULL with an exception set */
static PyObject *ring_entry(PyObject *seq, PyObject *const items[5]) {
    PyObject *slot = PyIter_Next(slots);
    Py_ssize_t i = slot == NULL ? -1 : PyLong_AsSsize_t(slot);
    Py_XDECREF(slot);
    PyObject *entry = i < 0 ? NULL : PyList_New(8);
    PyObject *t_end = entry == NULL ? NULL : PyFloat_FromDouble(0.0);
    if (t_end == NULL) {
        Py_DECREF(seq);
        Py_XDECREF(entry);
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "the recorder's slot cycle ended");
        return NULL;
    }
    PyList_SET_ITEM(entry, 0, seq);       /* steals */
    for (int k = 0; k < 5; k++)
        PyList_SET_ITEM(entry, k + 1, Py_NewRef(items[k]));
    PyList_SET_ITEM(entry, 6, Py_NewRef(PyList_GET_ITEM(tick, 0)));
    PyList_SET_ITEM(entry, 7, t_end);
    Py_INCREF(entry);                     /* one for the ring, one for the caller */
    if (PyList_SetItem(ring, i, entry) < 0) {
        Py_DECREF(entry);
        return NULL;
    }
    return entry;
}

/* the recorder's start(): [seq, OP, comm, shape, dtype, PEER, t_start, 0.0] into the ring,
   comm.seq + 1 (hpcddp.diagnostics.recorder.FlightRecorder._make_start) */
static PyObject *record_start_peer(PyObject *comm, PyObject *op, PyObject *shape,
                                   PyObject *dtype, PyObject *peer) {
    PyObject *seq = PyObject_GetAttr(comm, s_seq);
    if (seq == NULL)
        return NULL;
    PyObject *one = PyLong_FromLong(1);
    PyObject *next_seq = one ? PyNumber_Add(seq, one) : NULL;
    Py_DECREF(seq);
    Py_XDECREF(one);
    if (next_seq == NULL || PyObject_SetAttr(comm, s_seq, next_seq) < 0) {
        Py_XDECREF(next_seq);
        return NULL;
    }
    PyObject *items[] = {op, comm, shape, dtype, peer};
    return ring_entry(next_seq, items);
}

static PyObject *record_start(PyObject *comm, PyObject *op, PyObject *shape, PyObject *dtype) {
    return record_start_peer(comm, op, shape, dtype, Py_None);
}

/* 1 if T's dtype is DTYPE (torch dtypes are singletons: identity), 0 if not, -1 on error.
   `t.data = t.view(torch.int32)` keeps memory and size: the plan's MPI datatype and op are
   the planned dtype's. */
static int same_dtype(PyObject *t, PyObject *dtype) {
    return same_attr(t, s_dtype, dtype);
}

/* 1 if P was planned for GROUP (the group as planned or its Communicator) and that
   communicator is alive; 0 if not; -1 on error */
static int group_holds(Plan *p, PyObject *group) {
    if (p->group != group && p->comm != group)
        return 0;
    return comm_alive(p->comm, p->mpi);
}

/* 1 if TENSOR is still P's tensor I (object, memory, size, one block of memory), 0 if not,
   -1 on error */
static int tensor_i_holds(Plan *p, Py_ssize_t i, PyObject *tensor) {
    return tensor_holds(tensor, PyTuple_GET_ITEM(p->refs, i), PyTuple_GET_ITEM(p->ptrs, i),
                        PyTuple_GET_ITEM(p->numels, i));
}

/* group_holds, then P's one tensor still TENSOR with its dtype */
static int plan_holds(Plan *p, PyObject *tensor, PyObject *group) {
    int eq = group_holds(p, group);
    if (eq == 1)
        eq = tensor_i_holds(p, 0, tensor);
    if (eq == 1)
        eq = same_dtype(tensor, p->dtype);
    return eq;
}

static PyObject *run_plan(PyObject *plan, PyObject *tensor, PyObject *group);
static PyObject *record_end(PyObject *entry, int rc);

/* TABLE's plan for id(OBJ), a new reference: held while its hit runs (data_ptr() and the
   allocations may run a finalizer, or let another thread in, that replaces the plan or clears
   the table). NULL: none (no exception set) or an error (exception set). */
static PyObject *find_plan(PyObject *table, PyObject *obj) {
    PyObject *key = PyLong_FromVoidPtr(obj);
    if (key == NULL)
        return NULL;
    PyObject *plan = PyDict_GetItemWithError(table, key);   /* borrowed */
    Py_DECREF(key);
    return Py_XNewRef(plan);
}

static PyObject *all_reduce_sum(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "all_reduce_sum(tensor, group): expected 2 arguments, "
                     "got %zd", nargs);
        return NULL;
    }
    PyObject *plan = find_plan(plans, args[0]);
    if (plan == NULL)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_False);
    PyObject *done = run_plan(plan, args[0], args[1]);
    Py_DECREF(plan);
    return done;
}

static PyObject *run_plan(PyObject *plan, PyObject *tensor, PyObject *group) {
    Plan *p = (Plan *)plan;
    if (!Py_IS_TYPE(plan, &PlanType) || p->code != ALLREDUCE)
        Py_RETURN_FALSE;
    int eq = plan_holds(p, tensor, group);
    if (eq < 0)
        return NULL;
    if (eq == 0)
        Py_RETURN_FALSE;
    /* the plan holds: this object, this memory, this many elements, this live communicator */
    PyObject *entry = record_start(p->comm, s_op, p->shape, p->dtype);
    if (entry == NULL)
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = MPI_Allreduce(MPI_IN_PLACE, p->buf, p->count, p->htype, p->hop, p->hcomm);
    Py_END_ALLOW_THREADS
    return record_end(entry, rc);
}

/* the recorder's end() after the MPI call: on an error the entry stays in flight, as in
   Python, and mpi4py's exception is raised. Consumes ENTRY. */
static void entry_done(PyObject *entry);

static PyObject *record_end(PyObject *entry, int rc) {
    if (rc != MPI_SUCCESS) {
        Py_DECREF(entry);
        raise_mpi(rc);
        return NULL;
    }
    entry_done(entry);
    Py_DECREF(entry);
    Py_RETURN_TRUE;
}

/* The rooted hits: TABLE's plan of CODE for TENSOR (ARGS[0]) with root ARGS[1] on group
   ARGS[2], recorded as NAME with the root as its peer, then its MPI call with the GIL
   released. FN names the hit in the argument-count error. */
static PyObject *rooted_hit(PyObject *table, int code, PyObject *name, const char *fn,
                            PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "%s(tensor, root, group): expected 3 arguments, got %zd",
                     fn, nargs);
        return NULL;
    }
    if (!PyLong_CheckExact(args[1]))     /* the full path validates anything else */
        Py_RETURN_FALSE;
    PyObject *plan = find_plan(table, args[0]);
    if (plan == NULL)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_False);
    Plan *p = (Plan *)plan;
    PyObject *done = NULL;
    int eq = Py_IS_TYPE(plan, &PlanType) && p->code == code;
    if (eq) {
        long root = PyLong_AsLong(args[1]);
        eq = root == -1 && PyErr_Occurred() ? -1 : root == p->mpi_peer;
    }
    if (eq == 1)
        eq = plan_holds(p, args[0], args[2]);
    if (eq == 1) {
        PyObject *entry = record_start_peer(p->comm, name, p->shape, p->dtype, p->peer);
        if (entry != NULL) {
            int rc;
            Py_BEGIN_ALLOW_THREADS
            if (code == BROADCAST)
                rc = MPI_Bcast(p->buf, p->count, p->htype, p->mpi_peer, p->hcomm);
            else      /* REDUCE: the root receives in place, the others send only */
                rc = MPI_Reduce(p->in, p->in == MPI_IN_PLACE ? p->buf : NULL, p->count,
                                p->htype, p->hop, p->mpi_peer, p->hcomm);
            Py_END_ALLOW_THREADS
            done = record_end(entry, rc);
        }
    } else if (eq == 0)
        done = Py_NewRef(Py_False);
    Py_DECREF(plan);
    return done;
}

static PyObject *broadcast(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return rooted_hit(bplans, BROADCAST, s_broadcast, "broadcast", args, nargs);
}

static PyObject *reduce_sum(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return rooted_hit(rplans, REDUCE, s_reduce, "reduce_sum", args, nargs);
}

static PyObject *run_xplan(PyObject *plan, PyObject *tensors, PyObject *group);

static PyObject *exchange(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyLong_Check(args[0]) || !PyTuple_Check(args[1])
            || PyTuple_GET_SIZE(args[1]) < 1) {
        PyErr_SetString(PyExc_TypeError, "exchange(kind, tensors, group): expected an int kind, "
                        "a non-empty tuple of tensors and a group");
        return NULL;
    }
    Py_ssize_t kind = PyLong_AsSsize_t(args[0]);
    if (kind == -1 && PyErr_Occurred())
        return NULL;
    if (kind < 0 || kind >= PyTuple_GET_SIZE(xplans)) {
        PyErr_Format(PyExc_ValueError, "exchange: kind %zd is not a plan kind", kind);
        return NULL;
    }
    /* keyed by the call's first tensor */
    PyObject *plan = find_plan(PyTuple_GET_ITEM(xplans, kind), PyTuple_GET_ITEM(args[1], 0));
    if (plan == NULL)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_False);
    PyObject *done = run_xplan(plan, args[1], args[2]);
    Py_DECREF(plan);
    return done;
}

static PyObject *run_xplan(PyObject *plan, PyObject *tensors, PyObject *group) {
    Plan *p = (Plan *)plan;
    Py_ssize_t n = PyTuple_GET_SIZE(tensors);
    if (!Py_IS_TYPE(plan, &PlanType)
            || (p->code != ALLTOALLV && p->code != SENDRECV && p->code != ALLGATHER
                && p->code != REDUCE_SCATTER)
            || PyTuple_GET_SIZE(p->refs) != n)
        Py_RETURN_FALSE;
    int eq = group_holds(p, group);
    for (Py_ssize_t i = 0; eq == 1 && i < n; i++) {
        eq = tensor_i_holds(p, i, PyTuple_GET_ITEM(tensors, i));
        if (eq == 1 && p->code == REDUCE_SCATTER)     /* a reduction adds in its dtype */
            eq = same_dtype(PyTuple_GET_ITEM(tensors, i), p->dtype);
    }
    if (eq < 0)
        return NULL;
    if (eq == 0)
        Py_RETURN_FALSE;
    /* the plan holds: these objects, this memory, these sizes, this live communicator */
    /* the root of a gather or scatter as its peer (None for the others) */
    PyObject *entry = record_start_peer(p->comm, p->op, p->shape, p->dtype, p->peer);
    if (entry == NULL)
        return NULL;
    int rc = MPI_SUCCESS;
    Py_ssize_t rows = p->rows;
    Py_BEGIN_ALLOW_THREADS
    if (p->code == ALLTOALLV) {
        /* nonblocking, then wait: a peer's call may be async_op=True (Ialltoallv), and MPI
           never matches a blocking collective with a nonblocking one */
        const int *c = (const int *)p->table;
        MPI_Request req;
        rc = MPI_Ialltoallv(p->in, c, c + rows, p->htype, p->buf, c + 2 * rows, c + 3 * rows,
                            p->htype, p->hcomm, &req);
        if (rc == MPI_SUCCESS)
            rc = MPI_Wait(&req, MPI_STATUS_IGNORE);
    } else if (p->code == REDUCE_SCATTER) {
        /* blocking, as the Python path's (reduce_scatter_tensor runs it blocking whatever
           async_op); a list's blocks first into the plan's one buffer, as the path's cat */
        const int64_t *t = (const int64_t *)p->table;
        for (Py_ssize_t k = 0; k < rows; k++)
            memcpy((void *)(intptr_t)t[3 * k], (const void *)(intptr_t)t[3 * k + 1],
                   (size_t)t[3 * k + 2]);
        rc = MPI_Reduce_scatter_block(p->in, p->buf, p->count, p->htype, p->hop, p->hcomm);
    } else if (p->code == ALLGATHER) {
        /* blocking, as the Python path's (all_gather_into_tensor runs it blocking whatever
           async_op) */
        rc = MPI_Allgather(p->in, p->count, p->htype, p->buf, p->count, p->htype, p->hcomm);
    } else {
        const int64_t *t = (const int64_t *)p->table;
        if (t[2] > 0)                     /* this rank's own block (memmove: may overlap) */
            memmove((void *)(intptr_t)t[0], (const void *)(intptr_t)t[1], (size_t)t[2]);
        for (Py_ssize_t k = 0; rc == MPI_SUCCESS && k < rows; k++) {
            const int64_t *s = t + 3 + 6 * k;   /* send ptr, count, dst, recv ptr, count, src */
            rc = MPI_Sendrecv((void *)(intptr_t)s[0], (int)s[1], p->htype, (int)s[2],
                              p->mpi_tag, (void *)(intptr_t)s[3], (int)s[4], p->htype,
                              (int)s[5], p->mpi_tag, p->hcomm, MPI_STATUS_IGNORE);
        }
    }
    Py_END_ALLOW_THREADS
    return record_end(entry, rc);
}

/* -- point-to-point ---------------------------------------------------------------------------
 * P2PWork: the Work of a non-blocking send or recv started here. Its methods are those of
 * torch's Work (hpcddp.collectives.work.Work); it is not a torch.distributed.Work instance
 * (torch's C++ side takes only its own type: the backend wraps it, work.TorchP2PWork).
 * One MPI request; LOCK serialises wait()/is_completed() between threads (MPI must not see two
 * waits on one request); the GIL is released while MPI waits. */
typedef struct {
    PyObject_HEAD
    MPI_Request req;
    MPI_Status status;
    int is_recv, done;
    MPI_Datatype type;     /* a recv's datatype, count and tag: its count check */
    int count, tag;
    PyObject *result;      /* [tensor]: keeps the buffer alive while MPI may touch it */
    PyObject *entry;       /* the flight-recorder entry */
    PyObject *future;      /* get_future()'s torch Future (work.future_of sets it) */
    PyObject *exc;         /* a recv's count error (work.count_error), once complete */
    PyThread_type_lock lock;
} P2PWork;

static PyTypeObject P2PWorkType;

/* the recorder's end(): entry[7] = TICK[0] */
static void entry_done(PyObject *entry) {
    PyObject *t_end = PyList_GET_ITEM(tick, 0);
    Py_INCREF(t_end);
    PyList_SetItem(entry, 7, t_end);
}

/* 1 if RC, an MPI call's error, says a receive's message was longer than its buffer (the
   receive completed all the same; its count check names the sizes) */
static int is_truncation(int rc) {
    int cls = rc;
    MPI_Error_class(rc, &cls);
    return cls == MPI_ERR_TRUNCATE;
}

/* 1 if the receive that filled ST got COUNT elements of TYPE (MPI_Get_count; a message of
   another size, or not a whole number of elements, is 0) */
static int count_holds(MPI_Status *st, MPI_Datatype type, int count) {
    int got = MPI_UNDEFINED;
    return MPI_Get_count(st, type, &got) == MPI_SUCCESS && got == count;
}

/* the exception being raised, taken (a new reference) */
static PyObject *take_exception(void) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL)
        PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
}

/* the error of FN's receive into TENSOR that filled ST with tag TAG, whose count does not
   hold (TRUNCATED: MPI said the message was longer): work.count_error's, a new reference
   (or the exception that building it raised) */
static PyObject *count_error_of(const char *fn, PyObject *tensor, MPI_Status *st, int tag,
                                int truncated) {
    MPI_Count nbytes = -1;
    if (MPI_Get_elements_x(st, MPI_BYTE, &nbytes) != MPI_SUCCESS || nbytes == MPI_UNDEFINED)
        nbytes = -1;
    PyObject *exc = PyObject_CallFunction(count_error, "sOiiLO", fn, tensor, st->MPI_SOURCE, tag,
                                          (long long)nbytes, truncated ? Py_True : Py_False);
    return exc != NULL ? exc : take_exception();
}

/* after MPI_Wait/MPI_Test said the request is complete (RC: what it returned); caller holds
   the GIL and LOCK. A recv's message longer than the tensor completes it too; then, or when
   its count does not hold, w->exc is its error. Returns RC when it is another error (W stays
   pending, as a Work whose wait raised), else MPI_SUCCESS. */
static int work_completed(P2PWork *w, int rc) {
    int truncated = rc != MPI_SUCCESS;
    if (truncated && !(w->is_recv && is_truncation(rc)))
        return rc;
    w->done = 1;
    entry_done(w->entry);
    if (w->is_recv && (truncated || !count_holds(&w->status, w->type, w->count)))
        w->exc = count_error_of("irecv", PyList_GET_ITEM(w->result, 0), &w->status, w->tag,
                                truncated);
    return MPI_SUCCESS;
}

/* W's count error raised: -1 (as a Work's wait raises its exception each time) */
static int raise_work_exc(P2PWork *w) {
    PyErr_SetObject((PyObject *)Py_TYPE(w->exc), w->exc);
    return -1;
}

/* wait for W's request: 0, or -1 with an exception set: mpi4py's (the entry stays in flight,
   as in Work.wait) or a recv's count error */
static int work_finish(P2PWork *w) {
    if (!w->done) {
        int rc = MPI_SUCCESS;
        Py_BEGIN_ALLOW_THREADS
        PyThread_acquire_lock(w->lock, WAIT_LOCK);
        if (!w->done)
            rc = MPI_Wait(&w->req, &w->status);
        Py_END_ALLOW_THREADS
        if (!w->done)
            rc = work_completed(w, rc);
        PyThread_release_lock(w->lock);
        if (rc != MPI_SUCCESS) {
            raise_mpi(rc);
            return -1;
        }
    }
    return w->exc != NULL ? raise_work_exc(w) : 0;
}

static PyObject *work_wait(P2PWork *w, PyObject *args, PyObject *kw) {
    static char *names[] = {"timeout", NULL};
    PyObject *timeout = Py_None;          /* accepted as torch's; MPI_Wait has none */
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|O:wait", names, &timeout))
        return NULL;
    if (work_finish(w) < 0)
        return NULL;
    Py_RETURN_TRUE;
}

static PyObject *work_is_completed(P2PWork *w, PyObject *unused) {
    /* another thread inside wait(): not known to be complete yet */
    if (!w->done && PyThread_acquire_lock(w->lock, NOWAIT_LOCK)) {
        int flag = 0, rc = w->done ? MPI_SUCCESS : MPI_Test(&w->req, &flag, &w->status);
        if ((rc != MPI_SUCCESS || flag) && !w->done)
            rc = work_completed(w, rc);
        PyThread_release_lock(w->lock);
        if (rc != MPI_SUCCESS) {
            raise_mpi(rc);
            return NULL;
        }
    }
    return PyBool_FromLong(w->done);
}

static PyObject *work_is_success(P2PWork *w, PyObject *unused) {
    PyObject *done = work_is_completed(w, NULL);
    if (done == NULL || w->exc == NULL)
        return done;
    Py_DECREF(done);
    Py_RETURN_FALSE;
}

static PyObject *work_exception(P2PWork *w, PyObject *unused) {
    return Py_NewRef(w->exc != NULL ? w->exc : Py_None);   /* a recv's count error */
}

static PyObject *work_result(P2PWork *w, PyObject *unused) {
    return Py_NewRef(w->result);
}

static PyObject *work_source_rank(P2PWork *w, PyObject *unused) {
    if (!w->is_recv) {
        PyErr_SetString(PyExc_RuntimeError, "source_rank: only a recv has a source rank");
        return NULL;
    }
    if (work_finish(w) < 0)
        return NULL;
    return PyLong_FromLong(w->status.MPI_SOURCE);
}

static PyObject *work_synchronize(P2PWork *w, PyObject *unused) {
    if (work_finish(w) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *work_get_future(P2PWork *w, PyObject *unused) {
    return PyObject_CallOneArg(future_of, (PyObject *)w);
}

static PyObject *work_repr(P2PWork *w) {
    return PyUnicode_FromFormat("<hpcddp P2PWork %s, %s>", w->is_recv ? "recv" : "send",
                                w->done ? "completed" : "pending");
}

static void work_dealloc(P2PWork *w) {
    int finalized = 1;
    if (!w->done)
        MPI_Finalized(&finalized);
    if (!w->done && !finalized && w->req != MPI_REQUEST_NULL) {
        /* dropped before completing: MPI finishes the transfer on its own (MPI_Request_free),
           into or out of the tensor, which therefore must never be freed: leak it */
        MPI_Request_free(&w->req);
        w->result = NULL;
    }
    Py_XDECREF(w->result);
    Py_XDECREF(w->entry);
    Py_XDECREF(w->future);
    Py_XDECREF(w->exc);
    if (w->lock)
        PyThread_free_lock(w->lock);
    Py_TYPE(w)->tp_free((PyObject *)w);
}

static PyObject *no_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    PyErr_SetString(PyExc_TypeError, "P2PWork: returned by hpcddp.isend and hpcddp.irecv, not "
                    "made directly");
    return NULL;
}

static PyMethodDef work_methods[] = {
    {"wait", (PyCFunction)(void (*)(void))work_wait, METH_VARARGS | METH_KEYWORDS,
     "wait(timeout=None) -> True: wait until the transfer completes (the tensor may then be "
     "reused or read). The timeout is accepted and ignored, as MPI_Wait has none."},
    {"is_completed", (PyCFunction)work_is_completed, METH_NOARGS,
     "Whether the transfer has completed (MPI_Test: also makes progress on it)."},
    {"is_success", (PyCFunction)work_is_success, METH_NOARGS,
     "Completed, and not a recv whose message had another size than the tensor."},
    {"exception", (PyCFunction)work_exception, METH_NOARGS,
     "A recv's count error once complete (hpcddp.collectives.work.count_error), else None."},
    {"result", (PyCFunction)work_result, METH_NOARGS, "[tensor]: the future's value."},
    {"source_rank", (PyCFunction)work_source_rank, METH_NOARGS,
     "The group rank the message came from (a recv; waits for it)."},
    {"_source_rank", (PyCFunction)work_source_rank, METH_NOARGS, "source_rank()."},
    {"synchronize", (PyCFunction)work_synchronize, METH_NOARGS, "wait()."},
    {"get_future", (PyCFunction)work_get_future, METH_NOARGS,
     "A torch.futures.Future completed with [tensor] (hpcddp.collectives.work.future_of)."},
    {NULL, NULL, 0, NULL}};

static PyMemberDef work_members[] = {
    {"_future", T_OBJECT, offsetof(P2PWork, future), 0, "get_future()'s Future, once made"},
    {NULL, 0, 0, 0, NULL}};

static PyTypeObject P2PWorkType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hpcddp.collectives._fastpath.P2PWork",
    .tp_doc = "The Work of hpcddp.isend/irecv: torch Work's methods over one MPI request.",
    .tp_basicsize = sizeof(P2PWork),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = no_new,
    .tp_dealloc = (destructor)work_dealloc,
    .tp_repr = (reprfunc)work_repr,
    .tp_methods = work_methods,
    .tp_members = work_members,
};

/* the recorder's start_p2p(): [seq, OP, comm, shape, dtype, peer, t_start, 0.0] into the ring,
   with the communicator's own p2p sequence number (FlightRecorder.start_p2p) */
static PyObject *record_start_p2p(Plan *p) {
    PyObject *uid = p->uid;
    PyObject *last = PyDict_GetItemWithError(p2p_seq, uid);   /* borrowed */
    if (last == NULL && PyErr_Occurred())
        return NULL;
    long long seq = last == NULL ? 1 : PyLong_AsLongLong(last) + 1;
    if (seq == 0 && PyErr_Occurred())
        return NULL;
    PyObject *num = PyLong_FromLongLong(seq);
    if (num == NULL || PyDict_SetItem(p2p_seq, uid, num) < 0) {
        Py_XDECREF(num);
        return NULL;
    }
    PyObject *items[] = {p->op, p->comm, p->shape, p->dtype, p->peer};
    return ring_entry(num, items);
}

/* 1 if A and B are the same int (or both None) of the same type (a bool is not a rank) */
static int same_value(PyObject *a, PyObject *b) {
    if (a == b)
        return 1;
    if (Py_TYPE(a) != Py_TYPE(b) || !PyLong_CheckExact(a))
        return 0;
    return PyObject_RichCompareBool(a, b, Py_EQ);
}

static PyObject *run_pplan(PyObject *plan, long op, PyObject *const *args);

static PyObject *p2p(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    /* p2p(op, tensor, peer, tag, group) */
    if (nargs != 5 || !PyLong_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "p2p(op, tensor, peer, tag, group): expected an int op "
                        "and four more arguments");
        return NULL;
    }
    long op = PyLong_AsLong(args[0]);
    if (op < ISEND || op > RECV) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "p2p: op %ld is not ISEND, IRECV, SEND or RECV", op);
        return NULL;
    }
    /* sends and recvs plan apart: one tensor may be sent and received into */
    PyObject *plan = find_plan(PyTuple_GET_ITEM(pplans, op == IRECV || op == RECV), args[1]);
    if (plan == NULL)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_False);
    PyObject *done = run_pplan(plan, op, args);
    Py_DECREF(plan);
    return done;
}

static PyObject *run_pplan(PyObject *plan, long op, PyObject *const *args) {
    PyObject *tensor = args[1], *peer = args[2], *tag = args[3], *group = args[4];
    Plan *p = (Plan *)plan;
    if (!Py_IS_TYPE(plan, &PlanType) || p->code != POINT_TO_POINT)
        Py_RETURN_FALSE;
    int eq = same_value(peer, p->peer);
    if (eq == 1)
        eq = same_value(tag, p->tag);
    if (eq == 1)
        eq = plan_holds(p, tensor, group);
    if (eq < 0)
        return NULL;
    if (eq == 0)
        Py_RETURN_FALSE;
    /* the plan holds: this object, memory, size, dtype, peer, tag and live communicator */
    void *buf = p->buf;
    int count = p->count, mpi_peer = p->mpi_peer, mpi_tag = p->mpi_tag;
    MPI_Comm comm = p->hcomm;
    MPI_Datatype type = p->htype;
    P2PWork *w = NULL;
    if (op == ISEND || op == IRECV) {     /* made first: nothing to undo after MPI started */
        w = PyObject_New(P2PWork, &P2PWorkType);
        if (w == NULL)
            return NULL;
        w->req = MPI_REQUEST_NULL;
        w->is_recv = op == IRECV;
        w->done = 1;                      /* until started: dealloc frees nothing */
        w->type = type;
        w->count = count;
        w->tag = mpi_tag;
        w->entry = w->future = w->exc = NULL;
        w->result = PyList_New(1);
        w->lock = PyThread_allocate_lock();
        if (w->result == NULL || w->lock == NULL) {
            Py_DECREF(w);
            return PyErr_Occurred() ? NULL : PyErr_NoMemory();
        }
        PyList_SET_ITEM(w->result, 0, Py_NewRef(tensor));
    }
    PyObject *entry = record_start_p2p(p);
    if (entry == NULL) {
        Py_XDECREF(w);
        return NULL;
    }
    int rc;
    MPI_Status status;
    Py_BEGIN_ALLOW_THREADS
    switch (op) {
    case ISEND: rc = MPI_Isend(buf, count, type, mpi_peer, mpi_tag, comm, &w->req); break;
    case IRECV: rc = MPI_Irecv(buf, count, type, mpi_peer, mpi_tag, comm, &w->req); break;
    case SEND: rc = MPI_Send(buf, count, type, mpi_peer, mpi_tag, comm); break;
    default: rc = MPI_Recv(buf, count, type, mpi_peer, mpi_tag, comm, &status); break;
    }
    Py_END_ALLOW_THREADS
    int truncated = op == RECV && rc != MPI_SUCCESS && is_truncation(rc);   /* completed */
    if (rc != MPI_SUCCESS && !truncated) {   /* the entry stays in flight, as in Python */
        Py_DECREF(entry);
        Py_XDECREF(w);
        raise_mpi(rc);
        return NULL;
    }
    if (w != NULL) {
        w->entry = entry;                 /* steals */
        w->done = 0;
        return (PyObject *)w;
    }
    entry_done(entry);
    Py_DECREF(entry);
    if (op == SEND)
        Py_RETURN_TRUE;
    if (truncated || !count_holds(&status, type, count)) {
        PyObject *exc = count_error_of("recv", tensor, &status, mpi_tag, truncated);
        if (exc != NULL) {
            PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
            Py_DECREF(exc);
        }
        return NULL;
    }
    return PyLong_FromLong(status.MPI_SOURCE);
}

static PyObject *configure(PyObject *self, PyObject *args) {
    PyObject *p, *x, *r, *s, *t, *e, *q, *seq, *fut, *cerr, *b, *rd;
    if (!PyArg_ParseTuple(args, "O!O!O!OO!OO!O!OOO!O!:configure", &PyDict_Type, &p,
                          &PyTuple_Type, &x, &PyList_Type, &r, &s, &PyList_Type, &t, &e,
                          &PyTuple_Type, &q, &PyDict_Type, &seq, &fut, &cerr, &PyDict_Type, &b,
                          &PyDict_Type, &rd))
        return NULL;
    if (PyTuple_GET_SIZE(q) != 2 || !PyDict_Check(PyTuple_GET_ITEM(q, 0))
            || !PyDict_Check(PyTuple_GET_ITEM(q, 1)) || !PyCallable_Check(fut)
            || !PyCallable_Check(cerr)) {
        PyErr_SetString(PyExc_TypeError, "configure: pplans must be a tuple of two dicts, and "
                        "future_of and count_error callables");
        return NULL;
    }
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(x); k++)
        if (!PyDict_Check(PyTuple_GET_ITEM(x, k))) {
            PyErr_SetString(PyExc_TypeError, "configure: xplans must be a tuple of dicts");
            return NULL;
        }
    if (!PyIter_Check(s) || PyList_GET_SIZE(t) < 1) {
        PyErr_SetString(PyExc_TypeError, "configure: slots must be an iterator and tick a "
                        "non-empty list");
        return NULL;
    }
    Py_XSETREF(plans, Py_NewRef(p));
    Py_XSETREF(xplans, Py_NewRef(x));
    Py_XSETREF(ring, Py_NewRef(r));
    Py_XSETREF(slots, Py_NewRef(s));
    Py_XSETREF(tick, Py_NewRef(t));
    Py_XSETREF(mpi_exception, Py_NewRef(e));
    Py_XSETREF(pplans, Py_NewRef(q));
    Py_XSETREF(p2p_seq, Py_NewRef(seq));
    Py_XSETREF(future_of, Py_NewRef(fut));
    Py_XSETREF(count_error, Py_NewRef(cerr));
    Py_XSETREF(bplans, Py_NewRef(b));
    Py_XSETREF(rplans, Py_NewRef(rd));
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"all_reduce_sum", (PyCFunction)(void (*)(void))all_reduce_sum, METH_FASTCALL,
     "all_reduce_sum(tensor, group) -> bool: run the planned SUM all_reduce of TENSOR in "
     "place and return True, or return False (no plan, or it no longer holds)."},
    {"exchange", (PyCFunction)(void (*)(void))exchange, METH_FASTCALL,
     "exchange(kind, tensors, group) -> bool: run the planned blocking exchange of kind KIND "
     "(hpcddp.collectives._plans) on TENSORS and return True, or return False (no plan, or "
     "it no longer holds)."},
    {"broadcast", (PyCFunction)(void (*)(void))broadcast, METH_FASTCALL,
     "broadcast(tensor, root, group) -> bool: run the planned blocking broadcast of TENSOR "
     "from ROOT and return True, or return False (no plan, or it no longer holds)."},
    {"reduce_sum", (PyCFunction)(void (*)(void))reduce_sum, METH_FASTCALL,
     "reduce_sum(tensor, root, group) -> bool: run the planned blocking SUM reduce of TENSOR "
     "onto ROOT and return True, or return False (no plan, or it no longer holds)."},
    {"p2p", (PyCFunction)(void (*)(void))p2p, METH_FASTCALL,
     "p2p(op, tensor, peer, tag, group): run the planned send/recv of TENSOR (op ISEND or "
     "IRECV: return its P2PWork; SEND: True; RECV: the sender's rank), or return False (no "
     "plan, or it no longer holds)."},
    {"configure", configure, METH_VARARGS,
     "configure(plans, xplans, ring, slots, tick, mpi_exception, pplans, p2p_seq, future_of, "
     "count_error, bplans, rplans): what the hits read."},
    LIBRARY_VERSION_METHOD,
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastpath",
                                    "The plan hits in C (hpcddp.collectives._plans).", -1, methods};

PyMODINIT_FUNC PyInit__fastpath(void) {
    s_op = PyUnicode_InternFromString("all_reduce");
    s_broadcast = PyUnicode_InternFromString("broadcast");
    s_reduce = PyUnicode_InternFromString("reduce");
    s_data_ptr = PyUnicode_InternFromString("data_ptr");
    s_numel = PyUnicode_InternFromString("numel");
    s_is_contiguous = PyUnicode_InternFromString("is_contiguous");
    s_dtype = PyUnicode_InternFromString("dtype");
    s_seq = PyUnicode_InternFromString("seq");
    s_mpi = PyUnicode_InternFromString("mpi");
    if (!s_op || !s_broadcast || !s_reduce || !s_data_ptr || !s_numel || !s_is_contiguous || !s_dtype || !s_seq || !s_mpi)
        return NULL;
    if (PyType_Ready(&P2PWorkType) < 0 || PyType_Ready(&PlanType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL || PyModule_AddObjectRef(m, "P2PWork", (PyObject *)&P2PWorkType) < 0
            || PyModule_AddObjectRef(m, "Plan", (PyObject *)&PlanType) < 0) {
        Py_XDECREF(m);
        return NULL;
    }
    return m;
}
