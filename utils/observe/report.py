"""What the run tells its user: rank 0's start line, progress and epoch lines, metrics.jsonl, and
the lines every rank says after a join or a stop.

    start_line()       before the first step: what is trained, and how the sum is done
    Progress           tqdm on a terminal; under nohup a plain line every tenth of an epoch
    report_epoch()     after an epoch: the log line, the metrics line
    stopped_line()     after a stop: who got which signal, where the checkpoint is (a collective)
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

from utils.errors import PeerError, first_line
from utils.exchange import all_gather_json
from utils.setup import stop


def start_line(config, model, data, hosts, gradient_sync):
    """Rank 0's line before the first step. hosts: utils.comm.hierarchical.describe's words (and the threads')."""
    n, batch, sync = config.job.world_size, config.recipe.global_batch, config.sync
    share = batch // n
    per_rank = f"{share} per rank" if batch % n == 0 else f"{share}-{share + 1} per rank"
    if sync.balance:
        per_rank = "shared by measured speed" if sync.balance == "measured" else f"shared {sync.balance}"
    parameters = sum(p.numel() for p in model.parameters())
    test_note = f" ({len(data[3]):,} test images)" if config.recipe.test_subset else ""
    compress = gradient_sync.compressor.describe()
    return (
        f"rank 0 of {n}: {parameters:,} parameters, "
        f"{len(data[1]):,} training images{test_note}, batch {batch} ({per_rank}), "
        f"all-reduce {sync.allreduce} (chunks {sync.chunks}, overlap {'on' if gradient_sync.overlaps else 'off'}"
        f"{', lazy update' if sync.lazy_update else ''}){', ' + compress if compress else ''}, {hosts}"
    )


class Progress:
    """tqdm on a terminal; under nohup (not a terminal), a plain line every tenth of the epoch."""

    def __init__(self, epoch, first_step, total, enabled, started=None):
        """started: when the epoch began (time.time()): its clock goes on after a change of members."""
        self.epoch, self.total, self.enabled = epoch, total, enabled
        self.bar = None
        if enabled and sys.stderr.isatty():
            self.bar = tqdm(total=total, initial=first_step, desc=f"epoch {epoch}", leave=False)
        self.start, self.next_report = started or time.time(), first_step + max(1, total // 10)

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


class EpochReport:
    """Rank 0's report after an epoch's evaluation: the epoch line, the metrics line, the curves'
    epoch points (watch: a utils.observe.watch.Watch), and once a hint at a slow rank. members():
    the ids of the ranks in the job now; balance: --balance's (None without)."""

    def __init__(self, config, watch, members, balance, steps_per_epoch, test_images):
        self.config, self.watch, self.members, self.balance = config, watch, members, balance
        self.steps_per_epoch, self.test_images = steps_per_epoch, test_images
        self.hint = SlowRankHint(balance is None)

    def epoch(self, state, accuracy, ranks):
        """state: the training state at the epoch's end; ranks: every rank's epoch_by_rank."""
        epoch, stats = state.position.epoch, state.stats
        sent = max(r["bytes_sent_per_step"] for r in ranks)
        extra = {
            "losses": self.watch.epoch(epoch * self.steps_per_epoch, accuracy, sent),
            "test_images": self.test_images,
            "overlap": state.sync.overlaps,
        }
        rebalances = self.balance.changes if self.balance is not None else None
        seconds, members = state.epoch_seconds(), self.members()
        report_epoch(epoch, seconds, stats, accuracy, ranks, self.config, members, rebalances, extra)
        self.hint.check(ranks, stats.steps)


def report_epoch(epoch, seconds, stats, accuracy, ranks, config, members, rebalances=None, extra=None):
    """Rank 0, after an epoch: the log line and the metrics line. ranks: every rank's
    epoch_by_rank; members: the ids of the ranks in the job now; rebalances: --balance's changes of
    the shares so far (None: no --balance);
    extra: more for the metrics line (the losses of every progress report, utils/observe/watch.py; the
    number of test images)."""
    world_size = len(ranks)
    sent = [r["bytes_sent_per_step"] for r in ranks]
    shares = [r["images"] / max(1, stats.steps) for r in ranks]  # images per step, this epoch's mean
    speeds = [r["images"] / r["compute_seconds"] if r["compute_seconds"] else 0.0 for r in ranks]
    loss = stats.loss_sum / max(1, stats.steps)
    comm_share = stats.comm_seconds / stats.step_seconds if stats.step_seconds else 0.0
    busbw = (
        stats.bytes_summed * 2 * (world_size - 1) / world_size / stats.busy_seconds / 1e9 if stats.busy_seconds else 0.0
    )  # nccl-tests' bus bandwidth, GB/s, of what went on the wire
    print(
        f"epoch {epoch}/{config.recipe.epochs}  train loss {loss:.4f}  test accuracy {accuracy:.2%}  "
        f"time {seconds:.1f} s  comm {comm_share:.0%} of step time  busbw {busbw:.2f} GB/s  "
        f"sent {max(sent) / 1e6:.3g} MB/step"
        + (
            f"  shares {'/'.join(f'{s:.1f}' for s in shares)}  images/s {'/'.join(f'{v:.0f}' for v in speeds)}"
            if rebalances is not None
            else ""
        ),
        flush=True,
    )
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
                compress=config.sync.compress,
                bytes_sent_per_step=max(sent),
                bytes_sent_per_step_by_rank=sent,
                images=stats.images,
                members=members,
                shares=shares,
                images_per_second=speeds,
                rebalances=rebalances,
                **(extra or {}),
            ),
        )


def append_metrics(path, row):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def say_where_training_starts(config, resume_from, made_on):
    """Rank 0: where training starts, if it resumes (made_on: the ranks the checkpoint was made on)."""
    path, world_size = config.outputs.checkpoint, config.job.world_size
    if resume_from is not None:
        resized = (
            f"; resuming on {world_size} ranks; the checkpoint was made on {made_on}" if made_on != world_size else ""
        )
        print(
            f"resuming from {path}: epoch {resume_from['epoch']}, after step {resume_from['step']}{resized}", flush=True
        )
    elif config.job.resume:
        print(f"no checkpoint at {path}; starting afresh", flush=True)


def say_joined(membership, epoch, step, note=""):
    print(
        f"rank {membership.me}: joined the job after epoch {epoch}, step {step}, as rank {dist.get_rank()} of "
        f"{dist.get_world_size()} (members {', '.join(map(str, membership.members))}){note}",
        flush=True,
    )


def stopped_line(epoch, step, steps, checkpoint):
    """After a stop: who got which signal, where the job stopped, and where rank 0 saved it (a
    collective; rank 0 joins it once its save is done, so every rank may say it is saved)."""
    try:
        everyone = all_gather_json([stop.signalled(), checkpoint])
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


BY_RANK = ("bytes_sent_per_step", "images", "compute_seconds", "step_seconds")


def epoch_by_rank(stats):
    """Every rank's epoch so far, as {BY_RANK name: value}: its mean bytes sent per step, its images,
    its compute (the steps but for their waits for the sum) and step seconds. A collective: every
    rank calls it."""
    steps = max(1, stats.steps)
    values = [stats.bytes_sent / steps, stats.own_images, stats.step_seconds - stats.comm_seconds, stats.step_seconds]
    mine = torch.tensor(values, dtype=torch.float64)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    try:
        dist.all_gather(everyone, mine)
    except RuntimeError as e:
        raise PeerError(f"lost a peer at the end of an epoch: {first_line(e)}") from None
    ranks = [dict(zip(BY_RANK, t.tolist())) for t in everyone]
    for r in ranks:
        r["bytes_sent_per_step"], r["images"] = round(r["bytes_sent_per_step"]), round(r["images"])
    return ranks


class SlowRankHint:
    """Without --balance: when one rank kept the others waiting for more than WAITED of their steps
    over an epoch of at least MIN_STEPS, rank 0 says so once, naming it, and suggests --balance."""

    WAITED, MIN_STEPS = 0.25, 20

    def __init__(self, enabled):
        self.pending = enabled  # True until it has been said (or when it is not rank 0's to say)

    def check(self, ranks, steps):
        if not self.pending or steps < self.MIN_STEPS or len(ranks) < 2:
            return
        slow = max(range(len(ranks)), key=lambda r: ranks[r]["compute_seconds"])
        others = [r for r in ranks if r is not ranks[slow]]
        kept_waiting = [(ranks[slow]["compute_seconds"] - r["compute_seconds"]) / r["step_seconds"] for r in others]
        if min(kept_waiting) <= self.WAITED:
            return
        self.pending = False
        print(
            f"rank {slow} kept the others waiting for {min(kept_waiting):.0%} or more of each step (it computes "
            f"{ranks[slow]['compute_seconds'] / max(r['compute_seconds'] for r in others):.1f}x as long as the "
            f"next slowest); --balance shares each step's images by speed (docs/several-servers.md)",
            flush=True,
        )
