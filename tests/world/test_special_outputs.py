"""Outputs that are not regular files: a device is written in place (never replaced by a file), a
symlink through to its target (the link stays), and nothing is left beside them after the run.
The devices are private copies (mknod, as root) of /dev/null and /dev/full, in the test's folder."""

import os
import stat

import procs
import pytest
import torch


def device(path, minor):
    """A private copy of /dev/null (minor 3) or /dev/full (minor 7)."""
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, minor))
    except PermissionError as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"making a device needs root, and CI runs as root: {e}")
        pytest.skip(f"not root: {e}")


@pytest.mark.timeout(200)
def test_devices_and_symlinks_are_written_through(tmp_path):
    null, full = tmp_path / "null", tmp_path / "full"
    device(null, 3)
    device(full, 7)
    target = tmp_path / "real" / "c.pt"
    target.parent.mkdir()
    link = tmp_path / "c.pt"
    link.symlink_to(target)
    result = procs.train(
        [
            "--epochs",
            "1",
            "--train-subset",
            "640",
            "--test-subset",
            "200",
            "--metrics",
            "",
            "--save-path",
            str(null),
            "--checkpoint",
            str(link),
            "--timeline",
            str(full),
            "--timeline-steps",
            "2:3",
        ],
        timeout=150,
        cwd=str(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    assert stat.S_ISCHR(os.stat(null).st_mode) and stat.S_ISCHR(os.stat(full).st_mode)  # still devices
    assert link.is_symlink() and os.readlink(link) == str(target)  # still a link
    assert torch.load(target, weights_only=True)["epoch"] == 2  # written through
    # a full device is a write that failed: said in one line, and the training went on
    assert f"could not write the timeline (cannot write {full}: No space left on device)" in result.stderr, (
        result.stderr
    )
    assert "timeline of steps" not in result.stdout
    # no lock, no temp; the job's key beside the checkpoint as named (utils/elastic/key.py), the user's alone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt", "c.pt.key", "full", "null", "real"]
    assert stat.S_IMODE(os.stat(tmp_path / "c.pt.key").st_mode) == 0o600
    assert sorted(p.name for p in target.parent.iterdir()) == ["c.pt"]
