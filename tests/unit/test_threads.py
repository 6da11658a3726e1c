"""utils/setup/threads.py: a rank's share of its server's cores, and whose OMP_NUM_THREADS it is."""

from utils.setup.handoff import Handoff
from utils.setup.threads import checked, describe, share, threads_of, users_choice


def entry(machine="m", cpus=(0, 1), cap=None, fixed=None):
    return {"machine": machine, "cpus": list(cpus), "cap": cap, "fixed": fixed}


def test_ranks_that_share_a_server_take_its_cores_between_them():
    assert [threads_of(r, [entry()]) for r in range(1)] == [2]  # alone: every core
    assert [threads_of(r, [entry()] * 2) for r in range(2)] == [1, 1]
    three = [entry()] * 3  # 3 ranks on 2 cores: a third each, at least 1
    assert [threads_of(r, three) for r in range(3)] == [1, 1, 1]
    eight = [entry(cpus=range(8))] * 3
    assert [threads_of(r, eight) for r in range(3)] == [2, 2, 2]


def test_other_servers_do_not_count_and_pinned_ranks_keep_their_own_cpus():
    hosts = [entry("a", range(4)), entry("b", range(4)), entry("b", range(4))]
    assert [threads_of(r, hosts) for r in range(3)] == [4, 2, 2]
    pinned = [entry(cpus=(0, 1)), entry(cpus=(2, 3)), entry(cpus=range(4))]  # the third shares with both
    assert [threads_of(r, pinned) for r in range(3)] == [1, 1, 2]


def test_slurm_s_cpus_per_task_caps_the_share():
    assert threads_of(0, [entry(cpus=range(8), cap=2)]) == 2
    assert share(2, 3) == 1 and share(8, 3) == 2 and share(8, 1) == 8


def test_only_the_user_s_omp_num_threads_is_kept():
    assert users_choice({}, Handoff()) is None
    assert users_choice({"OMP_NUM_THREADS": "3"}, Handoff()) == "3"
    assert users_choice({"OMP_NUM_THREADS": "1"}, Handoff(threads_from_launcher=True)) is None
    torchrun = {"OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "x"}
    assert users_choice(torchrun, Handoff(), parent_environ={"PATH": ""}) is None  # torchrun's own default
    assert users_choice(torchrun, Handoff(), parent_environ={"OMP_NUM_THREADS": ""}) == "1"


def test_a_peer_s_malformed_entry_counts_for_nobody():
    for bad in (None, [], {"machine": "m"}, entry(cpus=["0"]), entry(cpus=[True]), entry(cap=0), entry(cpus=[])):
        assert checked(bad)["machine"] == "(malformed)"
    both = [entry(), checked({"machine": "m", "cpus": "all"})]
    assert threads_of(0, both) == 2


def test_the_start_line_s_words():
    assert describe([1, 1, 1]) == "1 torch thread per rank (a share of each server's cores)"
    assert describe([2, 4], fixed=True) == "torch threads 2-4 per rank (OMP_NUM_THREADS)"
