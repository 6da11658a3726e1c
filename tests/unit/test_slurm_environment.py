"""srun's environment becomes the rank, the world and the rendezvous (utils/setup/slurm.py). (scontrol run,
and rank 0's requeue through it: tests/world/test_scontrol.py.)"""

import pytest
from slurm_env import HOSTLISTS, TASK

import train
from utils.errors import UsageError
from utils.setup.config import from_args
from utils.setup.slurm import FIRST_PORT, describe, expand_hostlist, step_from


def config(*argv, environ):
    return from_args(train.parse_args(list(argv)), environ)


@pytest.mark.parametrize("text", HOSTLISTS)
def test_compressed_host_lists_expand_as_slurm_does(text):
    assert expand_hostlist(text) == HOSTLISTS[text]


@pytest.mark.parametrize("text", ["", "node[1-", "node]1[", "n[3-1]", "n[a]", "n,,m", "n[1-2] m", "n[]"])
def test_malformed_host_lists_are_one_line(text):
    with pytest.raises(UsageError, match="malformed Slurm node list"):
        expand_hostlist(text)


def test_an_srun_task_takes_rank_world_and_the_first_node_of_its_step():
    step = step_from(TASK)
    assert (step.rank, step.world_size, step.local_rank, step.node_id) == (1, 4, 1, 0)
    assert step.nodes == ("node07", "node08") and step.restarts == 0
    assert step.rendezvous == f"tcp://node07:{FIRST_PORT + 4321}"
    c = config(environ=TASK)
    assert (c.job.rank, c.job.world_size, c.job.init_method, c.job.torchrun) == (1, 4, step.rendezvous, False)
    assert c.job.slurm == step and c.recipe.global_batch == 64
    assert "Slurm job 4321 step 0: 4 tasks on 2 nodes (node07, node08)" == describe(step)


def test_master_addr_and_port_win_and_the_job_id_picks_the_port():
    assert step_from(dict(TASK, MASTER_ADDR="10.0.0.9", MASTER_PORT="29500")).rendezvous == "tcp://10.0.0.9:29500"
    assert step_from(dict(TASK, MASTER_PORT="29500")).rendezvous == "tcp://node07:29500"
    assert step_from(dict(TASK, SLURM_JOB_ID="123456")).rendezvous == f"tcp://node07:{FIRST_PORT + 3456}"
    assert step_from(dict(TASK, SLURM_RESTART_COUNT="2")).restarts == 2
    no_step_list = {k: v for k, v in TASK.items() if k != "SLURM_STEP_NODELIST"}
    assert step_from(no_step_list).nodes == ("node07", "node08", "node09")


def test_flags_torchrun_and_the_batch_script_come_before_slurm():
    flags = config("--rank", "0", "--world-size", "2", "--init-method", "tcp://127.0.0.1:1234", environ=TASK)
    assert (flags.job.rank, flags.job.world_size, flags.job.slurm) == (0, 2, None)
    torchrun = config(environ=dict(TASK, RANK="3", WORLD_SIZE="8"))
    assert (torchrun.job.rank, torchrun.job.torchrun, torchrun.job.slurm) == (3, True, None)
    batch_script = {k: v for k, v in TASK.items() if k != "SLURM_STEP_ID"}  # sbatch's shell, outside srun
    assert config(environ=batch_script).job.rank is None  # the local launcher, as on any machine
    assert config("--init-method", "tcp://10.1.1.1:4000", environ=TASK).job.init_method == "tcp://10.1.1.1:4000"
    assert config("--eval", "--model_path", "m.pth", environ=TASK).job.slurm is None


@pytest.mark.parametrize(
    "change, message",
    [
        ({"SLURM_NTASKS": None}, "SLURM_PROCID is set but SLURM_NTASKS is not"),
        ({"SLURM_NTASKS": None, "SLURM_NODEID": None}, "SLURM_NTASKS, SLURM_NODEID are not"),
        (
            {
                "SLURM_NTASKS": None,
                "SLURM_JOB_ID": None,
                "SLURM_STEP_ID": None,
                "SLURM_NODEID": None,
                "SLURM_STEP_NODELIST": None,
                "SLURM_JOB_NODELIST": None,
            },
            "SLURM_PROCID is set but SLURM_NTASKS, ",
        ),
        ({"SLURM_STEP_NODELIST": None, "SLURM_JOB_NODELIST": None}, "SLURM_STEP_NODELIST is not"),
        ({"SLURM_NTASKS": "four"}, "malformed SLURM_NTASKS='four'"),
        ({"SLURM_PROCID": "-1"}, "malformed SLURM_PROCID='-1'"),
        ({"SLURM_PROCID": "4"}, "SLURM_PROCID=4 is not a rank of SLURM_NTASKS=4"),
        ({"SLURM_NTASKS": "0", "SLURM_PROCID": "0"}, "SLURM_PROCID=0 is not a rank of SLURM_NTASKS=0"),
        ({"SLURM_STEP_NODELIST": "node[07-"}, "malformed Slurm node list 'node\\[07-'"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is out of range"),
        ({"SLURM_JOB_ID": "12a"}, "malformed SLURM_JOB_ID='12a'"),
    ],
)
def test_a_broken_slurm_environment_is_one_line(change, message):
    environ = {k: v for k, v in {**TASK, **change}.items() if v is not None}
    with pytest.raises(UsageError, match=message):
        config(environ=environ)
