"""The emulated ssh servers (tests/support/ssh_hosts.py) work: `ssh -F config hN` from the root namespace
lands in host N's namespace, by key; a password-only host refuses a BatchMode ssh at once, a host without
sshd refuses the connection; the program's folders are there; and nothing is left behind.

Needs root and openssh-server + openssh-client; in CI (CI=true) their absence is a failure, never a skip.
"""

import os
import pwd
import re
import subprocess
import time
import uuid
from pathlib import Path

import netns
import pytest
from hosts import left_of, processes_mentioning
from ssh_hosts import REPO, SshHosts, require_ssh

pytestmark = pytest.mark.usefixtures("needs_root")  # tests/conftest.py

ROOT_SSH = Path(pwd.getpwuid(0).pw_dir) / ".ssh"  # what ssh would read; the harness must never make it


@pytest.fixture
def ssh_installed():
    require_ssh()


def what_exists(h):
    """The names and the temporary directory of `h`, to look for after it is gone."""
    c = h.cluster
    return [*c.names, *c.veths, c.bridge], str(h.dir)


def assert_nothing_left(names, temp_dir):
    assert not left_of(names), left_of(names)
    assert not processes_mentioning(temp_dir)  # every sshd names its config there
    assert not os.path.exists(temp_dir)


@pytest.mark.timeout(60)
def test_ssh_lands_in_each_host_s_namespace_by_key(ssh_installed, tmp_path):
    root_ssh_before = ROOT_SSH.exists()
    with SshHosts(3, tmp_path) as h:
        names, temp_dir = what_exists(h)
        assert len(set(h.addrs)) == len(set(h.nics)) == 3 and h.names == ["h0", "h1", "h2"]
        assert h.gateway.rsplit(".", 1)[0] == h.addrs[0].rsplit(".", 1)[0]
        assert (
            f"inet {h.gateway}/24"
            in subprocess.run(
                ["ip", "-o", "-4", "addr", "show", "dev", h.cluster.bridge], capture_output=True, text=True, timeout=15
            ).stdout
        )
        for i in range(3):
            r = h.ssh(i, 'hostname; echo "from $SSH_CONNECTION"; ip -o addr')
            assert r.returncode == 0, (r.stderr, h.sshd_log(i))
            assert r.stdout.startswith(f"h{i}\nfrom {h.gateway} "), r.stdout
            assert re.search(rf"^\d+: {h.nics[i]}\s+inet {re.escape(h.addrs[i])}/24 ", r.stdout, re.M), r.stdout
            assert not {a for a in h.addrs if f"inet {a}/" in r.stdout} - {h.addrs[i]}, r.stdout
            assert f"Accepted publickey for root from {h.gateway}" in h.sshd_log(i)
    assert_nothing_left(names, temp_dir)
    assert ROOT_SSH.exists() == root_ssh_before


@pytest.mark.timeout(60)
def test_a_password_only_host_a_down_host_and_a_stopped_sshd_fail_at_once(ssh_installed, tmp_path):
    marker = uuid.uuid4().hex  # in the command lines of a session's client and shell, and of nothing else
    session = None
    try:
        with SshHosts(3, tmp_path, down=[2], password_only=[1]) as h:
            names, temp_dir = what_exists(h)
            started = time.monotonic()
            r = h.ssh(1, "true", timeout=20)
            assert (r.returncode, time.monotonic() - started < 5) == (255, True), r
            assert "Permission denied (password)" in r.stderr, r.stderr
            refused(h, 2)
            session = subprocess.Popen(
                [*h.ssh_command, "-o", "BatchMode=yes", "h0", f"sleep 300; echo {marker}"], stdin=subprocess.DEVNULL
            )
            shell = lambda: set(processes_mentioning(marker)) - {session.pid}  # noqa: E731
            wait_for(shell, what="the session's shell on h0")
            h.stop(0)
            refused(h, 0)
            assert session.poll() is None and shell()  # the session goes on
            h.start(0)
            h.start(2)
            assert [h.ssh(i, "hostname").stdout for i in (0, 2)] == ["h0\n", "h2\n"]
        assert session.wait(timeout=10) == 255  # its server side was killed with the namespace's processes
    finally:
        if session is not None and session.poll() is None:
            session.kill()
            session.wait()
    assert not processes_mentioning(marker)
    assert_nothing_left(names, temp_dir)


def refused(h, host):
    started = time.monotonic()
    r = h.ssh(host, "true", timeout=20)
    assert (r.returncode, time.monotonic() - started < 5) == (255, True), r
    assert f"connect to host {h.addrs[host]} port 22: Connection refused" in r.stderr, r.stderr


def wait_for(condition, what, timeout=10):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_each_host_has_its_own_copy_of_the_program_or_one_shared(ssh_installed, tmp_path):
    with SshHosts(2, tmp_path / "own") as h:
        folders = h.program_folders()
        assert folders == [tmp_path / "own" / name / "mnist-ring" for name in ("h0", "h1")]
        for i, folder in enumerate(folders):
            assert (folder / "train.py").read_bytes() == (REPO / "train.py").read_bytes()
            assert {p.name for p in (folder / "utils").iterdir()} == {p.name for p in (REPO / "utils").iterdir()} - {
                "__pycache__"
            }
            data = [p for p in (REPO / "data" / "MNIST").rglob("*") if p.is_file()]  # (the .gz, maybe unpacked too)
            assert len([p for p in data if p.suffix == ".gz"]) == 4, data
            assert all((folder / p.relative_to(REPO)).samefile(p) for p in data)
            r = h.ssh(i, f"cd {folder} && ls train.py utils/setup/program.py data/MNIST/raw/*.gz | wc -l")
            assert (r.returncode, r.stdout) == (0, "6\n"), r
        (folders[0] / "train.py").write_text("# changed on h0 only\n")  # a copy, not a link
        assert (folders[1] / "train.py").read_bytes() == (REPO / "train.py").read_bytes()
    with SshHosts(2, tmp_path / "shared") as h:
        folders = h.program_folders(shared=True)
        assert folders == [tmp_path / "shared" / "shared" / "mnist-ring"] * 2 and (folders[0] / "train.py").is_file()


@pytest.mark.timeout(30)
def test_a_gateway_cluster_moves_off_a_subnet_the_root_namespace_has(needs_root):
    """Another process's gateway cluster may have been given the same subnet: the second one moves."""
    with netns.Cluster(1, gateway=True) as first:
        second = netns.Cluster(1, gateway=True)
        second.subnet = first.subnet  # as another process's counter would have it
        with second:
            assert second.subnet != first.subnet and second.gateway_addr == f"{second.subnet}.254"
        names = [*second.names, *second.veths, second.bridge]
    assert not left_of(names + [*first.names, *first.veths, first.bridge])
    assert netns.Cluster(1).gateway_addr is None
