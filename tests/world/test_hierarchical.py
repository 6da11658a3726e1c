"""The hierarchical ring (utils/comm/hierarchical.py) over loopback, hosts faked with a host id per rank:
correct against a float64 reference, bit-identical on every rank, and `ring` itself when every
host has one rank. 1-3 hosts × 1-3 ranks, uneven hosts, ranks of a host not numbered together,
all in one world of 9 processes (a topology of fewer ranks uses ranks 0, 1, ...); and once with
bfloat16 on the wire across hosts (--compress bf16)."""

import os
import subprocess
import sys

import pytest
import torch
from hierarchical_worker import inputs, sizes
from procs import TRAIN, free_port, popen, run_workers, scratch_dir, wait_all

from utils.comm.hierarchical import blocks, describe, hosts_of, plan

WORKER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support", "hierarchical_worker.py")

# each rank's host id; the first covers the world (and is found through discover())
TOPOLOGIES = [
    "0,0,0,1,1,1,2,2,2",  # 3 hosts × 3 ranks
    "0",
    "0,0",
    "0,0,0",
    "0,1",
    "0,1,2",  # 1 × 1-3, 2 × 1, 3 × 1
    "0,0,1,1",
    "0,0,0,1,1,1",
    "0,0,1,1,2,2",  # 2 × 2, 2 × 3, 3 × 2
    "0,0,1",
    "0,1,1,1",
    "0,0,0,1,1,2",  # uneven: 2+1, 1+3, 3+2+1
    "0,1,0,1",
    "0,1,0",  # a host's ranks not numbered together
]
WORLD = len(TOPOLOGIES[0].split(","))


@pytest.mark.timeout(150)
def test_hierarchical_sums_exactly_once_and_identically(tmp_path):
    results = run_workers(
        WORKER, WORLD, tmp_path, TOPOLOGIES, timeout=120, env=lambda r: dict(os.environ, OMP_NUM_THREADS="1")
    )
    checked = 0
    for topology in TOPOLOGIES:
        hosts = hosts_of(topology.split(","))
        n = len(topology.split(","))
        for size in sizes(hosts):
            key = f"{topology}/{size}"
            reference = sum(inputs(r, size).double() for r in range(n))
            got = results[0][key]
            assert got.shape == (size,)
            assert torch.allclose(got.double(), reference, rtol=0, atol=1e-5 * n * 8), key
            for r in range(1, n):
                assert torch.equal(results[r][key], got), f"{key}: rank {r} differs from rank 0"
            if all(len(h) == 1 for h in hosts):
                assert torch.equal(results[0][key + "/ring"], got), f"{key}: not the plain ring's bits"
            if topology == TOPOLOGIES[0]:  # bfloat16 across hosts: a rounding per hop (8 bits of mantissa)
                compressed = results[0][key + "/bf16"]
                scale = sum(inputs(r, size).double().abs() for r in range(n))
                assert ((compressed.double() - reference).abs() <= scale * 2**-7).all(), key
                assert not torch.equal(compressed, got) or size < 9, key  # the wire did carry 16 bits
                for r in range(1, n):
                    assert torch.equal(results[r][key + "/bf16"], compressed), f"{key}/bf16: rank {r} differs"
            checked += 1
    assert checked == sum(len(sizes(hosts_of(t.split(",")))) for t in TOPOLOGIES)


@pytest.mark.timeout(120)
def test_uneven_hosts_train_and_say_so_once(tmp_path):
    """train.py with 2+1 ranks on two (faked) hosts, the plain path (--no-overlap): the start-up
    line names the topology, one note says how uneven hosts are handled, all ranks end identical."""
    port, cwd, hosts = free_port(), scratch_dir(), ["a", "a", "b"]
    procs = [
        popen(
            [
                sys.executable,
                TRAIN,
                "--rank",
                str(r),
                "--world-size",
                "3",
                "--init-method",
                f"tcp://127.0.0.1:{port}",
                "--gloo_socket_ifname",
                "lo",
                "--epochs",
                "1",
                "--test-subset",
                "1000",
                "--train-subset",
                "300",
                "--batch-size",
                "25",
                "--allreduce",
                "hierarchical",
                "--host-id",
                host,
                "--no-overlap",
                "--metrics",
                "",
                "--save-path",
                str(tmp_path / "m.pth"),
                "--checkpoint",
                str(tmp_path / "c.pt"),
            ],
            env=dict(os.environ, OMP_NUM_THREADS="1"),
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for r, host in enumerate(hosts)
    ]
    results = wait_all(procs, timeout=100)
    assert [code for code, _, _ in results] == [0, 0, 0], [err for _, _, err in results]
    out = results[0][1]
    assert "all-reduce hierarchical (chunks auto, overlap off), 2 hosts × 1-2 ranks (2+1)" in out, out
    assert (
        out.count(
            "hierarchical: the hosts hold different numbers of ranks (2+1): the buffer is cut into 2 "
            "shards, and a rank of a smaller host carries several, one after another"
        )
        == 1
    ), out
    assert "parameters identical on all 3 ranks" in out, out
    assert [o for _, o, _ in results[1:]] == ["", ""]


def test_topology_plan():
    assert hosts_of(["b", "a", "b", "a"]) == [[0, 2], [1, 3]]  # hosts ordered by their first rank
    assert describe([[0, 1], [2, 3]]) == "2 hosts × 2 ranks"
    assert describe([[0, 1, 2]]) == "1 host × 3 ranks"
    assert describe([[0], [1]]) == "2 hosts × 1 rank"
    assert describe([[0, 1], [2, 3], [4]]) == "3 hosts × 1-2 ranks (2+2+1)"
    # even hosts: local rank j carries shard j in a ring with local rank j of every other host
    assert plan([[0, 1], [2, 3]]) == ([(0, [0, 2]), (1, [1, 3])], 2)
    # one rank per host: one ring over everyone, in rank order (the plain ring)
    assert plan([[0], [1], [2]]) == ([(0, [0, 1, 2])], 1)
    # uneven: the lone rank of host 1 carries both shards, in two rings one after the other
    assert plan([[0, 1], [2]]) == ([(0, [0, 2]), (1, [1, 2])], 2)
    assert plan([[0, 1, 2], [3, 4]]) == ([(0, [0, 3]), (1, [1, 4]), (2, [2, 4])], 3)
    assert blocks([[0, 1], [2, 3, 4]])[0] == [[range(0, 1), range(1, 3)], [range(0, 1), range(1, 2), range(2, 3)]]
