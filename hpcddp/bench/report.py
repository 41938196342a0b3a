"""Results: statistics, tables, JSON, plots, ``--compare`` and the targets. No MPI here.

A comm result (what :func:`hpcddp.bench.comm.run` returns and ``--json`` writes) is::

    {"kind": "hpcddp-bench-comm", "setup": {...machine...}, "load": {...}, "config": {...},
     "cells": [{"op", "bytes", "busbw_factor",
                "impls": {name: {"k", "times_s": [per round, MAX over ranks], "wrong"} | {"na"}},
                "stats": {name: {"median_us", "q1_us", "q3_us", "algbw_GBps", "busbw_GBps",
                                 "cv"}},           # added by summarize()
                "ratios": {"hpcddp/mpi4py": {"median", "q1", "q3", "min", "max", "n"}, ...}}]}

Ratios are medians of *per-round paired* ratios over the kept rounds (round 1 dropped):
``X/mpi4py`` time ratios (1.0 = as fast as raw mpi4py; busbw efficiency is its inverse),
``X-mpi4py_us`` added microseconds, ``gloo/X`` how many times faster than gloo, and
``X:memcpy`` busbw as a fraction of the same-size memcpy bandwidth.
"""
from __future__ import annotations

import json
import math

from hpcddp.bench.protocol import fmt_size, paired, spread

HPCDDP_IMPLS = ("hpcddp", "direct", "hpcddp-async")
LABELS = {"mpi4py": "mpi4py", "hpcddp": "hpcddp", "direct": "direct", "gloo": "gloo",
          "memcpy": "memcpy", "hpcddp-async": "hpcddp-async",
          "direct-unchecked": "direct-unchecked"}
LATENCY_MAX = 32 << 10      # up to here a row shows latency (µs); above, busbw (GB/s)
THRESHOLD = 0.10            # --compare: a row regresses when 10 % worse


# -- statistics -----------------------------------------------------------------------------------

def summarize(result: dict) -> dict:
    """Add per-implementation stats and paired ratios to every cell (in place); returns it."""
    discard = result.get("config", {}).get("discarded_rounds", 1)
    for cell in result.get("cells", []):
        S, f = cell["bytes"], cell["busbw_factor"]
        kept = {name: rec["times_s"][discard:] for name, rec in cell["impls"].items()
                if rec.get("times_s")}
        stats = {}
        for name, ts in kept.items():
            sp = spread(ts)
            t = sp["median"]
            algbw = S / t / 1e9 if t > 0 else math.nan
            stats[name] = {"median_us": t * 1e6, "q1_us": sp["q1"] * 1e6, "q3_us": sp["q3"] * 1e6,
                           "algbw_GBps": algbw,
                           "busbw_GBps": algbw * (1.0 if name == "memcpy" else f),
                           "cv": _cv(ts)}
        ratios = {}
        base = kept.get("mpi4py")
        for name in ("hpcddp", "direct", "hpcddp-async", "gloo"):
            if base and name in kept:
                ratios[f"{name}/mpi4py"] = spread(paired(kept[name], base))
                if name != "gloo":
                    ratios[f"{name}-mpi4py_us"] = spread(
                        [d * 1e6 for d in paired(kept[name], base, "diff")])
        if "direct" in kept and "direct-unchecked" in kept:   # what the call agreement costs
            ratios["direct/direct-unchecked"] = spread(paired(kept["direct"],
                                                              kept["direct-unchecked"]))
            ratios["direct-unchecked_us"] = spread(
                [d * 1e6 for d in paired(kept["direct"], kept["direct-unchecked"], "diff")])
        if "gloo" in kept:
            for name in HPCDDP_IMPLS:
                if name in kept:
                    ratios[f"gloo/{name}"] = spread(paired(kept["gloo"], kept[name]))
        if "memcpy" in kept:
            for name in ("mpi4py", "hpcddp", "direct", "gloo"):
                if name in kept:
                    ratios[f"{name}:memcpy"] = spread(
                        [f * r for r in paired(kept["memcpy"], kept[name])])
        cell["stats"], cell["ratios"] = stats, ratios
    return result


def _cv(ts) -> float:
    from hpcddp.bench.protocol import cv
    return cv(ts)


# -- tables ---------------------------------------------------------------------------------------

def _fig(cell: dict, name: str) -> str:
    rec = cell["impls"].get(name, {})
    if "na" in rec:
        return "n/a"
    st = cell.get("stats", {}).get(name)
    if not st:
        return "-"
    mark = "!" if rec.get("wrong") else ""
    if cell["bytes"] <= LATENCY_MAX:
        return f"{_num(st['median_us'])} µs{mark}"
    return f"{_num(st['busbw_GBps'])} GB/s{mark}"


def _num(x: float) -> str:
    if x is None or math.isnan(x):
        return "-"
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def _ratio(cell: dict, key: str, unit: str = "") -> str:
    r = cell.get("ratios", {}).get(key)
    if not r or r["n"] == 0:
        return "-"
    return f"{_num(r['median'])}{unit} ({_num(r['q1'])}–{_num(r['q3'])})"


RATIO_COLUMNS = (("hpcddp/mpi4py", "hpcddp/mpi4py time", ""),
                 ("direct/mpi4py", "direct/mpi4py time", ""),
                 ("hpcddp-mpi4py_us", "hpcddp − mpi4py", " µs"),
                 ("gloo/hpcddp", "gloo/hpcddp time", ""),
                 ("direct/direct-unchecked", "check's cost: direct/unchecked time", ""))


def comm_table(result: dict, markdown: bool = False) -> str:
    """One table per op: per-implementation latency (≤ 32 KiB) or busbw, then paired ratios
    as median (quartiles) over rounds."""
    cfg = result.get("config", {})
    impls = [i for i in cfg.get("impls", []) if any(i in c["impls"] for c in result["cells"])]
    out = []
    by_op: dict = {}
    for cell in result["cells"]:
        by_op.setdefault(cell["op"], []).append(cell)
    for op, cells in by_op.items():
        cols = [key for key, _, _ in RATIO_COLUMNS
                if any(key in c.get("ratios", {}) for c in cells)]
        header = ["size"] + [LABELS.get(i, i) for i in impls] + \
                 [title for key, title, _ in RATIO_COLUMNS if key in cols] + ["check"]
        rows = []
        for c in cells:
            wrong = [i for i, rec in c["impls"].items() if rec.get("wrong")]
            rows.append([fmt_size(c["bytes"])] + [_fig(c, i) for i in impls] +
                        [_ratio(c, key, unit) for key, _, unit in RATIO_COLUMNS if key in cols] +
                        ["WRONG: " + ",".join(wrong) if wrong else "ok"])
        title = (f"{op}: {cfg.get('ranks', '?')} ranks, {cfg.get('dtype', 'float32')}; "
                 f"≤ 32 KiB: median latency per op, larger: busbw (GB/s = 1e9 B/s); ratios: "
                 f"median (quartiles) of per-round paired ratios")
        out.append(_render(title, header, rows, markdown))
    return "\n".join(out)


def _render(title: str, header: list, rows: list, markdown: bool) -> str:
    if markdown:
        lines = [f"**{title}**", "", "| " + " | ".join(header) + " |",
                 "|" + "|".join("---:" if i else "---" for i in range(len(header))) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines) + "\n"
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    lines = [title, fmt.format(*header)]
    lines += [fmt.format(*r) for r in rows]
    return "\n".join(lines) + "\n"


def setup_lines(result: dict) -> list[str]:
    s, load = result.get("setup", {}), result.get("load", {})
    omp = s.get("open_mpi", {})
    lines = [
        f"machine: {s.get('cpu')} x {s.get('cpus')} CPUs ({s.get('hypervisor') or 'bare metal'}"
        f"), kernel {s.get('kernel')}, host {s.get('host')}",
        f"MPI: {s.get('mpi_version')}; thread level {s.get('mpi_thread_level')}",
    ]
    if omp:
        mca = omp.get("mca_env", {})
        lines.append("Open MPI: " + ", ".join(
            [f"{k.replace('OMPI_MCA_', '')}={v}" for k, v in sorted(mca.items())] +
            [f"smsc components: {','.join(omp.get('smsc_components', [])) or 'none'}"]))
    lines.append(f"versions: torch {s.get('torch')}, numpy {s.get('numpy')}, mpi4py "
                 f"{s.get('mpi4py')}, python {s.get('python')}; hpcddp {s.get('hpcddp_commit')}")
    if s.get("all_reduce_hit"):
        ops = s.get("plan_hit_ops", ["all_reduce"])   # runs before the exchange plans: one
        lines.append(f"plan hits ({', '.join(ops)} on tensors used before): "
                     f"{s['all_reduce_hit']}")
    if s.get("async_engine"):
        lines.append(f"async ops: engine {s['async_engine']}; Open MPI waits "
                     f"{'yielding the core' if s.get('mpi_yield_when_idle') == '1' else 'spinning'}")
    lines.append(f"ranks {s.get('ranks')} on {len(s.get('hosts', [])) or '?'} host(s), affinity "
                 f"{s.get('rank_affinity')}, OMP_NUM_THREADS={s.get('omp_num_threads')}, torch "
                 f"threads {s.get('torch_threads')}")
    if load:
        lines.append(f"load: loadavg {load.get('loadavg_before')} before, "
                     f"{load.get('loadavg_after')} after; other processes used "
                     f"{load.get('other_processes_cpu_pct')} % of the machine's CPU during the "
                     f"run (steal {load.get('steal_pct')} %), {load.get('wall_s')} s")
    for d in result.get("node_paths", []):  # hpcddp.collectives._node's races, rank 0's view
        lines.append(node_path_line(d))
    return lines


def node_path_line(d: dict) -> str:
    """One start-up race's decision (_node.Crossover.as_dict), in words."""
    head = f"node path {d['path']} on {d['group']} ({d['ranks']} ranks)"
    if "steps" not in d:       # results saved before per-size races: one size, kept or not
        return (f"{head}: {d['ours_s'] * 1e3:.2f} ms vs MPI {d['mpi_s'] * 1e3:.2f} ms -> "
                f"{'kept' if d['kept'] else 'MPI kept'}")
    from hpcddp.collectives._node import WIN, _mib, losing
    steps = ", ".join(f"{_mib(b)} {o / m:.2f}x" for b, o, m in d["steps"])
    start = d["start_bytes"]
    verdict = f"from {_mib(start)}" if start is not None else \
        f"never ({losing(d.get('win', WIN))} than MPI at any size)"
    return (f"{head}, {d['op']}: {verdict}; its time / MPI's at {steps}; race "
            f"{d['cost_s'] * 1e3:.0f} ms")


# -- targets ----------------------------------------------------------------------------------

def comm_targets(result: dict) -> list[dict]:
    """The targets, evaluated on one run's paired ratios: on one node, shared memory's (over
    gloo's TCP loopback: 30x at small sizes, 2x from 1 MiB); across nodes, where both go
    through the same link, the link's (from 1 MiB: busbw >= 0.95x gloo's and, where the run
    knows the link's rate, >= 0.9x of it)."""
    out = []
    across = (result.get("setup", {}).get("nodes") or 1) > 1
    link = result.get("link_bytes_per_s")

    def add(name, cell, key, value, limit, ok):
        out.append({"target": name, "op": cell["op"], "bytes": cell["bytes"], "ratio": key,
                    "value": value, "limit": limit, "ok": bool(ok)})

    for c in result["cells"]:
        r = c.get("ratios", {})
        get = (lambda k: r[k]["median"] if k in r and r[k]["n"] else None)
        if c["bytes"] >= 64 << 10:
            v = get("direct/direct-unchecked")
            if v is not None:
                add("≥ 64 KiB: the cross-rank call agreement costs ≤ 3%", c,
                    "direct/direct-unchecked", v, 1.03, v <= 1.03)
        elif c["bytes"] <= 8:
            v = get("direct-unchecked_us")
            if v is not None:
                add("8 B: the cross-rank call agreement costs ≤ 0.5 µs", c,
                    "direct-unchecked_us", v, 0.5, v <= 0.5)
        if c["op"] == "all_reduce" and c["bytes"] <= 1024:
            v = get("hpcddp-mpi4py_us")
            if v is not None:
                add("all_reduce ≤ 1 KiB: hpcddp (torch.distributed) adds ≤ 10 µs over mpi4py",
                    c, "hpcddp-mpi4py_us", v, 10.0, v <= 10.0)
            v = get("direct/mpi4py")
            if v is not None:
                add("all_reduce ≤ 1 KiB: direct API ≤ 1.5× mpi4py time", c, "direct/mpi4py",
                    v, 1.5, v <= 1.5)
        if c["op"] == "all_reduce" and c["bytes"] <= 32 << 10 and not across:
            v = get("gloo/hpcddp")
            if v is not None:
                add("all_reduce ≤ 32 KiB: ≥ 30× faster than gloo", c, "gloo/hpcddp", v, 30.0,
                    v >= 30.0)
        if c["bytes"] >= 1 << 20:
            for name in ("hpcddp", "direct"):
                v = get(f"{name}/mpi4py")
                if v is not None:
                    eff = 1.0 / v
                    add(f"≥ 1 MiB: {name} busbw ≥ 0.95× mpi4py", c, f"mpi4py/{name}", eff,
                        0.95, eff >= 0.95)
                v = get(f"gloo/{name}")
                if v is not None and across:
                    add(f"≥ 1 MiB across nodes: {name} busbw ≥ 0.95× gloo", c, f"gloo/{name}",
                        v, 0.95, v >= 0.95)
                elif v is not None:
                    add(f"≥ 1 MiB: {name} busbw ≥ 2× gloo", c, f"gloo/{name}", v, 2.0, v >= 2.0)
                busbw = c.get("stats", {}).get(name, {}).get("busbw_GBps")
                if across and link and busbw is not None:
                    v = busbw * 1e9 / link
                    add(f"≥ 1 MiB across nodes: {name} busbw ≥ 0.9× the link's rate", c,
                        f"{name} busbw/link", v, 0.9, v >= 0.9)
    return out


def targets_text(targets: list[dict]) -> str:
    if not targets:
        return "targets: none evaluated (need mpi4py, hpcddp, direct and gloo rows)"
    ok = sum(t["ok"] for t in targets)
    lines = [f"targets: {ok} of {len(targets)} hold"]
    for t in targets:
        if not t["ok"]:
            lines.append(f"  MISSED {t['target']}: {t['op']} {fmt_size(t['bytes'])} "
                         f"{t['ratio']} = {_num(t['value'])} (limit {t['limit']})")
    return "\n".join(lines)


# -- compare ------------------------------------------------------------------------------------

# (ratio key, "lower" if lower is better) - the rows --compare gates on: paired ratios, which
# survive a change of load between the two runs; absolute times do not (shown, not gated).
COMPARED = (("hpcddp/mpi4py", "lower"), ("direct/mpi4py", "lower"),
            ("gloo/hpcddp", "higher"), ("gloo/direct", "higher"))


def compare(new: dict, old: dict, threshold: float = THRESHOLD,
            absolute: bool = False) -> tuple[list[dict], str]:
    """Rows of NEW that are more than THRESHOLD worse than OLD. Returns (regressions, text).

    Gated: the paired ratios in COMPARED (and with ABSOLUTE=True each hpcddp implementation's
    median time too). A ratio regresses when its median is more than THRESHOLD worse AND its
    quartile range no longer overlaps the saved one. Cells are matched by (op, bytes); cells
    in only one run are skipped.
    """
    if new.get("kind") != old.get("kind"):
        raise ValueError(f"compare: the saved file holds a {old.get('kind')!r} result, this run "
                         f"is {new.get('kind')!r}")
    if new.get("kind") == "hpcddp-bench-ddp":
        return compare_ddp(new, old, threshold)
    if new.get("kind") == "hpcddp-bench-stage":
        return compare_stage(new, old, threshold)
    for r in (new, old):
        if r["cells"] and "ratios" not in r["cells"][0]:
            summarize(r)
    old_cells = {(c["op"], c["bytes"]): c for c in old["cells"]}
    regressions, lines, matched = [], [], 0
    for c in new["cells"]:
        o = old_cells.get((c["op"], c["bytes"]))
        if o is None:
            continue
        matched += 1
        for key, better in COMPARED:
            a, b = o.get("ratios", {}).get(key), c.get("ratios", {}).get(key)
            if not a or not b or not a["n"] or not b["n"]:
                continue
            change = b["median"] / a["median"] - 1.0
            # worse by more than the threshold AND outside the saved run's spread: the
            # quartile ranges do not overlap (one noisy round cannot fail a run)
            if better == "lower":
                worse = change > threshold and b["q1"] > a["q3"]
            else:
                worse = change < -threshold / (1 + threshold) and b["q3"] < a["q1"]
            if worse:
                regressions.append({"op": c["op"], "bytes": c["bytes"], "metric": key,
                                    "old": a["median"], "new": b["median"], "change": change})
        for name in HPCDDP_IMPLS:
            a, b = o.get("stats", {}).get(name), c.get("stats", {}).get(name)
            if not a or not b:
                continue
            change = b["median_us"] / a["median_us"] - 1.0
            if change > threshold:
                row = {"op": c["op"], "bytes": c["bytes"], "metric": f"{name} time",
                       "old": a["median_us"], "new": b["median_us"], "change": change}
                if absolute:
                    regressions.append(row)
                else:
                    lines.append(f"  (not gated) {c['op']} {fmt_size(c['bytes'])} {name} time "
                                 f"{_num(a['median_us'])} -> {_num(b['median_us'])} µs "
                                 f"({change:+.0%})")
    head = [f"compare: {matched} cells matched; {len(regressions)} row(s) more than "
            f"{threshold:.0%} worse than the saved run (gated on paired ratios"
            f"{' and absolute times' if absolute else ''})"]
    for r in regressions:
        head.append(f"  REGRESSED {r['op']} {fmt_size(r['bytes'])} {r['metric']}: "
                    f"{_num(r['old'])} -> {_num(r['new'])} ({r['change']:+.0%})")
    if lines:
        head.append("absolute times more than the threshold slower (load differs between runs; "
                    "see 'load' in both files):")
        head += lines[:40]
    return regressions, "\n".join(head)


def compare_ddp(new: dict, old: dict, threshold: float = THRESHOLD) -> tuple[list[dict], str]:
    old_rows = {m["model"]: m for m in old.get("models", [])}
    regressions, matched = [], 0
    for m in new.get("models", []):
        o = old_rows.get(m["model"])
        if o is None:
            continue
        matched += 1
        for key in ("hpcddp/gloo", "hpcddp/compute"):
            a, b = o.get("ratios", {}).get(key), m.get("ratios", {}).get(key)
            if not a or not b:
                continue
            change = b["median"] / a["median"] - 1.0
            if change < -threshold / (1 + threshold):
                regressions.append({"model": m["model"], "metric": key, "old": a["median"],
                                    "new": b["median"], "change": change})
    lines = [f"compare: {matched} models matched; {len(regressions)} ratio(s) more than "
             f"{threshold:.0%} worse than the saved run"]
    for r in regressions:
        lines.append(f"  REGRESSED {r['model']} {r['metric']}: {_num(r['old'])} -> "
                     f"{_num(r['new'])} ({r['change']:+.0%})")
    return regressions, "\n".join(lines)


def compare_stage(new: dict, old: dict, threshold: float = THRESHOLD) -> tuple[list[dict], str]:
    """Gated: how much faster bcast is than each other strategy (paired), and bytes read from
    the source by hpcddp's strategies (exact counts: any growth is a regression)."""
    regressions = []
    for key, a in old.get("ratios", {}).items():
        b = new.get("ratios", {}).get(key)
        if b and a["n"] and b["n"]:
            change = b["median"] / a["median"] - 1.0
            if change < -threshold / (1 + threshold):
                regressions.append({"metric": key, "old": a["median"], "new": b["median"],
                                    "change": change})
    old_rows = {r["strategy"]: r for r in old.get("strategies", [])}
    for r in new.get("strategies", []):
        o = old_rows.get(r["strategy"])
        if o and r["strategy"] != "cp" and r["read_amplification"] > o["read_amplification"] + 1e-9:
            regressions.append({"metric": f"{r['strategy']} read amplification",
                                "old": o["read_amplification"], "new": r["read_amplification"],
                                "change": r["read_amplification"] / o["read_amplification"] - 1})
    lines = [f"compare: {len(regressions)} row(s) worse than the saved run"]
    for r in regressions:
        lines.append(f"  REGRESSED {r['metric']}: {_num(r['old'])} -> {_num(r['new'])} "
                     f"({r['change']:+.0%})")
    return regressions, "\n".join(lines)


# -- files and plots ----------------------------------------------------------------------------

def write_json(result: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=_jsonable)
        f.write("\n")


def _jsonable(x):
    if isinstance(x, set):
        return sorted(x)
    if isinstance(x, float) and math.isnan(x):
        return None
    return str(x)


def read_json(path: str) -> dict:
    try:
        with open(path) as f:
            result = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"compare: no saved result at {path!r}; write one with "
                                f"--json {path}") from None
    if "kind" not in result:
        raise ValueError(f"{path}: not an hpcddp bench result (no 'kind' field)")
    if result["kind"] == "hpcddp-bench-comm" and result["cells"] and \
            "ratios" not in result["cells"][0]:
        summarize(result)
    return result


STYLE = {"mpi4py": dict(color="k", marker="o"), "hpcddp": dict(color="tab:blue", marker="s"),
         "direct": dict(color="tab:cyan", marker="^"), "gloo": dict(color="tab:red", marker="v"),
         "memcpy": dict(color="0.5", marker="", linestyle="--"),
         "hpcddp-async": dict(color="tab:purple", marker="x"),
         "direct-unchecked": dict(color="tab:green", marker=".")}


def plot_comm(result: dict, path: str, ops=None) -> None:
    """Latency (µs) and busbw (GB/s) against size, one row per op, one line per implementation."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    by_op: dict = {}
    for cell in result["cells"]:
        if ops is None or cell["op"] in ops:
            by_op.setdefault(cell["op"], []).append(cell)
    nops = max(1, len(by_op))
    fig, axes = plt.subplots(nops, 2, figsize=(11, 3.0 * nops), squeeze=False)
    impls = result.get("config", {}).get("impls", list(STYLE))
    for row, (op, cells) in enumerate(by_op.items()):
        ax_t, ax_b = axes[row]
        for name in impls:
            pts = [(c["bytes"], c["stats"][name]) for c in cells if name in c.get("stats", {})]
            if not pts:
                continue
            xs = [p[0] for p in pts]
            style = dict(STYLE.get(name, {}))
            ax_t.plot(xs, [p[1]["median_us"] for p in pts], label=LABELS.get(name, name),
                      markersize=4, **style)
            ax_b.plot(xs, [p[1]["busbw_GBps"] for p in pts], label=LABELS.get(name, name),
                      markersize=4, **style)
        sizes = sorted({c["bytes"] for c in cells})
        ticks = sizes if len(sizes) <= 6 else sizes[::2]
        for ax in (ax_t, ax_b):
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks)
            ax.set_xticklabels([fmt_size(s).replace(" ", "\u2009") for s in ticks], fontsize=8)
            ax.minorticks_off()
            ax.grid(True, which="major", alpha=0.3)
            ax.set_xlabel("size S")
        ax_t.set_yscale("log")
        ax_b.set_yscale("log")
        ax_t.set_ylabel("time per op (µs)")
        ax_b.set_ylabel("busbw (GB/s)")
        ax_t.set_title(f"{op}: latency", fontsize=10)
        ax_b.set_title(f"{op}: bus bandwidth", fontsize=10)
        if row == 0:
            ax_t.legend(fontsize=8)
    s = result.get("setup", {})
    fig.suptitle(f"hpcddp bench comm: {s.get('ranks')} ranks, {s.get('cpu')}, "
                 f"{s.get('mpi_library')}; medians over rounds, MAX over ranks", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_ddp(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = result.get("models", [])
    modes = ["compute", "hpcddp", "gloo"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.25
    for i, mode in enumerate(modes):
        ys = [m["stats"][mode]["steps_per_s"] for m in models if mode in m.get("stats", {})]
        xs = [j + (i - 1) * width for j in range(len(ys))]
        ax.bar(xs, ys, width, label=mode, color={"compute": "0.6", "hpcddp": "tab:blue",
                                                 "gloo": "tab:red"}[mode])
    ax.set_xticks(range(len(models)))
    ax.set_xticklabels([f"{m['model']} ({m['params'] / 1e6:.1f}M params)" for m in models])
    ax.set_ylabel("training steps/s")
    ax.legend()
    ax.set_title(f"DDP, {result.get('setup', {}).get('ranks')} ranks: median over rounds",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
