"""`train.py --hosts node0,node1,...`: the whole job started from one terminal, over the user's own ssh.

    launch_remote(config, argv, handoff, prog)   check every server, start every rank there, watch them

1. Check, on every server at once (utils/setup/on_server.py `check`): ssh reaches it without a
   prompt, the folder is there, its Python has torch, it runs this program (the digest the join
   check uses) and every server the same torch; rank 0's port is free. Any problem: one line per
   server, exit 2, nothing started anywhere.
2. The job's key, made here, is written on every server over ssh (mode 600, beside the
   checkpoint, where --join, --status and --stop find it) and here; ranks read it with --key-file,
   so no secret crosses the rendezvous.
3. Each rank starts detached on its server, as nohup would start it (on_server `start`), with
   --rank, --world-size, --init-method (rank 0's address as this terminal reached it, the port
   checked free there) and no card: each rank finds its own (the route to rank 0).
4. Attached, each server's ranks are followed over ssh (`follow`): their lines, with their host,
   and their exit codes, for the one supervisor (utils/setup/launch.py `supervise`). Ctrl-C asks
   every rank to stop after the step, as SIGTERM does. --detach returns once all have started.
The launcher going away (a closed laptop, a lost connection, kill -9) changes nothing in the job.
"""

import json
import shlex
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from utils.elastic import key
from utils.errors import UsageError
from utils.setup import cli, stop
from utils.setup.follow import Lines, StartWindow, follow_all
from utils.setup.launch import exit_code, supervise
from utils.setup.on_server import keep_key, paths
from utils.setup.process import resume_command, say
from utils.setup.program import ROOT, program_digest
from utils.setup.servers import ranks_of
from utils.setup.ssh import Ssh, trouble

LAUNCHER_FLAGS = {"--hosts": 1, "--hostfile": 1, "--remote-dir": 1, "--python": 1, "--port": 1, "--detach": 0}


@dataclass(frozen=True)
class Place:
    """Where a server's ranks run: its host as ssh knows it, its folder, the Pythons to try there."""

    host: str
    folder: str
    pythons: tuple
    ranks: tuple


def places_of(launch):
    """[Place] of every server of Launch `launch`, in rank order."""
    pythons = (launch.python,) if launch.python else (sys.executable, "python3")
    ranks = ranks_of(launch.servers)
    return [
        Place(s.host, s.folder or launch.remote_dir or str(ROOT), pythons, tuple(r for t, r in ranks if t is s))
        for s in launch.servers
    ]


def launch_remote(config, argv, handoff, prog):
    """Start the job on every server of config.job.launch (with --join: on the servers past the
    running job's); the exit code (attached: the job's)."""
    ssh, places = Ssh(), places_of(config.job.launch)
    world = sum(len(p.ranks) for p in places)
    env = handoff.replace(resume_command=resume_command(argv, handoff, prog)).environ({})
    data_dir = config.job.data_dir if "--data-dir" in [w.split("=")[0] for w in argv] else None  # (else theirs)
    begin = joining if config.job.join is not None else starting
    places, secret, init_method = begin(ssh, places, config, world, data_dir)
    base = [*rank_argv(argv), "--world-size", str(world), "--init-method", init_method]
    if not config.job.key_file:
        base += ["--key-file", key.copy_path(config.outputs.checkpoint)]
    try:
        started = start_all(ssh, places, base, env)
    except KeyboardInterrupt:
        signal_all(ssh, places, signal.SIGKILL)
        say(f"{prog}: interrupted while starting the job; stopped whatever had started")
        return 130
    return watch(ssh, places, started, config, secret, init_method[len("tcp://") :], prog)


def starting(ssh, places, config, world, data_dir):
    """A new job: every server checked, the key shared; (places, key, init method)."""
    address, port = settle(ssh, places, config.job.launch)
    secret = None if config.job.key_file else key.new()  # (--key-file: the user's, on every server)
    init_method = f"tcp://{address}:{port}"
    prepare(ssh, places, config, secret, {"init_method": init_method, "world": world}, data_dir)
    return places, secret, init_method


def joining(ssh, places, config, world, data_dir):
    """--join: the servers past the running job's ranks, checked, given its key; (those, key, init method)."""
    job, secret = running_job(ssh, places[0], config)
    new = [p for p in places if min(p.ranks) >= job["world"]]
    if not new:
        raise UsageError(f"the job has {job['world']} ranks on these servers already; name one more to add it")
    settle(ssh, new, config.job.launch, first_is_rank_0=False)
    # (the job's servers have the key: only the record changes there)
    prepare(ssh, places, config, secret, dict(job, world=world), data_dir, tell=False)
    return new, secret, job["init_method"]


def watch(ssh, places, started, config, secret, where, prog):
    """Attached: every rank's lines and exit code, Ctrl-C passed on as a stop; --detach: how to watch.
    where: rank 0's HOST:PORT."""
    detach = config.job.launch.detach
    say_started(prog, places, where, detach)
    if detach:
        return 0
    lines = Lines()
    ranks = follow_all(ssh, places, started, lines)
    stop.install(prog)  # Ctrl-C: every rank stops after the same step, saved, as with SIGTERM
    stop.forward_to(ranks)
    world = sum(len(p.ranks) for p in places)
    window = StartWindow(
        world, where, secret, config.sync.timeout, lambda: signal_all(ssh, places, signal.SIGKILL), prog
    )
    outcome = supervise(ranks, grace=None, while_running=window)
    if lines.resume:
        say(f"{prog}: to resume the job: {lines.resume}")
    return exit_code(outcome, config.job.recover, prog)


def settle(ssh, places, launch, first_is_rank_0=True):
    """(rank 0's address, its port), once every server passed its checks; else every problem, one
    line per server, and UsageError: nothing is started. first_is_rank_0=False: servers joining a job."""
    given = launch.init_address
    rank_0 = {"port": launch.port, "choose": launch.port is None} if first_is_rank_0 else {}
    requests = [rank_0, *[{}] * (len(places) - 1)]
    with ThreadPoolExecutor(len(places)) as pool:
        answers = list(pool.map(lambda pr: check(ssh, *pr, joining=not first_is_rank_0), zip(places, requests)))
    problems = [p for a in answers for p in a["problems"]]
    problems += mismatches(places, answers)
    first = answers[0]
    if first_is_rank_0 and not answers[0]["problems"] and first.get("port") is None:
        problems.append(f"{places[0].host}: port {launch.port} is in use there; choose another: --port N")
    if problems:
        for line in problems:
            say(f"train.py: {line}")
        ready = len(places) - len({line.split(":")[0] for line in problems})
        raise UsageError(f"{ready} of {len(places)} servers are ready; nothing was started")
    return given or first.get("address"), first.get("port")


def check(ssh, place, request, joining=False):
    """One server's answer to on_server `check`, with its "problems" (lines). A job running in its
    folder is one, unless this server joins it with ranks that are not running there."""
    code, out, err = ssh.run(place.host, place.folder, place.pythons, "check", request)
    said = trouble(place.host, code, err, place.folder, place.pythons)
    if said:
        return {"problems": [said]}
    try:
        answer = json.loads(out.strip().splitlines()[-1])
        assert isinstance(answer, dict)
    except (ValueError, IndexError, AssertionError):
        last = (err.strip().splitlines() or ["no answer"])[-1]
        return {"problems": [f"{place.host}: its check failed: {last}"]}
    running = {int(r): pid for r, pid in answer.get("running", {}).items() if not joining or int(r) in place.ranks}
    if running:
        ranks = ", ".join(f"rank {r} (pid {pid})" for r, pid in sorted(running.items()))
        said = f"{place.host}: a job is running in {place.folder} ({ranks}); stop it or use another folder"
        return {"problems": [said]}
    if "missing" in answer:
        python = answer.get("python") or place.pythons[0]  # (the first of them that is there: ssh.Ssh.on)
        need = f"{python} -m pip install -r {place.folder}/requirements.txt"
        return {"problems": [f"{place.host}: {python} has no module {answer['missing']}; install: {need}"]}
    return dict(answer, problems=[])


def mismatches(places, answers):
    """Lines for servers whose program differs from this folder's, or whose torch from rank 0's."""
    here, lines = program_digest(), []
    torch0 = answers[0].get("identity", {}).get("torch")
    for place, answer in zip(places, answers):
        theirs = answer.get("identity")
        if theirs is None:
            continue
        if theirs.get("program") != here:
            lines.append(
                f"{place.host}: {place.folder} holds another program (train.py and utils/: {theirs.get('program')}, "
                f"here {here}); copy this one: rsync -a {shlex.quote(str(ROOT))}/ {place.host}:{place.folder}/"
            )
        elif torch0 and theirs.get("torch") != torch0:
            lines.append(f"{place.host}: torch {theirs.get('torch')}, but {places[0].host} has {torch0}; install one")
    return lines


def prepare(ssh, places, config, secret, job, data_dir, tell=True):
    """Each server (utils/setup/on_server.py `prepare`): the job's key (unless the user gave one:
    --key-file; here too), its record (rank 0's address, the world) and MNIST unpacked (data_dir:
    --data-dir as given, None: the folder's own). Rank 0's server first, then the others at once: a
    folder they share with it has the key and MNIST already, so each is written once."""
    path = None if config.job.key_file else key.copy_path(config.outputs.checkpoint)
    request = {"path": path, "job": job, "data_dir": data_dir}

    def one(place):
        code, out, err = ssh.run(place.host, place.folder, place.pythons, "prepare", request, stdin=secret or b"")
        if code != 0:
            said = (err.strip().splitlines() or [f"exit {code}"])[-1]
            raise UsageError(f"could not prepare {place.host} for the job: {said}")
        return bool(path) and '"written": false' in out  # (the key was there: a folder another server shares)

    shared = [one(places[0])]
    with ThreadPoolExecutor(max(1, len(places) - 1)) as pool:
        shared += list(pool.map(one, places[1:]))
    if path:
        keep_key(path, secret)  # (here too: --status and --stop from this terminal)
    if path and tell:
        found = [p.host for p, was in zip(places, shared) if was]
        also = f"; already there on {', '.join(found)} (a folder another server shares)" if found else ""
        print(f"the job's key: {path} on every server, readable by you only{also}", flush=True)


def running_job(ssh, place, config):
    """(record, key) of the job running on `place`, rank 0's server, for --join."""
    path = config.job.key_file or key.copy_path(config.outputs.checkpoint)
    code, out, err = ssh.run(place.host, place.folder, place.pythons, "job", {"path": path})
    said = trouble(place.host, code, err, place.folder, place.pythons)
    try:
        answer = json.loads(out.strip().splitlines()[-1])
        job, secret = answer["job"], answer["key"].encode()
        assert isinstance(job["init_method"], str) and isinstance(job["world"], int)
    except (ValueError, IndexError, KeyError, TypeError, AttributeError, AssertionError):
        raise UsageError(said or f"{place.host}: no job started by --hosts in {place.folder} to join") from None
    return job, key.checked(secret, f"the job's key on {place.host}")


def rank_argv(argv):
    """The user's command line without the launcher's own flags (each rank gets its own placement)."""
    out, skip = [], 0
    for word in argv:
        if skip:
            skip -= 1
            continue
        name = word.split("=", 1)[0]
        if name in LAUNCHER_FLAGS or name in ("--init-method", "--init_method"):
            skip = 0 if "=" in word else LAUNCHER_FLAGS.get(name, 1)
            continue
        out.append(word)
    left = cli.parse_args(out)
    if left.hosts or left.hostfile or left.remote_dir or left.python or left.port or left.detach:
        raise UsageError("spell --hosts, --hostfile, --remote-dir, --python, --port and --detach out in full")
    return out


def start_all(ssh, places, base, env):
    """Start every rank; {rank: offset of its log}. A server that fails: the others' ranks are killed."""

    def start(place):
        ranks = [{"rank": r, "argv": [*base, "--rank", str(r)]} for r in place.ranks]
        code, out, err = ssh.run(place.host, place.folder, place.pythons, "start", {"ranks": ranks, "env": env})
        try:
            return {int(r): int(v["offset"]) for r, v in json.loads(out.strip().splitlines()[-1]).items()}
        except (ValueError, IndexError, KeyError, TypeError, AttributeError):
            said = trouble(place.host, code, err, place.folder, place.pythons)
            raise UsageError(said or f"{place.host}: could not start its ranks: {err.strip()}") from None

    with ThreadPoolExecutor(len(places)) as pool:
        futures = [pool.submit(start, p) for p in places]
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        signal_all(ssh, places, signal.SIGKILL)
        raise UsageError(f"{failed[0]}; stopped the ranks started elsewhere")
    return {r: o for f in futures for r, o in f.result().items()}


def signal_all(ssh, places, sig):
    with ThreadPoolExecutor(len(places)) as pool:
        for p in places:
            pool.submit(ssh.run, p.host, p.folder, p.pythons, "signal", {"ranks": list(p.ranks), "signal": int(sig)})


def say_started(prog, places, where, detached):
    world = sum(len(p.ranks) for p in places)
    hosts = ", ".join(f"{p.host} ({len(p.ranks)})" if len(p.ranks) > 1 else p.host for p in places)
    ranks = f"{world} rank{'s' if world > 1 else ''}"
    print(f"started {ranks} on {hosts}; rank 0 at {where}; logs in runs/rank-N.log on each", flush=True)
    if detached:
        first = places[0]
        print(f"  watch:  python {prog} --status {where}", flush=True)
        print(f"  logs:   ssh {first.host} tail -f {shlex.quote(first.folder)}/{paths(0)['log']}", flush=True)
        print(f"  stop:   python {prog} --stop {where}", flush=True)
