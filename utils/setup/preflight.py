"""What is checked before anyone trains, on rank 0 or on the local launcher for all its ranks: one
error line, not one per rank, before any rank waits for the others.

    preflight(config, world_size, train_images)   the outputs, the data's share, the checkpoint to resume
    before_rendezvous(config, data, model)         rank 0's preflight and --model_path; torchrun's attempt
"""

import dataclasses
import datetime
import os

from utils.elastic import rejoin
from utils.errors import Damaged, UsageError
from utils.setup.config import check_share
from utils.store.files import check_folder, check_writable
from utils.store.outputs import lock_outputs


def preflight(config, world_size, train_images, unfinished=False, quiet=False):
    """What rank 0, or the local launcher for all its ranks, checks before anyone trains (one
    error line, not one per rank): the outputs can be written and no other job holds them, the
    ranks can share the data, and the checkpoint to resume from matches this run. Returns (that
    checkpoint or None, whether it is a finished run). It only looks; rank 0 takes the lock afterwards.
    unfinished: without --resume, resume a checkpoint of these settings with epochs left (a server's
    command run again: utils/elastic/rejoin.py); another run's checkpoint is set aside as ever, but
    a damaged one (its digest does not match) stops it here too. quiet: no line for a checkpoint
    without a digest (the local launcher's look: its rank 0 says it)."""
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
            expected = {"model": model_name(Net()), **config.must_keep()}
            resume_from = checkpoint.load(config.outputs.checkpoint, expected, quiet)
            done = checkpoint.finished(resume_from, config.recipe.epochs)
            kind = rejoin.Checkpoint.FINISHED if done else rejoin.Checkpoint.UNFINISHED
        except UsageError as e:
            if config.job.resume or isinstance(e, Damaged):
                raise
            kind = rejoin.Checkpoint.OTHER  # another run's, or not one: this run starts afresh, as without --resume
        if rejoin.choose(False, kind, config.job.resume) == rejoin.How.RESUME:
            return resume_from, done
    return None, False


def say_finished(config):
    epochs, path = config.recipe.epochs, config.outputs.checkpoint
    print(f"{path} is a finished run ({epochs} of {epochs} epochs); nothing to do", flush=True)


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
