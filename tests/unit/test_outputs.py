"""The output lock: no lock file beside a device, none left after release, a released file is not locked twice."""

import os

import pytest

from utils.errors import UsageError
from utils.setup.config import Outputs
from utils.store import outputs


def test_a_job_removes_its_lock_files_on_release(tmp_path):
    o = Outputs(checkpoint=str(tmp_path / "c.pt"), save_path=str(tmp_path / "m.pth"), metrics="")
    outputs.lock_outputs(o)
    assert sorted(os.listdir(tmp_path)) == ["c.pt.lock", "m.pth.lock"]
    with pytest.raises(UsageError, match="is in use by another job"):  # flock: another open file description
        outputs.lock_outputs(o, hold=True)
    outputs.release()
    assert os.listdir(tmp_path) == []
    outputs.lock_outputs(o, hold=False)  # free, and a look creates nothing
    assert os.listdir(tmp_path) == []


def test_devices_get_no_lock_file(tmp_path):
    o = Outputs(checkpoint=str(tmp_path / "c.pt"), save_path="/dev/null", metrics="")
    outputs.lock_outputs(o)
    try:
        assert not os.path.exists("/dev/null.lock") and os.listdir(tmp_path) == ["c.pt.lock"]
    finally:
        outputs.release()


def test_a_look_takes_a_shared_lock_that_a_holder_s_exclusive_one_refuses(tmp_path):
    """A look (hold=False) takes LOCK_SH: an NFS client refuses LOCK_EX on the read-only file a look
    opens (EBADF), which kept a job from starting where a killed job had left its lock file. A look
    must still see a holder, and a reader's shared lock is no holder."""
    import fcntl

    o = Outputs(checkpoint=str(tmp_path / "c.pt"), save_path="/dev/null", metrics="")
    lock = tmp_path / "c.pt.lock"
    lock.write_text("pid 1 on elsewhere\n")
    with open(lock) as reader:
        fcntl.flock(reader, fcntl.LOCK_SH)  # another look, at the same moment
        outputs.lock_outputs(o, hold=False)
    with open(lock, "r+") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        with pytest.raises(UsageError, match="is in use by another job"):
            outputs.lock_outputs(o, hold=False)
