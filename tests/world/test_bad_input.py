"""Bad input: one line on stderr, exit code 2, no traceback, nothing overwritten."""

import concurrent.futures
import os
import pickle
import random
import shutil

import procs
import pytest
import torch
from procs import REPO

from utils.errors import UsageError
from utils.learn.model import Net
from utils.store.checkpoint import load_model_state, safe_load

SHIPPED = os.path.join(REPO, "model_state_dict.pth")


def assert_one_line_error(result, *needles):
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    for needle in needles:
        assert needle in lines[0], lines[0]


def rank_args(rank=0, world_size=1, port=None, nic="lo"):
    return [
        "--init-method",
        f"tcp://127.0.0.1:{port or procs.free_port()}",
        "--rank",
        str(rank),
        "--world-size",
        str(world_size),
        "--gloo_socket_ifname",
        nic,
    ]


CASES = {
    "rank >= world size": (rank_args(rank=2, world_size=2), ["--rank"]),
    "negative rank": (rank_args(rank=-1, world_size=2), ["--rank"]),
    "world size 0": (rank_args(rank=0, world_size=0), ["--world-size"]),
    "unknown NIC": (rank_args(nic="nosuchnic0"), ["nosuchnic0", "lo"]),
    "malformed init method": (
        ["--init-method", "192.168.0.1:23456", "--rank", "0", "--world-size", "1"],
        ["malformed --init-method"],
    ),
    "port out of range": (["--init-method", "tcp://127.0.0.1:70000", "--rank", "0", "--world-size", "1"], ["port"]),
    "non-numeric epochs": (["--epochs", "ten"], ["--epoch"]),
    "zero epochs": (["--epochs", "0"], ["--epoch"]),
    "negative lr": (["--lr", "-0.1"], ["--lr"]),
    "nan lr": (["--lr", "nan"], ["--lr"]),
    "zero batch size": (["--batch-size", "0"], ["--batch-size"]),
    "zero test subset": (["--test-subset", "0"], ["--test-subset"]),
    "global batch smaller than the local ranks": (
        ["--global-batch", "2", "--nproc", "3"],
        ["global batch of 2", "--global-batch 3 or more"],
    ),
    "global and per-rank batch both": (["--global-batch", "64", "--batch-size", "32"], ["not both"]),
    "zero timeout": (["--timeout", "0"], ["--timeout"]),
    "unknown algorithm": (["--allreduce", "tree"], ["--allreduce"]),
    "unknown compression": (["--compress", "zstd"], ["--compress"]),
    "powersgd rank 0": (["--compress", "powersgd", "--powersgd-rank", "0"], ["--powersgd-rank"]),
    "powersgd rank beyond the model": (
        ["--compress", "powersgd", "--powersgd-rank", "1000"],
        ["--powersgd-rank", "at most"],
    ),
    "negative powersgd warm-up": (["--compress", "powersgd", "--powersgd-warmup", "-1"], ["--powersgd-warmup"]),
    "powersgd rank without powersgd": (["--compress", "bf16", "--powersgd-rank", "2"], ["needs --compress powersgd"]),
    "lazy update without overlap": (["--lazy-update", "--no-overlap"], ["--lazy-update needs --overlap"]),
    "missing model file": (["--model_path", "/nonexistent/model.pth"], ["does not exist"]),
    "model path is a folder": (["--model_path", REPO], ["is not a file"]),
    "timeline window backwards": (["--timeline", "t.json", "--timeline-steps", "5:2"], ["--timeline-steps", "5:2"]),
    "timeline window not A:B": (["--timeline", "t.json", "--timeline-steps", "7"], ["--timeline-steps", "FIRST:LAST"]),
    "timeline window without a timeline": (["--timeline-steps", "1:5"], ["needs --timeline"]),
    "unwritable timeline": (["--timeline", "/proc/timeline.json"], ["cannot write --timeline"]),
    "timeline is a folder": (["--timeline", REPO], ["--timeline", "is a folder"]),
    # values that pass "positive" but would crash or hang much later
    "lr that overflows Adam's float32 step": (["--lr", "1e38"], ["--lr", "at most"]),
    "timeout beyond gloo's 32-bit milliseconds": (["--timeout", "1e20"], ["--timeout", "at most"]),
    "negative seed": (["--seed", "-1"], ["--seed"]),
    "seed beyond 32 bits": (["--seed", str(2**70)], ["--seed"]),
    "a billion chunks": (["--chunks", "1000000000"], ["--chunks", "at most"]),
    "a thousand local ranks": (["--nproc", "1000"], ["--nproc", "at most"]),
    "fewer training images than local ranks": (["--train-subset", "3", "--nproc", "4"], ["--train-subset", "4 ranks"]),
    "fewer training images than servers": (
        [*rank_args(world_size=2), "--train-subset", "1"],
        ["--train-subset", "2 ranks"],
    ),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_arguments(case, tmp_path):
    args, needles = CASES[case]
    result = procs.train([*args, "--save-path", str(tmp_path / "m.pth")], timeout=50)
    assert_one_line_error(result, *needles)
    assert not (tmp_path / "m.pth").exists()


def bad_model_files(tmp_path):
    good = torch.load(SHIPPED, weights_only=True)
    files = {}
    files["empty"] = tmp_path / "empty.pth"
    files["empty"].write_bytes(b"")
    files["truncated"] = tmp_path / "truncated.pth"
    files["truncated"].write_bytes(open(SHIPPED, "rb").read()[:5000])
    files["garbage"] = tmp_path / "garbage.pth"
    files["garbage"].write_bytes(random.Random(0).randbytes(4096))  # seeded: the same bytes every run
    files["not a state dict"] = tmp_path / "list.pth"
    torch.save([1, 2, 3], files["not a state dict"])
    files["other architecture"] = tmp_path / "other.pth"
    torch.save({k.replace("fc1", "fc9"): v for k, v in good.items()}, files["other architecture"])
    files["wrong shapes"] = tmp_path / "shapes.pth"
    torch.save({k: v[..., :1] if v.dim() > 1 else v for k, v in good.items()}, files["wrong shapes"])
    return files


@pytest.mark.timeout(200)
def test_bad_model_files(tmp_path):
    """Every file as rank 0 of a multi-server job loads it: 6 runs of train.py, a few at a time (each its own
    process group with its own hard timeout, and its own output path, which none of them may write: rank 0
    holds its outputs' lock while it loads the model, so a shared one would be "in use by another job").
    --eval reads the file with the same call (utils/run.evaluate: load_model_state into a fresh Net): that
    call refuses every file here in this process, with the message the one line would carry, and one --eval
    run end to end turns it into that line and exit code 2."""
    files = bad_model_files(tmp_path)
    runs = [(path, [*rank_args(), "--model_path", str(path)]) for path in files.values()]
    runs.append((files["truncated"], ["--eval", "--model_path", str(files["truncated"])]))
    outs = [tmp_path / f"out{i}.pth" for i in range(len(runs))]
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        results = list(
            pool.map(lambda run, out: procs.train([*run[1], "--save-path", str(out)], timeout=60), runs, outs)
        )
    for (path, _), result in zip(runs, results):
        assert_one_line_error(result, str(path))
    assert not [out for out in outs if out.exists()]
    for path in files.values():  # what --eval does with each
        refused_by_eval(path)


def refused_by_eval(path, *needles):
    """train.py --eval's load of `path` (utils/run.evaluate) fails with a UsageError (main's one line and
    exit code 2) that names the file and says `needles`."""
    with pytest.raises(UsageError) as refused:
        load_model_state(Net(), str(path))
    for needle in (str(path), *needles):
        assert needle in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


@pytest.mark.timeout(60)
def test_any_random_bytes_are_refused_as_corrupt(tmp_path):
    """Random bytes go through the legacy unpickler, which can fail with almost any exception
    (IndexError, UnicodeDecodeError, ...). Every one must become a UsageError naming the file."""
    path = tmp_path / "garbage.pth"
    for seed in range(300):
        rng = random.Random(seed)
        path.write_bytes(rng.randbytes(rng.choice([1, 2, 16, 300, 4096])))
        with pytest.raises(UsageError, match="garbage.pth"):
            safe_load(str(path), "model file")


class RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.timeout(60)
def test_a_pickle_that_runs_code_is_refused_and_does_not_run(tmp_path):
    """torch's zip format end to end (train.py --eval); a plain pickle through the same load, in this process."""
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pth"
    torch.save({"fc1.weight": RunsCode(marker)}, evil, pickle_protocol=2)
    with open(tmp_path / "plain.pkl", "wb") as f:
        pickle.dump(RunsCode(marker), f)
    result = procs.train(["--eval", "--model_path", str(evil)], timeout=50)
    assert_one_line_error(result, "weights-only")
    refused_by_eval(tmp_path / "plain.pkl", "weights-only")
    assert not marker.exists()


@pytest.mark.timeout(120)
def test_damaged_and_missing_data_files(tmp_path):
    data = tmp_path / "data"
    shutil.copytree(os.path.join(REPO, "data"), data, ignore=shutil.ignore_patterns("*-ubyte"))
    raw = data / "MNIST" / "raw"
    blob = bytearray((raw / "t10k-labels-idx1-ubyte.gz").read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (raw / "t10k-labels-idx1-ubyte.gz").write_bytes(bytes(blob))
    result = procs.train(["--eval", "--model_path", SHIPPED, "--data-dir", str(data)], timeout=100)
    assert_one_line_error(result, "t10k-labels-idx1-ubyte")
    (raw / "t10k-labels-idx1-ubyte.gz").unlink()
    result = procs.train(["--eval", "--model_path", SHIPPED, "--data-dir", str(data)], timeout=100)
    assert_one_line_error(result, "missing data file", "t10k-labels-idx1-ubyte")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("option", ["--save-path", "--checkpoint", "--metrics"])
def test_an_output_that_cannot_be_written_fails_before_training(option, tmp_path):
    """Found only when rank 0 first saves, it would cost an epoch of work and end in a traceback."""
    folder = tmp_path / "a-folder"
    folder.mkdir()
    for path, needle in ((folder, "is a folder"), ("/proc/no-such-dir/out.pth", "cannot write")):
        for mode in ([], rank_args()):  # the local launcher, and rank 0 of a multi-server job
            result = procs.train([*mode, "--train-subset", "64", "--epochs", "1", option, str(path)], timeout=60)
            assert_one_line_error(result, option, str(path), needle)
            assert "epoch 1/1" not in result.stdout


@pytest.mark.timeout(120)
def test_unavailable_data_is_one_line_even_with_several_local_ranks(tmp_path):
    not_a_folder = tmp_path / "data"
    not_a_folder.write_text("")  # no MNIST there, and no download can land there either
    for mode in ([], rank_args()):
        result = procs.train([*mode, "--data-dir", str(not_a_folder)], timeout=100)
        assert_one_line_error(result, "MNIST is not in", str(not_a_folder))
    missing = tmp_path / "no-such-folder"
    result = procs.train(["--data-dir", str(missing)], timeout=100)
    assert_one_line_error(result, "MNIST is not in", str(missing))
    assert not missing.exists()  # the failed download leaves no empty folders behind
