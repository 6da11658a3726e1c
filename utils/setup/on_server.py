"""The server's side of `train.py --hosts`: what the launcher runs on each server over SSH.

    python -m utils.setup.on_server check  '{"port": 23456, "choose": false}'   can this folder run a rank here?
    python -m utils.setup.on_server prepare '{"path": "runs/checkpoint.pt.key", "job": {...}}' key (stdin), MNIST
    python -m utils.setup.on_server job    '{"path": "runs/checkpoint.pt.key"}' the running job's record and key
    python -m utils.setup.on_server start  '{"ranks": [...], "env": {...}}'    start ranks detached; their pids
    python -m utils.setup.on_server follow '{"ranks": {"0": 1234}}'            their logs and exit codes, as lines
    python -m utils.setup.on_server signal '{"ranks": [0, 1], "signal": 15}'   signal this server's ranks

The launcher's ssh runs it in the job's folder (cd there first), with the Python the ranks use. Each
answers on stdout: one JSON object (check, prepare, job, start, signal) or lines `L RANK OFFSET TEXT` (a
line of a rank's log, and where the next one starts), `E RANK CODE` (the rank ended) for follow.

A rank starts as `nohup` would start it: in a session of its own, stdin from /dev/null, SIGHUP
ignored, its output to runs/rank-N.log in the folder; a small watcher (`run`, this module too)
waits for it and writes its exit code to runs/rank-N.exit. Nothing here depends on the ssh
connection: the job goes on when the terminal, the connection or the launcher goes away.
"""

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

from utils.store.files import write_file

LOGS = "runs"  # each rank's files, in the job's folder: rank-N.log, rank-N.pid, rank-N.exit
JOB = os.path.join(LOGS, "job.json")  # the job's record: rank 0's address, the world (for --join)
FOLLOW_POLL = 0.2
NEEDED = ("torch", "torchvision", "numpy")  # what a rank imports (requirements.txt)
FIRST_PORT = 23456  # the port the original command names; another free one when it is taken


def paths(rank):
    return {kind: os.path.join(LOGS, f"rank-{rank}.{kind}") for kind in ("log", "pid", "exit")}


def check(request):
    """What the launcher checks before anything starts: torch and the program here, and rank 0's port."""
    from utils.setup.program import program_digest

    answer = {"host": socket.gethostname(), "address": server_address(), "python": sys.executable}
    missing = [name for name in NEEDED if importlib.util.find_spec(name) is None]
    if missing:
        answer["missing"] = missing[0]
        return answer
    answer["identity"] = {"torch": torch_version(), "program": program_digest()}
    answer["running"] = running_ranks()
    if request.get("port") is not None:
        port = request["port"]
        answer["port"] = port if port_free(port) else None
    elif request.get("choose"):
        answer["port"] = free_port()
    return answer


def running_ranks():
    """{rank: pid} of ranks a launcher started in this folder that are still running (another job)."""
    found = {}
    for name in os.listdir(LOGS) if os.path.isdir(LOGS) else ():
        if name.startswith("rank-") and name.endswith(".pid") and name[5:-4].isdigit():
            rank = int(name[5:-4])
            pid = read_code(paths(rank)["pid"])
            if pid is not None and read_code(paths(rank)["exit"]) is None and is_rank(pid):
                found[str(rank)] = pid
    return found


def torch_version():
    """torch.__version__ as torch/version.py says it, without the seconds an import of torch takes."""
    folder = importlib.util.find_spec("torch").submodule_search_locations[0]
    try:
        with open(os.path.join(folder, "version.py")) as f:
            return re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", f.read(), re.M).group(1)
    except (OSError, AttributeError):
        import torch

        return torch.__version__


def server_address():
    """This server's address as the launcher reached it (its ssh connection's), else None."""
    parts = os.environ.get("SSH_CONNECTION", "").split()
    return parts[2] if len(parts) == 4 else None


def port_free(port):
    """Whether the job's store could bind `port` here (as it does: SO_REUSEADDR, so a port an
    earlier job left in TIME_WAIT is free)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
            return True
        except OSError:
            return False


def free_port():
    """FIRST_PORT if free, else one the kernel gives (the ranks bind it within seconds)."""
    if port_free(FIRST_PORT):
        return FIRST_PORT
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def prepare(request):
    """Before the ranks start, one server at a time: the job's key (stdin), kept at `path` (see
    keep_key; None: the user gave the servers one); the job's record (rank 0's address, the world)
    in runs/job.json, for a later --join; MNIST unpacked once (`data_dir`, None: the folder's data/),
    not by ranks racing on a folder that servers share."""
    from utils.learn.mnist import ensure_mnist
    from utils.setup.cli import make_parser

    secret = sys.stdin.buffer.read().strip()
    os.makedirs(LOGS, exist_ok=True)
    write_file(JOB, (json.dumps(request["job"]) + "\n").encode())
    ensure_mnist(request.get("data_dir") or make_parser().get_default("data_dir"))
    return {"written": request["path"] is not None and keep_key(request["path"], secret)}


def job(request):
    """The running job's record and its key (at `path`), for a server that joins it (--join)."""
    with open(JOB) as f:
        record = json.load(f)
    with open(request["path"], "rb") as f:
        return {"job": record, "key": f.read().strip().decode()}


def keep_key(path, secret):
    """Write `secret` at `path`, readable by its user only, unless it is there already (a folder that
    servers share: written once); whether it wrote it."""

    try:
        with open(path, "rb") as f:
            if f.read().strip() == secret:
                return False
    except OSError:
        pass
    write_file(path, secret + b"\n", private=True)
    return True


def start(request):
    """Start each rank of `ranks` ({rank, argv}) detached, with `env` added to this environment;
    {rank: {pid, offset}}: its watcher's pid and where its log's new lines begin."""
    os.makedirs(LOGS, exist_ok=True)
    started = {}
    for entry in request["ranks"]:
        rank, files = entry["rank"], paths(entry["rank"])
        for stale in (files["exit"], files["pid"]):
            if os.path.exists(stale):
                os.remove(stale)
        with open(files["log"], "ab") as log:
            offset = log.tell()
            watcher = subprocess.Popen(
                [sys.executable, "-m", "utils.setup.on_server", "run", json.dumps(entry)],
                env=dict(os.environ, **request["env"]),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        started[str(rank)] = {"pid": watcher.pid, "offset": offset}
    return started


def run(entry):
    """The watcher of one rank: runs it, keeps its pid and, when it ends, its exit code."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup: a lost session changes nothing
    files = paths(entry["rank"])
    rank = subprocess.Popen([sys.executable, "-u", "train.py", *entry["argv"]], stdin=subprocess.DEVNULL)
    write_file(files["pid"], f"{rank.pid}\n".encode())
    for sig in (signal.SIGTERM, signal.SIGINT):  # a signal to the watcher is for the rank
        signal.signal(sig, lambda signum, _: rank.send_signal(signum))
    code = rank.wait()
    write_file(files["exit"], f"{code}\n".encode())
    return None


def follow(request):
    """Print each rank's new log lines (`L RANK OFFSET TEXT`) and its end (`E RANK CODE`) until
    every rank of `ranks` ({rank: offset}) has ended."""
    offsets = {int(r): int(o) for r, o in request["ranks"].items()}
    while offsets:
        for rank in list(offsets):
            ended = read_code(paths(rank)["exit"])  # (before the log: its last lines are written by then)
            offsets[rank] = print_new_lines(rank, offsets[rank])
            if ended is not None:
                print(f"E {rank} {ended}", flush=True)
                del offsets[rank]
        time.sleep(FOLLOW_POLL)
    return None


def print_new_lines(rank, offset):
    try:
        with open(paths(rank)["log"], "rb") as log:
            log.seek(offset)
            for line in log:
                if not line.endswith(b"\n"):
                    break  # (a line still being written: next time)
                offset += len(line)
                text = line.decode(errors="replace").rstrip("\n")
                print(f"L {rank} {offset} {text}", flush=True)
    except FileNotFoundError:
        pass
    return offset


def read_code(path):
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def signal_ranks(request):
    """Send `signal` to the ranks of `ranks` still running here; {rank: sent}."""
    sent = {}
    for rank in request["ranks"]:
        pid = read_code(paths(rank)["pid"])
        sent[str(rank)] = pid is not None and read_code(paths(rank)["exit"]) is None and deliver(pid, request["signal"])
    return sent


def deliver(pid, signum):
    """Signal `pid` if it is a rank of train.py (not a process that took a dead rank's pid)."""
    try:
        if is_rank(pid):
            os.kill(pid, signum)
            return True
    except OSError:
        pass
    return False


def is_rank(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"train.py" in f.read()
    except OSError:
        return False


COMMANDS = {
    "check": check,
    "prepare": prepare,
    "job": job,
    "start": start,
    "run": run,
    "follow": follow,
    "signal": signal_ranks,
}


def main(argv):
    answer = COMMANDS[argv[0]](json.loads(argv[1]))
    if answer is not None:
        print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
