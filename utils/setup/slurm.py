"""Running under Slurm: srun's environment gives the rank, the world and the rendezvous; the
warning before a time limit becomes a stop, a checkpoint and a requeue.

    step_from(environ)       the SlurmStep of an srun task, or None outside srun
    expand_hostlist(text)    "node[01-03,07],gpu1" -> node01 node02 node03 node07 gpu1
    requeue(step)            rank 0, after a stop on SIGUSR1: `scontrol requeue` if the job may be

srun starts every task of a step with SLURM_PROCID (its rank), SLURM_NTASKS (the world),
SLURM_LOCALID (its place on its node), SLURM_NODEID (its node, 0..nodes-1) and the step's nodes
in Slurm's compressed form (SLURM_STEP_NODELIST). The batch script itself runs outside any step
(it has SLURM_PROCID=0 and SLURM_JOB_ID but no SLURM_STEP_ID), so `python train.py` there, without
srun, is the local launcher, as on any machine. The rendezvous is MASTER_ADDR:MASTER_PORT where
they are set, else the step's first node, at a port every task derives alike from the job id (so
two jobs sharing a node differ).

Time limits: `#SBATCH --signal=USR1@90` has Slurm send SIGUSR1 to every task 90 s before the
limit. utils/setup/stop.py takes it as it takes SIGTERM: every rank stops after the same step and rank 0
saves the checkpoint. Then rank 0 requeues the job, if it is a batch job Slurm may requeue
(`--requeue`, or the cluster's JobRequeue=1): Slurm ends this run and queues the job again, and
its `--resume` continues from the checkpoint. A finished run exits 0 and is not requeued; SIGTERM
(scancel, or the limit itself) stops with the checkpoint and no requeue.
"""

import itertools
import re
import signal
import subprocess
from dataclasses import dataclass

from utils.errors import UsageError

FIRST_PORT, PORTS = 15000, 10000  # the derived port: FIRST_PORT + job id % PORTS (members use port + rank too)
SCONTROL_SECONDS = 30


@dataclass(frozen=True)
class SlurmStep:
    job_id: str
    step_id: str
    rank: int
    world_size: int
    local_rank: int
    node_id: int
    nodes: tuple[str, ...]
    rendezvous: str  # tcp://HOST:PORT
    restarts: int = 0  # SLURM_RESTART_COUNT: how often the job was requeued before this run


def step_from(environ):
    """The SlurmStep of this process if srun started it, else None. UsageError (one line, exit 2)
    for a Slurm environment that is incomplete or malformed."""
    if "SLURM_PROCID" not in environ or ("SLURM_STEP_ID" not in environ and "SLURM_JOB_ID" in environ):
        return None  # not Slurm's, or sbatch's own shell (a job, but no step): the local launcher
    missing = [
        name for name in ("SLURM_NTASKS", "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_NODEID") if name not in environ
    ]
    if not any(name in environ for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")):
        missing.append("SLURM_STEP_NODELIST")
    if missing:
        raise UsageError(
            f"SLURM_PROCID is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: "
            f"start train.py with srun, or give --rank, --world-size and --init-method"
        )
    rank, world_size = whole_number(environ, "SLURM_PROCID"), whole_number(environ, "SLURM_NTASKS")
    if world_size < 1 or rank >= world_size:
        raise UsageError(f"SLURM_PROCID={rank} is not a rank of SLURM_NTASKS={world_size}")
    listed = next(
        environ[name] for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if name in environ
    )
    nodes = tuple(expand_hostlist(listed))
    host = environ.get("MASTER_ADDR") or nodes[0]
    port = (
        whole_number(environ, "MASTER_PORT")
        if environ.get("MASTER_PORT")
        else FIRST_PORT + whole_number(environ, "SLURM_JOB_ID") % PORTS
    )
    if not 1 <= port <= 65535:
        raise UsageError(f"MASTER_PORT={port} is out of range (1-65535)")
    return SlurmStep(
        job_id=environ["SLURM_JOB_ID"],
        step_id=environ["SLURM_STEP_ID"],
        rank=rank,
        world_size=world_size,
        local_rank=whole_number(environ, "SLURM_LOCALID", 0),
        node_id=whole_number(environ, "SLURM_NODEID"),
        nodes=nodes,
        rendezvous=f"tcp://{host}:{port}",
        restarts=whole_number(environ, "SLURM_RESTART_COUNT", 0),
    )


def whole_number(environ, name, default=None):
    text = environ.get(name)
    if text is None and default is not None:
        return default
    if text is None or not text.strip().isdigit():
        raise UsageError(f"malformed {name}={text!r} in the Slurm environment; expected a whole number")
    return int(text)


_RANGES = r"\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*"
_ITEM = rf"(?:[A-Za-z0-9._-]|\[{_RANGES}\])+"


def expand_hostlist(text):
    """Slurm's compressed host list as a list of names, in Slurm's order: items at top-level
    commas; in each, every [ranges] multiplies (rack[1-2]-n[1-2]: rack1-n1, rack1-n2, rack2-n1, ...),
    and a range keeps its lower bound's zero padding (n[08-10]: n08 n09 n10)."""
    if not re.fullmatch(rf"{_ITEM}(?:,{_ITEM})*", text):
        raise UsageError(f"malformed Slurm node list {text!r}; expected e.g. node[01-04,07],login1")
    hosts = []
    for item in re.findall(_ITEM, text):
        parts = re.split(r"\[([^\]]*)\]", item)  # text, ranges, text, ranges, ..., text
        hosts.extend(
            "".join(names)
            for names in itertools.product(
                *([part] if i % 2 == 0 else numbers(part, text) for i, part in enumerate(parts))
            )
        )
    return hosts


def numbers(ranges, text):
    """ "01-03,7" -> ["01", "02", "03", "7"]."""
    found = []
    for piece in ranges.split(","):
        low, _, high = piece.partition("-")
        if high and int(high) < int(low):
            raise UsageError(f"malformed Slurm node list {text!r}: range {piece} runs backwards")
        found.extend(str(n).zfill(len(low)) for n in range(int(low), int(high or low) + 1))
    return found


def describe(step):
    """What rank 0's start-up line says of the Slurm step."""
    nodes = f"{len(step.nodes)} node{'s' if len(step.nodes) > 1 else ''} ({', '.join(step.nodes[:4])}"
    nodes += ", ...)" if len(step.nodes) > 4 else ")"
    restarts = f", requeued {step.restarts} time{'s' if step.restarts > 1 else ''} before" if step.restarts else ""
    return f"Slurm job {step.job_id} step {step.step_id}: {step.world_size} tasks on {nodes}{restarts}"


def requeue(step, checkpoint):
    """Rank 0, once every rank has stopped on Slurm's warning signal: queue the job again, if Slurm
    allows it. Returns the line to print."""
    try:
        shown = scontrol("show", "job", "--oneliner", step.job_id)
        fields = dict(word.split("=", 1) for word in shown.split() if "=" in word)
        if fields.get("BatchFlag") != "1":
            return f"not requeued: Slurm job {step.job_id} was not started by sbatch"
        if fields.get("Requeue") != "1":
            return f"not requeued: Slurm job {step.job_id} may not be requeued (sbatch --requeue allows it)"
        try:
            scontrol("requeue", step.job_id)
        except Requeuing:  # Slurm ended this run (and scontrol with it) to queue the job again
            pass
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        return f"could not requeue Slurm job {step.job_id}: {e}"
    return f"requeued Slurm job {step.job_id}: when it runs again it continues from {checkpoint}"


class Requeuing(Exception):
    """`scontrol requeue` was killed by SIGTERM: a requeue ends the running step at once, and
    slurmstepd signals every process of it, scontrol too, sometimes before it has exited."""


def scontrol(*words):
    done = subprocess.run(["scontrol", *words], capture_output=True, text=True, timeout=SCONTROL_SECONDS)
    if done.returncode == -signal.SIGTERM and words[0] == "requeue":
        raise Requeuing()
    if done.returncode != 0:
        raise ValueError(f"scontrol {' '.join(words)}: {(done.stderr or done.stdout).strip() or done.returncode}")
    return done.stdout
