"""Each rank's compute against the machine's ceiling: the step, the evaluation and the epoch.

    python bench/compute/compute.py                    # every part, medians of 5 rounds (about 12 minutes on 2 cores)
    python bench/compute/compute.py --parts step,eval  # some parts
    python bench/compute/compute.py --baseline REF     # the old path: a commit of this repository (default edb07fe)
    python bench/compute/compute.py --short --out DIR  # a few steps of each, for the tests

The parts, each variant in a process of its own, the variants in turns within a round:
  ceiling  a 2048x2048 matrix product on one thread, fp32 and bf16 (torch.mm: MKL; bf16 and every bf16
           variant below only on a CPU where train.py allows --precision bf16), and a 1x1
           convolution of 1024 channels through oneDNN (fp32): what one core can do
  step     one rank, 32 images, 1 thread: forward, loss.backward(), the optimizer's step, 300 steps
           after 20 of warm-up. old: the baseline's model and optimizer; default: today's; bf16:
           today's with --precision bf16; examples: the same model in a plain torch loop as
           pytorch/examples writes it (torch.optim.Adam, the default layout)
  eval     the 10,000 test images through the run's test_model: the baseline's and today's (fp32, bf16)
  epoch    one epoch on 2 ranks x 1 thread over loopback: `python train.py --epochs 1` of the baseline
           and of today (fp32, bf16), and DDP (torch's own, 2 ranks, gloo) with its best settings on
           the same model: today's layout, the fused Adam, gradient_as_bucket_view; the same images,
           schedule and evaluation on rank 0

Results: bench/results/compute/compute.json and .md; method and findings: bench/compute/NOTES.md.
"""

import importlib.util
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "bench" / "results" / "compute"
sys.path.insert(0, str(REPO / "bench" / "common"))  # harness, for the driver (run directly)
PARTS = ("ceiling", "step", "eval", "epoch")
# bf16 is measured where train.py allows it: a CPU with bf16 units (utils/setup/precision.py); elsewhere
# oneDNN emulates it, a 2048x2048 product takes seconds, and train.py refuses --precision bf16


def bf16_allowed():
    """Whether train.py allows --precision bf16 on this CPU (this checkout's utils/setup/precision.py,
    read by path: a worker of the baseline has the baseline's utils/ on its path)."""
    spec = importlib.util.spec_from_file_location("precision", REPO / "utils" / "setup" / "precision.py")
    precision = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(precision)
    return precision.refusal("bf16", precision.this_cpu()) is None


BF16 = bf16_allowed()
BATCH, STEPS, WARMUP = 32, 300, 20
SHORT_STEPS, SHORT_IMAGES = 10, 1280  # --short: steps of the step part, training images of the epoch part
TESTS, SHORT_TESTS = 10_000, 2_000  # test images evaluated (the eval part, and each epoch), and with --short
# multiply-adds of one image's forward through utils/learn/model.Net: conv1, conv2, fc1, fc2
MACS = 28 * 28 * 32 * 9 + 14 * 14 * 64 * 32 * 9 + 64 * 7 * 7 * 128 + 128 * 10
STEP_FLOP = 3 * 2 * MACS * BATCH  # forward, and backward's two products of each layer
TIMEOUT = 600  # seconds for any one process of the benchmark


# Where a worker finds what it measures: today's module first, then the baseline's (edb07fe's utils/
# was flat, before the modules were filed into utils/learn, utils/setup...: `flat` names a module of
# that layout). A worker imports from the tree it was started in (PYTHONPATH), so the old path's
# workers run the baseline's own code.
def flat(module):
    return f"utils.{module}"


HOMES = {
    "load_mnist": ("utils.learn.data", flat("data")),
    "step_batches": ("utils.learn.data", flat("data")),
    "Net": ("utils.learn.model", flat("model")),
    "use_deterministic_algorithms": ("utils.learn.model", flat("model")),
    "Adam": ("utils.learn.optim", flat("optim")),
    "OneCycleLR": ("utils.learn.optim", flat("optim")),
    "keep_freed_memory": ("utils.setup.memory", flat("memory")),
    "test_model": ("utils.run",),
}


# --------------------------------------------------------------------------- the workers (one process each)
def named(name):
    """`name` from the first of its HOMES that this tree has."""
    import importlib

    for module in HOMES[name]:
        try:
            return getattr(importlib.import_module(module), name)
        except ModuleNotFoundError as missing:
            if missing.name != module and not module.startswith(f"{missing.name}."):
                raise  # the module is there but lacks one of its own imports
    raise ImportError(f"{name}: in none of {', '.join(HOMES[name])}")


def ceiling_worker():
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)

    def rate(f, flop):
        f()
        times = []
        for _ in range(7):
            start = time.perf_counter()
            f()
            times.append(time.perf_counter() - start)
        return flop / statistics.median(times) / 1e9

    out = {}
    dtypes = (("mm_fp32", torch.float32), ("mm_bf16", torch.bfloat16))[: 2 if BF16 else 1]
    for name, dtype in dtypes:
        a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
        out[name] = rate(lambda a=a, b=b: a @ b, 2 * 2048**3)
    x = torch.randn(64, 1024, 16, 16).contiguous(memory_format=torch.channels_last)
    w = torch.randn(1024, 1024, 1, 1).contiguous(memory_format=torch.channels_last)
    out["conv_fp32"] = rate(lambda: F.conv2d(x, w), 2 * 64 * 16 * 16 * 1024 * 1024)
    return out


def examples_net():
    """utils/learn/model.Net's layers as pytorch/examples' mnist/main.py writes a model (no dropout, as ours)."""
    import torch.nn as nn
    import torch.nn.functional as F

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
            self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
            self.fc1 = nn.Linear(64 * 7 * 7, 128)
            self.fc2 = nn.Linear(128, 10)

        def forward(self, x):
            x = F.max_pool2d(F.relu(self.conv1(x)), 2)
            x = F.max_pool2d(F.relu(self.conv2(x)), 2)
            x = F.relu(self.fc1(x.flatten(1)))
            return self.fc2(x)

    return Net()


def rank_setup(repo):
    """What train.py does in each rank before it trains (with the utils of `repo`, on PYTHONPATH):
    one thread, glibc told to keep freed memory, deterministic kernels; returns MNIST as it loads it."""
    import torch

    torch.set_num_threads(1)
    named("keep_freed_memory")()
    named("use_deterministic_algorithms")()
    return named("load_mnist")(str(repo / "data"))


def step_worker(repo, variant, steps):
    import torch
    import torch.nn.functional as F

    images, labels, _, _ = rank_setup(repo)
    Net, Adam = named("Net"), named("Adam")

    torch.manual_seed(1)
    if variant == "examples":
        model = examples_net()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        model = Net("bf16") if variant == "bf16" else Net()
        optimizer = Adam(model.parameters(), lr=1e-3)
    times = []
    for i in range(WARMUP + steps):
        x, y = images[i * BATCH : (i + 1) * BATCH], labels[i * BATCH : (i + 1) * BATCH]
        start = time.perf_counter()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return {"ms": statistics.median(times[WARMUP:]) * 1e3}


def eval_worker(repo, variant, count):
    _, _, images, labels = rank_setup(repo)
    images, labels = images[:count], labels[:count]
    Net, test_model = named("Net"), named("test_model")

    model = Net("bf16") if variant == "bf16" else Net()
    test_model(model, images, labels)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        test_model(model, images, labels)
        times.append(time.perf_counter() - start)
    return {"s": statistics.median(times)}


def ddp_worker(rank, port, images, tests):
    """One rank of DDP's epoch: today's model, data order, schedule and evaluation, DDP's sum."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    train_images, train_labels, test_images, test_labels = rank_setup(REPO)
    train_images, train_labels = train_images[:images], train_labels[:images]
    test_images, test_labels = test_images[:tests], test_labels[:tests]
    Net, OneCycleLR, test_model = named("Net"), named("OneCycleLR"), named("test_model")

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(1)
    model = torch.nn.parallel.DistributedDataParallel(Net(), gradient_as_bucket_view=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=4e-3, fused=True)
    batches, _ = named("step_batches")(len(train_labels), 1, rank, 2, 1, 64)
    scheduler = OneCycleLR(optimizer, max_lr=4e-3, total_steps=len(batches), pct_start=0.15)
    dist.barrier()
    start = time.time()
    for batch in batches:
        F.cross_entropy(model(train_images[batch]), train_labels[batch]).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    accuracy = test_model(model.module, test_images, test_labels) if rank == 0 else None
    seconds = time.time() - start
    dist.barrier()
    dist.destroy_process_group()
    return {"s": seconds, "accuracy": accuracy}


# --------------------------------------------------------------------------- the driver
def die_with_driver():
    """In each process the driver starts: SIGKILL when the driver dies (PR_SET_PDEATHSIG), however it
    dies, so a test's timeout or a Ctrl-C leaves nothing behind (train.py's ranks die with their launcher)."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


def run_all(argvs, env, cwd=REPO, timeout=TIMEOUT):
    """Run the processes `argvs` at once, each in a session of its own; [(exit code, stdout, stderr)].
    Every session is killed on the way out, finished or not."""
    procs = [
        subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            preexec_fn=die_with_driver,
        )
        for argv in argvs
    ]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


def bounded(argv, cwd, timeout=TIMEOUT, env=None):
    """argv's stdout, or an error with its stderr's last line (run_all)."""
    ((code, out, err),) = run_all([argv], env, cwd, timeout)
    if code:
        raise RuntimeError(f"{argv[1:4]} exit {code}: {(err.strip().splitlines() or ['?'])[-1]}")
    return out


def worker(*args, repo=REPO):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(repo))
    out = bounded([sys.executable, __file__, "--worker", *map(str, args), str(repo)], REPO, env=env)
    return json.loads(out.strip().splitlines()[-1])


def ddp_epoch(images, tests):
    from harness import free_port

    port, env = free_port(), dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    argv = [sys.executable, __file__, "--worker", "ddp"]
    results = run_all([[*argv, str(rank), str(port), str(images), str(tests)] for rank in range(2)], env)
    if any(code for code, _, _ in results):
        raise RuntimeError(f"DDP's epoch failed: {results[0][2].strip().splitlines()[-1:]}")
    return json.loads(results[0][1].strip().splitlines()[-1])


def train_epoch(repo, flags, images, tests):
    """`python train.py --epochs 1` in `repo` on the first `images` training images: the epoch's
    seconds, communication's share of the step time, the test accuracy."""
    with tempfile.TemporaryDirectory(prefix="compute-") as folder:
        files = ["--save-path", f"{folder}/m.pth", "--checkpoint", f"{folder}/c.pt", "--metrics", ""]
        subset = ["--train-subset", str(images), "--test-subset", str(tests)]
        out = bounded([sys.executable, str(repo / "train.py"), "--epochs", "1", *subset, *flags, *files], folder)
    line = re.search(r"epoch 1/1 .*test accuracy ([\d.]+)%\s+time ([\d.]+) s\s+comm (\d+)%", out)
    if not line:
        raise RuntimeError(f"no epoch line in train.py's output: {out[-300:]}")
    return {"s": float(line.group(2)), "comm_pct": int(line.group(3)), "accuracy": float(line.group(1)) / 100}


def baseline_tree(ref, folder):
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", folder, ref], check=True)
    data = Path(folder) / "data"
    if not (data / "MNIST" / "raw" / "train-images-idx3-ubyte").exists():  # (decompressed once, not in git)
        subprocess.run(["cp", "-a", str(REPO / "data" / "."), str(data)], check=True)
    return Path(folder)


def plan(parts, old, steps, images, tests):
    """{(part, variant): a function that measures it once}."""
    jobs = {}
    if "ceiling" in parts:
        jobs["ceiling", "machine"] = lambda: worker("ceiling")
    for part, count in (("step", steps), ("eval", tests)):  # steps timed, or test images evaluated
        if part in parts:
            jobs[part, "old"] = lambda part=part, count=count: worker(part, "old", count, repo=old)
            jobs[part, "default"] = lambda part=part, count=count: worker(part, "default", count)
            if BF16:
                jobs[part, "bf16"] = lambda part=part, count=count: worker(part, "bf16", count)
    if "step" in parts:
        jobs["step", "examples"] = lambda: worker("step", "examples", steps)
    if "epoch" in parts:
        jobs["epoch", "old"] = lambda: train_epoch(old, [], images, tests)
        jobs["epoch", "default"] = lambda: train_epoch(REPO, [], images, tests)
        if BF16:
            jobs["epoch", "bf16"] = lambda: train_epoch(REPO, ["--precision", "bf16"], images, tests)
        jobs["epoch", "ddp"] = lambda: ddp_epoch(images, tests)
    return jobs


def medians(runs):
    """{(part, variant): {key: median over the rounds}} of {(part, variant): [one result a round]}."""
    return {
        job: {key: statistics.median(r[key] for r in results) for key in results[0] if results[0][key] is not None}
        for job, results in runs.items()
    }


def table(found, rounds, baseline, tests):
    ceiling = found.get(("ceiling", "machine"), {})
    lines = [f"Medians of {rounds} rounds; the old path is commit {baseline}.", ""]
    if ceiling:
        lines += ["| ceiling (one thread) | GFLOP/s |", "|---|---|"]
        lines += [f"| {name} | {value:.1f} |" for name, value in ceiling.items()]
        lines.append("")
    steps = {v: r for (p, v), r in found.items() if p == "step"}
    if steps:
        lines += [
            "| step, 32 images, 1 thread | ms/step | images/s | GFLOP/s | of fp32 mm | speed-up |",
            "|---|---|---|---|---|---|",
        ]
        for variant, r in steps.items():
            gflops = STEP_FLOP / r["ms"] / 1e6
            share = f"{gflops / ceiling['mm_fp32']:.0%}" if ceiling else "-"
            speedup = steps["old"]["ms"] / r["ms"] if "old" in steps else float("nan")
            lines.append(
                f"| {variant} | {r['ms']:.2f} | {BATCH / r['ms'] * 1e3:,.0f} | {gflops:.1f} | {share} | {speedup:.2f} |"
            )
        lines.append("")
    evals = {v: r for (p, v), r in found.items() if p == "eval"}
    if evals:
        lines += [f"| evaluation, {tests:,} images | s | time / old |", "|---|---|---|"]
        lines += [f"| {v} | {r['s']:.3f} | {r['s'] / evals['old']['s']:.2f} |" for v, r in evals.items()]
        lines.append("")
    epochs = {v: r for (p, v), r in found.items() if p == "epoch"}
    if epochs:
        lines += [
            "| one epoch, 2 ranks × 1 thread | s | time / old | comm % of step | accuracy |",
            "|---|---|---|---|---|",
        ]
        for variant, r in epochs.items():
            comm = f"{r['comm_pct']:.0f}%" if "comm_pct" in r else "-"
            lines.append(
                f"| {variant} | {r['s']:.1f} | {r['s'] / epochs['old']['s']:.2f} | {comm} | {r['accuracy']:.2%} |"
            )
    return "\n".join(lines) + "\n"


def main(argv):
    from harness import bench_parser, write_results  # (bench/common/harness.py: the driver's, never a worker's)

    p = bench_parser(__doc__)
    p.prog = "bench/compute/compute.py"
    p.add_argument("--parts", default=",".join(PARTS), help=f"some of {','.join(PARTS)} (default all)")
    p.add_argument("--rounds", type=int, default=5, help="rounds, each variant once a round (default 5)")
    p.add_argument("--baseline", default="edb07fe", help="the old path's commit (default edb07fe, before issue 60)")
    short = f"{SHORT_STEPS} steps, epochs of {SHORT_IMAGES} images, {SHORT_TESTS} test images"
    p.add_argument("--short", action="store_true", help=short)
    p.add_argument("--out", type=Path, default=OUT, help="the results' folder (default bench/results/compute)")
    args = p.parse_args(argv)
    steps, images, tests = (SHORT_STEPS, SHORT_IMAGES, SHORT_TESTS) if args.short else (STEPS, 60_000, TESTS)
    parts = args.parts.split(",")
    if not set(parts) <= set(PARTS) or args.rounds < 1:
        print(f"bench/compute/compute.py: error: --parts takes {','.join(PARTS)}; --rounds at least 1", file=sys.stderr)
        return 2
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="compute-baseline-") as folder:
        old = baseline_tree(args.baseline, f"{folder}/tree")
        try:
            jobs, runs = plan(parts, old, steps, images, tests), {}
            for rnd in range(args.rounds):
                names = list(jobs)
                for job in names[rnd % len(names) :] + names[: rnd % len(names)]:  # each first in turn
                    runs.setdefault(job, []).append(jobs[job]())
                    print(f"round {rnd + 1}: {job[0]} {job[1]}: {runs[job][-1]}", flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(old)], check=False)
    found = medians(runs)
    md = f"# bench/compute/compute.py\n\n`python bench/compute/compute.py {' '.join(argv)}`\n\n" + table(
        found, args.rounds, args.baseline, tests
    )
    print(md)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / ("compute" if parts == list(PARTS) else "compute-" + "-".join(parts))
    result = {
        "argv": argv,
        "seconds": round(time.time() - started),
        "baseline": args.baseline,
        "medians": {f"{p}/{v}": r for (p, v), r in found.items()},
        "runs": {f"{p}/{v}": r for (p, v), r in runs.items()},
    }
    write_results(stem, result, md)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        kind, rest = sys.argv[2], sys.argv[3:]
        if kind == "ceiling":
            result = ceiling_worker()
        elif kind == "ddp":
            result = ddp_worker(*map(int, rest[:4]))
        elif kind == "step":
            result = step_worker(Path(rest[-1]), rest[0], int(rest[1]))
        else:
            result = eval_worker(Path(rest[-1]), rest[0], int(rest[1]))
        print(json.dumps(result), flush=True)
        sys.exit(0)
    sys.exit(main(sys.argv[1:]))
