"""hpcddp's version: the one place it is written (pyproject.toml reads it; hpcddp.__version__,
`hpcddp --version` and `hpcddp info` print it)."""
__version__ = "0.1.0"
