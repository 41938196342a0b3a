"""DDP helpers: checkpoints that survive requeues (:mod:`hpcddp.parallel.checkpoint`).

The modules are imported by name (``from hpcddp.parallel.checkpoint import Checkpointer``);
this file makes the folder a package, so that wheels carry it.
"""
