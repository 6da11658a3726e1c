"""The trainer end to end: real processes, gloo over loopback TCP."""

import hashlib
import json
import os
import re
import sys

import procs
import pytest
import torch
from procs import REPO

from utils.learn.model import Net, parameter_vector
from utils.setup.threads import cpus_here, share

SMALL = ["--epochs", "1", "--test-subset", "1000", "--train-subset", "2000", "--metrics", ""]


def digest_of(path):
    model = Net()
    model.load_state_dict(torch.load(path, weights_only=True))
    flat = parameter_vector(model)
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def accuracy_of(stdout):
    found = re.findall(r"test accuracy ([\d.]+)%", stdout)
    assert found, stdout
    return float(found[-1])


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """One run of SMALL on 2 local ranks (its result and the model it saved), which two tests read."""
    save = tmp_path_factory.mktemp("small") / "model.pth"
    result = procs.train([*SMALL, "--save-path", str(save)], timeout=180)
    assert result.returncode == 0, result.stderr
    return result, save


@pytest.mark.timeout(200)
def test_two_ranks_learn_and_end_identical(small_run):
    result, save = small_run
    assert accuracy_of(result.stdout) > 80.0  # chance is 10%
    assert "all-reduce two-pass (chunks auto, overlap off), 1 host × 2 ranks" in result.stdout  # the topology
    if "OMP_NUM_THREADS" not in os.environ:  # the launcher's threads are its rule's, not the user's
        threads = share(len(cpus_here()), 2)
        assert (
            f"1 host × 2 ranks, {threads} torch thread{'s' if threads > 1 else ''} per rank (a share" in result.stdout
        )
    digest = re.search(r"identical on all 2 ranks \(sha256 ([0-9a-f]{64})\)", result.stdout).group(1)
    assert digest == digest_of(save)  # the file rank 0 saved is what every rank ended with


def lazy_with_step_checkpoints(folder, allreduce):
    """--lazy-update with --save-every 1: the lazy update is applied before each save, and its wait must still
    count as the step's communication (assert_communication_counted). Both kinds of lazy sum, a thread per
    bucket (two-pass) and gloo's asynchronous all_reduce, ride on runs that other tests start anyway."""
    return [
        "--allreduce",
        allreduce,
        "--lazy-update",
        "--save-every",
        "1",
        "--metrics",
        str(folder / "metrics.jsonl"),
        "--checkpoint",
        str(folder / "c.pt"),
    ]


def assert_communication_counted(folder):
    row = json.loads((folder / "metrics.jsonl").read_text().splitlines()[-1])
    assert 0 < row["comm_share"] < 1 and row["busbw_gbps"] > 0, row


@pytest.mark.timeout(200)
def test_ranks_started_by_hand_agree(tmp_path):
    """Also the lazy update's two-pass sum (a thread per bucket) with step checkpoints, on these 3 ranks."""
    lazy = lazy_with_step_checkpoints(tmp_path, "two-pass")
    ranks = procs.start_ranks(3, [*SMALL, "--train-subset", "900", *lazy, "--save-path", str(tmp_path / "m.pth")])
    results = procs.wait_all(ranks, timeout=180)
    assert [code for code, _, _ in results] == [0, 0, 0], [err for _, _, err in results]
    assert "identical on all 3 ranks" in results[0][1]
    assert results[1][1] == "" and results[2][1] == ""  # ranks other than 0 stay quiet
    assert_communication_counted(tmp_path)


@pytest.mark.timeout(300)
def test_model_path_continues_from_a_saved_model(small_run, tmp_path):
    first, second = small_run[1], tmp_path / "second.pth"
    # A tiny learning rate barely moves the weights: the result must sit next to `first`,
    # which a model trained from scratch would not.
    result = procs.train(
        [*SMALL, "--train-subset", "64", "--lr", "1e-9", "--model_path", str(first), "--save-path", str(second)],
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    a, b = torch.load(first, weights_only=True), torch.load(second, weights_only=True)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
    assert accuracy_of(result.stdout) > 80.0


@pytest.mark.timeout(200)
def test_torchrun_needs_no_flags(tmp_path):
    """Also the lazy update's wait for gloo's asynchronous all_reduce with step checkpoints, on these ranks."""
    result = procs.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(procs.free_port()),
            procs.TRAIN,
            *SMALL,
            *lazy_with_step_checkpoints(tmp_path, "gloo"),
            "--save-path",
            str(tmp_path / "m.pth"),
        ],
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    assert "identical on all 2 ranks" in result.stdout
    assert accuracy_of(result.stdout) > 80.0
    assert_communication_counted(tmp_path)


@pytest.mark.timeout(60)
def test_shipped_model_scores_at_least_99_3_percent():
    result = procs.train(["--eval", "--model_path", os.path.join(REPO, "model_state_dict.pth")], timeout=50)
    assert result.returncode == 0, result.stderr
    assert accuracy_of(result.stdout) >= 99.3


@pytest.mark.timeout(60)
def test_original_flag_spellings_are_accepted(tmp_path):
    # The original README's command line, with a NIC this host has and a rank that is alone.
    result = procs.train(
        [
            "--init-method",
            f"tcp://127.0.0.1:{procs.free_port()}",
            "--epoch",
            "1",
            "--rank",
            "0",
            "--world-size",
            "1",
            "--gloo_socket_ifname",
            "lo",
            "--model_path",
            os.path.join(REPO, "model_state_dict.pth"),
            "--train-subset",
            "64",
            "--test-subset",  # not the 10,000 images: the score is test_shipped_model_scores_at_least_99_3_percent's
            "500",
            "--save-path",
            str(tmp_path / "m.pth"),
            "--metrics",
            "",
        ],
        timeout=50,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "m.pth").exists()
