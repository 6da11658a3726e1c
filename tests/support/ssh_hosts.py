"""Emulated servers that each run a real OpenSSH server, for the tests of a launcher that starts a job
on every server over the user's own `ssh` client.

Each host is an emulated server from scripts/netns.py (a network namespace, one veth NIC named like
a server's, all on one bridge) whose bridge has an address in the hosts' subnet (``gateway=True``),
so that this machine's root namespace, standing for the user's laptop, reaches every host. On each
host runs ``sshd -D`` under a UTS namespace whose hostname is the host's name (``h0``, ``h1``, ...).

Nothing of the user's ssh setup is read or written: /root/.ssh is never touched (ssh reads the passwd
entry's home, not $HOME). A private temporary directory holds a client key, one host key per host, an
authorized_keys, one sshd_config and one sshd log per host, a known_hosts that already knows every
host's key (as after a user's first ssh to each) and a client config with one ``Host hN`` entry per
host; ``ssh -F <that config> hN`` logs in as root by key. ``ssh_command`` is that command. With
``system_config`` the same entries go to a drop-in of ssh's system config (/etc/ssh/ssh_config.d/,
removed on the way out) under the hosts' namespace names (``ssh_names``, unique while tests run side
by side), so that a plain ``ssh NAME``, as the launcher runs it, reaches them as a user's ~/.ssh/config would.

Failure cases: a host may be ``down`` (no sshd: "Connection refused"), or ``password_only`` (its
sshd takes no key, only passwords: a BatchMode ssh ends at once, exit 255, "Permission denied");
``stop`` and ``start`` take one host's sshd away and bring it back later.

The hosts share this machine's filesystem (as a home directory on NFS would): ``program_folders``
gives each host its own copy of the program's folder at its own path, or one folder for all.

Leaving the ``with`` block (also by an exception) stops every sshd, SIGKILLs every process left in
the namespaces (the sessions and whatever they started), deletes the namespaces, veths and bridge
and the temporary directory. Needs root and openssh-server + openssh-client. Standard library only.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import netns

REPO = Path(__file__).resolve().parents[2]
SSHD = "/usr/sbin/sshd"  # sshd re-executes itself, so it must be started by its absolute path
SYSTEM_CONFIG_DIR = Path("/etc/ssh/ssh_config.d")  # system_config: ssh's own drop-ins (Debian includes *.conf)
PRIVSEP_DIR = Path("/run/sshd")  # sshd refuses to start without it (the package's unit makes it at boot)
TEMP_PREFIX = "ssh-emu-"
PROGRAM = "mnist-ring"  # the name of the program's folder on a host
STOP_TIMEOUT = 5.0  # seconds an sshd gets to exit after SIGTERM
# Sets the hostname of a fresh UTS namespace, then becomes sshd: sh -c SCRIPT HOSTNAME ARGV...
_AS_HOST = 'hostname "$0" && exec "$@"'


class SshUnavailable(netns.ClusterError):
    """Not root, or openssh-server / openssh-client are not installed."""


def require_ssh() -> None:
    """For the tests: where the ssh hosts cannot run here, fail under CI=true (.ci/run installs
    openssh), else skip."""
    import pytest

    problem = None if os.geteuid() == 0 else "the ssh hosts need root (network namespaces, sshd)"
    missing = [tool for tool in (SSHD, "ssh", "ssh-keygen", "unshare") if shutil.which(tool) is None]
    if missing:
        problem = f"not installed: {', '.join(missing)} (apt-get install openssh-server openssh-client)"
    if problem:
        (pytest.fail if os.environ.get("CI") == "true" else pytest.skip)(problem)


def sshd_version() -> tuple[int, int]:
    """(major, minor) of the installed sshd; `sshd -V` prints it, and an older sshd's usage does too."""
    r = subprocess.run([SSHD, "-V"], capture_output=True, text=True, timeout=10)
    m = re.search(r"OpenSSH_(\d+)\.(\d+)", r.stdout + r.stderr)
    if m is None:
        raise SshUnavailable(f"cannot tell the version of {SSHD}: {(r.stdout + r.stderr).strip()}")
    return int(m[1]), int(m[2])


def keygen(path: Path, comment: str) -> str:
    """A new ed25519 key without passphrase at `path` (and path.pub); returns "ssh-ed25519 <base64>"."""
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        check=True,
        capture_output=True,
        timeout=30,
    )
    return " ".join(path.with_name(path.name + ".pub").read_text().split()[:2])


def program_files(repo: Path = REPO) -> list[str]:
    """The program's folder as a clone has it: what git tracks (changes not yet committed included) and
    what it would add (new files), plus data/MNIST, which a user downloads; paths relative to `repo`."""
    r = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
        timeout=30,
    )
    listed = {p for p in r.stdout.decode().split("\0") if p}
    listed |= {str(p.relative_to(repo)) for p in (repo / "data" / "MNIST").rglob("*") if p.is_file()}
    return sorted(p for p in listed if (repo / p).is_file())  # (a tracked file deleted here is left out)


def copy_program(dest: Path, repo: Path = REPO) -> Path:
    """Copy the program's folder to `dest` (made; must not exist yet). data/ is hard-linked where it
    can be (11 MB, only ever read), the rest copied, so that a test may change one host's code."""
    dest.mkdir(parents=True)
    for name in program_files(repo):
        source, target = repo / name, dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if name.startswith("data/"):
            try:
                os.link(source, target)
                continue
            except OSError:
                pass  # another filesystem
        shutil.copy2(source, target)
    return dest


def _remove_orphans() -> None:
    """Temporary directories of earlier runs whose namespaces are gone (their owner was SIGKILLed;
    netns.cleanup_stale has deleted the namespaces of dead owners). Their names carry the cluster's tag."""
    live = netns._our_objects()[0]
    for d in Path(tempfile.gettempdir()).glob(f"{TEMP_PREFIX}{netns.PREFIX}*"):
        tag = "-".join(d.name.removeprefix(TEMP_PREFIX).split("-")[:2])  # <tag>-<mkdtemp's random part>
        if not any(ns.startswith(f"{tag}h") for ns in live):
            shutil.rmtree(d, ignore_errors=True)
    for conf in SYSTEM_CONFIG_DIR.glob(f"{netns.PREFIX}*.conf"):  # system_config's drop-ins
        if not any(ns.startswith(f"{conf.stem}h") for ns in live):
            conf.unlink(missing_ok=True)


class SshHosts:
    """`n` emulated servers h0..h<n-1>, each running sshd; a context manager (see the module docstring).

    down: hosts whose sshd is not started (start() starts it); password_only: hosts whose sshd takes
    passwords and no key. workdir: where program_folders puts the copies (default: the temporary dir).
    system_config: the hosts in a drop-in of ssh's system config (ssh_names). environment: variables
    every session on every host has (sshd's SetEnv), as a server's own settings would give them.
    """

    def __init__(
        self,
        n: int = 3,
        workdir: str | os.PathLike | None = None,
        nics: list[str] | None = None,
        down: tuple[int, ...] | list[int] = (),
        password_only: tuple[int, ...] | list[int] = (),
        ready_timeout: float = 10.0,
        system_config: bool = False,
        environment: dict[str, str] | None = None,
    ):
        self.cluster = netns.Cluster(n, nics=nics, gateway=True)
        self.n = n
        self.names = [f"h{i}" for i in range(n)]
        self.down = set(down)
        self.password_only = set(password_only)
        if not self.down | self.password_only <= set(range(n)):
            raise ValueError(
                f"down {sorted(self.down)} / password_only {sorted(self.password_only)}: hosts are 0..{n - 1}"
            )
        self.ready_timeout = ready_timeout
        self.system_config = system_config
        self.environment = dict(environment or {})  # every session's, as a server's own environment
        self._workdir = workdir
        self.dir: Path | None = None  # the temporary directory, while up
        self.workdir: Path | None = None
        self._sshd: dict[int, subprocess.Popen] = {}

    # -- what the tests and the launcher are handed ---------------------------------------------
    @property
    def addrs(self) -> list[str]:
        return [self.cluster.addr(i) for i in range(self.n)]

    @property
    def nics(self) -> list[str]:
        return list(self.cluster.nics)

    @property
    def gateway(self) -> str:
        """The root namespace's address in the hosts' subnet: where ssh connections come from."""
        return self.cluster.gateway_addr

    @property
    def config(self) -> Path:
        """The client config: `ssh -F config hN`."""
        return self.dir / "ssh_config"

    @property
    def ssh_command(self) -> list[str]:
        return ["ssh", "-F", str(self.config)]

    def ssh(self, host: int, command: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """Run `command` (a shell line) on `host` through a BatchMode ssh from the root namespace; text output."""
        return subprocess.run(
            [*self.ssh_command, "-o", "BatchMode=yes", self.names[host], command],
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )

    def program_folders(self, shared: bool = False) -> list[Path]:
        """The program's folder for each host: its own copy at its own path (workdir/hN/mnist-ring), or
        with `shared` one copy (workdir/shared/mnist-ring) that every host uses."""
        if shared:
            return [copy_program(self.workdir / "shared" / PROGRAM)] * self.n
        return [copy_program(self.workdir / name / PROGRAM) for name in self.names]

    def sshd_log(self, host: int) -> str:
        path = self.dir / f"{self.names[host]}.sshd.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # -- lifecycle ------------------------------------------------------------------------------
    def __enter__(self) -> SshHosts:
        try:
            netns._check_privileges()
        except netns.ClusterError as e:
            raise SshUnavailable(str(e)) from None
        self.cluster.__enter__()
        try:
            _remove_orphans()
            self.dir = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{self.cluster.tag}-"))
            self.workdir = Path(self._workdir) if self._workdir else self.dir / "work"
            self._sshd_version = sshd_version()
            self._write_keys_and_configs()
            if self.system_config:
                self._system_config_path().write_text(self._system_config_text())
            PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
            for host in range(self.n):
                if host not in self.down:
                    self.start(host)
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def teardown(self) -> None:
        """Stop every sshd, kill everything left in the namespaces, delete them and the temp dir. Idempotent."""
        try:
            if self.system_config:
                self._system_config_path().unlink(missing_ok=True)
            for host in list(self._sshd):
                self.stop(host)
        finally:
            try:
                self.cluster.teardown()  # SIGKILLs every process still in the namespaces: sessions and theirs
            finally:
                if self.dir is not None:
                    shutil.rmtree(self.dir, ignore_errors=True)
                    self.dir = None

    # -- one host's sshd ------------------------------------------------------------------------
    def start(self, host: int) -> None:
        """Start `host`'s sshd (in the foreground, -D, so that it is our child) and wait until it answers."""
        if host in self._sshd:
            raise netns.ClusterError(f"the sshd of {self.names[host]} is running already")
        with open(self.dir / f"{self.names[host]}.sshd.log", "ab") as log:
            self._sshd[host] = self.cluster.popen(
                host,
                [
                    "unshare",
                    "--uts",
                    "sh",
                    "-c",
                    _AS_HOST,
                    self.names[host],
                    SSHD,
                    "-D",
                    "-e",
                    "-f",
                    self._sshd_config(host),
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self._wait_ready(host)

    def stop(self, host: int) -> None:
        """Stop `host`'s sshd as `systemctl stop ssh` would: new connections are refused, sessions go on."""
        p = self._sshd.pop(host)
        p.terminate()
        try:
            p.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.cluster.kill(p)
            p.wait(timeout=STOP_TIMEOUT)

    def _wait_ready(self, host: int) -> None:
        """Until `host`'s sshd greets a connection from the root namespace ("SSH-2.0-..."), at most ready_timeout."""
        deadline = time.monotonic() + self.ready_timeout
        while not self._greets(self.addrs[host]):
            exited = self._sshd[host].poll()
            if exited is not None or time.monotonic() > deadline:
                why = f"exited with {exited}" if exited is not None else f"did not answer within {self.ready_timeout} s"
                raise netns.ClusterError(f"the sshd of {self.names[host]} {why}:\n{self.sshd_log(host)}")
            time.sleep(0.05)

    @staticmethod
    def _greets(addr: str) -> bool:
        try:
            with socket.create_connection((addr, 22), timeout=1) as s:
                s.settimeout(2)
                return s.recv(8).startswith(b"SSH-2.0-")
        except OSError:
            return False

    # -- the files ------------------------------------------------------------------------------
    def _write_keys_and_configs(self) -> None:
        d = self.dir
        client = keygen(d / "id_ed25519", "ssh-hosts client")
        (d / "authorized_keys").write_text(f"{client} ssh-hosts client\n")
        known = []
        for host, name in enumerate(self.names):
            key = keygen(d / f"{name}_host_ed25519_key", f"{name} host key")
            known.append(f"{name},{self.addrs[host]} {key}\n")
            (d / f"{name}.sshd_config").write_text(self._sshd_config_text(host))
        (d / "known_hosts").write_text("".join(known))
        self.config.write_text("".join(self._client_entry(host) for host in range(self.n)))

    @property
    def ssh_names(self) -> list[str]:
        """The names a plain `ssh NAME` knows the hosts by: with system_config, their namespaces'
        names (unique on this machine, while tests run side by side), else the names of `config`."""
        return list(self.cluster.names) if self.system_config else list(self.names)

    def _system_config_path(self) -> Path:
        return SYSTEM_CONFIG_DIR / f"{self.cluster.tag}.conf"

    def _system_config_text(self) -> str:
        entries = [
            self._client_entry(host).replace(f"Host {self.names[host]}\n", f"Host {self.ssh_names[host]}\n")
            for host in range(self.n)
        ]
        known = self.dir / "known_hosts"
        known.write_text(
            known.read_text()
            + "".join(
                f"{self.ssh_names[h]} {line.split(' ', 1)[1]}"
                for h, line in enumerate(known.read_text().splitlines(True))
            )
        )
        return "".join(entries)

    def _sshd_config(self, host: int) -> str:
        return str(self.dir / f"{self.names[host]}.sshd_config")

    def _sshd_config_text(self, host: int) -> str:
        name, d = self.names[host], self.dir
        password = host in self.password_only
        # from OpenSSH 9.8 sshd shuts out an address after a few failed logins; all tests come from one
        penalties = "PerSourcePenalties no\n" if self._sshd_version >= (9, 8) else ""
        return f"""\
# {name}: namespace {self.cluster.names[host]}, {self.nics[host]} {self.addrs[host]}
ListenAddress {self.addrs[host]}
Port 22
HostKey {d}/{name}_host_ed25519_key
AuthorizedKeysFile {d}/authorized_keys
PidFile {d}/{name}.sshd.pid
StrictModes no
UsePAM no
PermitRootLogin {"yes" if password else "prohibit-password"}
PubkeyAuthentication {"no" if password else "yes"}
PasswordAuthentication {"yes" if password else "no"}
KbdInteractiveAuthentication no
UseDNS no
PrintMotd no
PrintLastLog no
X11Forwarding no
{penalties}{"".join(f"SetEnv {k}={v}{chr(10)}" for k, v in self.environment.items())}"""

    def _client_entry(self, host: int) -> str:
        d = self.dir
        return f"""\
Host {self.names[host]}
    HostName {self.addrs[host]}
    User root
    IdentityFile {d}/id_ed25519
    IdentitiesOnly yes
    UserKnownHostsFile {d}/known_hosts
    GlobalKnownHostsFile /dev/null
    StrictHostKeyChecking yes
    UpdateHostKeys no
    ControlMaster no
    ControlPath none
"""
