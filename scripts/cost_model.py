"""On paper: all-reduce, DDP step and staging times for 2 to 1024 nodes (standard library only).

    python scripts/cost_model.py                  # every table (Markdown), as the docs quote them
    python scripts/cost_model.py --section data   # the staging tables only (docs/data.md)
    python scripts/cost_model.py --check          # the model against the virtual cluster's figures
    python scripts/cost_model.py --plot docs/benchmarks/model.png   # needs matplotlib

The all-reduce model is alpha-beta-gamma (Thakur, Rabenseifner and Gropp, "Optimization of
collective communication operations in MPICH", 2005): a message of m bytes between two nodes
costs alpha + m * beta (alpha: latency per message, s; beta = 1 / the link's payload rate,
s/B), and reducing m bytes costs m * gamma (one core adding, s/B). N nodes, S bytes:

    ring               2(N-1) steps of S/N: the reduce-scatter's additions overlap the
                       transfers chunk by chunk (hpcddp's ring: 1 MiB chunks, each added as it
                       arrives), so a step costs alpha + S/N max(beta, gamma) + one chunk's
                       min(beta, gamma)
    binomial tree      reduce then broadcast, ceil(log2 N) steps of S each, adding after
                       each step's transfer
    pipelined tree     a binary tree, reduce then broadcast in chunks (the best power of two),
                       two children per node: (depth + chunks - 1) stages each way, adding a
                       chunk while the next arrives
    halving-doubling   Rabenseifner: reduce-scatter by recursive halving, all-gather by
                       recursive doubling, 2 log2 N steps, adding after each transfer as MPI
                       libraries do; not a power of two: two more steps of S
    hierarchical       G ranks per node: reduce-scatter inside the node (shared memory), an
                       all-reduce of S/G across nodes by each local rank (G streams share the
                       node's link), all-gather inside the node (hpcddp/collectives/_hier.py)

The network is assumed non-blocking (full bisection, no contention between pairs); the ring's
advantage in locality on an oversubscribed fabric is not priced, nor are the G ranks of a node
sharing its memory bandwidth. A DDP step: backward is 2/3
of the compute, its buckets become ready evenly through it, and their all-reduces run one at a
time in order, overlapping the rest of backward (the async engine on real nodes).

Staging (hpcddp/data/_staging_exchange.py) is a pipeline of four stages, each node leader
running them at once: read from the shared file system, the exchange among leaders, the write
to node-local storage, the CRC-32C check (a thread beside the write). Its time is the slowest
stage plus one round through the others (fill and drain):

    read       allgather, ring: every leader reads its 1/N at once, D / min(B, N r);
               bcast: one leader reads at a time, D / min(B, r)
    exchange   allgather, ring: each link carries (N-1)/N D each way (the model does not
               price allgather's wait for the slowest leader in every round, which the ring
               removes: measured, docs/data.md);
               bcast: chunk by chunk, MPI_Bcast's binomial tree or scatter + all-gather
    write      D / W per node;  check  D / the CRC-32C rate
    (B: the file system's aggregate read rate; r: one leader's read rate; W: node-local write;
    the reads are taken to travel beside the exchange, not on its link)

Calibration inputs (INPUTS) name their sources; the tables print them. --check compares the
model with the figures measured on the virtual cluster (CALIBRATION) and exits 1 where one is
off by more than TOLERANCE. docs/benchmarks.md ("On paper: 2 to 1024 nodes") and
docs/data.md ("On paper: staging time") quote the tables; tests/unit/test_cost_model.py
keeps them equal to what this prints.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import statistics
import sys

KiB, MiB = 1 << 10, 1 << 20
GBIT = 1e9
# Ethernet at MTU 1500 carries 1448 bytes of TCP payload (timestamps on) in 1538 bytes on the
# wire (headers, preamble, gap): what the virtual cluster's 1 Gbit/s links deliver
TCP_PAYLOAD = 1448 / 1538
RING_CHUNK = 1 * MiB          # hpcddp/collectives/_ring.py CHUNK
STAGE_CHUNK = 16 * MiB        # hpcddp stage --chunk-size default
BUCKET = 25 * MiB             # DDP's bucket_cap_mb default
NODES = [2 ** k for k in range(1, 11)]
RATES_GBIT = (25, 100, 200)
RANKS_PER_NODE = 8
TOLERANCE = 0.15              # the measured figures themselves spread 5-15% between runs
# at a power of two halving-doubling differs from the ring only in latency and in the ring's
# overlapped additions, so it "takes over" where it saves this much
TAKES_OVER = 0.10
ADD_SPEED_RUNS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / \
    "reduce-speed.txt"


def _measured_add_speed(path=ADD_SPEED_RUNS) -> tuple[float, int, float, float]:
    """B/s: the median, count, least and most of the recorded runs (GB/s, one a line)."""
    runs = [float(line.split()[0]) * 1e9 for line in path.read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    return statistics.median(runs), len(runs), min(runs), max(runs)


_ADD = _measured_add_speed()
# (value, unit, what, source): the model's inputs, printed as the docs' inputs table
INPUTS = {
    "alpha_vcluster": (14.4e-6, "s", "latency per message, virtual cluster",
                       "TCP socket latency at `--rate 1gbit`, 14.3-14.5 µs "
                       "(docs/multinode-testing.md, measured)"),
    "alpha": (5e-6, "s", "latency per message, tables",
              "assumed: MPI over InfiniBand or RoCE takes 1-2 µs, over TCP 10-20 µs; "
              "hpcddp's ring adds its Python per step"),
    "gamma": (1 / _ADD[0], "s/B", "one core adding float32 (np.add of 25 MiB, in place)",
              f"{_ADD[0] / 1e9:.1f} GB/s: the median of {_ADD[1]} runs ({_ADD[2] / 1e9:.1f}-"
              f"{_ADD[3] / 1e9:.1f} GB/s) of the command below on the development VM "
              "(docs/benchmarks/reduce-speed.txt, measured)"),
    "shm": (1 / 7.5e9, "s/B", "copy between ranks of a node (shared memory)",
            "memcpy of 25 MiB, 7.51 GB/s (docs/benchmarks.md, all_reduce table, measured)"),
    "alpha_shm": (0.86e-6, "s", "latency per message inside a node",
                  "mpi4py all_reduce of 4 B on 2 ranks, 0.86 µs (docs/benchmarks.md, measured)"),
    "crc": (12.7e9, "B/s", "CRC-32C check of staged bytes, one thread",
            "hardware CRC-32C, 12.7 GB/s (docs/benchmarks.md, Staging, measured)"),
}


def value(name: str) -> float:
    return INPUTS[name][0]


@dataclasses.dataclass(frozen=True)
class Net:
    """What the model knows of a cluster: the link of each node and the cores beside it."""
    rate_bits: float                     # each node's link, bit/s, each way
    alpha: float                         # s per message between nodes
    efficiency: float = TCP_PAYLOAD      # payload share of the link rate
    gamma: float = value("gamma")        # s per byte reduced
    shm: float = value("shm")            # s per byte copied inside a node
    alpha_shm: float = value("alpha_shm")

    @property
    def beta(self) -> float:
        """s per byte across the link."""
        return 8 / (self.rate_bits * self.efficiency)

    def shared(self, streams: int) -> "Net":
        """The same link divided among STREAMS transfers at once."""
        return dataclasses.replace(self, rate_bits=self.rate_bits / streams)


def net_at(gbit: float, alpha: float | None = None) -> Net:
    return Net(gbit * GBIT, value("alpha") if alpha is None else alpha)


# -- all-reduce of S bytes over N nodes, seconds ----------------------------------------------

def ring(n: int, s: float, net: Net, chunk: int = RING_CHUNK) -> float:
    if n < 2:
        return 0.0
    block = s / n
    # chunks overlapping, the slower of the link and the add sets the pace; the faster shows
    # once, for the chunk that starts or ends the step
    fast, slow = sorted((net.beta, net.gamma))
    reduce_scatter = net.alpha + block * slow + min(block, chunk) * fast
    all_gather = net.alpha + block * net.beta
    return (n - 1) * (reduce_scatter + all_gather)


def binomial_tree(n: int, s: float, net: Net) -> float:
    if n < 2:
        return 0.0
    steps = math.ceil(math.log2(n))
    return steps * (net.alpha + s * (net.beta + net.gamma)) + steps * (net.alpha + s * net.beta)


def pipelined_tree(n: int, s: float, net: Net) -> float:
    """The best power-of-two chunk from 64 KiB (as a tuned MPI would pick)."""
    if n < 2:
        return 0.0
    depth = int(math.log2(n))
    children = 1 if n == 2 else 2
    best = math.inf
    chunk = 64 * KiB
    while True:
        c = min(chunk, s)
        stages = depth + math.ceil(s / c) - 1
        up = net.alpha + children * c * max(net.beta, net.gamma)
        down = net.alpha + children * c * net.beta
        best = min(best, stages * (up + down))
        if c >= s:
            return best
        chunk *= 2


def halving_doubling(n: int, s: float, net: Net) -> float:
    if n < 2:
        return 0.0
    p = 1 << int(math.log2(n))
    t = 2 * math.log2(p) * net.alpha + (p - 1) / p * s * (2 * net.beta + net.gamma)
    if p < n:   # the extra ranks hand their whole vector to a partner first, and get it back
        t += 2 * net.alpha + s * (2 * net.beta + net.gamma)
    return t


FLAT = {"ring": ring, "binomial tree": binomial_tree, "pipelined tree": pipelined_tree,
        "halving-doubling": halving_doubling}


def hierarchical(nodes: int, per_node: int, s: float, net: Net, across=ring) -> float:
    """Reduce-scatter inside the node, ACROSS among the nodes on S/G by each of the G local
    ranks at once, all-gather inside the node."""
    g = per_node
    local_rs = (g - 1) * (net.alpha_shm + s / g * (net.shm + net.gamma))
    local_ag = (g - 1) * (net.alpha_shm + s / g * net.shm)
    return local_rs + across(nodes, s / g, net.shared(g)) + local_ag


def flat_ring(nodes: int, per_node: int, s: float, net: Net) -> float:
    """One ring over every rank, node by node: each step waits for its one cross-node hop."""
    return ring(nodes * per_node, s, net)


def busbw(n: int, s: float, seconds: float) -> float:
    """Bus bandwidth, B/s, as nccl-tests defines it for all-reduce."""
    return 2 * (n - 1) / n * s / seconds


# -- a DDP step -------------------------------------------------------------------------------

def buckets(grad_bytes: float, cap: float = BUCKET) -> list[float]:
    full, rest = divmod(grad_bytes, cap)
    return [cap] * int(full) + ([rest] if rest else [])


def ddp_step(grad_bytes: float, compute_s: float, allreduce) -> float:
    """Seconds per step: ALLREDUCE(bytes) -> s of each bucket, one at a time, each from the
    moment backward has produced it."""
    forward, backward = compute_s / 3, compute_s * 2 / 3
    done = produced = 0.0
    for size in buckets(grad_bytes):
        produced += size
        ready = forward + backward * produced / grad_bytes
        done = max(done, ready) + allreduce(size)
    return max(done, compute_s)


RESNET50 = ("ResNet-50", 25_557_032 * 4, 0.100)     # name, gradient bytes, compute s/step
MLP10M_GRAD_BYTES = 10_512_394 * 4                  # hpcddp/bench/ddp.py's 10M MLP


# -- staging ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Storage:
    fs: float            # B: the shared file system's aggregate read rate, B/s
    reader: float        # r: what one node leader's reader thread gets from it, B/s
    write: float         # W: node-local write, B/s
    check: float = value("crc")


def bcast_chunk(n: int, c: float, net: Net) -> float:
    """One MPI_Bcast of C bytes over N leaders: the better of a binomial tree and
    scatter + ring all-gather (van de Geijn), as MPI libraries switch between them."""
    binomial = math.ceil(math.log2(n)) * (net.alpha + c * net.beta)
    scatter_allgather = ((math.ceil(math.log2(n)) + n - 1) * net.alpha
                         + 2 * (n - 1) / n * c * net.beta)
    return min(binomial, scatter_allgather)


def _bcast_all(d: float, n: int, chunk: int, net: Net) -> float:
    full, rest = divmod(d, chunk)
    return full * bcast_chunk(n, chunk, net) + (bcast_chunk(n, rest, net) if rest else 0.0)


def staging(d: float, n: int, strategy: str, net: Net, st: Storage,
            chunk: int = STAGE_CHUNK) -> dict:
    """Seconds of each stage and the total, to give each of N nodes all D bytes."""
    if strategy == "every-rank":      # each node reads the whole set itself
        read = n * d / min(st.fs, n * st.reader)
        stages = {"read": read, "exchange": 0.0, "write": d / st.write, "check": d / st.check}
        per_round = {"read": chunk / st.reader, "exchange": 0.0, "write": chunk / st.write,
                     "check": chunk / st.check}
    elif strategy in ("allgather", "ring"):   # a round: every leader's next chunk to every leader
        rounds = math.ceil(d / (n * chunk))
        stages = {"read": d / min(st.fs, n * st.reader),
                  "exchange": (n - 1) / n * d * net.beta + rounds * (n - 1) * net.alpha,
                  "write": d / st.write, "check": d / st.check}
        per_round = {"read": chunk / st.reader,
                     "exchange": (n - 1) * (net.alpha + chunk * net.beta),
                     "write": n * chunk / st.write, "check": n * chunk / st.check}
    elif strategy == "bcast":         # a round: one leader's chunk to every leader
        stages = {"read": d / min(st.fs, st.reader),
                  "exchange": _bcast_all(d, n, chunk, net),
                  "write": d / st.write, "check": d / st.check}
        per_round = {"read": chunk / st.reader, "exchange": bcast_chunk(n, chunk, net),
                     "write": chunk / st.write, "check": chunk / st.check}
    else:
        raise ValueError(f"staging: strategy {strategy!r}; valid: allgather, ring, bcast, "
                         f"every-rank")
    slowest = max(stages, key=stages.get)
    fill = sum(t for k, t in per_round.items() if k != slowest)
    return {**stages, "bound": slowest, "total": stages[slowest] + fill}


def auto_strategy(n: int) -> str:
    """hpcddp/data/_staging_plan.py auto_strategy at the default chunk: the ring while its
    buffers (4 read ahead; per stream its share of 8 chunks in flight on a link, at least 2;
    per other leader's stream one more, being written) stay within 512 MiB."""
    share = max(2, -(-8 // max(1, n - 1)))
    return "ring" if (4 + share + (n - 1) * (share + 1)) * STAGE_CHUNK <= 512 * MiB else "bcast"


# -- calibration: the virtual cluster, 1 Gbit/s links, one rank per node ----------------------

VCLUSTER = Net(1 * GBIT, value("alpha_vcluster"))
# (what, measured by, nodes, bytes, "busbw" (MB/s), "ms" or "step-ms", measured low, high), as
# docs/benchmarks.md ("Across virtual nodes, in one command") and docs/ddp.md quote them
_SRC_RING = "busbw.py ring (hpcddp's ring algorithm)"
CALIBRATION = [
    ("ring, 2 nodes, 1 MiB", _SRC_RING, 2, 1 * MiB, "busbw", 120, 121),
    ("ring, 2 nodes, 4 MiB", _SRC_RING, 2, 4 * MiB, "busbw", 120, 120),
    ("ring, 2 nodes, 16 MiB", _SRC_RING, 2, 16 * MiB, "busbw", 117, 118),
    ("gloo, 2 nodes, 1 MiB", "busbw.py gloo", 2, 1 * MiB, "busbw", 102, 126),
    ("gloo, 2 nodes, 4 MiB", "busbw.py gloo", 2, 4 * MiB, "busbw", 113, 120),
    ("gloo, 2 nodes, 16 MiB", "busbw.py gloo", 2, 16 * MiB, "busbw", 118, 120),
    ("gloo, 2 nodes, 25 MiB", "bench ddp overlap rows", 2, 25 * MiB, "ms", 223, 225),
    ("hpcddp ring path, 4 nodes, 1 MiB", "busbw.py hpcddp", 4, 1 * MiB, "busbw", 102, 116),
    ("hpcddp ring path, 4 nodes, 4 MiB", "busbw.py hpcddp", 4, 4 * MiB, "busbw", 102, 108),
    ("hpcddp ring path, 4 nodes, 16 MiB", "busbw.py hpcddp", 4, 16 * MiB, "busbw", 104, 107),
    ("hpcddp ring path, 4 nodes, 25 MiB", "bench ddp overlap rows", 4, 25 * MiB, "ms", 386, 386),
    ("gloo, 4 nodes, 1 MiB", "busbw.py gloo", 4, 1 * MiB, "busbw", 112, 123),
    ("gloo, 4 nodes, 4 MiB", "busbw.py gloo", 4, 4 * MiB, "busbw", 112, 118),
    ("gloo, 4 nodes, 16 MiB", "busbw.py gloo", 4, 16 * MiB, "busbw", 114, 119),
    ("gloo, 4 nodes, 25 MiB", "bench ddp overlap rows", 4, 25 * MiB, "ms", 335, 340),
    ("DDP 10M, gloo, 2 nodes: comm ms/step", "docs/ddp.md, 5 runs", 2, MLP10M_GRAD_BYTES,
     "step-ms", 354, 404),
]


def modelled(nodes: int, nbytes: float, quantity: str, net: Net = VCLUSTER) -> float:
    if quantity == "step-ms":      # the step minus compute alone, with nothing overlapped
        return sum(ring(nodes, b, net) for b in buckets(nbytes)) * 1e3
    t = ring(nodes, nbytes, net)
    return busbw(nodes, nbytes, t) / 1e6 if quantity == "busbw" else t * 1e3


def calibration() -> list[dict]:
    rows = []
    for what, source, nodes, nbytes, quantity, lo, hi in CALIBRATION:
        model = modelled(nodes, nbytes, quantity)
        error = model / ((lo + hi) / 2) - 1
        rows.append({"what": what, "source": source, "quantity": quantity, "measured": (lo, hi),
                     "model": model, "error": error, "ok": abs(error) <= TOLERANCE})
    return rows


# -- Markdown ---------------------------------------------------------------------------------

def ms(seconds: float) -> str:
    v = seconds * 1e3
    return f"{v:.3f}" if v < 1 else f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 100 else f"{v:.0f}"


def duration(seconds: float) -> str:
    if seconds == 0:
        return "-"
    return f"{seconds:.2f} s" if seconds < 10 else f"{seconds:,.0f} s"


def _table(header: list[str], rows: list[list[str]], align: str = "") -> str:
    """Markdown; ALIGN: l or r per column (default: the first l, figures r)."""
    align = align or "l" + "r" * (len(header) - 1)
    rule = "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|"
    return "\n".join(["| " + " | ".join(header) + " |", rule,
                      *("| " + " | ".join(r) + " |" for r in rows)])


def inputs_table() -> str:
    def shown(name):
        v, unit, _, _ = INPUTS[name]
        if unit == "s":
            return f"{v * 1e6:.3g} µs"
        if unit == "s/B":
            return f"1 / {1 / v / 1e9:.3g} GB/s"
        return f"{v / 1e9:.3g} GB/s"
    rows = [[f"`{k}`", INPUTS[k][2], shown(k), INPUTS[k][3]] for k in INPUTS]
    rows.append(["`efficiency`", "payload share of the link rate", f"{TCP_PAYLOAD:.3f}",
                 "TCP over Ethernet at MTU 1500: 1448 of 1538 bytes on the wire (the virtual "
                 "cluster's point-to-point: 117-121 MB/s of 125)"])
    return _table(["input", "what", "value", "source"], rows, "llrl")


def calibration_table() -> str:
    rows = []
    for r in calibration():
        lo, hi = r["measured"]
        unit = "MB/s" if r["quantity"] == "busbw" else "ms"
        got = f"{lo:g}" if lo == hi else f"{lo:g}-{hi:g}"
        rows.append([r["what"], f"{got} {unit}", f"{r['model']:.0f} {unit}",
                     f"{round(r['error'] * 100):+d}%", r["source"]])
    return _table(["1 Gbit/s, 1 rank per node", "measured", "model", "error (vs middle)",
                   "measured by"], rows, "lrrrl")


def bucket_table(gbit: float, s: float = BUCKET) -> str:
    net = net_at(gbit)
    rows = []
    for n in NODES:
        times = {name: f(n, s, net) for name, f in FLAT.items()}
        best = min(times, key=times.get)
        rows.append([str(n), *(ms(t) for t in times.values()), best])
    return (f"**{gbit:g} Gbit/s, 1 rank per node: ms per 25 MiB all-reduce**\n\n"
            + _table(["nodes", *FLAT, "fastest"], rows))


def _hier_times(n: int, s: float, net: Net, g: int = RANKS_PER_NODE) -> dict:
    return {"flat ring": flat_ring(n, g, s, net),
            "hierarchical, ring across": hierarchical(n, g, s, net, ring),
            "hierarchical, halving-doubling across": hierarchical(n, g, s, net, halving_doubling)}


def hier_table(gbit: float, s: float = BUCKET, g: int = RANKS_PER_NODE) -> str:
    net = net_at(gbit)
    rows = [[str(n), *(ms(t) for t in _hier_times(n, s, net, g).values())] for n in NODES]
    return (f"**{gbit:g} Gbit/s, {g} ranks per node: ms per 25 MiB all-reduce**\n\n"
            + _table(["nodes", f"flat ring ({g}N ranks)", "hierarchical, ring across",
                      "hierarchical, halving-doubling across"], rows))


def first_node_count(wins, nodes=tuple(2 ** k for k in range(1, 17))) -> str:
    """The smallest of NODES where WINS(n), as text."""
    for n in nodes:
        if wins(n):
            return str(n)
    return f"> {nodes[-1]}"


def crossovers(gbit: float, alpha: float, s: float = BUCKET) -> list[str]:
    net = net_at(gbit, alpha)
    tree = lambda n: min(binomial_tree(n, s, net), pipelined_tree(n, s, net)) < ring(n, s, net)
    hd = lambda n: halving_doubling(n, s, net) <= (1 - TAKES_OVER) * ring(n, s, net)
    hier = lambda n: (hierarchical(n, RANKS_PER_NODE, s, net, ring)
                      < flat_ring(n, RANKS_PER_NODE, s, net))
    return [first_node_count(tree), first_node_count(hd), first_node_count(hier)]


def crossover_table(alphas=(2e-6, 5e-6, 15e-6)) -> str:
    rows = [[f"{gbit:g} Gbit/s", f"{a * 1e6:g} µs", *crossovers(gbit, a)]
            for gbit in RATES_GBIT for a in alphas]
    return _table(["link", "alpha", "a tree beats the ring from (nodes)",
                   f"halving-doubling ≥ {TAKES_OVER:.0%} faster than the ring from",
                   f"hierarchical ({RANKS_PER_NODE}/node) beats a flat ring from"], rows)


def ddp_table(model=RESNET50) -> str:
    name, grad, compute = model
    header, per_rate = ["nodes"], []
    for gbit in RATES_GBIT:
        header += [f"{gbit:g} Gbit/s: ring", "fastest"]
        per_rate.append(net_at(gbit))
    rows = []
    for n in NODES:
        row = [str(n)]
        for net in per_rate:
            steps = {k: ddp_step(grad, compute, lambda b, f=f: f(n, b, net))
                     for k, f in FLAT.items()}
            best = min(steps, key=steps.get)
            row += [ms(steps["ring"]), f"{ms(steps[best])} ({best})"]
        rows.append(row)
    return (f"**DDP step, {name}: {grad / 1e6:.0f} MB of float32 gradients in "
            f"{len(buckets(grad))} buckets of up to 25 MiB, {compute * 1e3:.0f} ms of compute, "
            "1 rank per node: ms per step**\n\n" + _table(header, rows))


# staging cases
VC_STORAGE = Storage(fs=1.42e9, reader=1.42e9, write=1.42e9)   # cp -r per node (data.md)
VC_DATA = 270e6                                                 # bench stage's data set
SCALE_DATA = 1e12
DEEPCAM_DATA = 7.7e12
ASSUMED = Storage(fs=90e9, reader=2e9, write=10e9)    # docs/data.md says why, for DeepCAM


def _assumed(st: Storage = ASSUMED) -> str:
    return f"B = {st.fs / 1e9:g} GB/s, r = {st.reader / 1e9:g} GB/s, W = {st.write / 1e9:g} GB/s"


def staging_vcluster_table() -> str:
    rows = []
    for n in (2, 4):
        for strategy in ("allgather", "bcast"):
            r = staging(VC_DATA, n, strategy, VCLUSTER, VC_STORAGE)
            bound = (n - 1) / n * VC_DATA / (1 * GBIT / 8)
            rows.append([f"{n} nodes, {strategy}", duration(r["exchange"]), duration(r["total"]),
                         r["bound"], duration(bound)])
    return _table(["270 MB, 1 Gbit/s", "exchange", "total (model)", "slowest stage",
                   "(N-1)/N x data / 125 MB/s"], rows, "lrrlr")


def staging_scale_table(gbit: float = 100) -> str:
    net = net_at(gbit)
    rows = []
    for n in NODES:
        cells = [staging(SCALE_DATA, n, s, net, ASSUMED)
                 for s in ("allgather", "bcast", "every-rank")]
        rows.append([str(n), *(f"{duration(c['total'])} ({c['bound']})" for c in cells),
                     auto_strategy(n)])
    return (f"**1 TB to every node, {gbit:g} Gbit/s, {_assumed()}: seconds (slowest stage)**\n\n"
            + _table(["nodes", "allgather", "bcast", "every-rank", "hpcddp's auto"], rows))


def deepcam_cases() -> list[tuple[str, dict]]:
    net, st = net_at(200), ASSUMED
    half = DEEPCAM_DATA / 2
    cases = [("hpcddp allgather: 256 nodes, the whole 7.7 TB each (16 GiB of buffers)",
              staging(DEEPCAM_DATA, 256, "allgather", net, st)),
             ("the same, `--chunk-size 1M` (1 GiB of buffers)",
              staging(DEEPCAM_DATA, 256, "allgather", net, st, chunk=1 * MiB)),
             ("hpcddp bcast (auto's pick at 256 nodes)",
              staging(DEEPCAM_DATA, 256, "bcast", net, st)),
             ("every-rank: each of 256 nodes reads 7.7 TB",
              staging(DEEPCAM_DATA, 256, "every-rank", net, st))]
    # NVIDIA's layout: 512 nodes as 256 instances of 2; each instance position (half the
    # files) is its own all-gather group of 256, both groups reading at once (half of B each)
    two_groups = staging(half, 256, "allgather", net, dataclasses.replace(st, fs=st.fs / 2))
    cases.append(("NVIDIA's layout: 2 groups of 256 nodes, 3.85 TB each, all-gather",
                  two_groups))
    return cases


def deepcam_table() -> str:
    rows = [[what, duration(r["read"]), duration(r["exchange"]), duration(r["write"]),
             duration(r["check"]), f"**{duration(r['total'])}** ({r['bound']})"]
            for what, r in deepcam_cases()]
    return _table([f"DeepCAM, 200 Gbit/s, {_assumed()}", "read",
                   "exchange", "write", "check", "total (slowest)"], rows)


def sections() -> dict[str, list[str]]:
    """The tables each docs page quotes, in order."""
    return {"benchmarks": [inputs_table(), calibration_table(),
                           *(bucket_table(g) for g in RATES_GBIT), hier_table(100),
                           crossover_table(), ddp_table()],
            "data": [staging_vcluster_table(), staging_scale_table(), deepcam_table()]}


def check() -> int:
    rows = calibration()
    print(calibration_table())
    bad = [r for r in rows if not r["ok"]]
    worst = max(rows, key=lambda r: abs(r["error"]))
    print(f"\n{len(rows) - len(bad)} of {len(rows)} figures within ±{TOLERANCE:.0%}; the "
          f"largest error: {worst['what']}, {worst['error']:+.1%}")
    print("staging: no figure measured across links yet (docs/data.md); the model's predictions "
          "are in --section data")
    return 1 if bad else 0


def plot(path: str, gbit: float = 100) -> None:
    try:
        import matplotlib
    except ImportError:
        sys.exit("cost_model.py --plot: matplotlib is not installed (pip install matplotlib)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    net = net_at(gbit)
    xs = NODES
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for name, f in FLAT.items():
        ax.plot(xs, [f(n, BUCKET, net) * 1e3 for n in xs], marker="o", ms=3,
                label=f"{name} (1 rank/node)")
    for name in ("flat ring", "hierarchical, ring across"):
        ax.plot(xs, [_hier_times(n, BUCKET, net)[name] * 1e3 for n in xs], ls="--", marker="s",
                ms=3, label=f"{name} ({RANKS_PER_NODE} ranks/node)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(n) for n in xs])
    ax.set_yscale("log")
    ax.set_xlabel("nodes")
    ax.set_ylabel("ms per 25 MiB all-reduce")
    ax.set_title(f"On paper: {gbit:g} Gbit/s links, alpha {value('alpha') * 1e6:g} µs "
                 f"(scripts/cost_model.py)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--section", choices=("benchmarks", "data", "all"), default="all",
                    help="which page's tables to print (default: both)")
    ap.add_argument("--check", action="store_true",
                    help=f"compare with the virtual cluster's figures; exit 1 if one is off by "
                         f"more than {TOLERANCE * 100:.0f}%%")  # argparse formats help with %
    ap.add_argument("--plot", metavar="PATH",
                    help="write ms per 25 MiB bucket against nodes at 100 Gbit/s (PNG)")
    args = ap.parse_args(argv)
    if args.check:
        return check()
    if args.plot:
        plot(args.plot)
        return 0
    pages = sections()
    for page in ("benchmarks", "data") if args.section == "all" else (args.section,):
        print("\n\n".join(pages[page]))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
