"""``hpcddp bench``: communication, DDP and staging benchmarks, measured side by side.

Every benchmark follows ../shared/BENCHMARKING.md (docs/benchmarks.md has the short form):
batches of back-to-back ops between untimed barriers, combined across ranks by MAX; every
implementation measured in the same job, in interleaved rounds whose order rotates; per-size
medians and the median of per-round *paired* ratios, because on a shared machine only ratios
taken side by side are comparable between runs.

Modules: :mod:`~hpcddp.bench.protocol` (sizes, batches, rounds, statistics),
:mod:`~hpcddp.bench.machine` (the setup recorded with every result),
:mod:`~hpcddp.bench.comm`, :mod:`~hpcddp.bench.ddp`, :mod:`~hpcddp.bench.stage` (the three
benchmarks, run inside an MPI job), :mod:`~hpcddp.bench.report` (tables, JSON, plots,
``--compare``, targets; no MPI). Importing this package imports nothing heavy.
"""
