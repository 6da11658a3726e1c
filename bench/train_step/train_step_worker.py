"""bench/train_step/train_step.py's ranks: every configuration's steps, interleaved round by round, timed.

Each runs the trainer's own loop (peers.train_steps) for a sample of steps with its gradient sync:
ours, peers.LocalStep (compute only, DDP) or Lockstep (the floors); PhaseClock times the step's parts.
"""

from __future__ import annotations

import os
import resource
import statistics
import time

from harness import REPO, digest, end_worker, numel, pick, rotated, start_worker
from peers import LocalStep, bytes_sent, make_ddp, nic_tx_bytes, our_sync, train_steps


def make_model(name: str):
    """The trainer's CNN (utils/learn/model.Net), or "reference": the CNN of the PyTorch MNIST example
    that issue #6's baseline numbers were measured with (1,199,882 parameters, ~3x the trainer's
    compute and bytes), without its two dropouts so that every configuration stays bit-comparable."""
    import torch.nn as nn
    import torch.nn.functional as F

    from utils.learn.model import Net

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

    def sum(self):
        import torch.distributed as dist

        if self.wire is not None:
            self.wire.wait()
        dist.all_reduce(self.token)


class PhaseClock:
    """A gradient sync, timed: a step's forward+backward (from begin() to sum()), the sum or
    wait after it, and the optimizer, summed over the steps in `parts`. Anything else is the sync's."""

    def __init__(self, sync):
        self.sync, self.parts = sync, [0.0, 0.0, 0.0]

    def __getattr__(self, name):
        return getattr(self.sync, name)

    def begin(self, weight=1.0, flags=None):
        self.start = time.perf_counter()
        self.sync.begin(weight, flags)

    def sum(self):
        self.backward_end = time.perf_counter()
        self.sync.sum()
        self.sum_end = time.perf_counter()

    def step(self):
        self.sync.step()
        times = (self.start, self.backward_end, self.sum_end, time.perf_counter())
        self.parts = [total + b - a for total, a, b in zip(self.parts, times, times[1:])]


class Runner:
    """One configuration: its own model (same seed), optimizer, schedule and gradient sync."""

    def __init__(self, spec: dict, cfg: dict, rank: int, wire, hosts):
        import torch

        from utils import timeline
        from utils.learn.training import make_optimizer
        from utils.setup.config import Recipe
        from utils.sync.factory import make_gradient_sync
        from utils.timeline import OFF

        self.skip = spec.get("alone") and rank != 0
        torch.manual_seed(cfg["seed"])
        self.model = self.forward = make_model(cfg["model"])
        steps = (cfg["warmup"] + cfg["iters"]) * cfg["steps_per_sample"] + 1
        optimizer, scheduler = make_optimizer(self.model, Recipe(epochs=1), steps)
        # --timeline: records every step, as train.py --timeline does inside its window (writes nothing)
        self.recorder = timeline.Recorder(os.devnull, 1, 10**9, 10**9) if spec.get("timeline") else None
        psgd = pick(cfg, "powersgd_rank powersgd_warmup")
        if spec["kind"] == "sum":
            flags = (spec["allreduce"], spec["overlap"], spec.get("lazy", False), spec.get("compress", "none"))
            layout = dict(timeout=cfg["op_timeout"], chunks=spec["chunks"] or "auto")
            ours, seed = our_sync(*flags, **psgd, **layout, bucket_mb=spec["bucket_mb"] or 1.0), cfg["seed"]
            self.sync = make_gradient_sync(
                self.model, ours, optimizer, scheduler, seed, hosts, timeline=self.recorder or OFF
            )  # (hosts: as train.py hands them over)
        elif spec["kind"] in ("sync", "wire"):
            self.sync = Lockstep(optimizer, scheduler, wire if spec["kind"] == "wire" else None)
            if spec["kind"] == "wire":  # the bytes start with backward, where a sum's would
                self.model.register_forward_hook(lambda *_: wire.start())
        else:
            if spec["kind"] == "ddp":
                self.forward, _ = make_ddp(self.model, spec.get("hook"), *psgd.values(), cfg["seed"])
            self.sync = LocalStep(optimizer, scheduler)

    def sample(self, batches: list, images, labels) -> tuple:
        """The steps of `batches` (after a barrier), ending with every lazy update applied (train_model's end).

        Per step: (total, fwd+bwd, sum, opt, CPU user, CPU sys) seconds, then bytes this rank's NIC sent
        (None on loopback) and bytes our gradient sync counts as sent (None for the others)."""
        if self.skip:
            return (0.0,) * 6 + (None, None)
        nic, clock, k = os.environ.get("GLOO_SOCKET_IFNAME"), PhaseClock(self.sync), len(batches)
        tx0, sent0 = nic_tx_bytes(nic), bytes_sent(self.sync)
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()  # all threads of this rank
        train_steps(self.forward, clock, images, labels, batches, recorder=self.recorder)
        total, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
        if self.recorder is not None:
            self.recorder.spans.clear()
        seconds = (total, *clock.parts, r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime)
        counts = ((tx0, nic_tx_bytes(nic)), (sent0, bytes_sent(self.sync)))
        return tuple(x / k for x in seconds) + tuple(None if b is None else (b - a) / k for a, b in counts)


def worker(args) -> int:
    import torch
    import torch.distributed as dist

    from utils.comm import hierarchical
    from utils.exchange import all_gather_json
    from utils.learn.data import load_mnist
    from utils.learn.training import batches_of_epoch
    from utils.setup.config import Recipe

    cfg, say = start_worker(args)
    rank, n, prefix = args.rank, cfg["world_size"], f"  [{cfg['label']} N={cfg['world_size']}]"
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "-")
    say(f"{prefix} {n} ranks up ({cfg['init_method']}, GLOO_SOCKET_IFNAME={ifname}, torch {torch.__version__})")
    images, labels, _, _ = load_mnist(str(REPO / "data"))
    batches = batches_of_epoch(len(labels), 1, Recipe(global_batch=cfg["batch_size"] * n, seed=cfg["seed"]))
    wire = None
    if n > 1 and any(spec["kind"] == "wire" for spec in cfg["configs"]):
        nbytes = 2 * (n - 1) * numel(make_model(cfg["model"])) * 4 // n
        wire = RawWire(rank, n, cfg["addrs"], nbytes, cfg["op_timeout"], all_gather_json)
    hosts = hierarchical.discover()  # which ranks share a host, as train.py finds them at start-up
    runners = [Runner(spec, cfg, rank, wire, hosts) for spec in cfg["configs"]]
    times = [[] for _ in runners]  # this rank: per timed round, (total, fb, sum, opt, usr, sys, tx, sent)
    t_start, k = time.time(), cfg["steps_per_sample"]
    for rnd in range(cfg["warmup"] + cfg["iters"]):
        sample = [batches[(rnd * k + s) % len(batches)] for s in range(k)]  # every configuration: the same batches
        for i in rotated(list(range(len(runners))), rnd):
            dist.barrier()
            t = runners[i].sample(sample, images, labels)
            if rnd >= cfg["warmup"]:
                times[i].append(t)
        if rnd + 1 == cfg["warmup"]:
            say(f"{prefix} warm-up done ({cfg['warmup']} rounds, {time.time() - t_start:.0f}s)")
    say(f"{prefix} {cfg['iters']} timed rounds done ({time.time() - t_start:.0f}s)")

    everyone = all_gather_json({"times": times, "digests": [digest(r.model) for r in runners]})  # (tuples: lists)
    for r in runners:
        r.sync.close()
    if wire is not None:
        wire.close()
    end_worker(cfg, rank, merge_ranks(cfg, everyone) if rank == 0 else {})
    return 0


class RawWire:
    """The bytes of the 'compute+wire' floor: a ring all-reduce's traffic on plain TCP, no all-reduce.

    Rank r streams `nbytes` to rank r+1 while receiving `nbytes` from rank r-1, one thread each,
    over sockets of its own (not gloo's). start() sets both going, wait() blocks until both are
    done. Whatever a real all-reduce adds to this (sum arithmetic, gloo's bookkeeping, waiting for
    a partial sum before passing it on) only makes it slower.
    """

    def __init__(self, rank, n, addrs, nbytes, timeout, all_gather):
        import socket
        import threading

        listener = socket.create_server((addrs[rank], 0))
        ports = all_gather(listener.getsockname()[1])  # every rank's port, in rank order
        right = (rank + 1) % n
        self.to_right = socket.create_connection((addrs[right], ports[right]), timeout=timeout)
        listener.settimeout(timeout)
        self.from_left, _ = listener.accept()  # only the left neighbour connects here
        listener.close()
        for sock in (self.to_right, self.from_left):
            sock.settimeout(timeout)  # a dead peer raises instead of hanging
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.outgoing, self.incoming = bytearray(nbytes), bytearray(nbytes)
        self.go, self.done = [threading.Semaphore(0), threading.Semaphore(0)], threading.Semaphore(0)
        self.error = None
        for go, job in zip(self.go, (self._send, self._receive)):
            threading.Thread(target=self._loop, args=(go, job), daemon=True).start()

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
    iters, digests = range(cfg["iters"]), everyone[0]["digests"]
    uncompressed = [s["kind"] == "sum" and s.get("compress", "none") == "none" for s in cfg["configs"]]
    plain = {s["allreduce"]: i for i, s in enumerate(cfg["configs"]) if uncompressed[i] and not s["overlap"]}
    out = {"world_size": cfg["world_size"], "configs": []}
    for i, spec in enumerate(cfg["configs"]):
        per_rank = [e["times"][i] for e in everyone]  # [rank][round] -> tuple
        step_s, fb_s, sum_s, opt_s = ([max(pr[j][c] for pr in per_rank) for j in iters] for c in range(4))
        ran = [pr for pr in per_rank if not (spec.get("alone") and pr[0][0] == 0)]
        same = None
        if spec.get("overlap") and spec["allreduce"] in plain and uncompressed[i]:
            same = digests[i] == digests[plain[spec["allreduce"]]]
        c = dict(spec, step_s=step_s, fb_s=fb_s, sum_s=sum_s, opt_s=opt_s)
        c["cpu_s"] = [statistics.mean(pr[j][4] + pr[j][5] for pr in ran) for j in iters]
        c["sys_s"] = [statistics.mean(pr[j][5] for pr in ran) for j in iters]
        c["rank_median_s"] = [statistics.median(t[0] for t in pr) for pr in per_rank]
        c["tx_bytes"] = [mean_or_none(pr[j][6] for pr in ran) for j in iters]
        c["sent_bytes"] = [mean_or_none(pr[j][7] for pr in ran) for j in iters]
        c["params_identical"] = len({e["digests"][i] for e in everyone}) == 1
        out["configs"].append(dict(c, same_bits_as_plain=same))
    return out


def mean_or_none(xs) -> float | None:
    """The mean of xs, or None if any is None (a counter this rank did not have)."""
    xs = list(xs)
    return None if not xs or any(x is None for x in xs) else statistics.mean(xs)
