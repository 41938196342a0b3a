/* Which MPI a C module of hpcddp was built and linked with, shared by every module.
 *
 * A module takes mpi4py's handles (MPI._handleof), so it must run on the same MPI library as
 * mpi4py: hpcddp.launch.mpilib.other_mpi() compares this string with mpi4py's before a module
 * is used. Include it once per module; add LIBRARY_VERSION_METHOD to its method table.
 */
#ifndef HPCDDP_MPI_LIBRARY_H
#define HPCDDP_MPI_LIBRARY_H

#include <Python.h>
#include <mpi.h>

static PyObject *library_version(PyObject *self, PyObject *unused) {
    char text[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    MPI_Get_library_version(text, &len);  /* callable before MPI_Init */
    return PyUnicode_DecodeLatin1(text, len, "replace");
}

#define LIBRARY_VERSION_METHOD                                                  \
    {"library_version", library_version, METH_NOARGS,                           \
     "MPI_Get_library_version() of the MPI this module was built and linked with."}

#endif
