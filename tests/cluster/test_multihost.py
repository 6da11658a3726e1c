"""Multi-host for real: train.py on emulated servers (scripts/cluster.py), one rank per server
(and two per server for the hierarchical ring).

Each emulated server is a network namespace whose only NIC has a server-like name
(eth0, ens3, enp1s0), so gloo can only talk over the NIC it was told to use.  The
ranks are started exactly as the README tells users (Cluster.train_argv).

They need root (CAP_NET_ADMIN); in CI (CI=true) they run as root and must not skip.
Every test has a pytest timeout and its own hard deadlines; leaving a `with Cluster`
block (also by an exception) kills every process in the namespaces and deletes them.
"""

import hashlib
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import cluster
import netns
import pytest
import torch
from forker import popen
from hosts import ENV, NICS, _created, existing_names, left_of, remember, report, start_ranks, wait_ranks

from utils.learn.model import Net, parameter_vector

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"

PY = sys.executable
GRADIENT_BYTES = sum(p.numel() for p in Net().parameters()) * 4
SHA_LINE = r"saved the model to (\S+); parameters identical on all {n} ranks \(sha256 ([0-9a-f]{{64}})\)"

pytestmark = pytest.mark.usefixtures("needs_root")  # tests/conftest.py


# -- helpers ------------------------------------------------------------------------------------


def digest_of(path):
    model = Net()
    model.load_state_dict(torch.load(path, weights_only=True))
    flat = parameter_vector(model)
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def nic_bytes(c, rank, nic=None):
    """(rx, tx) byte counters of `nic` (default: the host's NIC), read inside host `rank`."""
    nic = nic or c.nic(rank)
    stats = f"/sys/class/net/{nic}/statistics"
    r = c.run_on(rank, ["cat", f"{stats}/rx_bytes", f"{stats}/tx_bytes"], timeout=10, text=True, check=True)
    rx, tx = map(int, r.stdout.split())
    return rx, tx


# -- tests --------------------------------------------------------------------------------------


@pytest.mark.timeout(150)
def test_three_hosts_with_different_nics_find_them_and_train_to_identical_parameters(tmp_path):
    """Started without --gloo_socket_ifname, each rank finds its host's NIC (the route toward rank 0;
    rank 0's own address: its NIC, not lo) and names it; the same job with the README's flags ends
    with the same model file. Also --timeline on rank 0 alone (one timeline on aligned clocks):
    every host records, rank 0 writes; host 2's clock is 3 s ahead."""
    from trace_checks import FIRST, LAST, check_trace

    subset, world, batch, trace = 1500, 3, 32, tmp_path / "timeline.json"
    saves = [tmp_path / f"host{r}" / "model.pth" for r in range(world)]  # one filesystem: a path each
    given = tmp_path / "given"  # the run with --gloo_socket_ifname, in a folder of its own
    given.mkdir()
    with remember(cluster.Cluster(world, nics=NICS, starter=popen)) as c:
        assert [c.nic(r) for r in range(world)] == NICS

        def argvs(card, folder):
            job = ["--epochs", "1", "--test-subset", "1000", "--train-subset", str(subset), "--batch-size", str(batch)]
            outputs = ["--metrics", "", "--save-path", "model.pth", "--timeout", "60"]  # (in the host's folder)
            window = [
                "--timeline",
                str(folder / trace.name),
                "--timeline-steps",
                f"{FIRST}:{LAST}",
            ]  # 16 steps: it fits
            return [c.train_argv(r, 29500, [*job, *outputs, *(window if r == 0 else [])], card) for r in range(world)]

        before = [nic_bytes(c, r) for r in range(world)]
        lo_before = [nic_bytes(c, r, "lo") for r in range(world)]
        skewed = {**ENV, "TIMELINE_TEST_CLOCK_SKEW_S": "0,0,-3"}
        results = wait_ranks(c, start_ranks(c, argvs(False, tmp_path), tmp_path, env=skewed), tmp_path, timeout=90)
        after = [nic_bytes(c, r) for r in range(world)]
        lo_after = [nic_bytes(c, r, "lo") for r in range(world)]
        with_flag = wait_ranks(c, start_ranks(c, argvs(True, given), given, env=skewed), given, timeout=90)
    assert left_of(_created[-(2 * world + 1) :]) == []

    assert [code for code, *_ in results] == [0] * world, report(results)
    out0 = results[0][1]
    for _code, out, err, _ in results:
        assert "Traceback" not in out + err, report(results)
    rank_0 = c.addr(0)
    assert (
        out0.splitlines()[0] == f"rank 0: gloo over {c.nic(0)} ({rank_0}), the card holding rank 0's address {rank_0}"
    )
    assert [out for _, out, _, _ in results[1:]] == [  # the others say their card, and nothing else
        f"rank {r}: gloo over {c.nic(r)} ({c.addr(r)}), the card toward rank 0 at {rank_0}\n" for r in (1, 2)
    ], report(results)

    # bit-identical parameters on every rank: rank 0 compared all ranks' sha256; the file has them
    m = re.search(SHA_LINE.format(n=world), out0)
    assert m, out0
    assert Path(m[1]) == Path("model.pth")
    assert digest_of(saves[0]) == m[2]
    assert not saves[1].exists() and not saves[2].exists()  # only rank 0 writes
    assert f"timeline of steps {FIRST}-{LAST} written to {trace}" in out0
    check_trace(trace, world=world, buckets=2, overlap=True, lazy=False, skews=(0, 0, -3))
    # the card changes no arithmetic: the README's command, with the flag, saves the same bits, and says no card
    assert [code for code, *_ in with_flag] == [0] * world, report(with_flag)
    assert "gloo over" not in "".join(out for _, out, _, _ in with_flag), report(with_flag)
    assert re.search(SHA_LINE.format(n=world), with_flag[0][1])[2] == m[2], report(with_flag)
    assert (given / "host0" / "model.pth").read_bytes() == saves[0].read_bytes()

    # well above chance (10 %), and the saved model scores exactly what rank 0 reported
    reported = re.findall(r"test accuracy ([\d.]+)%", out0)
    assert len(reported) == 1 and float(reported[0]) > 60.0, out0
    ev = subprocess.run(
        [PY, str(REPO / "train.py"), "--eval", "--test-subset", "1000", "--model_path", str(saves[0])],
        capture_output=True,
        text=True,
        timeout=40,
        env={**os.environ, **ENV},
    )
    assert ev.returncode == 0, ev.stderr
    assert re.findall(r"test accuracy ([\d.]+)%", ev.stdout) == reported, (ev.stdout, out0)

    # gloo used each host's NIC: every step each rank sends and receives at least one full
    # gradient on it (default two-pass ring: rank 0 sends twice, rank 1 receives twice, rank 2
    # sends and receives once - its tx is barely above the bound, as veth counts GSO frames)
    steps = math.ceil(subset // world / batch)  # each rank's share of the epoch, in batches
    least = steps * GRADIENT_BYTES
    for r in range(world):
        rx, tx = (a - b for a, b in zip(after[r], before[r]))
        assert rx >= least and tx >= least, f"{c.nic(r)} on host {r}: rx {rx:,} tx {tx:,} B < {least:,} B"
        lo = sum(lo_after[r]) - sum(lo_before[r])
        print(f"host {r} {c.nic(r)}: rx {rx:,} B, tx {tx:,} B (at least {least:,}); lo {lo:,} B")
        assert lo < GRADIENT_BYTES, f"host {r} moved {lo:,} B over lo"  # no gradient took a shortcut


@pytest.mark.timeout(120)
def test_two_ranks_per_host_train_hierarchically_to_identical_parameters(tmp_path):
    """--ranks-per-host 2: the ranks find their hosts (namespaces with one hostname: the netns and
    the NIC's address tell them apart), sum within a host over loopback, and only 2(H-1)/H of the
    gradient per step crosses each host's card (a flat ring of 4 ranks: 2(4-1)/4 = 1.5 of it)."""
    hosts, k, subset, batch = 2, 2, 1280, 16
    world = hosts * k
    save = tmp_path / "host0" / "model.pth"
    with remember(cluster.Cluster(hosts, nics=NICS, ranks_per_host=k, starter=popen)) as c:
        argvs = [
            c.train_argv(
                r,
                29500,
                [
                    "--epochs",
                    "1",
                    "--test-subset",
                    "1000",
                    "--train-subset",
                    str(subset),
                    "--batch-size",
                    str(batch),
                    "--allreduce",
                    "hierarchical",
                    "--lazy-update",
                    "--metrics",
                    "",
                    "--save-path",
                    str(save),
                    "--timeout",
                    "60",
                ],
            )
            for r in range(world)
        ]
        before = [nic_bytes(c, h) for h in range(hosts)]
        results = wait_ranks(c, start_ranks(c, argvs, tmp_path), tmp_path, timeout=100)
        after = [nic_bytes(c, h) for h in range(hosts)]
    assert left_of(_created[-(2 * hosts + 1) :]) == []

    assert [code for code, *_ in results] == [0] * world, report(results)
    out0 = results[0][1]
    assert "all-reduce hierarchical (chunks auto, overlap on, lazy update), 2 hosts × 2 ranks" in out0, out0
    m = re.search(SHA_LINE.format(n=world), out0)  # rank 0 compared every rank's parameters
    assert m, out0
    assert digest_of(save) == m[2]
    assert float(re.findall(r"test accuracy ([\d.]+)%", out0)[0]) > 60.0, out0

    steps = math.ceil(subset // world / batch)
    for h in range(hosts):  # per step about the gradient once (+ start-up: parameters broadcast, checks)
        tx = after[h][1] - before[h][1]
        print(f"host {h} {c.nic(h)}: tx {tx:,} B = {tx / steps / GRADIENT_BYTES:.2f} gradients per step")
        assert steps * GRADIENT_BYTES <= tx <= (1.2 * steps + 3) * GRADIENT_BYTES, (h, tx, steps)


@pytest.mark.timeout(90)
def test_cli_trains_on_two_hosts_with_prefixed_output(tmp_path):
    save = tmp_path / "model.pth"
    argv = [
        PY,
        str(SCRIPTS / "cluster.py"),
        "train",
        "--hosts",
        "2",
        "--timeout",
        "70",
        "--",
        "--epochs",
        "1",
        "--test-subset",
        "1000",
        "--train-subset",
        "600",
        "--metrics",
        "",
        "--save-path",
        str(save),
    ]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env={**os.environ, **ENV},
        start_new_session=True,
    )
    ours = f"{cluster.PREFIX}{netns._b36(proc.pid)}-"  # the names this CLI run creates
    try:
        out, err = proc.communicate(timeout=80)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate(timeout=10)
        cluster.cleanup_stale()  # its owner is dead now
        pytest.fail(f"cluster.py train did not finish within 80 s\n{out}\n{err}")
    _created.extend(n for n in existing_names() if n.startswith(ours))  # (none, if all went well)
    assert not [n for n in existing_names() if n.startswith(ours)]

    assert proc.returncode == 0, out + err
    assert err == ""
    lines = out.splitlines()
    assert lines and all(re.match(r"\[host0 eth0\] |\[host1 ens3\] ", line) for line in lines), out
    assert re.search(r"^\[host0 eth0\] epoch 1/1 .* test accuracy [\d.]+%", out, re.M), out
    m = re.search(r"^\[host0 eth0\] " + SHA_LINE.format(n=2), out, re.M)
    assert m, out
    assert digest_of(save) == m[2]


@pytest.mark.timeout(90)
def test_host_without_the_named_nic_fails_clearly_and_nobody_hangs(tmp_path):
    world, timeout = 3, 8
    with remember(cluster.Cluster(world, nics=NICS, starter=popen)) as c:
        argvs = [
            c.train_argv(
                r,
                29500,
                [
                    "--epochs",
                    "1",
                    "--test-subset",
                    "1000",
                    "--train-subset",
                    "600",
                    "--metrics",
                    "",
                    "--save-path",
                    str(tmp_path / f"host{r}" / "m.pth"),
                    "--timeout",
                    str(timeout),
                ],
            )
            for r in range(world)
        ]
        argvs[1][argvs[1].index("--gloo_socket_ifname") + 1] = "wlan9"
        results = wait_ranks(c, start_ranks(c, argvs, tmp_path), tmp_path, timeout=timeout + 30)
    assert left_of(_created[-(2 * world + 1) :]) == []

    code, out, err, _ = results[1]
    assert code == 2, report(results)
    assert out == ""
    assert err.strip().splitlines() == [
        "train.py: error: network interface 'wlan9' not found on this host; it has: lo, ens3"
    ], report(results)
    # the others notice within --timeout (plus start-up) and stop by themselves
    print("exit codes", [res[0] for res in results], "after", [f"{res[3]:.1f} s" for res in results])
    for r in (0, 2):
        code, out, err, seconds = results[r]
        assert code != 0, report(results)
        assert seconds <= timeout + 25, report(results)  # + start-up: importing torch, loading MNIST
        assert "Traceback" not in err, report(results)
    assert not any((tmp_path / f"host{r}" / "m.pth").exists() for r in range(world))


@pytest.mark.timeout(60)
def test_a_rank_with_no_route_or_name_for_rank_0_asks_for_the_card_in_one_line(tmp_path):
    """A server whose only route is its own subnet (no default route): rank 0 elsewhere, or a name that
    does not resolve, is one line and exit 2 before anything loads; with the card named it goes on
    to the rendezvous (and gives up on it: nobody is there)."""
    with remember(cluster.Cluster(1, nics=NICS, starter=popen)) as c:
        base = [PY, str(REPO / "train.py"), "--rank", "1", "--world-size", "2", "--timeout", "2"]
        results = {
            host: c.run_on(0, [*base, "--init-method", f"tcp://{host}:29500"], timeout=40, text=True, cwd=tmp_path)
            for host in ("203.0.113.9", "no-such-host.invalid")
        }
        named = [*base, "--init-method", "tcp://203.0.113.9:29500", "--gloo_socket_ifname", c.nic(0)]
        named = c.run_on(
            0, [*named, "--test-subset", "100", "--train-subset", "100"], timeout=60, text=True, cwd=tmp_path
        )
    assert left_of(_created[-3:]) == []
    why = {"203.0.113.9": "Network is unreachable", "no-such-host.invalid": "it does not resolve"}
    for host, r in results.items():
        assert (r.returncode, r.stdout) == (2, ""), (host, r.returncode, r.stdout, r.stderr)
        assert r.stderr.splitlines() == [
            f"train.py: error: found no network card toward rank 0 at {host} ({why[host]}); "
            "pass --gloo_socket_ifname CARD"
        ], r.stderr
    assert named.returncode == 2 and "could not reach rank 0 at tcp://203.0.113.9:29500" in named.stderr, named.stderr


@pytest.mark.timeout(60)
def test_no_namespace_veth_or_bridge_is_left():
    if not _created:  # run on its own: make (and tear down) a cluster with a process in it
        with remember(cluster.Cluster(2, nics=NICS, starter=popen)) as c:
            assert left_of(_created) == sorted(_created)
            c.popen(1, ["sleep", "300"])
    assert left_of(_created) == []
    assert not any(Path(f"/run/netns/{n}").exists() for n in _created)  # no namespace mount either


@pytest.mark.timeout(150)
@pytest.mark.parametrize("fault", ["link cut", "host killed"])
def test_survivors_stop_within_the_timeout_when_a_host_drops_off(fault, tmp_path):
    """With --no-recover, a host whose link goes down (silence: no reset reaches anyone) or whose rank
    dies mid-epoch: every other rank exits 1 within --timeout + 10 s, with one line that says what
    happened, and the last step is saved (tests/test_recovery*.py: without --no-recover they go on)."""
    world, timeout = 3, 10
    with remember(cluster.Cluster(world, nics=NICS, starter=popen)) as c:
        argvs = [
            c.train_argv(
                r,
                29500,
                [
                    "--epochs",
                    "1",
                    "--test-subset",
                    "1000",
                    "--train-subset",
                    "30000",
                    "--metrics",
                    "",
                    "--no-recover",
                    "--save-every",
                    "2",
                    "--timeout",
                    str(timeout),
                ],
            )
            for r in range(world)
        ]
        procs = start_ranks(c, argvs, tmp_path)
        checkpoint = tmp_path / "host0" / "runs" / "checkpoint.pt"
        deadline = time.monotonic() + 90
        while not checkpoint.exists():  # training is under way
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "training did not start"
            time.sleep(0.1)
        if fault == "link cut":
            c.link_down(1)
        else:
            c.kill(procs[1])
        results = wait_ranks(c, procs, tmp_path, timeout=timeout + 40)
    survivors = (0, 1, 2) if fault == "link cut" else (0, 2)  # a cut-off host is a survivor too
    for r in survivors:
        code, out, err, seconds = results[r]
        assert code == 1, report(results)
        assert seconds <= timeout + 10, report(results)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "lost a peer" in lines[0] and lines[0].endswith("--resume"), report(results)
    assert torch.load(checkpoint, weights_only=True)["step"] >= 2  # the work up to the last checkpoint is kept
