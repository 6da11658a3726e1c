"""What the benchmarks measure with: the load check that tells a quiet machine from a busy one, and
the paired statistics that compare configurations measured side by side (bench/common/NOTES.md, "How
they run").

    load        proc_table, descendants, loadavg, cpu_snapshot, LoadWatch, quiet
    statistics  sign_test_p, p_text, paired_ratios, compare, ratios_to_gloo, quantile,
                median_or_none, fmt
    tables      md_row, md_head
"""

from __future__ import annotations

import math
import os
import resource
import statistics
import time
from pathlib import Path

QUIET_FOREIGN_CORES = 0.1  # more than this used by other processes: the timings may be inflated
QUIET_EXTRA_BUSY_CORES = 0.6  # nor this much CPU busy beyond our ranks (kernel networking included)


def proc_table() -> dict[int, tuple[int, int, str]]:
    """{pid: (parent pid, utime + stime clock ticks, command name)} of every process now."""
    out = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            head, tail = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)
            fields = tail.split()
            out[int(d)] = (int(fields[1]), int(fields[11]) + int(fields[12]), head.split("(", 1)[1])
        except (OSError, IndexError, ValueError):
            pass
    return out


def descendants(pids: set[int]) -> set[int]:
    """pids and all their descendants (ranks run under `ip netns exec`)."""
    parent = {pid: ppid for pid, (ppid, _, _) in proc_table().items()}
    out, grew = set(pids), True
    while grew:
        new = {p for p, pp in parent.items() if pp in out and p not in out}
        out |= new
        grew = bool(new)
    return out


def loadavg() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")


def cpu_snapshot() -> dict:
    """Every process's CPU ticks, /proc/stat's busy and total ticks, our reaped children's CPU seconds."""
    cpu = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy, children = sum(cpu) - cpu[3] - cpu[4], ru.ru_utime + ru.ru_stime
    return dict(procs=proc_table(), busy=busy, total=sum(cpu), children=children, t=time.monotonic(), loadavg=loadavg())


class LoadWatch:
    """How busy the machine was besides one world's ranks, from its start to result() (after the
    ranks were reaped). On a shared 2-core machine this says whether a run's timings can be trusted.
    note(procs), called while they run, learns the ranks' descendants (about once a second)."""

    def __init__(self):
        self.before, self.ours, self.noted = cpu_snapshot(), set(), 0.0

    def note(self, procs) -> None:
        if time.monotonic() - self.noted >= 1.0:
            self.ours |= descendants({p.pid for p in procs})
            self.noted = time.monotonic()

    def result(self, procs) -> dict:
        """foreign_cpu_cores: other processes alive at the end (ones that came and went are missed);
        busy_cores: all CPUs, kernel networking included; ours_cores: our ranks."""
        before, after = self.before, cpu_snapshot()
        ours = self.ours | {p.pid for p in procs} | {os.getpid()}
        hz, wall = os.sysconf("SC_CLK_TCK"), max(after["t"] - before["t"], 1e-9)
        earlier = {pid: ticks for pid, (_, ticks, _) in before["procs"].items()}
        used = [(t - earlier.get(pid, 0), name, pid) for pid, (_, t, name) in after["procs"].items()]
        used = sorted((u for u in used if u[2] not in ours and u[0] > 0), reverse=True)
        busy = (after["busy"] - before["busy"]) / max(after["total"] - before["total"], 1) * (os.cpu_count() or 1)
        return {
            "foreign_cpu_cores": round(sum(u[0] for u in used) / hz / wall, 2),
            "foreign_top": [f"{name}[{pid}] {d / hz / wall:.2f}" for d, name, pid in used[:4]],
            "busy_cores": round(busy, 2),
            "ours_cores": round((after["children"] - before["children"]) / wall, 2),
            "loadavg_before": before["loadavg"],
            "loadavg_after": after["loadavg"],
            "seconds": round(wall, 1),
        }


def quiet(load: dict) -> bool:
    """True if nothing but our ranks used the machine's CPUs to speak of."""
    foreign, extra = load["foreign_cpu_cores"], load["busy_cores"] - load["ours_cores"]
    return foreign <= QUIET_FOREIGN_CORES and extra <= QUIET_EXTRA_BUSY_CORES


# --------------------------------------------------------------------------- statistics
def sign_test_p(faster: int, total: int) -> float:
    """Two-sided sign test: how likely a split at least this uneven is if neither side is faster.

    Paired repetitions ran side by side, so each is a coin toss under "no difference"; p < 0.05
    means the difference is real, p above it means the runs cannot tell the two apart.
    """
    if total == 0:
        return 1.0
    k = min(faster, total - faster)
    return min(1.0, 2 * sum(math.comb(total, i) for i in range(k + 1)) / 2**total)


def p_text(p: float) -> str:
    """A sign test's p for a report line: small ones as 'p<0.001', not as a rounded 'p=0.00'."""
    return "p<0.001" if p < 0.001 else f"p={p:.3f}" if p < 0.01 else f"p={p:.2f}"


def paired_ratios(a: list[float], b: list[float]) -> list[float]:
    """a's times over b's, round by round: both ran in the same round, under the same load, so
    slow drifts of the machine cancel."""
    return [x / y for x, y in zip(a, b)]


def compare(a: list[float], b: list[float], bound: float) -> dict:
    """a's times against b's (paired, same rounds): the medians' ratio, the paired median, the rounds
    a was faster in and the sign test. PASS only if both ratios are within `bound`: on a shared
    machine the two can differ by 5-10%, and either alone can flatter."""
    paired = paired_ratios(a, b)
    ratio, pm = statistics.median(a) / statistics.median(b), statistics.median(paired)
    faster = sum(x < 1 for x in paired)
    status = "PASS" if max(ratio, pm) <= bound else "MISS"
    out = dict(status=status, ratio=ratio, paired_median_ratio=pm, bound=bound, rounds_faster=faster)
    return dict(out, rounds=len(paired), sign_test_p=sign_test_p(faster, len(paired)))


def ratios_to_gloo(results: list[dict], reference: str = "gloo") -> dict:
    """{(N, size, algorithm): [time / gloo's time, per repetition]} for all-reduce results rows
    (bench/allreduce/allreduce.py) that ran side by side with gloo (or `reference`), the same number of
    repetitions."""
    gloo = {(r["world_size"], r["size"]): r["times_ms"] for r in results if r["algorithm"] == reference}
    out = {}
    for r in results:
        ref = gloo.get((r["world_size"], r["size"]))
        if r["algorithm"] != reference and ref and len(ref) == len(r["times_ms"]):
            out[r["world_size"], r["size"], r["algorithm"]] = paired_ratios(r["times_ms"], ref)
    return out


def quantile(xs: list[float], f: float) -> float:
    """Quantile f of xs (linear interpolation)."""
    s, i = sorted(xs), f * (len(xs) - 1)
    lo = math.floor(i)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (i - lo)


def median_or_none(xs, scale=1.0) -> float | None:
    """The median of the known values of xs, times scale; None if none is known."""
    xs = [x for x in (xs or []) if x is not None]
    return statistics.median(xs) * scale if xs else None


def fmt(x, spec="{:.2f}", none="-"):
    return none if x is None else spec.format(x)


# --------------------------------------------------------------------------- tables
def md_row(*cells) -> str:
    """A markdown table's row."""
    return "| " + " | ".join(map(str, cells)) + " |"


def md_head(names, aligns: str) -> list[str]:
    """A markdown table's first two rows: the column names, and their alignments one letter each
    (r --:, l :--, c :-:, - ---)."""
    marks = {"r": "--:", "l": ":--", "c": ":-:", "-": "---"}
    return [md_row(*names), "|" + "|".join(marks[a] for a in aligns) + "|"]
