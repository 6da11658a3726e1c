"""Training: the epoch loop, one step at a time, with the gradients summed over the ring.

    train_step()   one step: forward, loss.backward(), the gradient sum, the optimizer step
    train_model()  one epoch of steps (or what is left of it)
    test_model()   accuracy on the 10,000 test images
    run()          the epoch loop: train, evaluate (rank 0), log, save state dict and checkpoint

The gradient sum is a utils.sync.buckets object (plain, overlapped or lazy; any --allreduce and
--compress). A signal (utils/stop.py) rides along with a step's gradient sum as a stop flag, so
every rank learns of it after the same step; then rank 0 saves the checkpoint and every rank
raises Stopped. A checkpoint records the step and the global batch, not the ranks: it resumes
on any number (utils/checkpoint.py).
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from utils import checkpoint, stop, timeline
from utils.data import step_batches
from utils.distributed import check_identical_parameters, model_name
from utils.elastic import faults
from utils.errors import PeerError, Stopped, first_line
from utils.sync.buckets import make_gradient_sync

JOIN_FLAG = 64.0  # the flag's sum: ranks with a signal + 64 if a server waits to join (exact, < 256)


def stop_flag(membership=None):
    """This rank's contribution to the flag: 1 once it got a signal; plus JOIN_FLAG on the leader
    while a server waits to join (utils/elastic/membership.py), so that every rank learns of it at one step."""
    joining = membership is not None and membership.wants_growth()
    return (1.0 if stop.signalled() else 0.0) + (JOIN_FLAG if joining else 0.0)


class Joining(Exception):
    """The step just done said a server waits to join: every rank takes it in now."""


def make_optimizer(model, recipe, steps_per_epoch):
    """Adam with a one-cycle learning rate over the whole run (warm up, then anneal)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=recipe.lr)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=recipe.lr, total_steps=recipe.epochs * steps_per_epoch, pct_start=0.15
    )
    return optimizer, scheduler


def batches_of_epoch(num_examples, epoch, recipe):
    """This rank's (batch, weight, images of the step in all) for every step of `epoch`
    (utils/data.step_batches); the weight is its share of the step's images times N, so the
    average over ranks weighs every image alike."""
    n = dist.get_world_size()
    batches, sizes = step_batches(num_examples, epoch, dist.get_rank(), n, recipe.seed, recipe.global_batch)
    return [
        (batch, 1.0 if len(batch) * n == size else len(batch) * n / size, size) for batch, size in zip(batches, sizes)
    ]


def train_step(model, gradient_sync, images, labels, weight=1.0):
    """One training step on `images`: the loss, before the step."""
    gradient_sync.weigh(weight)
    with timeline.span("step"):
        with timeline.span("forward"):
            loss = F.cross_entropy(model(images), labels)
        with timeline.span("backward"):
            loss.backward()
        faults.point("sum")
        gradient_sync.after_backward()  # the sum over all ranks (overlapped: already running)
        gradient_sync.step()
    return loss


class Progress:
    """tqdm on a terminal; under nohup (not a terminal), a plain line every tenth of the epoch."""

    def __init__(self, epoch, first_step, total, enabled):
        self.epoch, self.total, self.enabled = epoch, total, enabled
        self.bar = None
        if enabled and sys.stderr.isatty():
            self.bar = tqdm(total=total, initial=first_step, desc=f"epoch {epoch}", leave=False)
        self.start, self.next_report = time.time(), first_step + max(1, total // 10)

    def update(self, step, mean_loss):
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{mean_loss:.4f}", refresh=False)
        elif self.enabled and step >= self.next_report and step < self.total:
            print(
                f"  epoch {self.epoch}: {step}/{self.total} steps, mean loss {mean_loss:.4f}, "
                f"{time.time() - self.start:.0f} s",
                flush=True,
            )
            self.next_report += max(1, self.total // 10)

    def close(self):
        if self.bar is not None:
            self.bar.close()


class EpochStats:
    """What an epoch's log line reports; carried in mid-epoch checkpoints."""

    def __init__(
        self,
        loss_sum=0.0,
        steps=0,
        comm_seconds=0.0,
        step_seconds=0.0,
        busy_seconds=0.0,
        bytes_sent=0,
        bytes_summed=0,
        images=0,
    ):
        self.loss_sum, self.steps = loss_sum, steps
        self.images = images  # the steps' images in all, every rank's (each step once)
        self.comm_seconds = comm_seconds  # the step waited for communication this long
        self.busy_seconds = busy_seconds  # communication ran this long (hidden or not)
        self.step_seconds = step_seconds
        self.bytes_sent = bytes_sent  # this rank sent this much for gradient sums
        self.bytes_summed = bytes_summed  # the summed buffers' size on the wire (compressed)


class Done:
    """The last two steps this rank completed, (epoch, step, a copy of the epoch's stats then):
    where a job that lost a rank goes on from (utils/elastic/recovery.py)."""

    def __init__(self, epoch, step, stats, first=None):
        self.last = self.before = (epoch, step, EpochStats(**vars(stats)))
        self.first = first  # called once, after the first step (after a change of members: its time)

    def add(self, epoch, step, stats):
        self.before, self.last = self.last, (epoch, step, EpochStats(**vars(stats)))
        if self.first is not None:
            self.first, first = None, self.first
            first(epoch, step)


TIMES = (("busy_seconds", "busy_seconds"), ("comm_seconds", "waited_seconds"))
BYTES = (("bytes_sent", "bytes_sent"), ("bytes_summed", "bytes_summed"))


def train_model(
    model, gradient_sync, images, labels, batches, epoch, first_step, stats, save_every=0, save=None, done=None
):
    """Train on `batches[first_step:]` of `epoch`; `save(epoch, step, stats)` every save_every steps;
    `done` (a Done) notes each step.

    A stop flag summed with a step's gradients (any rank got a signal): save after that step and
    raise Stopped(epoch, step, steps in the epoch), on every rank alike."""
    model.train()
    progress = Progress(epoch, first_step, len(batches), enabled=dist.get_rank() == 0)
    step = first_step
    seen = gradient_sync.stats()  # what stats already holds of gradient_sync's running totals

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
            loss = train_step(model, gradient_sync, images[batch], labels[batch], weight)
            stats.loss_sum += loss.item()
            stats.steps += 1
            stats.images += size
            if done is not None:  # its sums are done or (lazy) under way: gradient_sync.abandon() tells
                done.add(epoch, step, stats)
            flags = gradient_sync.stop_count()
            stopping, joining = flags % JOIN_FLAG > 0, flags >= JOIN_FLAG
            saving = stopping or joining or (save_every and step % save_every == 0 and step < len(batches))
            if saving:  # lazy: apply the update now, not in the next forward (its wait is this step's)
                gradient_sync.finish()
            count(TIMES)
            if saving:  # lazy: only now are all of this step's sums done, so bytes are counted here
                count(BYTES)
            stats.step_seconds += time.perf_counter() - start
            progress.update(step, stats.loss_sum / stats.steps)
            if saving and not joining:
                save(epoch, step, stats)
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
        raise PeerError(f"lost a peer while {e.doing} (epoch {epoch}, step {step}): {e}") from None
    finally:
        progress.close()


@torch.no_grad()
def test_model(model, images, labels, batch_size=1000):
    """Fraction of `images` classified correctly."""
    model.eval()
    correct = sum(
        (model(x).argmax(1) == y).sum().item() for x, y in zip(images.split(batch_size), labels.split(batch_size))
    )
    return correct / len(labels)


def evaluate(config, data):
    """train.py --eval: the test accuracy of --model_path."""
    from utils.model import Net

    model = Net()
    checkpoint.load_model_state(model, config.job.model_path)
    accuracy = test_model(model, data[2], data[3])
    print(f"test accuracy {accuracy:.2%} ({config.job.model_path}, {len(data[3])} images)")


def run(model, data, config, resume_from=None, membership=None, joining=None):
    """Train for config.recipe.epochs epochs; rank 0 evaluates, logs and saves after each.

    `resume_from`: a checkpoint dict (the same on every rank) to continue exactly where it left off,
    on this number of ranks or another (utils/checkpoint.restore). `membership`: this rank's
    utils.elastic.membership.Membership; with it, a lost rank costs at most the step in flight
    (utils/elastic/recovery.py), without it a lost rank stops the job. `joining`: the decision that took
    this server into a running job (--join); it starts from the state a member sends.
    """
    recipe, outputs = config.recipe, config.outputs
    train_images, train_labels, test_images, test_labels = data
    steps_per_epoch = len(batches_of_epoch(len(train_labels), 1, recipe))
    optimizer, scheduler = make_optimizer(model, recipe, steps_per_epoch)
    flag = lambda: stop_flag(membership)  # noqa: E731
    gradient_sync = (
        make_gradient_sync(model, config.sync, optimizer, scheduler, recipe.seed, flag) if joining is None else None
    )  # a joining server makes its own with the members (Recovery.form)
    if gradient_sync is not None and dist.get_rank() == 0 and gradient_sync.allreduces[0].note():
        print(gradient_sync.allreduces[0].note(), flush=True)
    if outputs.timeline_steps:  # rank 0 was given --timeline (utils/distributed.agree)
        timeline.recorder = timeline.Recorder(
            outputs.timeline, *outputs.timeline_steps, recipe.epochs * steps_per_epoch
        )
    epoch, first_step, stats = 1, 0, EpochStats()
    if resume_from is not None:
        epoch, first_step, epoch_stats = checkpoint.restore(
            resume_from, optimizer, scheduler, gradient_sync, dist.get_rank(), dist.get_world_size()
        )
        stats = EpochStats(**epoch_stats)
    settings = {"model": model_name(model), **config.must_keep()}

    def state(epoch, step, stats, everyone=None, world_size=None):
        """The checkpoint dict of this rank after `step` of `epoch` (everyone: every rank's compression
        state; world_size: the ranks it was made on, if the group is gone)."""
        return checkpoint.training_state(
            model,
            optimizer,
            scheduler,
            epoch,
            step,
            vars(stats),
            world_size or dist.get_world_size(),
            everyone,
            settings,
            config.to_dict(),
        )

    def save_checkpoint(epoch, step, stats):
        """Rank 0 writes everything needed to continue after `step` of `epoch` (every rank calls it:
        a compressed run's checkpoint holds every rank's compression state)."""
        everyone = [None] * dist.get_world_size()
        per_rank = config.sync.compress != "none" or config.sync.sync_every > 1  # (--sync-every: each rank's Adam)
        if per_rank:
            try:
                dist.all_gather_object(everyone, gradient_sync.state_dict())
            except RuntimeError as e:
                raise PeerError(first_line(e), doing="saving a checkpoint") from None
        faults.point("save")
        if dist.get_rank() == 0:
            with timeline.span("checkpoint"):
                checkpoint.save(state(epoch, step, stats, everyone if per_rank else None), outputs.checkpoint)

    recovery = None
    if membership is not None:
        from utils.elastic.recovery import Recovery

        recovery = Recovery(
            membership,
            config,
            model,
            optimizer,
            scheduler,
            state,
            lambda: make_gradient_sync(model, config.sync, optimizer, scheduler, recipe.seed, flag),
            EpochStats,
        )
    if joining is not None:
        gradient_sync, (epoch, first_step, stats) = recovery.form(joining, None, None)
        say_joined(membership, epoch, first_step)
    done = Done(epoch, first_step, stats, first_step_after("joined") if joining is not None else None)
    accuracy = None
    while epoch <= recipe.epochs:
        try:
            accuracy = train_epoch(model, gradient_sync, data, config, epoch, first_step, stats, save_checkpoint, done)
            epoch, first_step, stats = epoch + 1, 0, EpochStats()
            done = Done(epoch, first_step, stats)
        except Joining:
            gradient_sync, (epoch, first_step, stats) = recovery.grow(gradient_sync, done.last)
            done = Done(epoch, first_step, stats, first_step_after("grew"))
        except PeerError as e:
            if recovery is None:
                raise
            undone = gradient_sync.abandon()
            epoch, first_step, stats = done.before if undone else done.last
            gradient_sync, (epoch, first_step, stats) = recovery.go_on(e, gradient_sync, (epoch, first_step, stats))
            done = Done(epoch, first_step, stats, first_step_after("shrank"))
    timeline.write()  # if the run ended inside the window
    try:  # also a barrier: nobody reports success before rank 0 has saved
        digest = check_identical_parameters(model)
    except RuntimeError as e:
        raise PeerError(f"lost a peer at the end of training: {first_line(e)}") from None
    if dist.get_rank() == 0:
        print(
            f"saved the model to {outputs.save_path}; parameters identical on all {dist.get_world_size()} ranks "
            f"(sha256 {digest})",
            flush=True,
        )
    gradient_sync.close()
    return accuracy


def train_epoch(model, gradient_sync, data, config, epoch, first_step, stats, save_checkpoint, done):
    """What is left of `epoch`: its steps, then rank 0 evaluates and reports, and the checkpoint."""
    train_images, train_labels, test_images, test_labels = data
    start, accuracy = time.time(), None
    batches = batches_of_epoch(len(train_labels), epoch, config.recipe)
    try:
        train_model(
            model,
            gradient_sync,
            train_images,
            train_labels,
            batches,
            epoch,
            first_step,
            stats,
            config.outputs.save_every,
            save_checkpoint,
            done,
        )
    except Stopped as e:
        timeline.write()
        raise Stopped(stopped_line(*e.args, config.outputs.checkpoint)) from None
    if epoch == config.recipe.epochs:  # the end: every rank's last changes in (--sync-every), then evaluate
        try:
            gradient_sync.flush()
        except PeerError as e:
            raise PeerError(f"lost a peer at the end of training: {e}") from None
    sent = bytes_sent_per_step(stats)
    if dist.get_rank() == 0:
        with timeline.span("evaluate"):
            accuracy = test_model(model, test_images, test_labels)
        report_epoch(model, epoch, time.time() - start, stats, accuracy, sent, config, dist.get_world_size())
    try:
        save_checkpoint(epoch + 1, 0, EpochStats())
    except PeerError as e:
        raise PeerError(f"lost a peer while {e.doing} after epoch {epoch}: {e}") from None
    return accuracy


def report_epoch(model, epoch, seconds, stats, accuracy, sent, config, world_size):
    """Rank 0, after an epoch: the log line, the state dict, the metrics line."""
    loss = stats.loss_sum / max(1, stats.steps)
    comm_share = stats.comm_seconds / stats.step_seconds if stats.step_seconds else 0.0
    busbw = (
        stats.bytes_summed * 2 * (world_size - 1) / world_size / stats.busy_seconds / 1e9 if stats.busy_seconds else 0.0
    )  # nccl-tests' bus bandwidth, GB/s, of what went on the wire
    print(
        f"epoch {epoch}/{config.recipe.epochs}  train loss {loss:.4f}  test accuracy {accuracy:.2%}  "
        f"time {seconds:.1f} s  comm {comm_share:.0%} of step time  busbw {busbw:.2f} GB/s  "
        f"sent {max(sent) / 1e6:.3g} MB/step",
        flush=True,
    )
    checkpoint.save(model.state_dict(), config.outputs.save_path)
    if config.outputs.metrics:
        append_metrics(
            config.outputs.metrics,
            dict(
                epoch=epoch,
                train_loss=loss,
                test_accuracy=accuracy,
                seconds=seconds,
                comm_share=comm_share,
                busbw_gbps=busbw,
                world_size=world_size,
                allreduce=config.sync.allreduce,
                overlap=config.sync.overlap,
                compress=config.sync.compress,
                bytes_sent_per_step=max(sent),
                bytes_sent_per_step_by_rank=sent,
                images=stats.images,
                members=membership_of_job(),
            ),
        )


def first_step_after(change):
    """What Done calls after the first step on new members: the time, for bench/recovery.py."""
    return lambda epoch, step: faults.log(
        event="first-step", after=change, epoch=epoch, step=step, world_size=dist.get_world_size()
    )


def say_joined(membership, epoch, step):
    print(
        f"rank {membership.me}: joined the job after epoch {epoch}, step {step}, as rank {dist.get_rank()} of "
        f"{dist.get_world_size()} (members {', '.join(map(str, membership.members))})",
        flush=True,
    )


def membership_of_job():
    """The ids (first ranks) of the ranks in the job now."""
    from utils.elastic import recovery

    return recovery.members() or list(range(dist.get_world_size()))


def stopped_line(epoch, step, steps, checkpoint):
    """After a stop: who got which signal, where the job stopped, and where rank 0 saved it (a
    collective; rank 0 joins it once its save is done, so every rank may say it is saved)."""
    everyone = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(everyone, (stop.signalled(), checkpoint))
    except RuntimeError as e:
        raise PeerError(f"lost a peer while stopping after epoch {epoch}, step {step}: {first_line(e)}") from None
    by_signal = {}
    for rank, (signal_name, _) in enumerate(everyone):
        if signal_name:
            by_signal.setdefault(signal_name, []).append(str(rank))
    who = ", ".join(
        f"{name} to rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)}" for name, ranks in by_signal.items()
    )
    return f"stopped after epoch {epoch}, step {step}/{steps} ({who}); checkpoint saved to {everyone[0][1]}"


def bytes_sent_per_step(stats):
    """Every rank's mean bytes sent per step this epoch (a collective: every rank calls it)."""
    mine = torch.tensor([stats.bytes_sent / max(1, stats.steps)], dtype=torch.float64)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    try:
        dist.all_gather(everyone, mine)
    except RuntimeError as e:
        raise PeerError(f"lost a peer at the end of an epoch: {first_line(e)}") from None
    return [round(t.item()) for t in everyone]


def append_metrics(path, row):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
