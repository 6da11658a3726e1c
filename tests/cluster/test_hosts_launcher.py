"""`train.py --hosts` / `--hostfile`: the whole job from one terminal, over real OpenSSH servers.

Each emulated server (tests/support/ssh_hosts.py) is a network namespace with its own card name and
address, its own sshd and its own copy of the program's folder; the launcher runs in the root
namespace, as from a laptop, with a plain `ssh` whose system config (a drop-in the harness removes)
knows the servers. No flag is typed per server.

Needs root and openssh-server; in CI (CI=true) their absence is a failure, never a skip.
"""

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hosts import processes_mentioning
from ssh_hosts import REPO, SshHosts, require_ssh
from throttle import CpuQuota

pytestmark = pytest.mark.usefixtures("needs_root")

SHORT = ["--epochs", "1", "--train-subset", "768", "--test-subset", "100", "--timeout", "60"]
LONG = ["--epochs", "1", "--train-subset", "19200", "--test-subset", "100", "--timeout", "60"]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # the servers' own setting: 3 ranks share this machine's 2 cores
DIGEST = re.compile(r"parameters identical on all (\d+) ranks \(sha256 ([0-9a-f]{64})\)")


class Launcher:
    """`python train.py ARGS` in `cwd` (the laptop's folder), its output collected line by line."""

    def __init__(self, h, args, cwd, env=None):
        self.lines, self.started = [], time.monotonic()
        env = dict(os.environ, **(env or {}))
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "train.py"), *args],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.monotonic() - self.started, line.decode(errors="replace").rstrip("\n")))

    @property
    def text(self):
        return "\n".join(line for _, line in self.lines)

    def wait_for(self, needle, timeout):
        """Seconds since the start until a line holds `needle`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = next((t for t, line in self.lines if needle in line), None)
            if found is not None:
                return found
            assert self.proc.poll() is None or needle in self.text, f"ended ({self.proc.returncode}):\n{self.text}"
            time.sleep(0.1)
        raise AssertionError(f"no {needle!r} within {timeout} s:\n{self.text}")

    def wait(self, timeout):
        try:
            code = self.proc.wait(timeout)
        finally:
            self.kill()
        self.reader.join(10)
        return code

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def run(h, args, cwd, timeout=90):
    launcher = Launcher(h, args, cwd)
    return launcher.wait(timeout), launcher.text


def hostfile(tmp, h, folders, slots=None, name="hostfile"):
    path = tmp / name
    slots = slots or [1] * len(folders)
    lines = ["# the servers, rank 0's first"]
    lines += [f"{name} slots={n} dir={folder}" for name, n, folder in zip(h.ssh_names, slots, folders)]
    path.write_text("\n".join(lines) + "\n")
    return path


def exit_codes(folder, ranks):
    return {r: (folder / "runs" / f"rank-{r}.exit").read_text().strip() for r in ranks}


def wait_for_exits(folders, timeout):
    """Until every rank r has written runs/rank-r.exit in folders[r]; their codes."""
    deadline = time.monotonic() + timeout
    paths = [f / "runs" / f"rank-{r}.exit" for r, f in enumerate(folders)]
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"ranks still running after {timeout} s"
        time.sleep(0.2)
    return [int(p.read_text()) for p in paths]


def nothing_running(folders):
    return not any(processes_mentioning(str(f)) for f in set(folders))


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    """3 servers, each with its own card name and address and its own copy of the folder."""
    require_ssh()
    tmp = tmp_path_factory.mktemp("three")
    with SshHosts(3, tmp, system_config=True, environment=ONE_THREAD) as h:
        yield h, h.program_folders(), tmp


def test_one_command_trains_on_three_servers_as_their_own_commands_do(three, tmp_path):
    h, folders, tmp = three
    code, out = run(h, ["--hostfile", str(hostfile(tmp, h, folders)), *SHORT], tmp_path)
    assert code == 0, out
    assert re.search(rf"^started 3 ranks on {', '.join(h.ssh_names)}; rank 0 at ([^;\s]+):(\d+);", out, re.M), out
    world, digest = DIGEST.search(out).groups()
    assert world == "3" and f"[{h.ssh_names[0]} rank 0]" in out
    for r, folder in enumerate(folders):  # each rank found its own card, and logged in its own folder
        log = (folder / "runs" / f"rank-{r}.log").read_text()
        assert h.nics[r] in log, log
        assert not (folder / "runs" / f"rank-{(r + 1) % 3}.log").exists()
    keys = [(f / "runs" / "checkpoint.pt.key") for f in folders]  # the key: over ssh only, mode 600, the same
    assert all(k.stat().st_mode & 0o777 == 0o600 for k in keys)
    assert len({k.read_bytes() for k in keys} | {(tmp_path / "runs" / "checkpoint.pt.key").read_bytes()}) == 1
    assert "the job's key: /" not in (folders[0] / "runs" / "rank-0.log").read_text()  # rank 0 made none to send
    assert digest == by_hand(h, folders, SHORT)


def by_hand(h, folders, args, port=23500):
    """The final sha256 of the same job started the original way: a person logs into each server
    (ssh, so each rank has a server's own environment) and types its command there."""
    procs = []
    try:
        for r, folder in enumerate(folders):
            argv = [sys.executable, "-u", "train.py", *args, "--rank", str(r), "--world-size", "3"]
            argv += ["--init-method", f"tcp://{h.addrs[0]}:{port}", "--gloo_socket_ifname", h.nics[r]]
            argv += ["--checkpoint", "runs/by-hand.pt", "--save-path", "runs/by-hand.pth", "--metrics", ""]
            typed = f"cd {shlex.quote(str(folder))} && {shlex.join(argv)}"
            procs.append(subprocess.Popen([*h.ssh_command, h.names[r], typed], **PIPED))
        outputs = [p.communicate(timeout=120)[0].decode() for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    return DIGEST.search(outputs[0]).group(2)


PIPED = dict(stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_the_job_outlives_its_launcher_grows_and_stops_and_resumes_from_any_terminal(three, tmp_path):
    """Started on 2 servers; the launcher killed -9; the third server added by the same command
    with --join; --status and --stop from this terminal; the launcher command with --resume ends it.
    While they are asked, the job's ranks are held to a fifth of a core each (a real CPU quota), so
    that it is still running whatever the machine's speed."""
    h, folders, tmp = three
    two = ["--hostfile", str(hostfile(tmp, h, folders[:2], name="two")), *LONG]
    launcher = Launcher(h, two, tmp_path)
    with CpuQuota("launcher-test") as quota:
        try:
            launcher.wait_for("epoch 1: ", timeout=90)
            hold(quota, folders, (0, 1))
            where = re.search(r"rank 0 at ([^;\s]+)", launcher.text).group(1)
            assert not store_holds(where, (tmp_path / "runs" / "checkpoint.pt.key").read_bytes().strip())
        finally:
            launcher.kill()  # kill -9: the job goes on
        three_servers = ["--hostfile", str(hostfile(tmp, h, folders, name="three")), *LONG]
        code, out = run(h, [*three_servers, "--join", "--detach"], tmp_path, timeout=60)
        assert code == 0 and re.search(rf"^started 1 ranks? on {h.ssh_names[2]}", out, re.M), out
        assert status_until(where, tmp_path, "3 members", timeout=60)
        wrong = tmp_path / "wrong.key"
        wrong.write_text("x" * 64)
        wrong.chmod(0o600)
        refused = stop_command(where, tmp_path, "--key-file", str(wrong))
        assert refused.returncode == 2, refused.stderr
        assert stop_command(where, tmp_path).returncode == 0
        assert wait_for_exits(folders, timeout=60) == [3, 3, 3]
    assert (folders[0] / "runs" / "checkpoint.pt").exists()
    assert re.search(r"dropped \d+ .*signature", "".join(f.read_text() for f in logs(folders))), "wrong key not counted"
    code, out = run(h, [*three_servers, "--resume"], tmp_path, timeout=180)
    assert code == 0 and "resuming" in out.lower() and DIGEST.search(out).group(1) == "3", out


def hold(quota, folders, ranks):
    """These ranks (their processes, by their pid files) to a fifth of a core each, from now on."""
    for r in ranks:
        quota.add(int((folders[r] / "runs" / f"rank-{r}.pid").read_text()))
    quota.set(0.2)


def status_until(where, cwd, needle, timeout):
    """Whether --status from this terminal shows `needle` within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        asked = subprocess.run([sys.executable, str(REPO / "train.py"), "--status", where], cwd=cwd, **TEXT)
        if asked.returncode == 0 and needle in asked.stdout:
            return True
        time.sleep(1)
    return False


def test_a_server_that_dies_while_the_job_starts_leaves_nothing_running(three, tmp_path):
    h, folders, tmp = three
    for f in folders:
        (f / "runs" / "rank-2.pid").unlink(missing_ok=True)
    launcher = Launcher(h, ["--hostfile", str(hostfile(tmp, h, folders)), *SHORT], tmp_path)
    try:
        pid_file = folders[2] / "runs" / "rank-2.pid"
        deadline = time.monotonic() + 60
        while not pid_file.exists():
            assert time.monotonic() < deadline and launcher.proc.poll() is None, launcher.text
            time.sleep(0.02)
        os.kill(int(pid_file.read_text()), signal.SIGKILL)  # before the job has formed
        code = launcher.wait(60)
    finally:
        launcher.kill()
    assert code != 0 and "rank 2 failed while the job started; stopping the others" in launcher.text, launcher.text
    time.sleep(1)
    assert nothing_running(folders), [processes_mentioning(str(f)) for f in folders]


TEXT = dict(capture_output=True, text=True, timeout=30)


def stop_command(where, cwd, *extra):
    return subprocess.run([sys.executable, str(REPO / "train.py"), "--stop", where, *extra], cwd=cwd, **TEXT)


def logs(folders):
    return [f / "runs" / f"rank-{r}.log" for r, f in enumerate(folders)]


def store_holds(where, secret):
    """Whether any value in the job's rendezvous store holds the key (read as any client could)."""
    import torch.distributed as dist

    host, port = where.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=__import__("datetime").timedelta(seconds=10))
    keys = store.list_keys()
    assert keys, "the store holds nothing: not the job's"
    return any(secret in store.get(k) for k in keys)


def test_a_keeper_brings_its_rank_back_and_ctrl_c_stops_every_rank_after_the_same_step(three, tmp_path):
    """--restart on-failure through the launcher: rank 1's training killed -9, its server's keeper
    starts it again and it joins; then Ctrl-C to the launcher stops all three after one step. The
    other ranks are held to a fifth of a core meanwhile (a real CPU quota), so the job outlasts it."""
    h, folders, tmp = three
    launcher = Launcher(h, ["--hostfile", str(hostfile(tmp, h, folders)), *LONG, "--restart", "on-failure"], tmp_path)
    with CpuQuota("launcher-test") as quota:
        try:
            launcher.wait_for("epoch 1: ", timeout=90)
            hold(quota, folders, (0, 2))
            keeper = int((folders[1] / "runs" / "rank-1.pid").read_text())
            os.kill(int(Path(f"/proc/{keeper}/task/{keeper}/children").read_text().split()[0]), signal.SIGKILL)
            launcher.wait_for("rank 1: training killed by SIGKILL; starting it again", timeout=30)
            launcher.wait_for("rank 1 joined after", timeout=60)
            os.kill(launcher.proc.pid, signal.SIGINT)
            code = launcher.wait(60)
        finally:
            launcher.kill()
    out = launcher.text
    assert code == 3, out
    steps = re.findall(r"stopped after epoch (\d+), step (\d+)/", out)
    assert len(steps) == 3 and len(set(steps)) == 1, out
    assert out.count("--resume") == 1 and re.search(r"to resume the job: .*--hostfile .*--resume$", out, re.M), out
    assert exit_codes(folders[1], [1]) == {1: "3"}  # (the keeper's: it ends with its rank's stop)


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    """h0, h1 ready; h2's sshd down; h3 takes passwords only."""
    require_ssh()
    tmp = tmp_path_factory.mktemp("broken")
    with SshHosts(4, tmp, down=(2,), password_only=(3,), system_config=True, environment=ONE_THREAD) as h:
        yield h, h.program_folders()[:2], tmp


def refused(h, args, cwd, folders, *needles):
    """The launcher's answer: exit 2, one line per needle, nothing started anywhere; its lines."""
    code, out = run(h, [*args, *SHORT], cwd, timeout=60)
    lines = out.splitlines()
    assert code == 2 and "Traceback" not in out, out
    assert lines[-1].endswith("nothing was started"), out
    for needle in needles:
        assert sum(needle in line for line in lines[:-1]) == 1, (needle, out)
    assert len(lines) == len(needles) + 1, out
    assert nothing_running(folders) and not any((f / "runs" / "rank-0.pid").exists() for f in folders)
    return lines


def test_every_problem_is_said_before_anything_starts(broken, tmp_path):
    h, folders, tmp = broken
    both = hostfile(tmp, h, folders)  # h0 and h1, each in its own folder
    h0, h1, h2, h3 = h.ssh_names
    at_h0 = ["--remote-dir", str(folders[0])]
    refused(h, ["--hosts", f"{h0},{h2}", *at_h0], tmp_path, folders, f"{h2}: ssh refused")
    refused(h, ["--hosts", f"{h0},{h3}", *at_h0], tmp_path, folders, f"{h3}: ssh asks for a password")
    refused(h, ["--hosts", f"{h0},nosuch", *at_h0], tmp_path, folders, "nosuch: unknown host")
    missing = hostfile(tmp, h, [folders[0], tmp / "not-here"], name="missing")
    refused(h, ["--hostfile", str(missing)], tmp_path, folders, f"{h1}: no folder {tmp / 'not-here'} there")
    lines = refused(h, ["--hosts", f"{h0},{h2},{h3}", *at_h0], tmp_path, folders, f"{h2}:", f"{h3}:")
    assert "1 of 3 servers are ready" in lines[-1]
    changed = folders[1] / "utils" / "errors.py"
    original = changed.read_text()
    try:
        changed.write_text(original + "\n# changed\n")
        refused(h, ["--hostfile", str(both)], tmp_path, folders, f"{h1}: {folders[1]} holds another program")
    finally:
        changed.write_text(original)
    bare = tmp / "bare"  # a Python without torch
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=60)
    python = bare / "bin" / "python"
    refused(
        h,
        ["--hostfile", str(both), "--python", str(python)],
        tmp_path,
        folders,
        f"{h0}: {python} has no module torch",
        f"{h1}: {python} has no module torch",
    )
    with taken_port(h, 0, 23999):
        refused(h, ["--hostfile", str(both), "--port", "23999"], tmp_path, folders, f"{h0}: port 23999 is in use")


class taken_port:
    """A socket listening on `port` inside host `i`'s namespace, while in the block."""

    def __init__(self, h, i, port):
        code = f"import socket,time; s=socket.socket(); s.bind(('', {port})); s.listen(); print(1, flush=True); "
        code += "time.sleep(600)"
        self.h, self.proc = h, h.cluster.popen(i, [sys.executable, "-c", code], stdout=subprocess.PIPE)

    def __enter__(self):
        assert self.proc.stdout.readline().strip() == b"1"
        return self

    def __exit__(self, *exc):
        self.h.cluster.kill(self.proc)


def test_a_folder_every_server_shares_and_two_ranks_on_one(tmp_path):
    require_ssh()
    for laptop in ("laptop", "laptop2"):
        (tmp_path / laptop).mkdir()
    with SshHosts(2, tmp_path, system_config=True) as h:
        folders = h.program_folders(shared=True)
        shared = folders[0]
        listed = hostfile(tmp_path, h, folders, slots=[2, 1])
        launcher = Launcher(h, ["--hostfile", str(listed), *LONG], tmp_path / "laptop")
        try:
            launcher.wait_for("epoch 1: ", timeout=90)
            second, out = run(h, ["--hostfile", str(listed), *SHORT], tmp_path / "laptop2", timeout=60)
            assert second == 2 and f"a job is running in {shared}" in out, out
            where = re.search(r"rank 0 at ([^;\s]+)", launcher.text).group(1)
            assert stop_command(where, tmp_path / "laptop").returncode == 0
            assert launcher.wait(90) == 3, launcher.text
        finally:
            launcher.kill()
        out = launcher.text
        assert f"already there on {h.ssh_names[1]} (a folder another server shares)" in out, out
        assert "2 hosts × 1-2 ranks (2+1), torch threads 1-2 per rank (a share of each server's cores)" in out, out
        assert [int((shared / "runs" / f"rank-{r}.exit").read_text()) for r in range(3)] == [3, 3, 3]
        written = sorted(p.name for p in (shared / "runs").glob("checkpoint.pt*"))  # (.members: every rank's, alike)
        assert written == ["checkpoint.pt", "checkpoint.pt.key", "checkpoint.pt.members"], written
        assert not list((shared / "runs").glob("*.lock"))  # rank 0's lock, released
