"""Data-parallel MNIST training across servers, gradients summed by a hand-written gloo ring.

On each server (one rank per server):
    nohup python3 -u train.py --init-method tcp://192.168.0.1:23456 --epoch 1200 --rank 0 \
        --world-size 2 --gloo_socket_ifname eth0 --model_path model_state_dict.pth

On one machine, all ranks over loopback:   python train.py
Under torchrun:                             torchrun --nproc-per-node 2 train.py
Under Slurm:                                sbatch scripts/slurm.sbatch   (its srun needs no rank flags)
Evaluate a saved model:                     python train.py --eval --model_path model_state_dict.pth
Ask a running job how it does:              python train.py --status 192.168.0.1:23456
Stop it from any terminal with its key:     python train.py --stop 192.168.0.1:23456
Every server from one terminal, over ssh:   python train.py --hosts node0,node1,node2 --epoch 1200
Stop with SIGTERM or SIGINT (Ctrl-C) to any rank, or with --stop: every rank stops after the same
step, rank 0 saves the checkpoint, and every rank exits with code 3; --resume continues, on this
number of servers or another. A NaN or an inf in the loss or the parameters stops every rank at
the same step, nothing saved after it (exit 4; docs/stopping-and-resuming.md).

This file sets up: the command line becomes a utils.setup.config.Config; then main() runs one mode:
--status, --stop, every server over ssh (--hosts, utils/setup/remote.py), the keeper (--restart,
utils/setup/keeper.py), every rank here (utils/setup/launch.py), --eval, or a rank, whose supervisor
(utils/setup/lifecycle.py) starts, joins or waits for the job through the process group
(utils/setup/distributed.py) and utils/run.py, which trains. Its end is one line and an exit code
(utils/setup/process.py, utils/errors.py).
"""

import dataclasses
import os
import sys

from utils.elastic import rejoin, status, stopper
from utils.errors import EXIT_BAD_INPUT, NotFinite, PeerError, Stopped, UsageError, first_line
from utils.learn.mnist import ensure_mnist
from utils.observe.instruments import OFF, from_environ

# Only modules without torch here: a bad command line and the local launcher answer before torch loads.
from utils.setup import cli, keeper, stop
from utils.setup.card import with_card
from utils.setup.config import check_share, from_args
from utils.setup.handoff import Handoff
from utils.setup.launch import launch_local, rank_threads
from utils.setup.lifecycle import Supervisor
from utils.setup.memory import keep_freed_memory
from utils.setup.precision import refusal, this_cpu
from utils.setup.preflight import before_rendezvous, preflight, say_finished
from utils.setup.process import Ending, resume_command, say
from utils.store.files import remove_stale_temps, set_aside
from utils.store.outputs import release

# c10d logs socket errors with stack traces; we report them in one line (set before torch loads)
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")

PROG = "train.py"


def parse_args(argv):
    return cli.parse_args(argv, PROG)


def train(config, data, instruments, supervisor):
    """Train this rank: its supervisor starts the job, joins it or waits for it (instruments: the
    tests' and benchmarks', utils/observe/instruments.py)."""
    import torch

    from utils.learn.model import Net

    torch.manual_seed(config.recipe.seed)
    model = Net(config.recipe.precision)
    supervisor.run(Rank(config, data, model, instruments))


class Rank:
    """What a rank's supervisor asks of it (utils/setup/lifecycle.py): start or join the job."""

    def __init__(self, config, data, model, instruments):
        self.config, self.data, self.model, self.instruments = config, data, model, instruments

    def start(self, rendezvous_seconds=None):
        return start_job(self.config, self.data, self.model, rendezvous_seconds, self.instruments)

    def join(self):
        """A server joining a running job: the members send it everything."""
        from utils.elastic.join import join_running_job
        from utils.setup.distributed import model_name

        job, model = self.config.job, self.model
        config = dataclasses.replace(self.config, job=dataclasses.replace(job, join=job.join or ""))
        membership, decision = join_running_job(config, model_name(model), self.instruments, stop.request)
        stop.arm()
        train_rank(model, self.data, config, membership, None, None, self.instruments, decision)
        return True


def train_rank(model, data, config, membership, hosts, resume_from, instruments, decision=None):
    """This rank's training, from the job's start (hosts, resume_from) or, for a joining server, from
    the members' state (decision); elastic when it has a membership (utils/elastic/recovery.py)."""
    from utils.elastic.join import report_dropped
    from utils.elastic.recovery import Elastic, NotElastic
    from utils.learn.training import Trainer
    from utils.run import run

    trainer = Trainer(model, data, config, membership, keeper.trained, instruments)
    elastic = NotElastic() if membership is None else Elastic(membership, trainer, instruments)
    try:
        if membership is not None:
            trainer.callbacks.add(elastic)  # (its join flag, its first step after a change)
            membership.carry(trainer.watch.record)  # what its heartbeats carry (--status)
        if decision is not None:
            elastic.join(decision, rejoin.absence())
        else:
            trainer.start(hosts, resume_from)
        run(trainer, elastic)
    finally:  # (stopped, or a lost peer, too)
        report_dropped(membership)


def start_job(config, data, model, rendezvous_seconds=None, instruments=OFF):
    """Start the job with every rank, or resume it (rank 0 decides: --resume, or a server's command run
    again on an unfinished checkpoint), and train it to its end. rendezvous_seconds: a server waiting
    for its job offers a restart this long; returns False if not every rank came (else True)."""
    import torch.distributed as dist

    from utils.setup.distributed import init_distributed

    check_share(len(data[1]), config.job.world_size, config.recipe.global_batch)
    config, resume_from, done, attempt_store = before_rendezvous(config, data, model)
    try:
        init_distributed(config.job, rendezvous_seconds or config.sync.timeout, attempt_store)
    except (PeerError, UsageError):
        if rendezvous_seconds is None:
            raise
        release()  # (rank 0's locks: taken again at the next offer)
        return False
    started = meet(config, model, resume_from, done, instruments)
    if started is not None:
        stop.arm()  # from here a signal stops the job after a step, with the checkpoint saved
        train_rank(model, data, *started, instruments)
    dist.destroy_process_group()
    return True


def meet(config, model, resume_from, done, instruments):
    """In the new group: the ranks agree on what they train, every rank gets rank 0's checkpoint and
    parameters, and its membership. Returns (config, membership, hosts, checkpoint or None); None
    for a finished run (rank 0 says so; nobody trains or writes)."""
    import torch.distributed as dist

    from utils.comm import hierarchical
    from utils.elastic.join import start_membership
    from utils.exchange import broadcast_state
    from utils.observe.report import say_where_training_starts
    from utils.setup.distributed import agree, broadcast_parameters, model_name
    from utils.store import checkpoint

    job = config.job
    if job.rank == 0 and not done:
        remove_stale_temps(config.outputs.checkpoint)  # only now: they could have been another job's
        say_where_training_starts(config, resume_from, resume_from and checkpoint.upgrade(resume_from)[1])
    try:
        config = agree(config, model)
        resume_from = broadcast_state(resume_from, src=0)  # the other servers need not have the file
        if checkpoint.finished(resume_from, config.recipe.epochs):  # every rank knows it now: none trains or writes
            dist.barrier()  # nobody leaves (rank 0 hosts the rendezvous) before everyone has the news
            if job.rank == 0:
                say_finished(config)
            return None
        broadcast_parameters(model)  # (a resume's model: from the checkpoint, which every rank has now)
        hosts = hierarchical.discover(job.host_id)  # which ranks share a server: for the log and the hierarchical sum
        membership = None
        if job.world_size > 1:  # (train.py --stop to a member: a stop as a first SIGTERM to its rank)
            membership = start_membership(config, model_name(model), instruments, stop.request)
    except RuntimeError as e:
        raise PeerError(f"lost a peer during start-up: {first_line(e)}") from None
    say_starting(config, resume_from)
    return config, membership, hosts, resume_from


def say_starting(config, resume_from):
    """Rank 0: that an earlier run's checkpoint is set aside, and Slurm's allocation."""
    from utils.setup import slurm

    if config.job.rank != 0:
        return
    if resume_from is None and set_aside(config.outputs.checkpoint):
        print(f"starting afresh; the earlier checkpoint is kept as {config.outputs.checkpoint}.prev", flush=True)
    if config.job.slurm:
        print(slurm.describe(config.job.slurm), flush=True)


def main(argv=None):
    """Parse, run one mode, and turn how it ended into one line and an exit code."""
    stop.note_early()
    process = Process(sys.argv[1:] if argv is None else argv, PROG, __file__)
    try:
        return process.run()
    except UsageError as e:
        say(f"{PROG}: error: {e}")
        return EXIT_BAD_INPUT
    except PeerError as e:
        return process.lost(e)
    except Stopped as e:
        return process.stopped(e)
    except NotFinite as e:
        return process.not_finite(e)
    except KeyboardInterrupt:
        say(f"{PROG}: rank {process.rank}: interrupted")
        return 130
    finally:
        release()  # this job's lock files (rank 0's), if it took them


class Process(Ending):
    """This run of train.py: the mode it runs, from its command line and what it was handed; how it
    ends: utils/setup/process.py."""

    def run(self):
        """The one mode this command runs; its exit code."""
        self.handoff = Handoff.from_environ()
        args = parse_args(self.argv)
        if args.status is not None:  # a question to a running job: no torch, no training
            status.command(args.status, args.init_method, args.key_file, args.checkpoint, args.json)
            return 0
        if args.stop is not None:  # a request to a running job: no torch either
            if args.json:
                raise UsageError("--json goes with --status")
            stopper.command(args.stop, args.init_method, args.key_file, args.checkpoint)
            return 0
        self.config = config = from_args(args)
        job = config.job
        if job.launch is not None:  # every server's ranks, started from here over ssh
            from utils.setup.remote import launch_remote

            return launch_remote(config, self.argv, self.handoff, PROG)
        if job.restart == "on-failure" and self.handoff.keeper_pipe is None:  # this process keeps the training going
            label = f"{PROG}: rank {job.rank}"
            return keeper.keep(self.argv, __file__, label, job.max_restarts, say, self.handoff)
        if refusal(config.recipe.precision, this_cpu()):  # each server asks its own CPU
            raise UsageError(refusal(config.recipe.precision, this_cpu()))
        keep_freed_memory()  # a step's freed buffers stay for the next (utils/setup/memory.py); forked ranks inherit it
        if job.rank is None and not job.eval:
            return launch(config, self.argv, self.handoff)
        self.rank = job.rank if job.rank is not None else os.environ.get("RANK", 0)
        if job.eval:
            from utils.run import evaluate

            evaluate(config, load_data(config))
            return 0
        return self.train()

    def train(self):
        """A rank of the job: trains it to its end (utils/setup/lifecycle.py: how it begins)."""
        job, found = with_card(self.config.job)  # before the data loads: a host with no route fails at once
        if found:
            print(found, flush=True)
        self.config = config = dataclasses.replace(self.config, job=job)
        stop.install(f"{PROG}: rank {self.rank}")
        data = load_data(config)
        instruments = from_environ(send_to_self=stop.send_to_self)
        self.supervisor = Supervisor(config, self.handoff, instruments)
        train(config, data, instruments, self.supervisor)
        rejoin.forget_book(config.outputs.checkpoint)  # the job finished: the command run again starts afresh
        return 0


def launch(config, argv, handoff):
    """The local launcher: check here what every rank would trip over, then start them all."""
    job = config.job
    # torch loads here with its ranks' threads, so that the ranks it forks are as if started afresh
    os.environ["OMP_NUM_THREADS"], handoff = rank_threads(job.nproc, handoff)
    if job.model_path:  # the only check that needs torch
        from utils.learn.model import Net
        from utils.store.checkpoint import load_model_state

        load_model_state(Net(), job.model_path, quiet=True)  # (rank 0 says it if it has no digest)
    if preflight(config, job.nproc, config.recipe.train_subset, quiet=True)[1]:
        say_finished(config)
        return 0
    ensure_mnist(job.data_dir)
    handoff = handoff.replace(resume_command=resume_command(argv, handoff))  # its command resumes, not a rank's
    fork_ranks = not job.model_path  # (its check ran torch here)
    return launch_local(__file__, argv, job.nproc, PROG, handoff, keep_going=job.recover, fork_ranks=fork_ranks)


def load_data(config):
    """MNIST, deterministic kernels first (every rank computes the same bits)."""
    from utils.learn.data import load_mnist
    from utils.learn.model import use_deterministic_algorithms

    use_deterministic_algorithms()
    return load_mnist(config.job.data_dir, config.recipe.train_subset, config.recipe.test_subset)


if __name__ == "__main__":
    code = main()
    # Leave without Python's shutdown: it destroys gloo's threads, and one still tearing down a connection
    # (to a lost peer, or to rank 0's store, gone first at the end of a run) aborts the process ("terminate
    # called without an active exception", exit -6). Everything worth keeping is on disk (saves are fsynced).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
