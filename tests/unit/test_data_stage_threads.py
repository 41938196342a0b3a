"""The staging pipeline's threads never leave the main thread waiting forever: a reader that
fails hands its exception over, and a writer that fails fails the shard, not the pipeline."""
from __future__ import annotations

import queue

import pytest

from hpcddp.data import _staging_io as io


class _Slot:
    def __init__(self):
        self.buf = bytearray(64)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_failed_reader_raises_in_the_main_thread():
    class Failing(io.Reader):
        def _open(self, s):
            raise MemoryError("no room for the file object")
    pool = queue.Queue()
    pool.put(_Slot())
    reader = Failing("/nonexistent", [None], [[(0, 0, 0, 8, True)]], pool, 0)
    reader.start()
    with pytest.raises(RuntimeError, match="the thread reading the source failed: MemoryError"):
        reader.next()
    reader.join(timeout=10)
    assert not reader.is_alive()
