"""The end-to-end demo job: scikit-learn's digits as PNG files, packed, staged, trained with DDP
over MPI, evaluated exactly (``hpcddp demo``; docs/quickstart.md).

Modules: :mod:`~hpcddp.demo.digits` (write the data set as image files),
:mod:`~hpcddp.demo.model` (the CNN), :mod:`~hpcddp.demo.train` (the job, every phase timed).
Importing this package imports nothing heavy.
"""
