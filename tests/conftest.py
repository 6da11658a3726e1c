"""Shared fixtures, and the order the test files run in."""

import collections
import json
import os

import netns
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# pytest finds utils/, scripts/, bench/, bench's folders and tests/support/ through pyproject.toml's pythonpath; the
# processes the tests start (ranks, workers, probes) find them through the same folders here.
BENCHMARKS = ("common", "allreduce", "balance", "compute", "fuzz", "heal", "recovery", "time_to_accuracy", "train_step")
os.environ["PYTHONPATH"] = os.pathsep.join(
    [REPO, os.path.join(REPO, "scripts"), os.path.join(REPO, "bench")]
    + [os.path.join(REPO, "bench", b) for b in BENCHMARKS]
    + [os.path.join(REPO, "tests", "support")]
    + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
)


@pytest.fixture
def needs_root():
    """Emulated hosts need root (CAP_NET_ADMIN). In CI (CI=true) that is a failure, never a skip."""
    try:
        netns._check_privileges()
    except netns.ClusterError as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"emulated-host tests must run as root in CI: {e}")
        pytest.skip(f"not root: {e}")


# The slowest files first, so that with two workers and `--dist loadfile` no long file starts last
# while the other worker sits idle. The order is measured: tests/durations.json holds each file's
# seconds (setup, call and teardown of its tests) as the last broad run took them, and every run of
# 10 files or more writes what it measured back into it. Files it does not name follow in their
# usual order. Only the order changes, never what runs.
DURATIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "durations.json")
BROAD = 10  # files a run must take to update DURATIONS
_spent = collections.defaultdict(float)  # test file -> seconds, this run


def measured():
    try:
        with open(DURATIONS) as f:
            return {name: float(seconds) for name, seconds in json.load(f).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def pytest_collection_modifyitems(items):
    seconds = measured()
    items.sort(key=lambda item: -seconds.get(os.path.basename(str(item.path)), 0.0))  # stable: a file's tests stay


def pytest_runtest_logreport(report):  # (under xdist, the controller gets every worker's reports)
    _spent[os.path.basename(str(report.fspath))] += report.duration


def pytest_sessionfinish(session):
    if hasattr(session.config, "workerinput") or len(_spent) < BROAD:
        return  # a worker, or a narrow run: the file keeps the last broad run's
    merged = {**measured(), **{name: round(seconds, 1) for name, seconds in _spent.items()}}
    temporary = f"{DURATIONS}.{os.getpid()}"
    with open(temporary, "w") as f:
        json.dump(dict(sorted(merged.items(), key=lambda kv: -kv[1])), f, indent=1)
        f.write("\n")
    os.replace(temporary, DURATIONS)
