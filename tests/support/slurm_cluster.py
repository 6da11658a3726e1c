"""A real Slurm (slurmctld + one slurmd per node + a private munged) on emulated nodes, for tests.

Each node is an emulated server from scripts/netns.py: a network namespace with one veth NIC
named like a server's (``eth0``, ``ens3``, ``enp1s0``), all on one bridge.  Host 0 is the
controller ("login node", hostname ``ctl``): munged, slurmctld and every client command
(sbatch, squeue, scontrol, scancel) run there.  Hosts 1..N are compute nodes ``node1`` ..
``nodeN``, each running ``slurmd -D -N nodeK`` inside a UTS namespace whose hostname is
``nodeK``, so ``hostname`` in a job prints the node's name.  Jobs, slurmstepd and srun'd tasks
are children of their slurmd, so they live in that node's network namespace and see only its NIC.

Names resolve everywhere through ``/etc/netns/<namespace>/hosts``, which ``ip netns exec``
bind-mounts over /etc/hosts (the daemons, and so every job, are started that way).  Config,
state, spool dirs, pid files, the munge key and socket, and one log per daemon live in a
temporary directory; daemons get ``-f slurm.conf``, clients ``SLURM_CONF``.  munged is private
(its own key and socket, Slurm's ``AuthInfo=socket=``), so a system munged never clashes.

Leaving the ``with`` block (also by an exception or KeyboardInterrupt) cancels all jobs, SIGKILLs
every process in the namespaces (daemons, slurmstepd, tasks), deletes namespaces, the hosts files
and the temporary directory.  Needs root and Debian's ``slurm-wlm`` + ``munge``.  Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import netns

TOOLS = ["munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo", "unshare"]
CONTROLLER = "ctl"
FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
}
CLIENT_TIMEOUT = 30  # seconds for one client command (slurmctld answers in milliseconds)
ETC_NETNS = Path("/etc/netns")
TEMP_PREFIX = "slurm-emu-"

# A requeued job waits for BeginTime = end + cred_expire + 1 s (default 120 s), then for the next main
# scheduling pass (sched_interval, default 60 s). With these it runs again ~6 s after its tasks ended:
# SlurmCluster(**FAST_REQUEUE).
FAST_REQUEUE = {"auth_info": "cred_expire=5", "extra_conf": "SchedulerParameters=sched_interval=1"}

TIME_LIMIT_PERIOD = 30  # seconds between slurmctld's looks at time limits

# Sets the hostname of a fresh UTS namespace, then becomes the daemon: sh -c SCRIPT HOSTNAME ARGV...
_AS_HOST = 'hostname "$0" && exec "$@"'


class SlurmUnavailable(netns.ClusterError):
    """Not root, or slurm-wlm / munge are not installed."""


def missing_tools() -> list[str]:
    return [t for t in TOOLS if shutil.which(t) is None]


def require_slurm() -> None:
    """For the tests: where a Slurm cannot run here (not root, or not installed), fail under CI=true
    (.ci/run installs it), else skip."""
    import pytest

    problem = None if os.geteuid() == 0 else "the Slurm tests need root (network namespaces, slurmd)"
    if missing := missing_tools():
        problem = (
            f"Slurm is not installed ({', '.join(missing)} missing): "
            f"apt-get install slurmctld slurmd slurm-client munge"
        )
    if problem:
        (pytest.fail if os.environ.get("CI") == "true" else pytest.skip)(problem)


def _remove_orphans() -> None:
    """Hosts files and temp dirs of clusters whose namespaces are gone (runs SIGKILLed before teardown).

    Both carry netns names (owner pid + counter), and netns.cleanup_stale has already deleted the
    namespaces of dead owners.
    """
    live = set(netns._our_objects()[0])
    for d in ETC_NETNS.glob(f"{netns.PREFIX}*"):
        if d.name not in live:
            shutil.rmtree(d, ignore_errors=True)
    for d in Path(tempfile.gettempdir()).glob(f"{TEMP_PREFIX}{netns.PREFIX}*"):
        tag = "-".join(d.name.removeprefix(TEMP_PREFIX).split("-")[:2])  # <tag>-<mkdtemp's random part>
        if not any(ns.startswith(f"{tag}h") for ns in live):
            shutil.rmtree(d, ignore_errors=True)


class SlurmCluster:
    """`nodes` compute nodes node1..nodeN plus the controller; a context manager (see module docstring)."""

    def __init__(
        self,
        nodes: int = 2,
        workdir: str | os.PathLike | None = None,
        nics: list[str] | None = None,
        extra_conf: str = "",
        auth_info: str = "",
        ready_timeout: float = 30.0,
    ):
        self.nodes = nodes
        self.node_names = [f"node{k}" for k in range(1, nodes + 1)]
        self.net = netns.Cluster(nodes + 1, nics=nics)  # host 0 = controller, host k = node k
        self.extra_conf = extra_conf  # more slurm.conf lines
        self.auth_info = auth_info  # more AuthInfo options, e.g. "cred_expire=10"
        self.ready_timeout = ready_timeout
        self._workdir = workdir
        self.dir: Path | None = None
        self._made_etc_netns = False

    # -- addressing: index 0 is the controller, k = 1..N is node k ------------------------------
    def nic(self, node: int) -> str:
        return self.net.nic(node)

    def addr(self, node: int) -> str:
        return self.net.addr(node)

    def hostname(self, node: int) -> str:
        return CONTROLLER if node == 0 else self.node_names[node - 1]

    # -- lifecycle ------------------------------------------------------------------------------
    def __enter__(self) -> SlurmCluster:
        try:
            netns._check_privileges()
        except netns.ClusterError as e:
            raise SlurmUnavailable(str(e)) from None
        if missing := missing_tools():
            raise SlurmUnavailable(f"not installed: {', '.join(missing)} (apt-get install -y slurm-wlm munge)")
        self.net.__enter__()
        try:
            _remove_orphans()
            self.dir = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{self.net.tag}-"))
            self.dir.chmod(0o755)  # else munged warns that its socket is inaccessible to other users
            for sub in ["state", *(f"spool-{n}" for n in self.node_names)]:
                (self.dir / sub).mkdir()
            self.workdir = Path(self._workdir) if self._workdir else self.dir / "work"
            self.workdir.mkdir(parents=True, exist_ok=True)
            self.conf = self.dir / "slurm.conf"
            self._write_hosts_files()
            self._start_munged()
            self._write_conf()
            self._start(0, ["slurmctld", "-D", "-f", str(self.conf)], "slurmctld")
            for k, name in enumerate(self.node_names, 1):
                self._start(k, ["slurmd", "-D", "-N", name, "-f", str(self.conf)], f"slurmd-{name}")
            self._wait_ready()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def teardown(self) -> None:
        """Cancel all jobs, kill everything in the namespaces, remove hosts files and temp dir. Idempotent."""
        try:
            if self.dir is not None and (self.dir / "slurmctld.pid").exists():
                self.run(["scancel", f"--user={os.getuid()}"], timeout=10)  # the tasks get SIGTERM first
        except (subprocess.TimeoutExpired, OSError):
            pass
        finally:
            try:
                self.net.teardown()  # SIGKILLs every process in the namespaces: daemons, slurmstepd, tasks
            finally:
                for ns in self.net.names:
                    shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
                if self._made_etc_netns:
                    with contextlib.suppress(OSError):
                        ETC_NETNS.rmdir()  # only if empty: another cluster may be using it
                if self.dir is not None:
                    shutil.rmtree(self.dir, ignore_errors=True)
                    self.dir = None

    def _write_hosts_files(self) -> None:
        self._made_etc_netns = not ETC_NETNS.exists()
        hosts = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n" + "".join(
            f"{self.addr(k)}\t{self.hostname(k)}\n" for k in range(self.nodes + 1)
        )
        for ns in self.net.names:
            (ETC_NETNS / ns).mkdir(parents=True, exist_ok=True)
            (ETC_NETNS / ns / "hosts").write_text(hosts)

    def _start(self, host: int, argv: list[str], name: str) -> None:
        """Start daemon argv (in the foreground) on `host` under its hostname; its output to <name>.stdout."""
        with open(self.dir / f"{name}.stdout", "ab") as out:
            self.net.popen(
                host,
                ["unshare", "--uts", "sh", "-c", _AS_HOST, self.hostname(host), *argv],
                env={"SLURM_CONF": self.conf},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def _start_munged(self) -> None:
        key = self.dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.munge_socket = self.dir / "munge.socket"
        self._start(
            0,
            [
                "munged",
                "--foreground",
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--pid-file={self.dir / 'munged.pid'}",
                f"--seed-file={self.dir / 'munged.seed'}",
            ],
            "munged",
        )
        self._wait(lambda: self.munge_socket.exists(), 10, "munged did not create its socket")

    def _write_conf(self) -> None:
        cpus = len(os.sched_getaffinity(0))
        d = self.dir
        nodes = "".join(
            f"NodeName={self.hostname(k)} NodeAddr={self.addr(k)} CPUs={cpus} RealMemory=1000 State=UNKNOWN\n"
            for k in range(1, self.nodes + 1)
        )
        self.conf.write_text(f"""\
ClusterName=emu
SlurmctldHost={CONTROLLER}({self.addr(0)})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo={",".join(filter(None, [f"socket={self.munge_socket}", self.auth_info]))}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
KillWait=10
MinJobAge=30
JobRequeue=1
{nodes}PartitionName=emu Nodes=ALL Default=YES MaxTime=INFINITE State=UP
{self.extra_conf}
""")
        # slurmd 22.05 always loads a cgroup plugin, and "autodetect" fails: `ip netns exec` mounts a fresh
        # /sys, without the cgroup mounts under /sys/fs/cgroup.  cgroup/v1 loads anyway; nothing uses it.
        (self.dir / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")

    def _wait_ready(self) -> None:
        def all_idle():
            r = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], timeout=10)
            states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
            return r.returncode == 0 and all(states.get(n) == "idle" for n in self.node_names)

        self._wait(all_idle, self.ready_timeout, "the nodes did not become idle")

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                raise netns.ClusterError(f"{what} within {timeout} s\n{self.log_tails()}")
            time.sleep(0.2)

    # -- using it -------------------------------------------------------------------------------
    def run(
        self, argv: list[str], timeout: float = CLIENT_TIMEOUT, env: dict | None = None, check: bool = False
    ) -> subprocess.CompletedProcess:
        """Run a client command on the controller ("login node") with SLURM_CONF set."""
        return self.net.run_on(
            0,
            ["unshare", "--uts", "sh", "-c", _AS_HOST, CONTROLLER, *argv],
            timeout=timeout,
            env={"SLURM_CONF": self.conf, **(env or {})},
            text=True,
            check=check,
            stdin=subprocess.DEVNULL,
        )

    def sbatch(
        self,
        script: str | os.PathLike,
        *options: str,
        script_args: list[str] = (),
        cwd: str | os.PathLike | None = None,
        env: dict | None = None,
    ) -> int:
        """Submit `script` with sbatch `options`; it runs in cwd (default: the shared workdir). Returns the job id."""
        r = self.run(
            ["sbatch", "--parsable", f"--chdir={cwd or self.workdir}", *options, str(script), *script_args], env=env
        )
        if r.returncode != 0:
            raise netns.ClusterError(f"sbatch failed: {r.stderr.strip()}")
        return int(r.stdout.strip().split(";")[0])

    def job_state(self, job_id: int) -> dict | None:
        """`scontrol show job -o` as a dict (JobState, Restarts, ExitCode, RunTime, ...); None once forgotten."""
        r = self.run(["scontrol", "show", "job", "-o", str(job_id)])
        if r.returncode != 0:
            return None
        return dict(re.findall(r"(\w[\w:/]*)=(.*?)(?= \w[\w:/]*=|$)", r.stdout.strip()))

    def wait_job(self, job_id: int, states=FINAL_STATES, timeout: float = 120) -> dict:
        """Poll until the job's JobState is one of `states`; on timeout raise with squeue and log tails."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job_state(job_id)
            if info is not None and info.get("JobState") in states:
                return info
            if time.monotonic() > deadline or info is None:
                squeue = self.run(["squeue", "-a"]).stdout
                raise netns.ClusterError(
                    f"job {job_id} not in {sorted(states)} within {timeout} s: {info}\n{squeue}\n{self.log_tails()}"
                )
            time.sleep(0.5)

    def next_time_limit_check(self) -> float:
        """When (time.time()) slurmctld next looks at time limits, and so sends `--signal` warnings.

        Its background thread does that every 30 s (PERIODIC_TIMEOUT, not configurable), counted
        from its start; the log says when it started."""
        started = re.search(
            r"^\[([\d-]+T[\d:]+)\.(\d+)\] slurmctld version \S+ started", (self.dir / "slurmctld.log").read_text(), re.M
        )
        if started is None:
            raise netns.ClusterError(f"slurmctld's log does not say when it started\n{self.log_tails()}")
        base = time.mktime(time.strptime(started.group(1), "%Y-%m-%dT%H:%M:%S")) + int(started.group(2)) / 1000
        return base + TIME_LIMIT_PERIOD * (int((time.time() - base) // TIME_LIMIT_PERIOD) + 1)

    def logs(self) -> dict[str, str]:
        """Every daemon's log by file name; its stdout+stderr instead where it has no log file (munged),
        or has not opened it yet (a bad slurm.conf)."""
        if self.dir is None:
            return {}
        files = [p for p in sorted(self.dir.glob("*.stdout")) if not p.with_suffix(".log").exists()]
        return {p.name: p.read_text(errors="replace") for p in sorted(self.dir.glob("*.log")) + files}

    def log_tails(self, lines: int = 20) -> str:
        return "\n".join(
            f"--- {name} (last {lines} lines)\n" + "\n".join(text.splitlines()[-lines:])
            for name, text in self.logs().items()
        )
