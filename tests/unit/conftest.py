"""The fast tier: pure functions, the config, the checkpoint and files, in this process alone. It starts
no process (no rank, worker, probe or other program: those tests are tests/world's), which
no_process_started holds it to at run time and tests/unit/test_structure.py by the imports."""

import os
import subprocess

import pytest
import torch  # noqa: F401  (its first import runs ldconfig: here, before no_process_started, not in a test)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def no_process_started(monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("tests/unit starts no process: a test that needs one belongs in tests/world")

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refused)  # subprocess.run, Popen, check_output...
    for name in ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp"):
        monkeypatch.setattr(os, name, refused)
