"""How many torch threads a rank takes: its share of its server's cores.

torch takes every core of the server by default. Several ranks on one server (the local launcher's,
scripts/cluster.py's emulated hosts, several per-server commands, torchrun's or Slurm's tasks on one
node) would each take them all and fight over them: 3 ranks on 2 cores stepped several times slower
than with a core between them (bench/regression/NOTES.md). So once the group is up, the ranks tell
each other their machine and the CPUs they may run on, and each takes its share:

    threads = max(1, floor( sum over this rank's CPUs c of 1 / (ranks of its machine that may run on c) ))

capped by Slurm's --cpus-per-task. One rank on a server keeps every core; 3 ranks on 2 cores take
1 each; tasks pinned to CPUs of their own (Slurm's binding, taskset) keep theirs. The same rule runs
after every change of members (a survivor alone on its server takes the cores freed).

Unless the user chose: an OMP_NUM_THREADS they set is kept. The launchers that load torch for their
ranks set it themselves to this rule's answer (a fork is faithful only if torch loaded with its
child's count: utils/setup/fork.py) and say so in the handoff (threads_from_launcher); torchrun sets
it to 1 when it starts several ranks, unless its own environment had it.

    share(cpus, ranks)                  a launcher's ranks, all on `cpus`: each one's threads
    users_choice(environ, handoff)      the OMP_NUM_THREADS the user set, or None
    ServerShare(environ, handoff)       a rank's: .follow() (a collective) sets its threads, returns every rank's
    describe(counts, fixed)             "1 torch thread per rank" for the start line
"""

import os
import socket
from fractions import Fraction

VARIABLE = "OMP_NUM_THREADS"
MAX_CPUS = 1 << 16  # a CPU number a peer may name


def cpus_here():
    """The CPUs this process may run on (its affinity: Slurm's binding, taskset, a cpuset)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def machine_key():
    """What makes this machine, whose cores its ranks share: hostname and boot id. Not the network
    namespace nor the card (the hierarchical sum's host_key has them): emulated hosts share the cores."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "-"
    return f"{socket.gethostname()}/{boot}"


def share(cpus, ranks):
    """Threads for each of `ranks` ranks that may all run on `cpus` (a count of CPUs)."""
    return max(1, cpus // max(1, ranks))


def threads_of(me, entries):
    """The rule, for entry `me` of `entries` (every rank's {machine, cpus, cap}): its share of each of
    its CPUs among the ranks of its machine that may run there, summed, at least 1, at most its cap."""
    mine = entries[me]
    neighbours = [e["cpus"] for e in entries if e["machine"] == mine["machine"]]
    total = sum((Fraction(1, sum(c in cpus for cpus in neighbours)) for c in mine["cpus"]), Fraction(0))
    threads = max(1, int(total))
    return min(threads, mine["cap"]) if mine["cap"] else threads


def users_choice(environ, handoff, parent_environ=None):
    """The OMP_NUM_THREADS the user set (text), or None: unset, set by a launcher of ours (the handoff
    says), or torchrun's default (its agent, this process's parent, was started without it)."""
    value = environ.get(VARIABLE)
    if value is None or handoff.threads_from_launcher:
        return None
    if "TORCHELASTIC_RUN_ID" in environ:
        agent = parent_environ if parent_environ is not None else _parent_environ()
        if agent is not None and VARIABLE not in agent:
            return None
    return value


def _parent_environ():
    """The environment this process's parent was started with, or None (not readable)."""
    try:
        with open(f"/proc/{os.getppid()}/environ", "rb") as f:
            pairs = f.read().split(b"\0")
    except OSError:
        return None
    return {p.split(b"=", 1)[0].decode(errors="replace"): "" for p in pairs if b"=" in p}


def slurm_cap(environ):
    """Slurm's --cpus-per-task for a task of a step (SLURM_CPUS_PER_TASK), or None."""
    value = environ.get("SLURM_CPUS_PER_TASK", "") if "SLURM_PROCID" in environ else ""
    return int(value) if value.isdigit() and int(value) > 0 else None


def checked(entry):
    """A peer's entry, as used: {machine: text, cpus: [whole numbers], cap: None or a whole number,
    fixed: None or text}; anything else stands for a rank that shares no CPU (so changes nobody's share)."""
    ok = (
        isinstance(entry, dict)
        and isinstance(entry.get("machine"), str)
        and isinstance(entry.get("cpus"), list)
        and 0 < len(entry["cpus"]) <= MAX_CPUS
        and all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c < MAX_CPUS for c in entry["cpus"])
        and (entry.get("cap") is None or (isinstance(entry["cap"], int) and 0 < entry["cap"] <= MAX_CPUS))
        and (entry.get("fixed") is None or isinstance(entry["fixed"], str))
    )
    if not ok:
        return {"machine": "(malformed)", "cpus": [-1], "cap": None, "fixed": None}
    return {"machine": entry["machine"], "cpus": entry["cpus"], "cap": entry["cap"], "fixed": entry.get("fixed")}


class ServerShare:
    """A rank's torch threads, following who shares its server. environ, handoff: this process's."""

    def __init__(self, environ=os.environ, handoff=None):
        from utils.setup.handoff import Handoff

        handoff = handoff if handoff is not None else Handoff.from_environ(environ)
        self.fixed, self.cap = users_choice(environ, handoff), slurm_cap(environ)
        self.counts, self.fixed_by = [], []

    def follow(self):
        """A collective over the default group: every rank's machine and CPUs; this rank takes its share
        (torch.set_num_threads) unless the user chose. Returns every rank's threads, in rank order."""
        import torch
        import torch.distributed as dist

        from utils.exchange import all_gather_json

        mine = {"machine": machine_key(), "cpus": cpus_here(), "cap": self.cap, "fixed": self.fixed}
        entries = [checked(e) for e in all_gather_json(mine)]
        me = dist.get_rank()
        counts = [threads_of(r, entries) for r in range(len(entries))]
        if self.fixed is None and torch.get_num_threads() != counts[me]:
            torch.set_num_threads(counts[me])
        self.counts = [torch.get_num_threads() if r == me else counts[r] for r in range(len(entries))]
        self.fixed_by = [e["fixed"] is not None for e in entries]
        for r, e in enumerate(entries):  # the others' own choices, as they will report them
            if r != me and e["fixed"] is not None and e["fixed"].isdigit():
                self.counts[r] = int(e["fixed"])
        return self.counts

    def describe(self):
        return describe(self.counts, any(self.fixed_by))


def describe(counts, fixed=False):
    """'1 torch thread per rank' or 'torch threads 1-4 per rank', then whose: '(OMP_NUM_THREADS)' if a user chose."""
    low, high = min(counts), max(counts)
    words = (
        f"{low} torch thread{'s' if low > 1 else ''} per rank"
        if low == high
        else f"torch threads {low}-{high} per rank"
    )
    return words + (f" ({VARIABLE})" if fixed else " (a share of each server's cores)")
