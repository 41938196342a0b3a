/* The heartbeat pump in C: a thread of its own, outside Python, that keeps Open MPI's progress
 * engine turning while the rank computes (hpcddp.comm.heartbeat says why).
 *
 * Every `interval` seconds it calls MPI_Iprobe `probes` times on a private communicator that
 * never receives a message: each call runs opal_progress once, and Open MPI runs its timers
 * (ULFM's heartbeat send and check among them) once in 8 of those. It never takes the GIL, so a
 * rank that holds the GIL for seconds (an h5py read, a large unpickle) still sends its
 * heartbeats; the Python pump in hpcddp.comm.heartbeat does not.
 *
 * Built by setup.py with the MPI compiler wrapper beside the C plan hits; optional.
 * hpcddp.comm.heartbeat checks library_version() against mpi4py's before using it
 * (_mpi_library.h).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <mpi.h>
#include "_mpi_library.h"
#include <pthread.h>
#include <stdint.h>
#include <time.h>
#include <errno.h>

static pthread_t pump_thread;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static int running = 0;          /* a pump thread exists (start..stop) */
static int stopping = 0;         /* under lock: stop() asked it to end */
static MPI_Comm pump_comm;
static double pump_interval;
static int pump_probes, pump_tag;
static unsigned long long rounds_done = 0;   /* rounds of probes since start (for tests) */

static void *pump(void *unused) {
    (void)unused;
    pthread_mutex_lock(&lock);
    while (!stopping) {
        pthread_mutex_unlock(&lock);
        for (int i = 0; i < pump_probes; i++) {
            int flag = 0;
            MPI_Iprobe(0, pump_tag, pump_comm, &flag, MPI_STATUS_IGNORE);
        }
        __atomic_add_fetch(&rounds_done, 1, __ATOMIC_RELAXED);
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        long ns = until.tv_nsec + (long)(pump_interval * 1e9);
        until.tv_sec += ns / 1000000000L;
        until.tv_nsec = ns % 1000000000L;
        pthread_mutex_lock(&lock);
        while (!stopping) {   /* sleep the interval; stop() wakes it at once */
            if (pthread_cond_timedwait(&wake, &lock, &until) == ETIMEDOUT)
                break;
        }
    }
    pthread_mutex_unlock(&lock);
    return NULL;
}

static PyObject *start(PyObject *self, PyObject *args) {
    long long handle;
    double interval;
    int probes, tag;
    if (!PyArg_ParseTuple(args, "Ldii", &handle, &interval, &probes, &tag))
        return NULL;
    if (running) {
        PyErr_SetString(PyExc_RuntimeError, "heartbeat pump: already running");
        return NULL;
    }
    if (!(interval > 0) || probes < 1) {
        PyErr_Format(PyExc_ValueError, "heartbeat pump: interval must be > 0 s and probes >= 1, "
                     "got %R and %d", PyTuple_GET_ITEM(args, 1), probes);
        return NULL;
    }
    pump_comm = (MPI_Comm)(intptr_t)handle;   /* mpi4py's MPI._handleof: a pointer in Open MPI */
    pump_interval = interval;
    pump_probes = probes;
    pump_tag = tag;
    stopping = 0;
    rounds_done = 0;
    int rc = pthread_create(&pump_thread, NULL, pump, NULL);
    if (rc != 0) {
        errno = rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    running = 1;
    Py_RETURN_NONE;
}

static PyObject *stop(PyObject *self, PyObject *unused) {
    if (!running)
        Py_RETURN_FALSE;
    pthread_mutex_lock(&lock);
    stopping = 1;
    pthread_cond_signal(&wake);
    pthread_mutex_unlock(&lock);
    Py_BEGIN_ALLOW_THREADS
    pthread_join(pump_thread, NULL);   /* at most one round of probes */
    Py_END_ALLOW_THREADS
    running = 0;
    Py_RETURN_TRUE;
}

static PyObject *is_running(PyObject *self, PyObject *unused) {
    return PyBool_FromLong(running);
}

static PyObject *rounds(PyObject *self, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&rounds_done, __ATOMIC_RELAXED));
}

static PyMethodDef methods[] = {
    {"start", start, METH_VARARGS,
     "start(comm_handle, interval, probes, tag): the pump thread, MPI_Iprobe(0, tag) PROBES "
     "times every INTERVAL s on the communicator of that mpi4py handle."},
    {"stop", stop, METH_NOARGS, "End the pump thread and wait for it; False if none ran."},
    {"is_running", is_running, METH_NOARGS, "Whether the pump thread runs."},
    {"rounds", rounds, METH_NOARGS, "Rounds of probes the pump ran since it started."},
    LIBRARY_VERSION_METHOD,
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_heartbeat",
    "The heartbeat pump's thread, outside Python (hpcddp.comm.heartbeat).", -1, methods,
};

PyMODINIT_FUNC PyInit__heartbeat(void) {
    return PyModule_Create(&module);
}
