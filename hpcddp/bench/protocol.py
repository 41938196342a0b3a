"""The measurement protocol (../shared/BENCHMARKING.md): sizes, batches, rounds, statistics.

A *batch* is: an untimed barrier, then k back-to-back calls timed with ``perf_counter_ns``;
the per-op time is batch / k, and the figure for a batch is the MAX over ranks (an op is done
when its slowest rank is done). k is calibrated once per (implementation, cell) so that a
batch lasts at least ``batch_s`` (2 ms by default) and is agreed across ranks.

A *cell* (one op at one size) runs R rounds; each round measures every implementation once,
in an order rotated by one each round, so a load spike lands on all of them alike. Round 1
is discarded (it also absorbs first-touch and connection costs). A rotation keeps who runs
after whom, so where what one implementation leaves behind helps the next, a lead-in evens
it out: across nodes (``lead_in``) each batch follows an untimed batch of its own, so
every batch meets a link already busy. A shaped link's token bucket otherwise refills while
the implementation before it computes without the network (memcpy), and hands the one after
it a burst above the line rate: raw mpi4py, always after memcpy, measured 0.21 GB/s at 64 KiB
on a 0.125 GB/s link, the rows after it 0.12 (docs/benchmarks.md). Per implementation we report
the median over the kept rounds; between two implementations we report the median of the
per-round *paired* ratios with their quartiles: on a shared machine absolute times move by
2-3x within minutes while paired ratios stay put.

Everything here takes an mpi4py intracommunicator ``ctl`` for the barriers and the MAX: a
private duplicate that no measured implementation uses.
"""
from __future__ import annotations

import math
import re
import time

# BENCHMARKING.md section "Protocol", item 3
DEFAULT_SIZES = (4, 64, 1 << 10, 4 << 10, 32 << 10, 256 << 10, 1 << 20, 4 << 20, 25 << 20,
                 64 << 20)

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20,
          "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_size(text: str) -> int:
    """'4', '64B', '1K', '32KiB', '25M', '64MiB' -> bytes (binary units: K = 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ValueError(f"size {text!r}: expected a number with an optional unit B, K/KiB, "
                         f"M/MiB or G/GiB, e.g. 4, 1K, 25MiB")
    n = int(float(m.group(1)) * _UNITS[unit])
    if n < 1:
        raise ValueError(f"size {text!r}: must be at least 1 byte")
    return n


def parse_sizes(text: str) -> list[int]:
    """A comma-separated list of sizes, or 'A-B' for the default sizes from A to B."""
    text = text.strip()
    if "-" in text and "," not in text:
        lo, hi = (parse_size(p) for p in text.split("-", 1))
        picked = [s for s in DEFAULT_SIZES if lo <= s <= hi]
        if not picked:
            raise ValueError(f"sizes {text!r}: no default size lies in that range")
        return picked
    return sorted({parse_size(p) for p in text.split(",") if p.strip()})


def fmt_size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    if n >= 1 << 10:
        return f"{n / (1 << 10):.1f} KiB"
    return f"{n} B"


# -- statistics ---------------------------------------------------------------------------------

def quantile(xs, q: float) -> float:
    """Linear-interpolated quantile (numpy's default), without numpy."""
    xs = sorted(x for x in xs if x is not None and not math.isnan(x))
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(xs) -> float:
    return quantile(xs, 0.5)


def spread(xs) -> dict:
    """median, quartiles and range of XS: what every reported figure carries."""
    return {"median": median(xs), "q1": quantile(xs, 0.25), "q3": quantile(xs, 0.75),
            "min": quantile(xs, 0.0), "max": quantile(xs, 1.0), "n": len(xs)}


def paired(a, b, how: str = "ratio") -> list[float]:
    """Per-round a/b (how='ratio') or a-b (how='diff') over rounds where both exist."""
    out = []
    for x, y in zip(a, b):
        if x is None or y is None or math.isnan(x) or math.isnan(y):
            continue
        out.append(x / y if how == "ratio" else x - y)
    return out


def cv(xs) -> float:
    """Coefficient of variation (stdev / mean); NaN for fewer than 2 values."""
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if len(xs) < 2:
        return math.nan
    m = sum(xs) / len(xs)
    var = sum((x - m) ** 2 for x in xs) / (len(xs) - 1)
    return math.sqrt(var) / m if m else math.nan


# -- timing -------------------------------------------------------------------------------------

def time_batch(fn, k: int, ctl, lead_in: bool = False) -> float:
    """Seconds per call of FN over K back-to-back calls after an untimed barrier (and, with
    LEAD_IN, K untimed calls of FN) on this rank."""
    ctl.Barrier()
    for _ in range(k if lead_in else 0):
        fn()
    clock = time.perf_counter_ns
    t0 = clock()
    for _ in range(k):
        fn()
    return (clock() - t0) / k / 1e9


def allmax(ctl, value: float) -> float:
    from hpcddp.comm import MPI
    return ctl.allreduce(value, op=MPI.MAX)


def calibrate(fn, ctl, batch_s: float = 2e-3, max_k: int = 100_000, warmup: int = 3) -> int:
    """Calls per batch so that a batch lasts >= BATCH_S on the slowest rank (same k on all).

    k grows 8x until a batch lasts a quarter of BATCH_S; each probe is the faster of two
    batches, so one descheduled call on a loaded machine does not shrink k for good.
    """
    for _ in range(warmup):
        ctl.Barrier()
        fn()
    k = 1
    while True:
        per = allmax(ctl, min(time_batch(fn, k, ctl), time_batch(fn, k, ctl)))
        if per * k >= batch_s / 4 or k >= max_k:
            break
        k = min(max_k, k * 8)
    k = max(1, min(max_k, math.ceil(batch_s / max(per, 1e-9))))
    return int(allmax(ctl, k))


def run_rounds(impls: dict, ctl, rounds: int, batch_s: float = 2e-3,
               max_k: int = 100_000, lead_in: bool = False) -> tuple[dict, dict]:
    """Measure every implementation of one cell in ROUNDS interleaved, rotated rounds.

    impls: name -> zero-argument callable (one op). Returns (times, ks): times[name] is the
    list of per-op seconds, one per round (round 1 included; callers drop it), each the MAX
    over ranks; ks[name] the calls per batch. LEAD_IN: each batch after an untimed one.
    """
    from hpcddp.comm import MPI
    import numpy as np
    names = list(impls)
    ks = {name: calibrate(impls[name], ctl, batch_s, max_k) for name in names}
    local = np.zeros((rounds, len(names)))
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            local[r, names.index(name)] = time_batch(impls[name], ks[name], ctl, lead_in)
    both = np.empty_like(local)
    ctl.Allreduce(local, both, op=MPI.MAX)
    return {name: both[:, i].tolist() for i, name in enumerate(names)}, ks
