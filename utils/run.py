"""Training: the epoch loop, one step at a time, with the gradients summed over the ring.

    train_step()   one step: forward, loss.backward(), the ring sum, optimizer.step()
    train_model()  one epoch of steps (or what is left of it)
    test_model()   accuracy on the 10,000 test images
    run()          the epoch loop: train, evaluate (rank 0), log, save state dict and checkpoint

The gradient sum is a utils.sync GradientSync (plain, overlapped, lazy or periodic; any
--allreduce and --compress). A signal (utils/setup/stop.py) rides along with a step's gradient sum as a
stop flag (utils.sync.flags.Flags), so every rank learns of it after the same step; then rank
0 saves the checkpoint and every rank raises Stopped. A checkpoint records the step and the global
batch, not the ranks: it resumes on any number (utils/store/checkpoint.py). What the run holds from epoch
to epoch is a utils.learn.training.Trainer; what rank 0 prints is utils/observe/report.py's; what a rank shows
those who watch the job (--status, --tensorboard), utils/observe/watch.py's.
"""

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from utils.balance.shares import REVIEW
from utils.comm import hierarchical
from utils.elastic import faults, rejoin
from utils.elastic.recovery import Done, Recovery
from utils.elastic.status import Record
from utils.errors import PeerError, Stopped, first_line
from utils.learn.model import Net
from utils.learn.training import UNTIMED, Steps, Trainer
from utils.observe.report import (
    EpochStats,
    Progress,
    SlowRankHint,
    epoch_by_rank,
    report_epoch,
    say_joined,
    start_line,
    stopped_line,
)
from utils.observe.watch import Watch
from utils.setup import keeper
from utils.setup.distributed import check_identical_parameters
from utils.store import checkpoint
from utils.timeline import OFF


class Joining(Exception):
    """The step just done said a server waits to join: every rank takes it in now."""


def train_step(model, images, labels, gradient_sum, optimizer, timeline=OFF, clock=UNTIMED):
    """One training step on `images`, as the original draws it: forward, loss.backward(), the ring
    sum, optimizer.step(). Returns the loss, before the step. gradient_sum: a utils.sync
    GradientSync; optimizer: its DistributedOptimizer. clock: marks the step's start, the end of its
    forward and backward, and its end."""
    clock.start()
    with timeline.span("step"):
        with timeline.span("forward"):
            loss = F.cross_entropy(model(images), labels)
        with timeline.span("backward"):
            loss.backward()
        clock.computed()
        faults.point("sum")
        gradient_sum.sum()  # every rank's gradients added up over the ring, divided by N (overlap: under way)
        optimizer.step()  # Adam and the learning rate's schedule, when this kind of sum calls for them
    clock.ended(len(images))
    return loss


TIMES = (("busy_seconds", "busy_seconds"), ("comm_seconds", "waited_seconds"))
BYTES = (("bytes_sent", "bytes_sent"), ("bytes_summed", "bytes_summed"))


def train_model(steps, batches, position, done=None):
    """Train on `batches[first_step:]` of `epoch` (utils.learn.training.batches_of_epoch), position being
    (epoch, first_step, stats); stats (an EpochStats) adds the steps up; `done` (a
    utils.elastic.recovery.Done) notes each step; steps: a Steps.

    A stop flag summed with a step's gradients (any rank got a signal): save after that step and
    raise Stopped(epoch, step, steps in the epoch), on every rank alike."""
    epoch, first_step, stats = position
    model, gradient_sync, images, labels = steps.model, steps.sync, steps.images, steps.labels
    timeline, balance, save_every = steps.timeline, steps.balance, steps.save_every
    model.train()
    progress = Progress(epoch, first_step, len(batches), enabled=dist.get_rank() == 0)
    step = first_step
    seen = gradient_sync.stats()  # what stats already holds of gradient_sync's running totals
    watch = steps.watch or Watch(Record())
    watch.begin(epoch, stats)

    def count(names):
        """Add what gradient_sync did since the last count to stats: (stats field, its stats() key)."""
        now = gradient_sync.stats()
        for field, key in names:
            setattr(stats, field, getattr(stats, field) + now[key] - seen[key])
            seen[key] = now[key]

    try:
        for step in range(first_step + 1, len(batches) + 1):
            batch, weight, size = batches[step - 1]
            start = time.perf_counter()
            timeline.at_step((epoch - 1) * len(batches) + step)
            faults.at_step((epoch - 1) * len(batches) + step)
            gradient_sync.weigh(weight)  # this rank's share of the step's images, times N
            loss = train_step(
                model, images[batch], labels[batch], gradient_sync, gradient_sync.optimizer, timeline, steps.clock
            )
            stats.loss_sum += loss.item()
            stats.steps += 1
            stats.images += size
            stats.own_images += len(batch)
            keeper.trained()  # (under --restart: a keeper's backoff starts again, this process trains)
            if done is not None:  # its sums are done or (lazy) under way: gradient_sync.abandon() tells
                done.add(epoch, step, stats)
            flags = gradient_sync.flags()
            stopping, joining = flags.stopping, flags.joining
            if balance is not None and balance.review(step, flags.speeds):
                now = timeline.now_ns()
                timeline.add("re-balance", now, now, shares="/".join(map(str, balance.shares())))
                watch.rebalanced((epoch - 1) * len(batches) + step, balance.shares())
            if balance is not None and step % REVIEW == 0:  # (bench/balance/balance.py: the shares over time)
                faults.log(event="shares", epoch=epoch, step=step, shares=balance.shares(), speeds=flags.speeds)
            saving = stopping or joining or (save_every and step % save_every == 0 and step < len(batches))
            if saving:  # lazy: apply the update now, not in the next forward (its wait is this step's)
                gradient_sync.finish()
            count(TIMES)
            if saving:  # lazy: only now are all of this step's sums done, so bytes are counted here
                count(BYTES)
            seconds = time.perf_counter() - start
            stats.step_seconds += seconds
            progress.update(step, stats.loss_sum / stats.steps)
            watch.step(epoch, step, len(batches), len(batch), size, seconds, stats)
            if saving and not joining:
                steps.save(epoch, step, stats)
            if stopping:
                raise Stopped(epoch, step, len(batches))
            if joining:
                raise Joining()
            if timeline.window_ends():  # lazy: this step's update now, so that its sums are in the trace
                gradient_sync.finish()
                timeline.write()
        gradient_sync.finish()
        count(TIMES + BYTES)
    except PeerError as e:
        raise e.where(f"(epoch {epoch}, step {step})") from None
    finally:
        progress.close()


# images a test batch: its largest buffer (conv2's output, 147 KB an image: 29 MB) stays under
# utils/memory.MMAP_THRESHOLD, so each batch reuses the last one's memory; and in the channels_last
# layout 200 still beats 500 and 1000 (0.62 s for the 10,000 images, against 0.73 and 0.86:
# bench/compute/NOTES.md)
TEST_BATCH = 200


@torch.no_grad()
def test_model(model, images, labels, batch_size=TEST_BATCH):
    """Fraction of `images` classified correctly."""
    model.eval()
    correct = sum(
        (model(x).argmax(1) == y).sum().item() for x, y in zip(images.split(batch_size), labels.split(batch_size))
    )
    return correct / len(labels)


def evaluate(config, data):
    """train.py --eval: the test accuracy of --model_path."""
    model = Net(config.recipe.precision)
    checkpoint.load_model_state(model, config.job.model_path)
    accuracy = test_model(model, data[2], data[3])
    print(f"test accuracy {accuracy:.2%} ({config.job.model_path}, {len(data[3])} images)")


def run(model, data, config, hosts=None, resume_from=None, membership=None, joining=None):
    """Train for config.recipe.epochs epochs; rank 0 evaluates, logs and saves after each.

    `hosts`: the servers' ranks (utils.comm.hierarchical.discover), for the start line and the
    hierarchical sum. `resume_from`: a checkpoint dict (the same on every rank) to continue exactly
    where it left off, on this number of ranks or another (utils/checkpoint.restore). `membership`:
    this rank's utils.elastic.membership.Membership; with it, a lost rank costs at most the step in
    flight (utils/elastic/recovery.py), without it a lost rank stops the job. `joining`: the decision
    that took this server into a running job (--join); it starts from the state a member sends.
    """
    trainer = Trainer(model, data, config, membership)
    balance = trainer.balance
    if joining is None:
        trainer.sync = trainer.new_sync(hosts)
        if dist.get_rank() == 0:
            print(start_line(config, model, data, hierarchical.describe(hosts), trainer.sync), flush=True)
            if trainer.sync.note():
                print(trainer.sync.note(), flush=True)
    epoch, first_step, stats = 1, 0, EpochStats()
    if resume_from is not None:
        epoch, first_step, epoch_stats = checkpoint.restore(
            resume_from, trainer.optimizer, trainer.scheduler, trainer.sync, dist.get_rank(), dist.get_world_size()
        )
        stats = EpochStats(**epoch_stats)
        if balance is not None and resume_from.get("balance") and resume_from["world_size"] == dist.get_world_size():
            trainer.new_group(resume_from["balance"])
            if dist.get_rank() == 0:
                print(f"shares from the checkpoint: {'/'.join(map(str, balance.shares()))}", flush=True)
    recovery = Recovery(membership, trainer) if membership is not None else None
    if joining is not None:
        trainer.sync, (epoch, first_step, stats) = recovery.form(joining, None, None)
        say_joined(membership, epoch, first_step, rejoin.absence())
        trainer.new_group()
    trainer.hint = SlowRankHint(dist.get_rank() == 0 and balance is None)
    if membership is not None:
        membership.progress = trainer.record
    done = Done(epoch, first_step, stats, first_step_after("joined") if joining is not None else None)
    accuracy = None
    while epoch <= config.recipe.epochs:
        members = list(membership.members) if membership is not None else list(range(dist.get_world_size()))
        trainer.watch.members(members, (epoch - 1) * trainer.steps_per_epoch + first_step, dist.get_rank() == 0)
        try:
            accuracy = train_epoch(trainer, (epoch, first_step, stats), done, members)
            epoch, first_step, stats = epoch + 1, 0, EpochStats()
            done = Done(epoch, first_step, stats, done.first)  # (not called yet: a change at the epoch's last step)
        except Joining:
            trainer.sync, (epoch, first_step, stats) = recovery.grow(trainer.sync, done.last)
            done = Done(epoch, first_step, stats, first_step_after("grew"))
            trainer.new_group()
        except PeerError as e:
            if recovery is None:
                raise
            undone = trainer.sync.abandon()
            position = done.before if undone else done.last
            trainer.sync, (epoch, first_step, stats) = recovery.go_on(e, trainer.sync, position)
            done = Done(epoch, first_step, stats, first_step_after("shrank"))
            trainer.new_group()
    trainer.timeline.write()  # if the run ended inside the window
    try:  # also a barrier: nobody reports success before rank 0 has saved
        digest = check_identical_parameters(model)
    except RuntimeError as e:
        raise PeerError(f"lost a peer at the end of training: {first_line(e)}") from None
    if dist.get_rank() == 0:
        print(
            f"saved the model to {config.outputs.save_path}; parameters identical on all {dist.get_world_size()} "
            f"ranks (sha256 {digest})",
            flush=True,
        )
    trainer.sync.close()
    trainer.watch.close()
    return accuracy


def train_epoch(trainer, position, done, members):
    """What is left of the epoch of `position` (epoch, first step, EpochStats): its steps, then rank
    0 evaluates and reports, and the checkpoint. done: a Done; members: the ids of the ranks in the
    job now, for metrics.jsonl."""
    epoch, first_step, stats = position
    model, config, timeline, watch = trainer.model, trainer.config, trainer.timeline, trainer.watch
    train_images, train_labels, test_images, test_labels = trainer.data
    start, accuracy = time.time(), None
    batches = trainer.batches(epoch)
    steps = Steps(
        model, trainer.sync, train_images, train_labels, timeline, trainer.balance, watch, trainer.save_checkpoint,
        config.outputs.save_every,
    )  # fmt: skip
    try:
        train_model(steps, batches, position, done)
    except Stopped as e:
        timeline.write()
        raise Stopped(stopped_line(*e.args, config.outputs.checkpoint)) from None
    if epoch == config.recipe.epochs:  # the end: every rank's last changes in (--sync-every), then evaluate
        try:
            trainer.sync.flush()
        except PeerError as e:
            raise PeerError(f"lost a peer at the end of training: {e}") from None
    ranks = epoch_by_rank(stats)
    if dist.get_rank() == 0:
        with timeline.span("evaluate"):
            accuracy = test_model(model, test_images, test_labels)
        losses = watch.epoch(epoch * len(batches), accuracy, max(r["bytes_sent_per_step"] for r in ranks))
        extra = {"losses": losses, "test_images": len(test_labels)}
        rebalances = trainer.balance.changes if trainer.balance is not None else None
        report_epoch(epoch, time.time() - start, stats, accuracy, ranks, config, members, rebalances, extra)
        checkpoint.save_model(model, config.outputs.save_path)
        trainer.hint.check(ranks, stats.steps)
    try:
        trainer.save_checkpoint(epoch + 1, 0, EpochStats())
    except PeerError as e:
        raise e.where(f"after epoch {epoch}") from None
    return accuracy


def first_step_after(change):
    """What Done calls after the first step on new members: the time, for bench/recovery/recovery.py."""
    return lambda epoch, step: faults.log(
        event="first-step", after=change, epoch=epoch, step=step, world_size=dist.get_world_size()
    )
