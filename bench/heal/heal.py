"""A job that heals itself (docs/healing.md), measured on emulated servers (scripts/netns.py; root).

    sudo python bench/heal/heal.py                       # every trial
    sudo python bench/heal/heal.py --only kill --kills 10
    sudo python bench/heal/heal.py --only soak --faults 40

Three servers, one rank each, each in its own network namespace and folder, with the README's
command plus --restart on-failure and --heartbeat 2. Nobody types a command once they run.

  kill   kill -9 a random server's training process (its keeper stays), at a random moment, again
         once the job is back on 3: seconds from the kill to the job's first step on 3 members.
         Then the oracle: the same job stopped and resumed at the same steps (the local launcher)
         must end with the same parameters.
  cut    a server's cable down for --cut seconds, then up: seconds from the link coming back to its
         first step in the job, and from the cut to the majority's first step without it.
  storm  a server killed at step 30 whose training then dies at every restart: given up after
         --max-restarts 5; the majority's epoch against the same job whose server is not restarted
         (pairs, in turns).
  soak   a job of many short epochs with a fault every few seconds, each of a random kind: kill -9,
         freeze (SIGSTOP, SIGCONT seconds later), a cut cable, a reboot (the keeper killed with its
         training, the same command started again): every server in the job at the end, every image
         once per epoch, identical parameters.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # bench/common: harness (run directly)
from harness import REPO, RESULTS, bench_parser, command_line, host_info, netns, positive, results_stem, write_results

from utils.observe.instruments import environ_for, read_events

TRAIN = str(REPO / "train.py")
HEARTBEAT = 2.0
RUN = ["--test-subset", "200", "--timeout", "60", "--heartbeat", str(HEARTBEAT), "--save-every", "50"]
FULL = 938  # steps an epoch of 60,000 images, 64 a step
TRIALS = ("kill", "cut", "storm", "soak")
FOUND = re.compile(r"parameters identical on all (\d+) ranks \(sha256 ([0-9a-f]{64})\)")


class Job:
    """One job on the cluster's 3 emulated servers, each started with `extra` (and its own faults:
    rank -> a RING_INSTRUMENTS faults spec, utils/observe/instruments.py)."""

    def __init__(self, cl, home, extra, faults=None, port=29500, pace=None):
        self.cl, self.home, self.extra, self.port, self.pace = cl, home, extra, port, pace
        self.events = home / "events.jsonl"
        self.faults = faults or {}
        self.procs = {}
        for r in range(3):
            (home / f"host{r}").mkdir(parents=True)
            self.start(r)

    def start(self, rank):
        """The server's command (again, after a reboot): output appended to its logs."""
        instruments = environ_for(faults=self.faults.get(rank), events=str(self.events), pace=self.pace)
        env = {"OMP_NUM_THREADS": "1", **instruments}
        with open(self.home / f"rank{rank}.out", "ab") as out, open(self.home / f"rank{rank}.err", "ab") as err:
            argv = self.cl.train_argv(rank, self.port, self.extra)
            self.procs[rank] = self.cl.popen(rank, argv, env=env, cwd=self.home / f"host{rank}", stdout=out, stderr=err)

    def training(self, rank):
        """The pid of the training process under rank's keeper (None between restarts)."""
        keeper = self.procs[rank].pid
        try:
            children = Path(f"/proc/{keeper}/task/{keeper}/children").read_text().split()
        except OSError:
            return None
        return int(children[0]) if children else None

    def started(self, timeout=120):
        """Until the job is training (rank 0 saved its step 50: --save-every)."""
        deadline = time.monotonic() + timeout
        while not (self.home / "host0" / "runs" / "checkpoint.pt").exists() and time.monotonic() < deadline:
            time.sleep(0.1)

    def back_on_3(self, since, timeout=180):
        """Seconds from `since` (time.time()) to the job's first step on 3 members after it, or None."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.running():
            firsts = [
                e["time"]
                for e in read_events(self.events)
                if e["event"] == "first-step" and e["world_size"] == 3 and e["time"] > since
            ]
            if firsts:
                return min(firsts) - since
            time.sleep(0.1)
        return None

    def first_after(self, since, after):
        found = [e["time"] for e in read_events(self.events) if e["event"] == "first-step" and e["after"] == after]
        later = [t for t in found if t > since]
        return min(later) - since if later else None

    def running(self):
        return all(p.poll() is None for p in self.procs.values())

    def wait(self, timeout):
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in self.procs.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        codes = {r: p.poll() for r, p in self.procs.items()}
        self.kill_all()
        return codes

    def kill_all(self):
        for p in self.procs.values():
            self.cl.kill(p)

    def outputs(self, rank):
        return (self.home / f"rank{rank}.out").read_text(), (self.home / f"rank{rank}.err").read_text()

    def digests(self):
        return {m.group(2) for r in range(3) for m in FOUND.finditer(self.outputs(r)[0])}

    def images_once(self, images):
        """Every epoch trained `images` images (each once), as metrics.jsonl's rows say."""
        rows = self.metrics()
        return bool(rows) and all(row["images"] == images for row in rows)

    def metrics(self):
        rows = []
        for r in range(3):
            path = self.home / f"host{r}" / "runs" / "metrics.jsonl"
            if path.exists():
                rows += [json.loads(line) for line in path.read_text().splitlines()]
        return rows

    def changes(self, steps):
        """The job's changes of members as (global step after which it changed, ranks after it), in
        order: from each change's first step (its events), one per change."""
        seen = set()
        for e in read_events(self.events):
            if e["event"] == "first-step" and e["after"] in ("shrank", "grew"):
                seen.add(((e["epoch"] - 1) * steps + e["step"] - 1, e["world_size"]))
        return sorted(seen)


def oracle(changes, run, home):
    """The final digest of the same job stopped after each change's step and resumed on the new number
    of ranks (the local launcher; a fault's SIGTERM, RING_INSTRUMENTS, stops it after that step)."""
    legs, ranks = [], 3
    for step, world in changes:
        legs.append((ranks, step))
        ranks = world
    legs.append((ranks, None))
    home.mkdir()
    result = None
    for i, (ranks, step) in enumerate(legs):
        stop = environ_for(faults=f"0:{step}:TERM") if step is not None else {}
        env = dict(os.environ, OMP_NUM_THREADS="1", **stop)
        argv = [sys.executable, TRAIN, *run, "--nproc", str(ranks), *(["--resume"] if i else [])]
        result = subprocess.run(argv, cwd=home, env=env, capture_output=True, text=True, timeout=900)
        want = 3 if step is not None else 0
        if result.returncode != want:
            raise RuntimeError(
                f"oracle leg {i} ({ranks} ranks, to step {step}): exit {result.returncode}\n{result.stderr}"
            )
    return FOUND.search(result.stdout).group(2)


def kill_trial(cl, tmp, kills, rng, train_subset, epochs, pace=None):
    run = [*RUN, "--train-subset", str(train_subset), "--epochs", str(epochs)]
    job = Job(cl, tmp / "kill", [*run, "--restart", "on-failure"], pace=pace)
    steps = -(-train_subset // 64)  # (the last step of an epoch may be short)
    back, done = [], []
    try:
        job.started()
        while len(done) < kills and job.running():
            time.sleep(rng.uniform(3, 8))
            rank = rng.randrange(3)
            pid = job.training(rank)
            if pid is None:
                continue
            killed = time.time()
            os.kill(pid, signal.SIGKILL)
            done.append({"rank": rank, "at": killed})
            seconds = job.back_on_3(killed)
            back.append(seconds)
            print(f"kill {len(done)}: rank {rank}'s training; back on 3 after {seconds} s", flush=True)
            if seconds is None:
                break
        codes = job.wait(900)
    finally:
        job.kill_all()
    changes = job.changes(steps)
    rows = job.metrics()
    result = {
        "kills": done,
        "back_seconds": back,
        "codes": codes,
        "changes": changes,
        "digests": sorted(job.digests()),
        "images_ok": job.images_once(train_subset),
        "members_at_end": rows[-1]["members"] if rows else None,
    }
    result["oracle"] = oracle(changes, run, tmp / "kill-oracle") if len(result["digests"]) == 1 else None
    result["bits_ok"] = result["oracle"] is not None and result["digests"] == [result["oracle"]]
    return result


def cut_trial(cl, tmp, cut_seconds, train_subset):
    extra = [*RUN, "--train-subset", str(train_subset), "--epochs", "6", "--restart", "on-failure"]  # outlasts the cut
    job = Job(cl, tmp / "cut", extra)
    try:
        job.started()
        time.sleep(2)
        down = time.time()
        cl.link_down(2)
        time.sleep(cut_seconds)
        cl.link_up(2)
        up = time.time()
        rejoined = job.back_on_3(up)
        went_on = job.first_after(down, "shrank")
        codes = job.wait(900)
    finally:
        job.kill_all()
        cl.link_up(2)
    rows = job.metrics()
    return {
        "cut_seconds": cut_seconds,
        "rejoined_after_link_up": rejoined,
        "majority_went_on_after_cut": went_on,
        "codes": codes,
        "digests": sorted(job.digests()),
        "images_ok": job.images_once(train_subset),
        "members_at_end": rows[-1]["members"] if rows else None,
    }


def storm_trial(cl, tmp, pairs, train_subset):
    """(epoch seconds with the storm, without a restart), per pair, in turns."""
    run = [*RUN, "--train-subset", str(train_subset), "--epochs", "1"]
    fault = {2: "2:30:KILL,2:0:KILL:restart"}
    out = []
    for i in range(pairs):
        arms = {}
        for arm in ("storm", "quiet") if i % 2 == 0 else ("quiet", "storm"):
            extra = [*run, *(["--restart", "on-failure", "--max-restarts", "5"] if arm == "storm" else [])]
            job = Job(cl, tmp / f"storm{i}-{arm}", extra, faults=fault)
            codes = job.wait(900)
            seconds = [row["seconds"] for row in job.metrics()]
            gave_up = "gave up after 5 restarts" in job.outputs(2)[1]
            changes = len(job.changes(FULL))  # the members' changes: the one loss at step 30, no growth after it
            arms[arm] = {"codes": codes, "epoch_seconds": seconds, "gave_up": gave_up, "member_changes": changes}
        out.append(arms)
        print(f"storm pair {i + 1}: {arms['storm']['epoch_seconds']} s against {arms['quiet']['epoch_seconds']} s")
    return out


def soak_trial(cl, tmp, faults, rng, epochs, train_subset):
    run = [*RUN, "--epochs", str(epochs), "--train-subset", str(train_subset)]
    job = Job(cl, tmp / "soak", [*run, "--restart", "on-failure"])
    done = []
    try:
        job.started()
        while len(done) < faults and any(p.poll() is None for p in job.procs.values()):
            time.sleep(rng.uniform(3, 10))
            rank, kind = rng.randrange(3), rng.choice(["kill", "freeze", "cut", "reboot"])
            pid = job.training(rank)
            if pid is None:
                continue
            at = time.time()
            if kind == "kill":
                os.kill(pid, signal.SIGKILL)
            elif kind == "freeze":
                os.kill(pid, signal.SIGSTOP)
                time.sleep(rng.uniform(3, 6))
                os.kill(pid, signal.SIGCONT)
            elif kind == "cut":
                cl.link_down(rank)
                time.sleep(rng.uniform(5, 15))
                cl.link_up(rank)
            else:  # a reboot: everything on the server gone, then its command again (as systemd at boot)
                cl.kill(job.procs[rank])
                job.procs[rank].wait()
                time.sleep(rng.uniform(2, 5))
                job.start(rank)
            seconds = job.back_on_3(at)
            done.append({"rank": rank, "kind": kind, "at": at, "back_seconds": seconds})
            print(f"fault {len(done)}: {kind} of rank {rank}; back on 3 after {seconds} s", flush=True)
            if seconds is None:
                break
        codes = job.wait(1800)
    finally:
        job.kill_all()
        for r in range(3):
            cl.link_up(r)
    rows = job.metrics()
    by_epoch = {}
    for row in rows:
        by_epoch.setdefault(row["epoch"], []).append(row)
    return {
        "faults": done,
        "codes": codes,
        "digests": sorted(job.digests()),
        "images_ok": all(row["images"] == train_subset for row in rows)
        and sorted(by_epoch) == list(range(1, epochs + 1)),
        "epochs_once": all(len(v) == 1 for v in by_epoch.values()),
        "members_at_end": rows[-1]["members"] if rows else None,
    }


def verdict(ok):
    return "PASS" if ok else "FAIL"


def summary(values):
    values = [v for v in values if v is not None]
    if not values:
        return "none"
    return f"median {statistics.median(values):.1f} s (min {min(values):.1f}, max {max(values):.1f}, n {len(values)})"


def main(argv=None):
    ap = bench_parser(__doc__)
    ap.add_argument("--only", choices=TRIALS, action="append", help="run only this trial (repeatable)")
    ap.add_argument("--kills", type=positive(int), default=10)
    ap.add_argument("--kill-epochs", type=positive(int), default=8, help="kill trial: epochs")
    ap.add_argument("--cut", type=positive(float), default=30.0, help="seconds the cable is down (cut trial)")
    ap.add_argument("--pairs", type=positive(int), default=2, help="storm trial: pairs of jobs, in turns")
    ap.add_argument("--faults", type=positive(int), default=30, help="soak trial: faults in all")
    ap.add_argument("--epochs", type=positive(int), default=300, help="soak trial: epochs of --soak-subset images")
    ap.add_argument("--train-subset", type=positive(int), default=60000, help="images an epoch (kill, cut, storm)")
    ap.add_argument(
        "--pace",
        type=positive(float),
        help="kill trial: seconds every rank sleeps as a step begins (its test: a short job outlasts a kill anywhere)",
    )
    ap.add_argument("--soak-subset", type=positive(int), default=12800, help="images an epoch (soak)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--results-dir", default=str(RESULTS / "heal"))
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    trials = args.only or list(TRIALS)
    tmp = Path(tempfile.mkdtemp(prefix="heal-"))  # kept: every server's log
    os.chmod(tmp, 0o755)
    print(f"logs in {tmp}", flush=True)
    result, lines = {"command": command_line("heal/heal.py"), "host": host_info()}, []
    with netns.Cluster(hosts=3) as cl:
        if "kill" in trials:
            k = result["kill"] = kill_trial(cl, tmp, args.kills, rng, args.train_subset, args.kill_epochs, args.pace)
            ok = len(k["back_seconds"]) == args.kills and all(
                s is not None and s <= HEARTBEAT + 10 for s in k["back_seconds"]
            )
            ok = ok and set(k["codes"].values()) == {0} and k["bits_ok"] and k["images_ok"]
            lines.append(
                f"kill: {len(k['kills'])} kills (ranks {[x['rank'] for x in k['kills']]}); back on 3 members "
                f"{summary(k['back_seconds'])} (target <= {HEARTBEAT + 10:g} s); exit codes {k['codes']}; every image "
                f"once: {k['images_ok']}; identical to the stop-and-resume oracle: {k['bits_ok']} -> {verdict(ok)}"
            )
        if "cut" in trials:
            c = result["cut"] = cut_trial(cl, tmp, args.cut, args.train_subset)
            r = c["rejoined_after_link_up"]
            ok = r is not None and r <= 10 and set(c["codes"].values()) == {0} and c["images_ok"]
            lines.append(
                f"cut: cable down {args.cut:g} s; the majority went on {c['majority_went_on_after_cut']} s after the "
                f"cut; back on 3 {r} s after the link came up (target <= 10 s); exit codes {c['codes']} -> "
                f"{'PASS' if ok else 'FAIL'}"
            )
        if "storm" in trials:
            pairs = result["storm"] = storm_trial(cl, tmp, args.pairs, args.train_subset)
            ratios = [p["storm"]["epoch_seconds"][0] / p["quiet"]["epoch_seconds"][0] for p in pairs]
            gave_up = all(p["storm"]["gave_up"] and p["storm"]["codes"][2] == 1 for p in pairs)
            changes = [p["storm"]["member_changes"] for p in pairs]
            lines.append(
                f"storm: a server failing at every restart given up after 5: {gave_up}; the members' changes of "
                f"members with it: {changes} (1: the loss at step 30, no attempt reached them); the majority's epoch "
                f"with it against without restarts: {', '.join(f'{x:.3f}x' for x in ratios)} (its restarts share "
                "these 2 cores with the members)"
            )
        if "soak" in trials:
            s = result["soak"] = soak_trial(cl, tmp, args.faults, rng, args.epochs, args.soak_subset)
            kinds = {k: sum(1 for f in s["faults"] if f["kind"] == k) for k in ("kill", "freeze", "cut", "reboot")}
            backs = [f["back_seconds"] for f in s["faults"]]
            ok = set(s["codes"].values()) == {0} and len(s["digests"]) == 1 and s["images_ok"] and s["epochs_once"]
            ok = ok and s["members_at_end"] is not None and len(s["members_at_end"]) == 3 and None not in backs
            lines.append(
                f"soak: {len(s['faults'])} faults ({kinds}); back on 3 {summary(backs)}; exit codes {s['codes']}; "
                f"members at the end {s['members_at_end']}; every image once per epoch: {s['images_ok']}; each "
                f"epoch once: {s['epochs_once']}; identical parameters: {len(s['digests']) == 1} -> {verdict(ok)}"
            )
    for line in lines:
        print(line, flush=True)
    md = f"# bench/heal/heal.py\n\n    {result['command']}\n\n" + "".join(f"- {line}\n" for line in lines)
    stem = results_stem("heal", "-".join(trials) if args.only else None, f"seed{args.seed}" if args.seed != 1 else None)
    write_results(Path(args.results_dir) / stem, result, md)
    return 0 if all(line.endswith("PASS") or line.startswith("storm") for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
