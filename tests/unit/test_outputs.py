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
