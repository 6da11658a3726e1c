"""The tests' process starter: `python SCRIPT ...` forked from a server that has loaded torch once.

    popen(argv, **popen_args)   like subprocess.Popen; a Python script is forked from the server

The suite starts some 450 processes that load torch, at about 3 s of CPU each on a 2-core machine:
more than half of its time. Each pytest worker has a fork server (tests/support/forkserver.py; started at
its first use, gone with the worker; one for each set of values of the variables torch reads at
load) that loads torch and forks every `python SCRIPT` a test starts: the child runs the script as
`python SCRIPT` would (utils/setup/fork.py), and its handle is a real process's.

Anything else (another program, `python -c`, a Popen option this does not know, or an environment
that torch would load differently: utils.setup.fork.forkable) is started by subprocess.Popen as before.
"""

import os
import subprocess
import sys
import threading

from forkserver import ForkServer

from utils.setup import fork
from utils.setup.handoff import Handoff
from utils.setup.threads import cpus_here, share

KNOWN = {"stdin", "stdout", "stderr", "text", "env", "cwd", "start_new_session", "netns"}
_servers = {}  # the variables read at load -> its ForkServer
_lock = threading.Lock()


def popen(argv, netns=None, **kwargs):
    """subprocess.Popen(argv, **kwargs), forked from the server when argv is `python [-u] SCRIPT ...`;
    netns: in that network namespace, as `ip netns exec NETNS argv` (scripts/netns.py's hosts)."""
    argv = [str(a) for a in argv]
    unbuffered = len(argv) > 2 and argv[1] == "-u"
    script_at = 2 if unbuffered else 1
    env = dict(os.environ if kwargs.get("env") is None else kwargs["env"])
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    script = argv[script_at] if len(argv) > script_at else ""
    if os.path.basename(script) == "train.py":  # what it sets for itself before torch loads
        env.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
        if launcher_threads(argv[script_at + 1 :]) and "OMP_NUM_THREADS" not in env:  # (not the user's: its own)
            env["OMP_NUM_THREADS"] = launcher_threads(argv[script_at + 1 :])
            env.update(Handoff.from_environ(env).replace(threads_from_launcher=True).environ({}))
    if (
        os.environ.get("RING_TEST_FORK") == "0"
        or set(kwargs) - KNOWN
        or argv[0] != sys.executable
        or not script.endswith(".py")
        or not os.path.isfile(script)
        or not fork.forkable(env, server_for(env).env)
    ):
        return subprocess.Popen(["ip", "netns", "exec", netns, *argv] if netns else argv, **kwargs)
    kwargs["env"] = env
    return server_for(env).popen(argv, netns=netns, **kwargs)


def launcher_threads(args):
    """train.py's local launcher loads torch with its ranks' threads (utils.setup.launch.rank_threads);
    the threads as text for a launcher's command line `args`, else None."""
    if {"--rank", "--eval", "--status", "--stop", "-h", "--help"} & {a.split("=")[0] for a in args}:
        return None
    nproc = "2"
    for i, arg in enumerate(args):
        if arg == "--nproc" and i + 1 < len(args):
            nproc = args[i + 1]
        elif arg.startswith("--nproc="):
            nproc = arg.split("=", 1)[1]
    return str(share(len(cpus_here()), int(nproc))) if nproc.isdigit() and int(nproc) > 0 else None


def server_for(env):
    """This worker's server whose torch loaded with what `env` has of the variables read at load
    (utils.setup.fork.AT_LOAD); started at the first call for such an environment."""
    at_load = fork.at_load(env)
    key = tuple(sorted(at_load.items()))
    with _lock:
        if key not in _servers or not _servers[key].alive():
            loaded = {n: v for n, v in os.environ.items() if n not in fork.at_load(os.environ)}
            _servers[key] = ForkServer({**loaded, **at_load})
        return _servers[key]
