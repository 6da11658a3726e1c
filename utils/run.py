"""Training: the epoch loop, one step at a time, with the gradients summed over the ring.

    train_step()   one step: forward, loss.backward(), the ring sum, optimizer.step()
    train_model()  one epoch of steps (or what is left of it)
    test_model()   accuracy on the 10,000 test images
    run()          the epoch loop: train, evaluate (rank 0), log, save state dict and checkpoint

The gradient sum is a utils.sync GradientSync (plain, overlapped, lazy or periodic; any
--allreduce and --compress). A signal (utils/stop.py) rides along with a step's gradient sum as a
stop flag (utils.sync.flags.Flags), so every rank learns of it after the same step; then rank
0 saves the checkpoint and every rank raises Stopped. A checkpoint records the step and the global
batch, not the ranks: it resumes on any number (utils/checkpoint.py). What rank 0 prints is
utils/report.py's; what a rank shows those who watch the job (--status, --tensorboard), utils/watch.py's.
"""

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from utils import checkpoint, stop
from utils.balance import REVIEW, Balance
from utils.board import Board
from utils.comm import hierarchical
from utils.data import BalancedBatches, step_batches
from utils.distributed import check_identical_parameters, model_name
from utils.elastic import faults
from utils.elastic.recovery import Recovery
from utils.elastic.status import Record
from utils.errors import PeerError, Stopped, first_line
from utils.exchange import all_gather_state
from utils.model import Net
from utils.optim import Adam, OneCycleLR
from utils.report import Progress, SlowRankHint, epoch_by_rank, report_epoch, say_joined, start_line, stopped_line
from utils.sync.factory import make_gradient_sync
from utils.sync.flags import Flags
from utils.timeline import OFF, Recorder
from utils.watch import Watch


def stop_flag(membership=None, balance=None):
    """This rank's flags for the next sum: a signal it got; on the leader, a server waiting to join
    (utils/elastic/membership.py), so that every rank learns of it at one step; --balance: its speed."""
    return Flags(
        signalled=1 if stop.signalled() else 0,
        joining=membership is not None and membership.wants_growth(),
        speeds=balance.slots() if balance is not None else (),
    )


class Joining(Exception):
    """The step just done said a server waits to join: every rank takes it in now."""


def make_optimizer(model, recipe, steps_per_epoch):
    """Adam with a one-cycle learning rate over the whole run (warm up, then anneal): utils/optim.py,
    torch.optim's sums without its start-up cost."""
    optimizer = Adam(model.parameters(), lr=recipe.lr)
    scheduler = OneCycleLR(optimizer, max_lr=recipe.lr, total_steps=recipe.epochs * steps_per_epoch, pct_start=0.15)
    return optimizer, scheduler


def batches_of_epoch(num_examples, epoch, recipe, balance=None):
    """This rank's (batch, weight, images of the step in all) for every step of `epoch`
    (utils/data.step_batches; --balance: utils/data.BalancedBatches); the weight is its share of
    the step's images times N, so the average over ranks weighs every image alike."""
    if balance is not None:
        return BalancedBatches(num_examples, epoch, recipe.seed, recipe.global_batch, balance)
    n = dist.get_world_size()
    batches, sizes = step_batches(num_examples, epoch, dist.get_rank(), n, recipe.seed, recipe.global_batch)
    return [
        (batch, 1.0 if len(batch) * n == size else len(batch) * n / size, size) for batch, size in zip(batches, sizes)
    ]


def train_step(model, images, labels, gradient_sum, optimizer, timeline=OFF, balance=None):
    """One training step on `images`, as the original draws it: forward, loss.backward(), the ring
    sum, optimizer.step(). Returns the loss, before the step. gradient_sum: a utils.sync
    GradientSync; optimizer: its DistributedOptimizer. balance (--balance): told the time the step's
    work needed, its forward and backward apart."""
    started = balance.start(gradient_sum) if balance is not None else None
    with timeline.span("step"):
        with timeline.span("forward"):
            loss = F.cross_entropy(model(images), labels)
        with timeline.span("backward"):
            loss.backward()
        computed = balance.now(gradient_sum) if balance is not None else None
        faults.point("sum")
        gradient_sum.sum()  # every rank's gradients added up over the ring, divided by N (overlap: under way)
        optimizer.step()  # Adam and the learning rate's schedule, when this kind of sum calls for them
    if balance is not None:
        balance.timed(len(images), started, computed, balance.now(gradient_sum))
    return loss


@dataclass
class EpochStats:
    """What an epoch's log line reports; carried in mid-epoch checkpoints."""

    loss_sum: float = 0.0
    steps: int = 0
    comm_seconds: float = 0.0  # the step waited for communication this long
    step_seconds: float = 0.0
    busy_seconds: float = 0.0  # communication ran this long (hidden or not)
    bytes_sent: int = 0  # this rank sent this much for gradient sums
    bytes_summed: int = 0  # the summed buffers' size on the wire (compressed)
    images: int = 0  # the steps' images in all, every rank's (each step once)
    own_images: int = 0  # this rank's share of them


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
    model,
    gradient_sync,
    images,
    labels,
    batches,
    epoch,
    first_step,
    stats,
    save_every=0,
    save=None,
    done=None,
    timeline=OFF,
    balance=None,
    watch=None,
):
    """Train on `batches[first_step:]` of `epoch` (batches_of_epoch); `save(epoch, step, stats)`
    every save_every steps; `done` (a Done) notes each step; stats (an EpochStats) adds them up;
    balance (--balance, utils/balance.py) times each step and reviews the shares; watch (a
    utils.watch.Watch) is told each step's progress.

    A stop flag summed with a step's gradients (any rank got a signal): save after that step and
    raise Stopped(epoch, step, steps in the epoch), on every rank alike."""
    model.train()
    progress = Progress(epoch, first_step, len(batches), enabled=dist.get_rank() == 0)
    step = first_step
    seen = gradient_sync.stats()  # what stats already holds of gradient_sync's running totals
    watch = watch or Watch(Record())
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
                model, images[batch], labels[batch], gradient_sync, gradient_sync.optimizer, timeline, balance
            )
            stats.loss_sum += loss.item()
            stats.steps += 1
            stats.images += size
            stats.own_images += len(batch)
            if done is not None:  # its sums are done or (lazy) under way: gradient_sync.abandon() tells
                done.add(epoch, step, stats)
            flags = gradient_sync.flags()
            stopping, joining = flags.stopping, flags.joining
            if balance is not None and balance.review(step, flags.speeds):
                now = timeline.now_ns()
                timeline.add("re-balance", now, now, shares="/".join(map(str, balance.shares())))
                watch.rebalanced((epoch - 1) * len(batches) + step, balance.shares())
            if balance is not None and step % REVIEW == 0:  # (bench/balance.py: the shares over time)
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


# images a test batch: its largest buffer (conv2's output, 147 KB an image: 29 MB) stays under
# utils/memory.MMAP_THRESHOLD, so each batch reuses the last one's memory; and in the channels_last
# layout 200 still beats 500 and 1000 (0.62 s for the 10,000 images, against 0.73 and 0.86:
# bench/README.md, "Compute")
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
    model = Net()
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
    recipe, outputs = config.recipe, config.outputs
    steps_per_epoch = len(batches_of_epoch(len(data[1]), 1, recipe))
    balance = None  # --balance: the shares of each step (utils/balance.py)
    if config.sync.balance:
        rank, world_size, threads = dist.get_rank(), dist.get_world_size(), torch.get_num_threads()
        balance = Balance(config.sync.balance, rank, world_size, recipe.global_batch, threads)
    optimizer, scheduler = make_optimizer(model, recipe, steps_per_epoch)
    timeline = OFF  # rank 0 was given --timeline (utils/distributed.agree): every rank records
    if outputs.timeline_steps:
        timeline = Recorder(outputs.timeline, *outputs.timeline_steps, recipe.epochs * steps_per_epoch)

    def new_sync(hosts):
        flags = lambda: stop_flag(membership, balance)  # noqa: E731
        broken = membership.broken if membership is not None else None
        return make_gradient_sync(model, config.sync, optimizer, scheduler, recipe.seed, flags, hosts, timeline, broken)

    gradient_sync = None  # a joining server makes its own with the members (Recovery.form)
    if joining is None:
        gradient_sync = new_sync(hosts)
        if dist.get_rank() == 0:
            print(start_line(config, model, data, hierarchical.describe(hosts), gradient_sync), flush=True)
            if gradient_sync.note():
                print(gradient_sync.note(), flush=True)
    epoch, first_step, stats = 1, 0, EpochStats()
    if resume_from is not None:
        epoch, first_step, epoch_stats = checkpoint.restore(
            resume_from, optimizer, scheduler, gradient_sync, dist.get_rank(), dist.get_world_size()
        )
        stats = EpochStats(**epoch_stats)
        if balance is not None and resume_from.get("balance") and resume_from["world_size"] == dist.get_world_size():
            balance.restart(dist.get_rank(), dist.get_world_size(), resume_from["balance"])
            if dist.get_rank() == 0:
                print(f"shares from the checkpoint: {'/'.join(map(str, balance.shares()))}", flush=True)
    settings = {"model": model_name(model), **config.must_keep()}

    def state(epoch, step, stats, everyone=None, world_size=None):
        """The checkpoint dict of this rank after `step` of `epoch` (everyone: every rank's own
        gradient-sync state; world_size: the ranks it was made on, if the group is gone)."""
        world_size = world_size or dist.get_world_size()
        shares = list(balance.weights) if balance is not None and len(balance.weights) == world_size else None
        return checkpoint.training_state(
            model,
            optimizer,
            scheduler,
            epoch,
            step,
            vars(stats),
            world_size,
            everyone,
            settings,
            config.to_dict(),
            shares,
        )

    def save_checkpoint(epoch, step, stats):
        """Rank 0 writes everything needed to continue after `step` of `epoch` (every rank calls it:
        the checkpoint may hold every rank's own state, gradient_sync.has_rank_state)."""
        everyone = [None] * dist.get_world_size()
        if gradient_sync.has_rank_state:
            try:
                everyone = all_gather_state(gradient_sync.state_dict())
            except RuntimeError as e:
                raise PeerError(first_line(e), doing="saving a checkpoint") from None
        faults.point("save")
        if dist.get_rank() == 0:
            with timeline.span("checkpoint"):
                everyone = everyone if gradient_sync.has_rank_state else None
                checkpoint.save(state(epoch, step, stats, everyone), outputs.checkpoint)

    recovery = None
    if membership is not None:
        recovery = Recovery(membership, config, model, optimizer, scheduler, state, new_sync, EpochStats, timeline)
    if joining is not None:
        gradient_sync, (epoch, first_step, stats) = recovery.form(joining, None, None)
        say_joined(membership, epoch, first_step)
        if balance is not None:
            balance.restart(dist.get_rank(), dist.get_world_size())
    hint = SlowRankHint(dist.get_rank() == 0 and balance is None)
    record = Record(recipe.epochs)  # this rank's progress: its heartbeats carry it (train.py --status)
    if membership is not None:
        membership.progress = record
    board = (lambda at: Board(outputs.tensorboard, at)) if outputs.tensorboard else None  # rank 0 opens it
    watch = Watch(record, board, lambda: optimizer.param_groups[0]["lr"])
    done = Done(epoch, first_step, stats, first_step_after("joined") if joining is not None else None)
    accuracy = None
    while epoch <= recipe.epochs:
        members = list(membership.members) if membership is not None else list(range(dist.get_world_size()))
        watch.members(members, (epoch - 1) * steps_per_epoch + first_step, dist.get_rank() == 0)
        try:
            accuracy = train_epoch(
                model,
                gradient_sync,
                data,
                config,
                (epoch, first_step, stats),
                save_checkpoint,
                done,
                timeline,
                members,
                balance,
                hint,
                watch,
            )
            epoch, first_step, stats = epoch + 1, 0, EpochStats()
            done = Done(epoch, first_step, stats, done.first)  # (not called yet: a change at the epoch's last step)
        except Joining:
            gradient_sync, (epoch, first_step, stats) = recovery.grow(gradient_sync, done.last)
            done = Done(epoch, first_step, stats, first_step_after("grew"))
            if balance is not None:  # new members: equal shares until their speeds arrive
                balance.restart(dist.get_rank(), dist.get_world_size())
        except PeerError as e:
            if recovery is None:
                raise
            undone = gradient_sync.abandon()
            epoch, first_step, stats = done.before if undone else done.last
            gradient_sync, (epoch, first_step, stats) = recovery.go_on(e, gradient_sync, (epoch, first_step, stats))
            done = Done(epoch, first_step, stats, first_step_after("shrank"))
            if balance is not None:
                balance.restart(dist.get_rank(), dist.get_world_size())
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
    watch.close()
    return accuracy


def train_epoch(
    model, gradient_sync, data, config, position, save_checkpoint, done, timeline, members, balance, hint, watch
):
    """What is left of the epoch of `position` (epoch, first step, EpochStats): its steps, then rank
    0 evaluates and reports, and the checkpoint. members: the ids of the ranks in the job now, for
    metrics.jsonl; balance: --balance's shares (or None); hint: a SlowRankHint; watch: a utils.watch.Watch."""
    epoch, first_step, stats = position
    train_images, train_labels, test_images, test_labels = data
    start, accuracy = time.time(), None
    batches = batches_of_epoch(len(train_labels), epoch, config.recipe, balance)
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
            timeline,
            balance,
            watch,
        )
    except Stopped as e:
        timeline.write()
        raise Stopped(stopped_line(*e.args, config.outputs.checkpoint)) from None
    if epoch == config.recipe.epochs:  # the end: every rank's last changes in (--sync-every), then evaluate
        try:
            gradient_sync.flush()
        except PeerError as e:
            raise PeerError(f"lost a peer at the end of training: {e}") from None
    ranks = epoch_by_rank(stats)
    if dist.get_rank() == 0:
        with timeline.span("evaluate"):
            accuracy = test_model(model, test_images, test_labels)
        losses = watch.epoch(epoch * len(batches), accuracy, max(r["bytes_sent_per_step"] for r in ranks))
        extra = {"losses": losses, "test_images": len(test_labels)}
        report_epoch(epoch, time.time() - start, stats, accuracy, ranks, config, members, balance, extra)
        checkpoint.save_model(model, config.outputs.save_path)
        hint.check(ranks, stats.steps)
    try:
        save_checkpoint(epoch + 1, 0, EpochStats())
    except PeerError as e:
        raise PeerError(f"lost a peer while {e.doing} after epoch {epoch}: {e}") from None
    return accuracy


def first_step_after(change):
    """What Done calls after the first step on new members: the time, for bench/recovery.py."""
    return lambda epoch, step: faults.log(
        event="first-step", after=change, epoch=epoch, step=step, world_size=dist.get_world_size()
    )
