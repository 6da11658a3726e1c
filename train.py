"""Data-parallel MNIST training across servers, gradients summed by a hand-written gloo ring.

On each server (one rank per server):
    nohup python3 -u train.py --init-method tcp://192.168.0.1:23456 --epoch 1200 --rank 0 \
        --world-size 2 --gloo_socket_ifname eth0 --model_path model_state_dict.pth

On one machine, all ranks over loopback:   python train.py
Under torchrun:                             torchrun --nproc-per-node 2 train.py
Under Slurm:                                sbatch scripts/slurm.sbatch   (its srun needs no rank flags)
Evaluate a saved model:                     python train.py --eval --model_path model_state_dict.pth
Ask a running job how it does:              python train.py --status 192.168.0.1:23456

Stop with SIGTERM or SIGINT (Ctrl-C) to any rank: every rank stops after the same step, rank 0
saves the checkpoint, and every rank exits with code 3; --resume continues, on this number of
servers or another.

This file sets up: the command line becomes a utils.setup.config.Config; then it evaluates, starts every
rank here (utils/setup/launch.py), or joins the process group (utils/setup/distributed.py) and hands over to
utils/run.py, which trains. Exceptions become one line and an exit code (utils/errors.py).
"""

import dataclasses
import datetime
import os
import shlex
import sys

from utils.elastic import faults, rejoin, status
from utils.errors import EXIT_BAD_INPUT, EXIT_LOST_PEER, EXIT_STOPPED, PeerError, Stopped, UsageError, first_line
from utils.learn.mnist import ensure_mnist
from utils.observe.instruments import OFF, from_environ

# Only modules without torch here: a bad command line and the local launcher answer before torch loads.
from utils.setup import cli, keeper, stop
from utils.setup.config import check_share, from_args
from utils.setup.launch import launch_local, threads_per_rank
from utils.setup.memory import keep_freed_memory
from utils.setup.precision import refusal, this_cpu
from utils.store.files import check_folder, check_writable, remove_stale_temps, set_aside
from utils.store.outputs import lock_outputs, release

# c10d logs socket errors with stack traces; we report them in one line (set before torch loads)
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")

PROG = "train.py"


def parse_args(argv):
    return cli.parse_args(argv, PROG)


def preflight(config, world_size, train_images, unfinished=False):
    """What rank 0, or the local launcher for all its ranks, checks before anyone trains (one
    error line, not one per rank): the outputs can be written and no other job holds them, the
    ranks can share the data, and the checkpoint to resume from matches this run. Returns (that
    checkpoint or None, whether it is a finished run). It only looks; rank 0 takes the lock afterwards.
    unfinished: without --resume, resume a checkpoint of these settings with epochs left (a server's
    command run again: utils/elastic/rejoin.py); another run's checkpoint is set aside as ever."""
    for option, path in config.outputs.files():
        check_writable(path, option)
    if config.outputs.tensorboard:
        check_folder(config.outputs.tensorboard, "--tensorboard")
    lock_outputs(config.outputs, hold=False)
    check_share(train_images, world_size, config.recipe.global_batch)
    if (config.job.resume or unfinished) and os.path.exists(config.outputs.checkpoint):
        from utils.learn.model import Net
        from utils.setup.distributed import model_name
        from utils.store import checkpoint

        try:
            resume_from = checkpoint.load(config.outputs.checkpoint, {"model": model_name(Net()), **config.must_keep()})
            done = checkpoint.finished(resume_from, config.recipe.epochs)
            kind = rejoin.Checkpoint.FINISHED if done else rejoin.Checkpoint.UNFINISHED
        except UsageError:
            if config.job.resume:
                raise
            kind = rejoin.Checkpoint.OTHER  # another run's, or not one: this run starts afresh, as without --resume
        if rejoin.choose(False, kind, config.job.resume) == rejoin.How.RESUME:
            return resume_from, done
    return None, False


def say_finished(config):
    epochs, path = config.recipe.epochs, config.outputs.checkpoint
    print(f"{path} is a finished run ({epochs} of {epochs} epochs); nothing to do", flush=True)


def train(config, data, instruments=OFF):
    import torch

    from utils.elastic.join import join_running_job
    from utils.learn.model import Net
    from utils.setup.distributed import model_name

    torch.manual_seed(config.recipe.seed)
    model, job = Net(config.recipe.precision), config.job
    faults.at_restart(job.rank)
    joins = job.join is not None
    if not joins and rejoin.per_server(job):  # the same command run again: is its job running? (rejoin.py)
        offer = lambda: start_job(config, data, model, rendezvous_seconds=rejoin.RENDEZVOUS_SECONDS)  # noqa: E731
        how = rejoin.look_for_job(config, offer)
        if how == rejoin.How.TRAINED:  # (a server that waited for its job: the whole job started again)
            return
        joins = how == rejoin.How.JOIN
    if joins:  # a server joining a running job: the members send it everything
        config = dataclasses.replace(config, job=dataclasses.replace(job, join=job.join or ""))
        membership, decision = join_running_job(config, model_name(model))
        stop.arm()
        train_rank(model, data, config, membership, None, None, instruments, decision)
        return
    start_job(config, data, model, instruments=instruments)


def train_rank(model, data, config, membership, hosts, resume_from, instruments, decision=None):
    """This rank's training, from the job's start (hosts, resume_from) or, for a joining server, from
    the members' state (decision); elastic when it has a membership (utils/elastic/recovery.py)."""
    from utils.elastic.join import report_dropped
    from utils.elastic.recovery import Elastic, NotElastic
    from utils.learn.training import Trainer
    from utils.run import run

    instruments.bind(membership.me if membership is not None else config.job.rank or 0)
    trainer = Trainer(model, data, config, membership, keeper.trained, instruments)
    elastic = NotElastic() if membership is None else Elastic(membership, trainer, instruments)
    try:
        if membership is not None:
            trainer.add(elastic)
            membership.progress = trainer.watch.record  # what its heartbeats carry (--status)
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
    started = meet(config, model, resume_from, done)
    if started is not None:
        stop.arm()  # from here a signal stops the job after a step, with the checkpoint saved
        train_rank(model, data, *started, instruments)
    dist.destroy_process_group()
    return True


def before_rendezvous(config, data, model):
    """Under torchrun's agent, this attempt's store; on rank 0, what a bad file or another job's
    outputs would fail on (preflight), before anyone waits. Returns (config, the checkpoint to resume
    or None, whether it is a finished run, the attempt's store or None)."""
    from utils.setup.distributed import torchrun_attempt_store
    from utils.store import checkpoint

    job = config.job
    attempt_store, restarted = None, False
    if job.torchrun and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        timeout = datetime.timedelta(seconds=config.sync.timeout)
        attempt_store, restarted = torchrun_attempt_store(job.rank, job.world_size, timeout)
    resume_from, done = None, False
    if job.rank == 0:
        if restarted:  # torchrun started this rank again after a failure: it resumes without --resume
            config = dataclasses.replace(config, job=dataclasses.replace(job, resume=True))
        resume_from, done = preflight(config, job.world_size, len(data[1]), rejoin.per_server(job))
        lock_outputs(config.outputs, hold=not done)  # a finished run writes nothing, not even a lock file
        if resume_from is None and job.model_path:
            checkpoint.load_model_state(model, job.model_path)
    return config, resume_from, done, attempt_store


def meet(config, model, resume_from, done):
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
        membership = start_membership(config, model_name(model)) if job.world_size > 1 else None
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


def resume_command(argv):
    """The command that continues this job from its checkpoint."""
    if os.environ.get("RING_RESUME_COMMAND"):  # set by the local launcher: its command, not ours
        return os.environ["RING_RESUME_COMMAND"]
    return shlex.join(["python3", "-u", PROG, *argv, *([] if "--resume" in argv else ["--resume"])])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    rank = "?"
    try:
        args = parse_args(argv)
        if args.status is not None:  # a question to a running job: no torch, no training
            status.command(args.status, args.init_method, args.key_file, args.checkpoint, args.json)
            return 0
        config = from_args(args)
        job = config.job
        if job.restart == "on-failure" and not os.environ.get(keeper.KEPT):  # this process keeps the training going
            return keeper.keep(argv, __file__, f"{PROG}: rank {job.rank}", job.max_restarts, say)
        if refusal(config.recipe.precision, this_cpu()):  # each server asks its own CPU
            raise UsageError(refusal(config.recipe.precision, this_cpu()))
        keep_freed_memory()  # a step's freed buffers stay for the next (utils/setup/memory.py); forked ranks inherit it
        if job.rank is None and not job.eval:  # the local launcher: check here what every rank would trip over
            # torch loads here with its ranks' threads, so that the ranks it forks are as if started afresh
            os.environ["OMP_NUM_THREADS"] = str(threads_per_rank(job.nproc))
            if job.model_path:  # the only check that needs torch
                from utils.learn.model import Net
                from utils.store.checkpoint import load_model_state

                load_model_state(Net(), job.model_path)
            if preflight(config, job.nproc, config.recipe.train_subset)[1]:
                say_finished(config)
                return 0
            ensure_mnist(job.data_dir)
            return launch_local(
                __file__,
                argv,
                job.nproc,
                PROG,
                dict(os.environ, RING_RESUME_COMMAND=resume_command(argv)),
                keep_going=job.recover,
                fork_ranks=not job.model_path,  # (its check ran torch here)
            )
        rank = job.rank if job.rank is not None else os.environ.get("RANK", 0)
        if not job.eval:
            stop.install(f"{PROG}: rank {rank}")
        from utils.learn.data import load_mnist
        from utils.learn.model import use_deterministic_algorithms

        use_deterministic_algorithms()
        data = load_mnist(job.data_dir, config.recipe.train_subset, config.recipe.test_subset)
        if job.eval:
            from utils.run import evaluate

            evaluate(config, data)
        else:
            train(config, data, from_environ(send_to_self=stop.send_to_self))
            rejoin.forget_book(config.outputs.checkpoint)  # the job finished: the command run again starts afresh
        return 0
    except UsageError as e:
        say(f"{PROG}: error: {e}")
        return EXIT_BAD_INPUT
    except PeerError as e:
        if e.left_behind and rejoin.per_server(job) and job.rejoin_timeout > 0 and stop.signalled() is None:
            say(f"{PROG}: rank {rank}: {e}; waiting up to {job.rejoin_timeout:g} s to join the job again")
            release()
            rejoin.again(__file__, argv, job.rejoin_timeout)  # (this process, started afresh: no return)
        hint = f"; to resume: {resume_command(argv)}" if e.resumable else ""
        say(f"{PROG}: rank {rank}: {e}{hint}")
        if e.final:
            keeper.final()
        return EXIT_LOST_PEER
    except Stopped as e:
        stop.leaving()  # a requeue's SIGTERM, or a late repeat, must not make this exit a crash
        say(f"{PROG}: rank {rank}: {e}; to resume: {resume_command(argv)}")
        if job.slurm and job.rank == 0 and stop.signalled() == "SIGUSR1":  # Slurm's warning: its time is nearly up
            from utils.setup.slurm import requeue

            say(f"{PROG}: rank 0: {requeue(job.slurm, config.outputs.checkpoint)}")
        return EXIT_STOPPED
    except KeyboardInterrupt:
        say(f"{PROG}: rank {rank}: interrupted")
        return 130
    finally:
        release()  # this job's lock files (rank 0's), if it took them


def say(line):
    """One line to stderr in one write: ranks under torchrun or our launcher share one pipe, and
    print's two writes (text, then newline) let their lines run into each other."""
    sys.stderr.flush()
    os.write(2, (line + "\n").encode())


if __name__ == "__main__":
    code = main()
    # Leave without Python's shutdown: it destroys gloo's threads, and one still tearing down a connection
    # (to a lost peer, or to rank 0's store, gone first at the end of a run) aborts the process ("terminate
    # called without an active exception", exit -6). Everything worth keeping is on disk (saves are fsynced).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
