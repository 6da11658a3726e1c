"""bench/train_step.py's ranks: every configuration's steps, interleaved round by round, timed.

Every configuration runs the trainer's own step, utils.run.train_step, with a gradient sync in
the place it takes: ours (utils.sync.buckets.make_gradient_sync), or peers.LocalStep (compute only,
DDP), or Lockstep (the floors). PhaseClock, wrapped around it, times the step's parts.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import time
from pathlib import Path

from harness import REPO, digest, numel, rotated, start_worker
from peers import LocalStep, bytes_sent, make_ddp, nic_tx_bytes, our_sync

from utils.files import write_file


def make_model(name: str):
    """The trainer's CNN (utils/model.Net), or "reference": the CNN of the PyTorch MNIST example
    that issue #6's baseline numbers were measured with (1,199,882 parameters, ~3x the trainer's
    compute and bytes), without its two dropouts so that every configuration stays bit-comparable."""
    import torch.nn as nn
    import torch.nn.functional as F

    from utils.model import Net

    class ReferenceNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.conv2 = nn.Conv2d(1, 32, 3), nn.Conv2d(32, 64, 3)
            self.fc1, self.fc2 = nn.Linear(9216, 128), nn.Linear(128, 10)

        def forward(self, x):
            x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
            return self.fc2(F.relu(self.fc1(x.flatten(1))))

    return ReferenceNet() if name == "reference" else Net()


class Lockstep(LocalStep):
    """The floors: after backward, an all-reduce of one number (every step waits for the slowest
    rank), and for compute+wire first the ring's bytes streamed since backward began (RawWire)."""

    def __init__(self, optimizer, scheduler, wire=None):
        import torch

        super().__init__(optimizer, scheduler)
        self.wire, self.token = wire, torch.zeros(1)

    def after_backward(self):
        import torch.distributed as dist

        if self.wire is not None:
            self.wire.wait()
        dist.all_reduce(self.token)


class PhaseClock:
    """A gradient sync, timed: when backward ended and when the sum (or wait) after it did, so that a
    step splits into forward+backward, sum/wait and optimizer."""

    def __init__(self, sync):
        self.sync, self.backward_end, self.sum_end = sync, 0.0, 0.0

    def weigh(self, weight):
        self.sync.weigh(weight)

    def after_backward(self):
        self.backward_end = time.perf_counter()
        self.sync.after_backward()
        self.sum_end = time.perf_counter()

    def step(self):
        self.sync.step()


def worker(args) -> int:
    cfg = json.loads(Path(args.config).read_text())
    rank, n = args.rank, cfg["world_size"]

    import torch
    import torch.distributed as dist

    from utils import timeline
    from utils.config import Recipe
    from utils.data import epoch_indices, load_mnist
    from utils.run import make_optimizer, train_step
    from utils.sync.buckets import make_gradient_sync

    say = start_worker(cfg, rank)
    prefix = f"  [{cfg['label']} N={n}]"
    say(
        f"{prefix} {n} ranks up ({cfg['init_method']}, GLOO_SOCKET_IFNAME="
        f"{os.environ.get('GLOO_SOCKET_IFNAME', '-')}, torch {torch.__version__})"
    )

    train_images, train_labels, _, _ = load_mnist(str(REPO / "data"))
    batches = torch.split(epoch_indices(len(train_labels), 1, rank, n, cfg["seed"]), cfg["batch_size"])
    k_steps = cfg["steps_per_sample"]
    rounds = cfg["warmup"] + cfg["iters"]
    nic = os.environ.get("GLOO_SOCKET_IFNAME")

    class Runner:
        """One configuration: its own model (same seed), optimizer, schedule and gradient sync."""

        def __init__(self, spec):
            self.skip = spec.get("alone") and rank != 0
            torch.manual_seed(cfg["seed"])
            self.model = self.forward = make_model(cfg["model"])
            optimizer, scheduler = make_optimizer(self.model, Recipe(epochs=1), rounds * k_steps + 1)
            if spec["kind"] == "sum":
                self.sync = make_gradient_sync(
                    self.model,
                    our_sync(
                        spec["allreduce"],
                        spec["overlap"],
                        spec.get("lazy", False),
                        spec.get("compress", "none"),
                        cfg["powersgd_rank"],
                        cfg["powersgd_warmup"],
                        cfg["op_timeout"],
                        spec["chunks"] or "auto",
                        spec["bucket_mb"] or 1.0,
                    ),
                    optimizer,
                    scheduler,
                    cfg["seed"],
                )
            elif spec["kind"] in ("sync", "wire"):
                self.sync = Lockstep(optimizer, scheduler, wire if spec["kind"] == "wire" else None)
                if spec["kind"] == "wire":  # the bytes start with backward, where a sum's would
                    self.model.register_forward_hook(lambda *_: wire.start())
            else:
                if spec["kind"] == "ddp":
                    self.forward, _ = make_ddp(
                        self.model, spec.get("hook"), cfg["powersgd_rank"], cfg["powersgd_warmup"], cfg["seed"]
                    )
                self.sync = LocalStep(optimizer, scheduler)
            self.clock = PhaseClock(self.sync)
            # --timeline: records every step, as train.py --timeline does inside its window (writes nothing)
            self.recorder = timeline.Recorder(os.devnull, 1, 10**9, 10**9) if spec.get("timeline") else None

        def sample(self, first_batch):
            """k_steps consecutive training steps (after a barrier), ending with every lazy update applied.

            Per step: (total, fwd+bwd, sum, opt, CPU user, CPU sys) seconds, then bytes this rank's NIC sent
            (None on loopback) and bytes our gradient sync counts as sent (None for the others)."""
            if self.skip:
                return (0.0,) * 6 + (None, None)
            tx0, sent0 = nic_tx_bytes(nic), bytes_sent(self.sync)
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()  # all threads of this rank
            fb = sm = op = 0.0
            timeline.recorder = self.recorder  # None: off, as without --timeline
            for s in range(k_steps):
                batch = batches[(first_batch + s) % len(batches)]
                timeline.at_step(first_batch + s + 1)
                start = time.perf_counter()
                train_step(self.forward, self.clock, train_images[batch], train_labels[batch]).item()
                end, clock = time.perf_counter(), self.clock
                fb, sm, op = (
                    fb + clock.backward_end - start,
                    sm + clock.sum_end - clock.backward_end,
                    op + end - clock.sum_end,
                )
            self.sync.finish()  # lazy: the last step's update is part of this sample
            if self.recorder is not None:
                self.recorder.spans.clear()
            timeline.recorder = None
            total, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
            tx1, sent1 = nic_tx_bytes(nic), bytes_sent(self.sync)
            return tuple(
                x / k_steps for x in (total, fb, sm, op, r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime)
            ) + tuple(None if b is None else (b - a) / k_steps for a, b in ((tx0, tx1), (sent0, sent1)))

    wire = None
    if n > 1 and any(spec["kind"] == "wire" for spec in cfg["configs"]):
        wire = RawWire(
            rank,
            n,
            cfg["addrs"],
            2 * (n - 1) * numel(make_model(cfg["model"])) * 4 // n,
            cfg["op_timeout"],
            dist.all_gather_object,
        )
    runners = [Runner(spec) for spec in cfg["configs"]]
    times = [[] for _ in runners]  # this rank: per timed round, (total, fb, sum, opt, usr, sys)
    t_start = time.time()
    for rnd in range(rounds):
        for i in rotated(list(range(len(runners))), rnd):
            dist.barrier()
            t = runners[i].sample(rnd * k_steps)  # every configuration sees the same batches
            if rnd >= cfg["warmup"]:
                times[i].append(t)
        if rnd + 1 == cfg["warmup"]:
            say(f"{prefix} warm-up done ({cfg['warmup']} rounds, {time.time() - t_start:.0f}s)")
    say(f"{prefix} {cfg['iters']} timed rounds done ({time.time() - t_start:.0f}s)")

    everyone = [None] * n
    dist.all_gather_object(everyone, {"times": times, "digests": [digest(r.model) for r in runners]})
    if rank == 0:
        write_file(Path(cfg["out"]), json.dumps(merge_ranks(cfg, everyone)).encode())
    for r in runners:
        r.sync.close()
    if wire is not None:
        wire.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


class RawWire:
    """The bytes of the 'compute+wire' floor: a ring all-reduce's traffic on plain TCP, no all-reduce.

    Rank r streams `nbytes` to rank r+1 while receiving `nbytes` from rank r-1, one thread each,
    over sockets of its own (not gloo's). start() sets both going, wait() blocks until both are
    done. Whatever a real all-reduce adds to this (sum arithmetic, gloo's bookkeeping, waiting for
    a partial sum before passing it on) only makes it slower.
    """

    def __init__(self, rank, n, addrs, nbytes, timeout, all_gather_object):
        import socket
        import threading

        listener = socket.create_server((addrs[rank], 0))
        ports = [None] * n
        all_gather_object(ports, listener.getsockname()[1])
        right = (rank + 1) % n
        self.to_right = socket.create_connection((addrs[right], ports[right]), timeout=timeout)
        listener.settimeout(timeout)
        self.from_left, _ = listener.accept()  # only the left neighbour connects here
        listener.close()
        for sock in (self.to_right, self.from_left):
            sock.settimeout(timeout)  # a dead peer raises instead of hanging
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.outgoing, self.incoming = bytearray(nbytes), bytearray(nbytes)
        self.go = [threading.Semaphore(0), threading.Semaphore(0)]
        self.done = threading.Semaphore(0)
        self.error = None
        for i, job in enumerate((self._send, self._receive)):
            threading.Thread(target=self._loop, args=(self.go[i], job), daemon=True).start()

    def _send(self):
        self.to_right.sendall(self.outgoing)

    def _receive(self):
        view, got = memoryview(self.incoming), 0
        while got < len(view):
            chunk = self.from_left.recv_into(view[got:])
            if not chunk:
                raise ConnectionError("the left neighbour closed its wire socket")
            got += chunk

    def _loop(self, go, job):
        while True:
            go.acquire()
            try:
                job()
            except Exception as e:
                self.error = e
            self.done.release()

    def start(self):
        for go in self.go:
            go.release()

    def wait(self):
        self.done.acquire()
        self.done.acquire()
        if self.error is not None:
            raise RuntimeError(f"compute+wire: {self.error}")

    def close(self):
        self.to_right.close()
        self.from_left.close()


def merge_ranks(cfg: dict, everyone: list[dict]) -> dict:
    """Every rank's per-round times and parameter digests -> per configuration and timed round: the
    step and its parts as the max over ranks, CPU as the mean over the ranks that ran."""
    iters, digests = cfg["iters"], everyone[0]["digests"]
    plain = {
        s["allreduce"]: i
        for i, s in enumerate(cfg["configs"])
        if s["kind"] == "sum" and not s["overlap"] and s.get("compress", "none") == "none"
    }
    out = {"world_size": cfg["world_size"], "configs": []}
    for i, spec in enumerate(cfg["configs"]):
        per_rank = [e["times"][i] for e in everyone]  # [rank][round] -> tuple
        rows = [[max(x) for x in zip(*(pr[j][:6] for pr in per_rank))] for j in range(iters)]
        step_s, fb_s, sum_s, opt_s = [list(col) for col in zip(*rows)][:4]
        ran = [pr for pr in per_rank if not (spec.get("alone") and pr[0][0] == 0)]
        same = None
        if spec.get("overlap") and spec["allreduce"] in plain and spec.get("compress", "none") == "none":
            same = digests[i] == digests[plain[spec["allreduce"]]]
        out["configs"].append(
            {
                **spec,
                "step_s": step_s,
                "fb_s": fb_s,
                "sum_s": sum_s,
                "opt_s": opt_s,
                "cpu_s": [statistics.mean(pr[j][4] + pr[j][5] for pr in ran) for j in range(iters)],
                "sys_s": [statistics.mean(pr[j][5] for pr in ran) for j in range(iters)],
                "rank_median_s": [statistics.median(t[0] for t in pr) for pr in per_rank],
                "tx_bytes": [mean_or_none(pr[j][6] for pr in ran) for j in range(iters)],
                "sent_bytes": [mean_or_none(pr[j][7] for pr in ran) for j in range(iters)],
                "params_identical": len({e["digests"][i] for e in everyone}) == 1,
                "same_bits_as_plain": same,
            }
        )
    return out


def mean_or_none(xs) -> float | None:
    """The mean of xs, or None if any is None (a counter this rank did not have)."""
    xs = list(xs)
    return None if not xs or any(x is None for x in xs) else statistics.mean(xs)
