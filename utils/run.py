"""Training: the epoch loop, one step at a time, with the gradients summed over the ring.

    train_model()  one epoch: forward, loss.backward(), gradient_sum.sum(), gradient_sum.step()
    test_model()   accuracy on the 10,000 test images
    run()          the epoch loop: train, evaluate (rank 0), log, save state dict and checkpoint

A signal (utils/stop.py) rides along with a step's gradient sum as a stop flag, so every rank
learns of it after the same step; then rank 0 saves the checkpoint and every rank raises Stopped.
A checkpoint records the step and the global batch, not the ranks: it resumes on any number.
"""
import datetime
import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from utils.checkpoint import atomic_save
from utils import stop, timeline
from utils.compress import DEFAULT_POWERSGD_RANK, DEFAULT_POWERSGD_WARMUP, RingSum, make_compressor, state_for
from utils.data import step_batches
from utils.errors import PeerError, Stopped, first_line
from utils.hierarchical import Hierarchy
from utils.overlap import LazyUpdate, OverlappedGradientSum, average_gradients


def stop_flag():
    """This rank's contribution to the stop flag: 1 once it got a signal."""
    return 1.0 if stop.signalled() else 0.0


class GradientSum:
    """The training loop's calls between backward and the next forward: sum(), then step().

    Plain (--no-overlap): backward first, then the whole sum, then optimizer.step().
    Overlapped (utils/overlap.py): buckets are summed during backward; sum() waits for the last.
    Lazy (--lazy-update): sum() does not wait at all; step() leaves each bucket's update to the
    next forward, which applies it just before it uses those parameters. finish() applies
    anything still due (before evaluating or saving).
    Compression (--compress, utils/compress.py) happens inside the sum, per bucket.
    weigh() before backward gives this rank's gradient its share of the step's images, and
    stop_flag() after step() says how many ranks were signalled: the flag was summed with the step.
    """

    def __init__(self, model, args, optimizer, scheduler):
        self.params, self.args = list(model.parameters()), args
        self.optimizer, self.scheduler = optimizer, scheduler
        self.overlapped = self.lazy = None
        self.weight, self.flag_sum = 1.0, 0.0
        self.busy_seconds = self.waited_seconds = 0.0  # communication ran / the training thread waited

        def compressor_for(buckets):
            return make_compressor(getattr(args, "compress", "none"), buckets,
                                   getattr(args, "powersgd_rank", None) or DEFAULT_POWERSGD_RANK,
                                   getattr(args, "powersgd_warmup", DEFAULT_POWERSGD_WARMUP), getattr(args, "seed", 0))
        if args.overlap:
            self.overlapped = OverlappedGradientSum(self.params, args.allreduce, args.chunks,
                                                    int(args.bucket_mb * 2**20),
                                                    datetime.timedelta(seconds=args.timeout), compressor_for,
                                                    stop_flag)
            self.compressor = self.overlapped.compressor
            if args.lazy_update:
                self.lazy = LazyUpdate(model, optimizer, scheduler, self.overlapped)
        else:
            group = None                  # the hierarchical sum's subgroups: made by every rank, now
            if args.allreduce == "hierarchical":
                group = Hierarchy(timeout=datetime.timedelta(seconds=args.timeout))
            self.ring_sum = RingSum(args.allreduce, args.chunks, group)
            self.compressor = compressor_for([self.params])

    def weigh(self, weight):
        """This step's weight of this rank's gradient: its share of the step's images times N (1.0: equal shares)."""
        self.weight = weight
        if self.overlapped is not None:
            self.overlapped.weight = weight

    def sum(self):
        """Average the gradients over all ranks (lazy: just let the buckets' sums run)."""
        start = time.perf_counter()
        if self.lazy is not None:
            return
        if self.overlapped is not None:
            self.overlapped.wait()
        else:
            try:
                self.flag_sum = average_gradients(self.params, self.ring_sum, self.compressor, 0, self.weight,
                                                  stop_flag())
            except RuntimeError as e:  # gloo reports a dead or silent peer this way
                raise PeerError(first_line(e)) from None  # train_model says where
            self.busy_seconds += time.perf_counter() - start
        self.waited_seconds += time.perf_counter() - start

    def step(self):
        """optimizer.step() and the learning-rate schedule, now (lazy: in the next forward)."""
        if self.lazy is not None:
            self.lazy.step()
            return
        with timeline.span("optimizer"):
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad()

    def stop_flag(self):
        """How many ranks had a signal when this step's gradients were summed: the same on every rank."""
        if self.overlapped is None:
            return self.flag_sum
        if self.lazy is not None:  # the flag's bucket: the next forward would wait for it first anyway
            self.lazy.apply(self.overlapped.flag_bucket)
        return self.overlapped.flag_sum

    def finish(self):
        """Apply any update still due (lazy); call before evaluating or saving."""
        if self.lazy is not None:
            self.lazy.finish()

    def seconds(self):
        """(communication ran, the training thread waited for it), seconds since the start."""
        if self.overlapped is None:
            return self.busy_seconds, self.waited_seconds
        return self.overlapped.busy_seconds, self.waited_seconds + (self.lazy.waited_seconds if self.lazy else 0.0)

    def traffic(self):
        """(bytes this rank sent, bytes of the buffers summed), since the start."""
        if self.overlapped is None:
            return self.ring_sum.bytes_sent, self.ring_sum.bytes_summed
        return self.overlapped.traffic()

    def state_dict(self):
        """This rank's compression state (PowerSGD's error buffers differ between ranks)."""
        return self.compressor.state_dict()

    def load_state_dict(self, state):
        self.compressor.load_state_dict(state)

    def close(self):
        for part in (self.lazy, self.overlapped):
            if part is not None:
                part.close()


def make_optimizer(model, args, steps_per_epoch):
    """Adam with a one-cycle learning rate over the whole run (warm up, then anneal)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.lr, total_steps=args.epochs * steps_per_epoch, pct_start=0.15)
    return optimizer, scheduler


def batches_of_epoch(num_examples, epoch, args):
    """This rank's (batch, weight) for every step of `epoch` (utils/data.step_batches); the weight
    is its share of the step's images times N, so the average over ranks weighs every image alike."""
    n = dist.get_world_size()
    batches, sizes = step_batches(num_examples, epoch, dist.get_rank(), n, args.seed, args.global_batch)
    return [(batch, 1.0 if len(batch) * n == size else len(batch) * n / size) for batch, size in zip(batches, sizes)]


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
            print(f"  epoch {self.epoch}: {step}/{self.total} steps, mean loss {mean_loss:.4f}, "
                  f"{time.time() - self.start:.0f} s", flush=True)
            self.next_report += max(1, self.total // 10)

    def close(self):
        if self.bar is not None:
            self.bar.close()


class EpochStats:
    """What an epoch's log line reports; carried in mid-epoch checkpoints."""

    def __init__(self, loss_sum=0.0, steps=0, comm_seconds=0.0, step_seconds=0.0, busy_seconds=0.0,
                 bytes_sent=0, bytes_summed=0):
        self.loss_sum, self.steps = loss_sum, steps
        self.comm_seconds = comm_seconds    # the step waited for communication this long
        self.busy_seconds = busy_seconds    # communication ran this long (hidden or not)
        self.step_seconds = step_seconds
        self.bytes_sent = bytes_sent        # this rank sent this much for gradient sums
        self.bytes_summed = bytes_summed    # the summed buffers' size on the wire (compressed)


def train_model(model, gradient_sum, images, labels, batches, epoch, first_step, stats, save_every=0, save=None):
    """Train on `batches[first_step:]` of `epoch`; `save(epoch, step, stats)` every save_every steps.

    A stop flag summed with a step's gradients (any rank got a signal): save after that step and
    raise Stopped(epoch, step, steps in the epoch), on every rank alike."""
    model.train()
    progress = Progress(epoch, first_step, len(batches), enabled=dist.get_rank() == 0)
    step = first_step
    counted = list(gradient_sum.traffic())

    def count_traffic():
        """Add the bytes of the sums done since the last count (lazy: only whole steps are done
        after finish(), so traffic is counted then, not step by step)."""
        sent, summed = gradient_sum.traffic()
        stats.bytes_sent += sent - counted[0]
        stats.bytes_summed += summed - counted[1]
        counted[:] = sent, summed
    try:
        for step in range(first_step + 1, len(batches) + 1):
            batch, weight = batches[step - 1]
            start, (busy_before, waited_before) = time.perf_counter(), gradient_sum.seconds()
            timeline.at_step((epoch - 1) * len(batches) + step)
            gradient_sum.weigh(weight)
            with timeline.span("step"):
                with timeline.span("forward"):
                    loss = F.cross_entropy(model(images[batch]), labels[batch])
                with timeline.span("backward"):
                    loss.backward()
                gradient_sum.sum()
                gradient_sum.step()
            stopping = gradient_sum.stop_flag() > 0
            saving = stopping or (save_every and step % save_every == 0 and step < len(batches))
            if saving:  # lazy: apply the update now, not in the next forward (its wait is this step's)
                gradient_sum.finish()
            busy, waited = gradient_sum.seconds()
            stats.busy_seconds += busy - busy_before
            stats.comm_seconds += waited - waited_before
            stats.step_seconds += time.perf_counter() - start
            stats.loss_sum += loss.item()
            stats.steps += 1
            progress.update(step, stats.loss_sum / stats.steps)
            if saving:
                count_traffic()
                save(epoch, step, stats)
            if stopping:
                raise Stopped(epoch, step, len(batches))
            if timeline.window_ends():   # lazy: this step's update now, so that its sums are in the trace
                gradient_sum.finish()
                timeline.write()
        gradient_sum.finish()
        count_traffic()
    except PeerError as e:
        raise PeerError(f"lost a peer while {e.doing} (epoch {epoch}, step {step}): {e}") from None
    finally:
        progress.close()


@torch.no_grad()
def test_model(model, images, labels, batch_size=1000):
    """Fraction of `images` classified correctly."""
    model.eval()
    correct = sum((model(x).argmax(1) == y).sum().item()
                  for x, y in zip(images.split(batch_size), labels.split(batch_size)))
    return correct / len(labels)


def run(model, data, args, resume_from=None):
    """Train for args.epochs epochs; rank 0 evaluates, logs and saves after each.

    `resume_from`: a checkpoint dict (the same on every rank) to continue exactly where it left off,
    on this number of ranks or another (then each rank's compression state is compress.state_for's).
    """
    train_images, train_labels, test_images, test_labels = data
    rank, world_size = dist.get_rank(), dist.get_world_size()
    steps_per_epoch = len(batches_of_epoch(len(train_labels), 1, args))
    optimizer, scheduler = make_optimizer(model, args, steps_per_epoch)
    gradient_sum = GradientSum(model, args, optimizer, scheduler)
    if getattr(args, "timeline_steps", None):   # rank 0 was given --timeline (train.check_same_settings)
        timeline.recorder = timeline.Recorder(args.timeline, *args.timeline_steps, args.epochs * steps_per_epoch)
    first_epoch, first_step, stats = 1, 0, EpochStats()
    compressed = getattr(args, "compress", "none") != "none"
    if resume_from is not None:
        optimizer.load_state_dict(resume_from["optimizer"])
        scheduler.load_state_dict(resume_from["scheduler"])
        torch.set_rng_state(resume_from["rng"])
        first_epoch, first_step = resume_from["epoch"], resume_from["step"]
        stats = EpochStats(**resume_from["epoch_stats"])
        if compressed:
            gradient_sum.load_state_dict(state_for(resume_from["compression"], rank, world_size))

    def save_checkpoint(epoch, step, stats):
        """Rank 0 writes everything needed to continue after `step` of `epoch` (every rank calls it:
        a compressed run's checkpoint holds every rank's compression state)."""
        everyone = [None] * world_size
        if compressed:
            try:
                dist.all_gather_object(everyone, gradient_sum.state_dict())
            except RuntimeError as e:
                raise PeerError(first_line(e), doing="saving a checkpoint") from None
        if rank == 0:
            with timeline.span("checkpoint"):
                atomic_save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                             "scheduler": scheduler.state_dict(), "rng": torch.get_rng_state(),
                             "epoch": epoch, "step": step, "epoch_stats": vars(stats), "world_size": world_size,
                             "compression": everyone if compressed else None,
                             "settings": args.checkpoint_settings}, args.checkpoint)

    accuracy = None
    for epoch in range(first_epoch, args.epochs + 1):
        start = time.time()
        batches = batches_of_epoch(len(train_labels), epoch, args)
        try:
            train_model(model, gradient_sum, train_images, train_labels, batches, epoch, first_step, stats,
                        args.save_every, save_checkpoint)
        except Stopped as e:
            timeline.write()
            raise Stopped(stopped_line(*e.args, args.checkpoint)) from None
        sent = bytes_sent_per_step(stats)
        if rank == 0:
            with timeline.span("evaluate"):
                accuracy = test_model(model, test_images, test_labels)
            seconds = time.time() - start
            loss = stats.loss_sum / max(1, stats.steps)
            comm_share = stats.comm_seconds / stats.step_seconds if stats.step_seconds else 0.0
            busbw = (stats.bytes_summed * 2 * (world_size - 1) / world_size / stats.busy_seconds / 1e9
                     if stats.busy_seconds else 0.0)  # nccl-tests' bus bandwidth, GB/s, of what went on the wire
            print(f"epoch {epoch}/{args.epochs}  train loss {loss:.4f}  test accuracy {accuracy:.2%}  "
                  f"time {seconds:.1f} s  comm {comm_share:.0%} of step time  busbw {busbw:.2f} GB/s  "
                  f"sent {max(sent) / 1e6:.3g} MB/step", flush=True)
            atomic_save(model.state_dict(), args.save_path)
            if args.metrics:
                append_metrics(args.metrics, dict(epoch=epoch, train_loss=loss, test_accuracy=accuracy,
                                                  seconds=seconds, comm_share=comm_share, busbw_gbps=busbw,
                                                  world_size=world_size, allreduce=args.allreduce,
                                                  overlap=args.overlap, compress=getattr(args, "compress", "none"),
                                                  bytes_sent_per_step=max(sent), bytes_sent_per_step_by_rank=sent))
        first_step, stats = 0, EpochStats()
        try:
            save_checkpoint(epoch + 1, 0, stats)
        except PeerError as e:
            raise PeerError(f"lost a peer while {e.doing} after epoch {epoch}: {e}") from None
    timeline.write()   # if the run ended inside the window
    try:  # also a barrier: nobody reports success before rank 0 has saved
        digest = check_identical_parameters(model)
    except RuntimeError as e:
        raise PeerError(f"lost a peer at the end of training: {first_line(e)}") from None
    if rank == 0:
        print(f"saved the model to {args.save_path}; parameters identical on all {world_size} ranks "
              f"(sha256 {digest})", flush=True)
    return accuracy


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
    who = ", ".join(f"{name} to rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)}"
                    for name, ranks in by_signal.items())
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


def check_identical_parameters(model):
    """Compare a sha256 of every rank's parameters; returns it, or raises if any rank differs."""
    flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if len(set(digests)) != 1:
        raise PeerError("parameters differ between ranks: " +
                        ", ".join(f"rank {r} {d[:12]}" for r, d in enumerate(digests)))
    return digest


def append_metrics(path, row):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
