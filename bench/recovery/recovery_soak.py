"""The soak of the live-recovery issue: a long job that keeps losing servers and taking them back.

    python bench/recovery/recovery_soak.py  # 4 ranks, 2 epochs of MNIST, 20 faults
    python bench/recovery/recovery_soak.py --faults 30 --ranks 4 --epochs 2

Every rank runs as on a server of its own (its own folder, loopback). While the job runs, every
few seconds one member, chosen at random (rank 0 included), gets SIGKILL or SIGSTOP. A killed
server is started again with its command plus --join; a stopped one gets SIGCONT a few seconds
later, finds itself fenced out, exits 1, and is started again with --join (or, when the others
were lost meanwhile and its side kept the quorum, it simply goes on). Every other fault comes
while another server is out of the job (restarting or joining); never more than two at once, and
never two members at once (that may leave exactly half without the lowest rank, which must stop).
With --save-every 10, faults land during saves too.

Then a fault-free run of the same job, and the checks: no rank hangs (a woken rank that neither
leaves nor goes on within 10 s, or any rank still running a minute after the job ended, is dumped
with py-spy into the logs); the job ends on every rank with identical parameters; every epoch's
`images` is 60000; each epoch is reported once (one lineage: only one side ever trains); and the
final accuracy is within 0.1 point of the fault-free run's.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # bench/common: harness, stats (run directly)
from harness import REPO, RESULTS, bench_parser, command_line, host_info, positive, results_stem, write_results

from utils.observe.instruments import environ_for
from utils.setup.launch import free_port, kill

TRAIN = str(REPO / "train.py")


def main(argv=None):
    ap = bench_parser(__doc__)
    ap.add_argument("--ranks", type=positive(int), default=4)
    ap.add_argument("--epochs", type=positive(int), default=2)
    ap.add_argument("--faults", type=positive(int), default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=positive(float), default=1800.0, help="hard limit for the soak, s")
    ap.add_argument("--results-dir", default=str(RESULTS / "recovery"))
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    run = ["--epochs", str(args.epochs), "--heartbeat", "2", "--save-every", "10", "--timeout", "60"]
    tmp = Path(tempfile.mkdtemp(prefix="recovery-soak-"))  # kept: every rank's log, for a failed soak
    print(f"logs in {tmp}", flush=True)
    soak = Soak(tmp / "soak", args.ranks, run, rng)
    started = time.monotonic()
    try:
        faults = soak.run(args.faults, args.timeout)
    finally:
        soak.stop_all()
    soak_seconds = time.monotonic() - started
    clean = tmp / "clean"
    clean.mkdir()
    argv, env = [sys.executable, TRAIN, *run, "--nproc", str(args.ranks)], dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(argv, cwd=clean, capture_output=True, text=True, timeout=args.timeout, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    clean_rows = [json.loads(line) for line in (clean / "runs" / "metrics.jsonl").read_text().splitlines()]
    result = soak.check(clean_rows, args.epochs)
    result |= dict(
        command=command_line("recovery/recovery_soak.py"), host=host_info(), faults=faults, seconds=soak_seconds
    )
    result["clean_accuracy"] = clean_rows[-1]["test_accuracy"]
    checks = (result["identical"], result["images_ok"], result["epochs_once"], not result["hung"])
    close = abs(result["accuracy"] - result["clean_accuracy"]) <= 0.001
    result["ok"] = ok = len(faults) >= args.faults and all(checks) and close
    kinds = {k: sum(1 for f in faults if f["kind"] == k) for k in ("kill", "stop")}
    line = (
        f"soak: {len(faults)} faults ({kinds['kill']} kill -9, {kinds['stop']} SIGSTOP; ranks "
        f"{sorted({f['rank'] for f in faults})}; {sum(f['during_join'] for f in faults)} during a join), "
        f"{result['joins']} rejoins, {len(result['stayed'])} woken ranks stayed in, hung ranks "
        f"{result['hung'] or 'none'}, {soak_seconds:.0f} s; accuracy {result['accuracy']:.2%} (fault-free "
        f"{result['clean_accuracy']:.2%}); images per epoch {result['images']}; each epoch reported once: "
        f"{result['epochs_once']}; identical parameters: {result['identical']} -> {'PASS' if ok else 'FAIL'}"
    )
    print(line, flush=True)
    md = f"# bench/recovery/recovery_soak.py\n\n    {result['command']}\n\n{line}\n"
    write_results(Path(args.results_dir) / results_stem("recovery_soak", f"n{args.ranks}"), result, md)
    return 0 if ok else 1


class Soak:
    def __init__(self, home, ranks, run, rng):
        self.home, self.ranks, self.rng = home, ranks, rng
        self.port = free_port()
        self.events = home / "events.jsonl"
        self.common = f"--world-size {ranks} --init-method tcp://127.0.0.1:{self.port} --gloo_socket_ifname lo".split()
        self.common += run
        self.procs, self.joins = {}, 0
        self.stayed, self.hung = [], []  # woken ranks whose side went on; ranks that did not end when they should
        for r in range(ranks):
            (home / f"host{r}").mkdir(parents=True)
            self.start(r, join=False)

    def start(self, rank, join):
        with open(self.home / f"rank{rank}.out", "ab") as out, open(self.home / f"rank{rank}.err", "ab") as err:
            self.procs[rank] = subprocess.Popen(
                [sys.executable, TRAIN, "--rank", str(rank), *self.common, *(["--join"] if join else [])],
                cwd=self.home / f"host{rank}",
                stdout=out,
                stderr=err,
                start_new_session=True,
                env=dict(os.environ, OMP_NUM_THREADS="1", **environ_for(events=str(self.events))),
            )
        self.joins += join

    def stepped(self, rank, since, after=None):
        """Whether `rank` completed a first step after a membership change (of kind `after`, if
        given) since `since` (a time.time())."""
        if not self.events.exists():
            return False
        return any(
            e["event"] == "first-step" and e["rank"] == rank and after in (None, e["after"]) and e["time"] > since
            for e in map(json.loads, self.events.read_text().splitlines())
        )

    def running(self):
        return any(p.poll() is None for p in self.procs.values())

    def finished(self):
        return any(p.poll() == 0 for p in self.procs.values())

    def run(self, faults, timeout):
        deadline, done, pending = time.monotonic() + timeout, [], []  # pending: (rank, when, how) to bring back
        started = {}  # rank -> time.time() its --join was started, or it was woken
        time.sleep(15)  # the job gets going
        while self.running() and not self.finished() and time.monotonic() < deadline:
            now = time.monotonic()
            for item in list(pending):
                rank, when, how = item
                if now < when:
                    continue
                if how == "cont":
                    self.signal(rank, signal.SIGCONT)
                    pending.remove(item)
                    pending.append((rank, now, "woken"))
                    started[rank] = time.time()
                elif how == "woken" and self.procs[rank].poll() is None and self.stepped(rank, started[rank], "shrank"):
                    pending.remove(item)  # its side had the quorum (the others were lost): it is the job
                    self.stayed.append(rank)
                elif (
                    how == "woken" and self.procs[rank].poll() is None and now - when > 10 and rank not in self.hung
                ):  # fenced out, it should have seen so within a second
                    self.hung.append(rank)
                    self.dump(rank, f"hung{rank}-{len(done)}.txt")
                elif how in ("woken", "join-when-exited") and self.procs[rank].poll() is not None:
                    pending.remove(item)
                    self.start(rank, join=True)
                    pending.append((rank, now, "joining"))
                    started[rank] = time.time()  # the events' clock
                elif how == "joining" and (
                    self.stepped(rank, started[rank], "joined") or self.procs[rank].poll() is not None
                ):
                    pending.remove(item)
                    if self.procs[rank].poll() is not None:  # it died joining (a fault during its join): again
                        pending.append((rank, now, "join-when-exited"))
            out = [r for r, _, how in pending]
            joining = [r for r, _, how in pending if how == "joining"]
            if not any(p.poll() is None for r, p in self.procs.items() if r not in out):
                break  # no member left: the job is over (or lost; check says which)
            gone = [r for r, _, how in pending if how in ("joining", "join-when-exited")]  # members no more
            # a second fault only while the first is no member any more: two members lost at once may leave
            # exactly half without the lowest rank, which stops by the rule of no split brain
            if len(done) < faults and len(out) < 2 and (not out or gone and len(done) % 2 == 1):
                up = [r for r, p in self.procs.items() if p.poll() is None and r not in out]
                rank, kind = self.rng.choice(up), self.rng.choice(["kill", "stop"])
                self.signal(rank, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
                done.append({"rank": rank, "kind": kind, "during_join": bool(joining), "at": time.time()})
                with open(self.home / "faults.jsonl", "a") as f:
                    f.write(json.dumps(done[-1]) + "\n")
                back = now + (self.rng.uniform(2.5, 4) if kind == "stop" else self.rng.uniform(0.3, 1))
                pending.append((rank, back, "cont" if kind == "stop" else "join-when-exited"))
                time.sleep(self.rng.uniform(0.5, 1.5) if not joining else 0.2)
            time.sleep(0.05)
        for rank, _, how in pending:
            if how == "cont":
                self.signal(rank, signal.SIGCONT)
        end = min(deadline, time.monotonic() + 60)  # the end: everyone finishes, or is out within a minute
        while self.running() and time.monotonic() < end:
            time.sleep(0.2)
        for rank, proc in self.procs.items():
            if proc.poll() is None and not any(r == rank and how == "joining" for r, _, how in pending):
                self.hung.append(rank)
                self.dump(rank, f"hung{rank}-end.txt")
        return done

    def signal(self, rank, signum):
        try:
            os.kill(self.procs[rank].pid, signum)
        except ProcessLookupError:  # it ended (and was reaped) a moment ago
            pass

    def dump(self, rank, name):
        """Where a rank's threads are (py-spy, if installed), for the logs of a failed soak."""
        with open(self.home / name, "w") as f:
            argv = ["py-spy", "dump", "--native", "--pid", str(self.procs[rank].pid)]
            subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, timeout=30, check=False)

    def stop_all(self):
        for p in self.procs.values():
            kill(p, group=True)

    def check(self, clean_rows, epochs):
        outs = {r: (self.home / f"rank{r}.out").read_text() for r in range(self.ranks)}
        found = re.compile(r"parameters identical on all (\d+) ranks \(sha256 ([0-9a-f]{64})\)")
        digests = {m.group(2) for out in outs.values() for m in found.finditer(out)}
        metrics = [self.home / f"host{r}" / "runs" / "metrics.jsonl" for r in range(self.ranks)]
        rows = [json.loads(line) for path in metrics if path.exists() for line in path.read_text().splitlines()]
        by_epoch = {}
        for row in rows:
            by_epoch.setdefault(row["epoch"], []).append(row)
        last = by_epoch.get(epochs, [{"test_accuracy": 0.0}])[-1]
        images_ok = all(row["images"] == 60000 for row in rows) and sorted(by_epoch) == list(range(1, epochs + 1))
        out = {"identical": len(digests) == 1, "digests": sorted(digests)}
        out |= {"images": [row["images"] for e in sorted(by_epoch) for row in by_epoch[e]], "images_ok": images_ok}
        out |= {"epochs_once": all(len(v) == 1 for v in by_epoch.values()), "accuracy": last["test_accuracy"]}
        out |= {"joins": self.joins, "members_at_end": last.get("members")}
        return out | {"stayed": self.stayed, "hung": self.hung}


if __name__ == "__main__":
    sys.exit(main())
