"""What a lost or joining server costs a running job (issue: live recovery), measured on real runs.

    python bench/recovery/recovery.py                        # faults, joins and the steady-state cost, loopback
    python bench/recovery/recovery.py --rates 1gbit,200mbit  # the steady-state cost on emulated hosts too (root)
    python bench/recovery/recovery.py --faults 5 --world-size 3
    python bench/recovery/recovery.py --only cut --cut-rate 200mbit --faults 20  # link cuts mid-sum (root)

Every trial is `python train.py` itself on N ranks (1 thread each). RING_INSTRUMENTS
(utils/observe/instruments.py) makes one rank, chosen at random (rank 0 included), send itself
SIGKILL or SIGSTOP at a random step, and logs the fault's time and each survivor's first completed
step after the change of members. Reported, as medians with min and max:

    fault -> next completed step   the fault's time to the last survivor's first completed step
    steps lost                     completed steps redone: the step after the one they went on from
    join -> first step             a server started with --join: from its process being ready
                                   (torch imported, data loaded) to its first completed step
    steady-state cost              one epoch with --recover (heartbeats, the agreement's bookkeeping)
                                   against --no-recover, side by side in alternating order
    cut -> next completed step     (--cut-rate, as root) a server's link goes down at a random moment
                                   on emulated hosts capped at that rate: no reset, only silence;
                                   once each with --overlap, --no-overlap, --allreduce=gloo

Targets (bench/common/targets.py, recovery_*): kill <= 2 s; SIGSTOP <= heartbeat + 2 s; join <= 5 s; cost <= 3%;
a cut <= heartbeat + 2 s + the 2 s a sum may go on after it (utils/sync/interface.py).
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # bench/common: harness, stats (run directly)
import harness
from harness import REPO, RESULTS, emulated_cluster
from stats import md_head, md_row
from targets import bound

from utils.errors import EXIT_STOPPED
from utils.observe.instruments import environ_for, read_events
from utils.setup.launch import free_port, kill, supervise
from utils.sync.interface import ABANDON_SECONDS

TRAIN = str(REPO / "train.py")
RUN = ["--epochs", "1", "--train-subset", "6400", "--test-subset", "200", "--metrics", "m.jsonl", "--timeout", "60"]
STEPS = 100  # 6400 images, 64 a step (--train-subset changes both)
HEARTBEAT = 2.0
JOIN_HEARTBEAT = 5.0  # the join trial: train.py's default, so that a server still loading on a busy machine
# (CI runs two test files at once) is not taken for lost while the state goes round
TARGETS = {"kill": bound("recovery_kill"), "stop": HEARTBEAT + bound("recovery_stop"), "join": bound("recovery_join")}
TARGETS["cost"] = bound("recovery_cost")
TARGETS["cut"] = TARGETS["stop"] + ABANDON_SECONDS
CUT_FLAGS = ("--overlap", "--no-overlap", "--allreduce=gloo")  # (each one argument)


def start(argv, cwd, env, stdout=subprocess.DEVNULL, train=TRAIN):
    """`python train.py argv` in a session of its own; its stderr kept."""
    kw = dict(cwd=cwd, env=env, stdout=stdout, stderr=subprocess.PIPE, text=True, start_new_session=True)
    return subprocess.Popen([sys.executable, train, *argv], **kw)


def fault_trial(kind, world_size, rng, tmp):
    """One run with one fault; (seconds from the fault to the last survivor's next step, steps lost)."""
    rank, step = rng.randrange(world_size), rng.randrange(STEPS // 10 + 2, STEPS - STEPS // 10)
    cwd = Path(tempfile.mkdtemp(dir=tmp))
    fault = f"{rank}:{step}:{'KILL' if kind == 'kill' else 'STOP'}"
    env = dict(os.environ, **environ_for(faults=fault, events=str(cwd / "events.jsonl")), OMP_NUM_THREADS="1")
    proc = start([*RUN, "--nproc", str(world_size), "--heartbeat", str(HEARTBEAT)], cwd, env, subprocess.PIPE)
    outcome = supervise([proc], timeout=240)
    if outcome.codes != [0]:
        raise RuntimeError(
            f"{kind} of rank {rank} at step {step}: exit {outcome.codes}\n{outcome.outputs[0][1][-2000:]}"
        )
    seen = read_events(cwd / "events.jsonl")
    fault = next(e for e in seen if e["event"] == "fault")
    firsts = [e for e in seen if e["event"] == "first-step" and e["after"] == "shrank"]
    if len(firsts) != world_size - 1:
        raise RuntimeError(f"{kind} of rank {rank}: {len(firsts)} survivors went on, expected {world_size - 1}")
    return max(e["time"] for e in firsts) - fault["time"], fault["step"] - min(e["step"] for e in firsts), rank


def join_trial(world_size, rng, tmp):
    """A job loses a rank (SIGKILL); its server is started again with --join: (ready -> first step, s).
    The job is long (60 epochs) so that it still runs however slowly the server comes back; once
    the server has trained a step, every rank is stopped with SIGTERM (exit 3, with a checkpoint).
    A job that ended by itself (exit 0) after the server trained a step counts too."""
    rank, step = rng.randrange(1, world_size), rng.randrange(STEPS // 10 + 2, STEPS // 3)
    cwd, port = Path(tempfile.mkdtemp(dir=tmp)), free_port()
    log = cwd / "events.jsonl"
    common = f"--world-size {world_size} --init-method tcp://127.0.0.1:{port} --gloo_socket_ifname lo".split()
    common += [*RUN, "--epochs", "60", "--heartbeat", str(JOIN_HEARTBEAT)]
    env = dict(os.environ, **environ_for(faults=f"{rank}:{step}:KILL", events=str(log)), OMP_NUM_THREADS="1")
    ranks = [start(["--rank", str(r), *common], cwd, env) for r in range(world_size)]
    joiner, stopped = None, []

    def joined(procs):  # supervise's while_running: stop the job once the server is in (one signal each)
        if not stopped and any(e["event"] == "first-step" and e["after"] == "joined" for e in read_events(log)):
            stopped.append(True)
            for p in procs:
                p.send_signal(signal.SIGTERM)

    try:
        deadline = time.monotonic() + 120
        while ranks[rank].poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        joiner = start(["--rank", str(rank), *common, "--join"], cwd, dict(env, **environ_for(events=str(log))))
        members = [*[r for i, r in enumerate(ranks) if i != rank], joiner]
        outcome = supervise(members, timeout=240, grace=None, ok_codes=(0, EXIT_STOPPED), while_running=joined)
    finally:
        for p in [*ranks, *([joiner] if joiner else [])]:
            kill(p, group=True)
    seen = read_events(log)
    ready = next((e for e in seen if e["event"] == "join-ready"), None)
    first = next((e for e in seen if e["event"] == "first-step" and e["after"] == "joined"), None)
    if any(code not in (0, EXIT_STOPPED) for code in outcome.codes) or ready is None or first is None:
        raise RuntimeError(
            f"join of rank {rank}: exit codes {outcome.codes}, join-ready seen: {ready is not None}, "
            f"first step after the join seen: {first is not None}\n{outcome.outputs}"
        )
    return first["time"] - ready["time"]


def cut_trial(cl, flags, victim, delay, tmp, port, train=TRAIN):
    """A job on `cl`'s emulated hosts with `flags`; `delay` seconds after the first checkpoint is
    written, rank `victim`'s server's link goes down (scripts/netns.py: packets vanish, no reset).
    Seconds from the cut to the last survivor's first completed step after it. Once the survivors
    went on the trial is over: every rank is killed, and the link comes back up."""
    cwd = Path(tempfile.mkdtemp(dir=tmp))
    os.chmod(cwd, 0o755)
    log, procs, host = cwd / "events.jsonl", [], cl.host_of(victim)
    try:
        for r in range(cl.world_size):
            home = cwd / f"host{r}"
            home.mkdir()
            argv = cl.train_argv(r, port, [*RUN, "--heartbeat", str(HEARTBEAT), "--save-every", "5", flags])
            argv[2] = train  # the train.py under test (--baseline: an older one)
            env = {"OMP_NUM_THREADS": "1", **environ_for(events=str(log))}
            if train != TRAIN:  # an older train.py, from before RING_INSTRUMENTS, logs where RING_EVENTS says
                env["RING_EVENTS"] = str(log)
            kw = dict(env=env, cwd=home)
            procs.append(cl.popen(cl.host_of(r), argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kw))
        deadline = time.monotonic() + 120
        while not (cwd / "host0" / "runs" / "checkpoint.pt").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(delay)
        cut = time.time()
        cl.link_down(host)
        survivors, firsts = cl.world_size - 1, []
        deadline = time.monotonic() + 120
        while len(firsts) < survivors and time.monotonic() < deadline:
            firsts = [e for e in read_events(log) if e["event"] == "first-step" and e["after"] == "shrank"]
            time.sleep(0.05)
    finally:
        for p in procs:
            cl.kill(p)
        cl.link_up(host)  # (for the next trial; up already if the cut never came)
    if len(firsts) < survivors:
        raise RuntimeError(f"cut of rank {victim} ({flags}): {len(firsts)} survivors went on, expected {survivors}")
    return max(e["time"] for e in firsts) - cut


def epoch_seconds(recover, world_size, tmp, cl=None, port=None, train=TRAIN):
    """One fault-free epoch, --recover or --no-recover (None: neither, an older train.py): the
    epoch's seconds from metrics.jsonl."""
    cwd = Path(tempfile.mkdtemp(dir=tmp))
    flag = {True: "--recover", False: "--no-recover", None: "--metrics=m.jsonl"}[recover]
    if cl is None:
        procs = [
            start([*RUN, "--nproc", str(world_size), flag], cwd, dict(os.environ, OMP_NUM_THREADS="1"), train=train)
        ]
    else:
        homes = [cwd / f"host{r}" for r in range(cl.world_size)]
        for home in homes:
            home.mkdir()
        procs = []
        for r in range(cl.world_size):
            argv = cl.train_argv(r, port, [*RUN, flag])
            argv[2] = train  # the train.py under test (--baseline: an older one)
            kw = dict(env={"OMP_NUM_THREADS": "1"}, cwd=homes[r], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            procs.append(cl.popen(cl.host_of(r), argv, **kw))
        cwd = homes[0]
    outcome = supervise(procs, timeout=240)
    if outcome.failed:
        raise RuntimeError(f"{flag}: exit codes {outcome.codes}")
    return json.loads((cwd / "m.jsonl").read_text().splitlines()[-1])["seconds"]


def cost(world_size, pairs, tmp, cl=None, baseline=None):
    """--recover against --no-recover, side by side in turns; with `baseline` (a train.py from
    before this machinery) also against it, which has no heartbeats at all."""
    arms = [True, False] + ([None] if baseline else [])
    times = {arm: [] for arm in arms}
    for i in range(pairs):
        for k, arm in enumerate(arms[i % len(arms) :] + arms[: i % len(arms)]):
            train = baseline if arm is None else TRAIN
            times[arm].append(epoch_seconds(arm, world_size, tmp, cl, 29400 + 3 * i + k, train))
    ratios = [a / b for a, b in zip(times[True], times[False])]
    result = {"ratio_median": statistics.median(ratios), "ratios": ratios}
    result["seconds"] = {"recover": times[True], "no-recover": times[False]}
    if baseline:
        result["baseline_ratios"] = [a / b for a, b in zip(times[True], times[None])]
        result["baseline_ratio_median"] = statistics.median(result["baseline_ratios"])
        result["seconds"]["baseline"] = times[None]
    return result


def cuts(rate, world_size, trials, rng, tmp, baseline=None):
    """`trials` cuts, each of a random rank at a random moment up to a second after the first
    checkpoint, the same for every arm: each of CUT_FLAGS, and with `baseline` (an older train.py)
    each of them again with it, in turns. {arm: summary, with the seconds}; an arm is named by its
    flags, and "(baseline)" after them for the older train.py."""
    arms = [(flags, TRAIN) for flags in CUT_FLAGS] + [(flags, baseline) for flags in CUT_FLAGS if baseline]
    seconds = {arm: [] for arm in arms}
    with emulated_cluster(rate, world_size) as cl:
        for i in range(trials):
            victim, delay = rng.randrange(world_size), rng.uniform(0, 1)
            for k, arm in enumerate(arms[i % len(arms) :] + arms[: i % len(arms)]):
                port = 29300 + len(arms) * i + k
                seconds[arm].append(cut_trial(cl, arm[0], victim, delay, tmp, port, arm[1]))
                print(f"cut {i + 1}/{trials} of rank {victim}, {cut_name(arm)}: {seconds[arm][-1]:.2f} s", flush=True)
    return {cut_name(arm): dict(summary(s), seconds=s) for arm, s in seconds.items()}


def cut_name(arm):
    return arm[0] if arm[1] == TRAIN else f"{arm[0]} (baseline)"


def summary(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def stat_text(s, n):
    return f"{s['median']:.2f} s (median of {n}; {s['min']:.2f}-{s['max']:.2f})"


def ratios_text(ratios):
    return ", ".join(f"{r:.3f}" for r in ratios)


def stat_row(what, s, target):
    return md_row(what, f"{s['median']:.2f}", f"{s['min']:.2f}", f"{s['max']:.2f}", f"≤ {target:g}")


def cost_row(what, median, ratios):
    return md_row(what, f"{median:.3f}", f"{min(ratios):.3f}", f"{max(ratios):.3f}", f"≤ {TARGETS['cost']:g}")


def main(argv=None):
    ap, positive, number_list = harness.bench_parser(__doc__), harness.positive, harness.number_list
    ap.add_argument("--world-size", type=positive(int), default=3)
    ap.add_argument("--faults", type=positive(int), default=5, help="trials per kind of fault (default 5)")
    ap.add_argument("--pairs", type=positive(int), default=5, help="side-by-side epochs for the cost (default 5)")
    ap.add_argument("--rates", type=number_list(str), default=[], help="also measure the cost on emulated hosts")
    ap.add_argument(
        "--baseline",
        help="an older train.py (a worktree's): the cost against one from before live recovery (7c9a211); "
        "the cuts with it too",
    )
    ap.add_argument(
        "--cut-rate",
        type=harness.checked_rate,
        help="also cut a server's link on emulated hosts at this rate (root), e.g. 200mbit",
    )
    ap.add_argument("--only", choices=["faults", "cost", "cut"], help="run only this part")
    ap.add_argument("--train-subset", type=positive(int), default=6400, help="images per trial's epoch (default 6400)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--results-dir", default=str(RESULTS / "recovery"))
    args = ap.parse_args(argv)
    if args.only == "cut" and not args.cut_rate:
        ap.error("--only cut needs --cut-rate RATE (e.g. 200mbit)")
    global STEPS
    RUN[RUN.index("--train-subset") + 1], STEPS = str(args.train_subset), -(-args.train_subset // 64)
    rng, started = random.Random(args.seed), time.time()
    result = {"command": harness.command_line("recovery/recovery.py"), "host": harness.host_info()}
    result["world_size"] = args.world_size
    result |= {"heartbeat": HEARTBEAT, "targets": TARGETS}
    with tempfile.TemporaryDirectory() as tmp:
        faults = args.only in (None, "faults")
        for kind in ("kill", "stop") if faults else ():
            trials = [fault_trial(kind, args.world_size, rng, tmp) for _ in range(args.faults)]
            seconds, lost, ranks = zip(*trials)
            result[kind] = s = dict(summary(seconds), steps_lost=list(lost), ranks=list(ranks))
            lost = f"completed steps lost {max(s['steps_lost'])} at most, ranks {s['ranks']}"
            print(f"{kind}: fault -> next step {stat_text(s, args.faults)}, {lost}", flush=True)
        joins = [join_trial(args.world_size, rng, tmp) for _ in range(args.faults if faults else 0)]
        result["join"] = summary(joins) if joins else None
        if joins:
            print(f"join: ready -> first step {stat_text(result['join'], args.faults)}", flush=True)
        if args.cut_rate and args.only in (None, "cut"):
            result["cut"] = cuts(args.cut_rate, args.world_size, args.faults, rng, tmp, args.baseline)
        result["cost"] = {}
        if args.only in (None, "cost"):
            result["cost"]["loopback"] = cost(args.world_size, args.pairs, tmp, baseline=args.baseline)
            for rate in args.rates:
                with emulated_cluster(rate, 2) as cl:
                    result["cost"][rate] = cost(2, args.pairs, tmp, cl, baseline=args.baseline)
        for where, c in result["cost"].items():
            line = (
                f"steady-state cost, {where}: --recover / --no-recover epoch time {c['ratio_median']:.3f} "
                f"(median of {args.pairs} pairs: {ratios_text(c['ratios'])})"
            )
            if args.baseline:
                line += f"; --recover / before live recovery {c['baseline_ratio_median']:.3f} "
                line += f"({ratios_text(c['baseline_ratios'])})"
            print(line, flush=True)
    result["seconds"] = time.time() - started
    faults = [k for k in ("kill", "stop") if k in result]
    rows = [stat_row(f"{k}: fault → next completed step (s)", result[k], TARGETS[k]) for k in faults]
    for flags, s in result.get("cut", {}).items():
        rows.append(stat_row(f"cut at {args.cut_rate}, {flags}: cut → next completed step (s)", s, TARGETS["cut"]))
    if result["join"]:
        rows.append(stat_row("join: ready → first step (s)", result["join"], TARGETS["join"]))
    for where, c in result["cost"].items():
        rows.append(cost_row(f"{where}: --recover / --no-recover epoch time", c["ratio_median"], c["ratios"]))
        if "baseline_ratios" in c:
            what = f"{where}: --recover / before live recovery"
            rows.append(cost_row(what, c["baseline_ratio_median"], c["baseline_ratios"]))
    lines = [f"# bench/recovery/recovery.py ({result['host']['node']})", "", f"    {result['command']}", ""]
    lines += [*md_head(["what", "median", "min", "max", "target"], "-----"), *rows, ""]
    lost = [f"{k} {result[k]['steps_lost']}" for k in faults]
    if lost:
        lines.append(f"Completed steps lost per fault: {'; '.join(lost)}.")
    md = "\n".join(lines)
    only = args.only if args.only != "cut" else None  # (the cut's own part names it)
    cut = f"cut-{args.cut_rate}" if "cut" in result else None
    stem = harness.results_stem("recovery", f"n{args.world_size}", only, "rates" if args.rates else None, cut)
    harness.write_results(Path(args.results_dir) / stem, result, md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
