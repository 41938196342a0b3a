"""Which TCP peers this rank's sockets struggle to reach: evidence for a stall report.

A link that loses packets stalls collectives without killing anyone: every rank waits in the same
call and the flight recorders agree. What tells the lossy link apart is TCP's own bookkeeping,
the segments each connection had to send again. ``tcp_peers`` reads it for this process's own
sockets from `ss -tie` (iproute2: the kernel's per-socket tcp_info, which /proc does not show);
the watchdog reads it once when a call has waited a quarter of its timeout and again for the report, so
that the segments counted are the stall's own (``since``), not the healthy gigabytes before it;
``lossy_links`` turns every rank's difference into the connections that resent more than
LOSS_FRACTION of their segments and the host most of them have at one end. Only the stall report
calls this: one `ss` run per rank, a few milliseconds.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess

LOSS_FRACTION = 0.05      # TCP on a healthy LAN resends well under 1% of its segments
MIN_RETRANS = 2           # and a stalled healthy link resends none
MIN_BACKOFF = 2           # a resent segment lost again, twice: TCP's timer has grown 4-fold

_ADDRS = re.compile(r"^\s*\d+\s+\d+\s+(\S+):\d+\s+(\S+):\d+")
_INODE = re.compile(r"\bino:(\d+)")
_SEGS_OUT = re.compile(r"\bsegs_out:(\d+)")
_RETRANS = re.compile(r"\bretrans:\d+/(\d+)")
_BACKOFF = re.compile(r"\bbackoff:(\d+)")


def parse_ss(text: str, inodes: set | None = None) -> dict:
    """`ss -tineH state established` -> {"peers": {peer address: [segments sent, resent,
    backoff]}, "local": [this host's addresses]}, over the sockets whose inode is in INODES
    (None: all). Backoff: the most times in a row any socket's retransmission went
    unacknowledged (its timer doubled each time), now."""
    blocks, peers, local = [], {}, set()
    for line in text.splitlines():
        if line[:1].isspace() and blocks:
            blocks[-1] += " " + line           # ss's second line of a socket: its tcp_info
        elif line.strip():
            blocks.append(line)
    for block in blocks:
        addrs, inode = _ADDRS.match(block), _INODE.search(block)
        if not addrs or not inode or (inodes is not None and inode.group(1) not in inodes):
            continue
        local.add(addrs.group(1).strip("[]"))
        segs, resent = _SEGS_OUT.search(block), _RETRANS.search(block)
        backoff = _BACKOFF.search(block)
        count = peers.setdefault(addrs.group(2).strip("[]"), [0, 0, 0])
        count[0] += int(segs.group(1)) if segs else 0
        count[1] += int(resent.group(1)) if resent else 0
        count[2] = max(count[2], int(backoff.group(1)) if backoff else 0)
    return {"peers": peers, "local": sorted(local)}


def tcp_peers() -> dict:
    """``parse_ss`` of this process's own established TCP connections ({} where `ss` is
    missing or fails: the report then says nothing of the network)."""
    ss = shutil.which("ss") or ("/usr/sbin/ss" if os.access("/usr/sbin/ss", os.X_OK) else None)
    if ss is None:
        return {}
    try:
        out = subprocess.run([ss, "-tineH", "state", "established"], capture_output=True,
                             text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    inodes = set()
    try:
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return {}
    return parse_ss(out, inodes)


def since(before: dict, now: dict) -> dict:
    """NOW's reading less BEFORE's, per peer: what the connections sent and resent between."""
    old = before.get("peers", {})
    peers = {}
    for address, (segs, resent, backoff) in now.get("peers", {}).items():
        was = old.get(address, [0, 0, 0])
        peers[address] = [max(0, segs - was[0]), max(0, resent - was[1]), backoff]
    return {"peers": peers, "local": now.get("local", [])}


def _etc_hosts(path: str = "/etc/hosts") -> dict:
    names = {}
    try:
        with open(path) as f:
            for line in f:
                fields = line.split("#", 1)[0].split()
                if len(fields) >= 2:
                    names.setdefault(fields[0], fields[1])
    except OSError:
        pass
    return names


def lossy_links(snaps: dict) -> list:
    """Lines for the stall report: the connections (rank's host -> peer host) that resent more
    than LOSS_FRACTION of their segments, and the host at one end of every one of them.
    SNAPS: rank -> snapshot with "host" and "tcp" (``tcp_peers``); a peer address is named by
    the host whose ranks have it as a local address, else by /etc/hosts (no DNS: a stall report
    must not wait on a name server), else shown as it is."""
    host_of = _etc_hosts()
    host_of.update({a: s["host"] for s in snaps.values() if s
                    for a in (s.get("tcp") or {}).get("local", ())})
    links, ends = [], {}
    for rank, snap in sorted(snaps.items()):
        if not snap:
            continue
        for address, (segs, resent, backoff) in sorted(
                ((snap.get("tcp") or {}).get("peers") or {}).items()):
            resending = resent >= MIN_RETRANS and resent >= LOSS_FRACTION * max(segs, 1)
            if not resending and backoff < MIN_BACKOFF:
                continue
            peer = host_of.get(address, address)
            what = [f"resent {resent} of {segs} TCP segments ({100.0 * resent / max(segs, 1):.0f}%)"
                    if resending else "",
                    f"has had its resent segments go unanswered {backoff} times in a row"
                    if backoff >= MIN_BACKOFF else ""]
            links.append(f"rank {rank} ({snap['host']}) {' and '.join(w for w in what if w)} "
                         f"to {peer}")
            for host in {snap["host"], peer}:
                ends[host] = ends.get(host, 0) + 1
    if not links:
        return []
    suspect, count = max(ends.items(), key=lambda kv: kv[1])
    lines = [f"the network loses packets: {line}" for line in links]
    if count == len(links) and len(links) > 1:
        lines.append(f"every such connection has {suspect} at one end: {suspect}'s link (or "
                     f"its port, cable, driver) loses packets")
    return lines
