"""The checkpoint's schema (utils/learn/state.py builds and restores it), its checks and upgrade
(utils/store/checkpoint.py); every written file: atomic, through a
symlink, in place for a device or FIFO (utils/store/files.py)."""

import os
import socket
import stat
import threading

import pytest
import torch

from utils.errors import UsageError
from utils.learn.model import Net
from utils.learn.state import EpochStats, Position, TrainingState
from utils.store import checkpoint, files


def state(epoch=2, step=0, settings=None, **extra):
    model = Net()
    optimizer = torch.optim.Adam(model.parameters())
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-3, total_steps=10)
    settings = settings or {"model": "Net/421642", "global-batch": 64, "compress": "none"}
    s = TrainingState(model, optimizer, scheduler, settings=settings)
    s.position = Position(epoch, step, EpochStats(steps=3))
    return {**s.state_dict(world_size=2), **extra}


def test_save_and_load_against_the_expected_settings(tmp_path):
    path = tmp_path / "c.pt"
    checkpoint.save(state(), path)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]  # no temp file left
    loaded = checkpoint.load(str(path), {"model": "Net/421642", "global-batch": 64, "compress": "none"})
    assert checkpoint.SCHEMA <= set(loaded) and loaded["epoch_stats"]["steps"] == 3
    with pytest.raises(UsageError, match="was made with --global-batch 64, this run has 96"):
        checkpoint.load(str(path), {"model": "Net/421642", "global-batch": 96, "compress": "none"})


def test_not_a_checkpoint_is_one_line(tmp_path):
    torch.save({"just": torch.zeros(1)}, tmp_path / "x.pt")
    with pytest.raises(UsageError, match="is not a training checkpoint of this program"):
        checkpoint.load(str(tmp_path / "x.pt"), {})
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(UsageError, match="is empty"):
        checkpoint.load(str(tmp_path / "empty.pt"), {})


def test_older_checkpoints_are_upgraded():
    old = {"settings": {"world-size": 2, "batch-size": 32, "lr": 4e-3}}
    assert checkpoint.upgrade(old) == ({"compress": "none", "global-batch": 64, "lr": 4e-3}, 2)
    new = {"settings": {"global-batch": 64, "compress": "bf16"}, "world_size": 3}
    assert checkpoint.upgrade(new) == ({"global-batch": 64, "compress": "bf16"}, 3)


def test_finished_is_after_the_last_epoch_at_step_0():
    assert checkpoint.finished({"epoch": 3, "step": 0}, 2)
    assert not checkpoint.finished({"epoch": 2, "step": 0}, 2)
    assert not checkpoint.finished({"epoch": 3, "step": 5}, 2)
    assert not checkpoint.finished(None, 2)


def test_restore_gives_back_the_position_and_the_random_state():
    s = state(epoch=1, step=7)
    torch.manual_seed(5)
    s["rng"] = torch.get_rng_state()
    expected = torch.rand(3)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters())
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-3, total_steps=10)
    restored = TrainingState(model, optimizer, scheduler)
    restored.load_state_dict(s, 0, 2)
    assert restored.position == Position(1, 7, EpochStats(steps=3))
    assert torch.equal(torch.rand(3), expected)


def test_a_symlink_is_written_through_and_stays_a_link(tmp_path):
    target, link = tmp_path / "real" / "m.pth", tmp_path / "m.pth"
    target.parent.mkdir()
    target.write_bytes(b"old")
    link.symlink_to(target)
    files.write_file(str(link), b"new")
    assert link.is_symlink() and target.read_bytes() == b"new"
    assert sorted(os.listdir(tmp_path / "real")) == ["m.pth"]
    assert files.set_aside(str(link)) and (tmp_path / "real" / "m.pth.prev").read_bytes() == b"new"
    assert link.is_symlink()


def test_a_device_is_written_in_place_never_replaced():
    before = os.stat("/dev/null")
    files.write_file("/dev/null", b"x" * 1000)
    after = os.stat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and after.st_ino == before.st_ino
    assert not files.set_aside("/dev/null")  # a fresh start moves no device aside
    files.check_writable("/dev/null", "--save-path")
    files.remove_stale_temps("/dev/null")  # looks at no folder of devices


def test_a_full_device_fails_instead_of_reporting_success():
    if not os.path.exists("/dev/full"):
        pytest.fail("this test needs Linux's /dev/full")
    with pytest.raises(UsageError, match="cannot write /dev/full: No space left on device"):
        files.write_file("/dev/full", b"x")
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


def test_a_fifo_is_written_in_place(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo, "rb").read()))
    reader.start()
    files.write_file(str(fifo), b"through the pipe")
    reader.join(10)
    assert got == [b"through the pipe"] and stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_folders_and_sockets_are_refused_in_one_line(tmp_path):
    with pytest.raises(UsageError, match="is a folder"):
        files.check_writable(str(tmp_path), "--checkpoint")
    path = tmp_path / "s"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        with pytest.raises(UsageError, match="is a socket"):
            files.check_writable(str(path), "--metrics")
        with pytest.raises(UsageError, match="is a socket"):
            files.write_file(str(path), b"x")


def test_stale_temps_of_a_killed_save_are_removed(tmp_path):
    (tmp_path / "c.pt.abc123.tmp").write_bytes(b"half")
    (tmp_path / "other.tmp").write_bytes(b"not ours")
    files.remove_stale_temps(str(tmp_path / "c.pt"))
    assert sorted(os.listdir(tmp_path)) == ["other.tmp"]
