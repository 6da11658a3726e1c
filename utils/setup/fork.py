"""Starting a Python script in a forked child of a process that has loaded torch once.

    loaded = preload()                      in the parent, before any thread: load torch
    forkable(env, loaded.env)               can a child with this environment be forked (else: exec it)
    start(loaded, script, argv, env, ...)   fork; the child runs `python SCRIPT ARGV` and exits; its pid
    Child(pid, args)                a forked child as a Popen-like handle: poll, wait, signals

Most of a rank's start is `import torch`, as long as a small run's training (measured:
bench/common/NOTES.md, "Forking instead of loading torch"). The local launcher
(utils/setup/launch.py) and the tests (tests/support/forker.py) load it once and fork each rank from
there, as torch's own DataLoader forks its workers. The child is a process of its own and runs the
script as `python SCRIPT ARGV` would: the repository's modules imported afresh, its own environment,
folder, standard streams and session, files it was not given closed (as Popen's close_fds), none of
the parent's exit handlers, and the same exit code (a signal's death included).

What a child cannot take afresh is what the libraries read when they loaded (AT_LOAD): those must
be what the parent had, or `forkable` says no. OMP_NUM_THREADS is one of them: a fork whose torch
loaded with another thread count than the child's ended with other bits (bench/common/NOTES.md,
"Forking instead of loading torch"). A process forked from such a parent (a launcher forked by the
tests' server) finds in its handoff (utils/setup/handoff.py: torch_loaded_with) what its torch loaded with.
"""

import atexit
import ctypes
import io
import logging
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import traceback
import weakref
from dataclasses import dataclass

from utils.setup.handoff import Handoff

# variables the libraries (or Python) read once, at load: a child must see the parent's
AT_LOAD = ("TORCH_CPP_LOG_LEVEL", "MKL_", "DNNL_", "ONEDNN_", "KMP_", "GOMP_", "OMP_", "LD_", "MALLOC_", "PYTHON")
# ... but these the child sets for itself
OWN = ("PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE")
LIBRARIES = ("/site-packages/", "/dist-packages/", f"/lib/python{sys.version_info.major}.{sys.version_info.minor}/")
PR_SET_PDEATHSIG, PR_SET_NAME, CLONE_NEWNET = 1, 15, 0x40000000


@dataclass(frozen=True)
class Loaded:
    """What a parent that has loaded torch hands its children."""

    env: dict | None  # the AT_LOAD variables torch loaded with (None: not known, never fork)
    pythonpath: str  # PYTHONPATH then
    files: frozenset  # the file descriptors torch opened as it loaded: a child keeps these, no others


def at_load(env):
    return {n: v for n, v in env.items() if n.startswith(AT_LOAD) and n not in OWN}


def preload():
    """Load torch here, once; call before starting any thread (a fork copies only the caller), and
    fork only from a process that has not run torch since (a fork after OpenMP's threads have run is
    not safe: the child's pool would wait for threads it does not have)."""
    pythonpath = os.environ.get("PYTHONPATH", "")
    if "torch" in sys.modules:  # loaded before: only a fork parent's handoff says with what
        return Loaded(Handoff.from_environ().torch_loaded_with, pythonpath, frozenset())
    before, loaded_with = _open_files(), at_load(os.environ)
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    return Loaded(loaded_with, pythonpath, frozenset(_open_files() - before))


def _open_files():
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def forkable(env, loaded_env):
    """Whether a child with environment `env` behaves as it would when started afresh, in a parent
    whose torch loaded with the AT_LOAD variables `loaded_env`."""
    return loaded_env is not None and at_load(env) == at_load(loaded_env)


def start(
    loaded,
    script,
    argv,
    env,
    cwd=None,
    stdio=(None, None, None),
    new_session=False,
    die_with_parent=None,
    name=None,
    netns=None,
):
    """Fork a child that runs `python SCRIPT ARGV` with environment `env` in folder `cwd`, its
    standard streams on the file descriptors `stdio` (None: the parent's). new_session: it leads a
    session and process group of its own (Popen's start_new_session); die_with_parent: a signal it
    gets when the parent dies; name: what `ps -o comm` and `top` show for it (the command line shown is
    the parent's); netns: the network namespace (`ip netns` name) it runs in, as under `ip netns exec`.
    Returns its pid once it has its session."""
    assert forkable(env, loaded.env), "not forkable: start it with exec"
    ready_read, ready_write = os.pipe()
    sys.stdout.flush(), sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(ready_read)
            code = _run_child(
                loaded, script, argv, env, cwd, stdio, (new_session, die_with_parent, name, netns), ready_write
            )
        finally:
            os._exit(code)
    os.close(ready_write)
    os.read(ready_read, 1)  # EOF: the child has its session and its streams (or is gone)
    os.close(ready_read)
    return pid


def _run_child(loaded, script, argv, env, cwd, stdio, process, ready):
    _become(*process)
    for target, fd in enumerate(stdio):
        if fd is not None and fd != target:
            os.dup2(fd, target)
    for fd in _open_files() - loaded.files - {0, 1, 2, ready}:  # as Popen's close_fds
        try:
            os.close(fd)
        except OSError:  # the listing's own descriptor, closed already
            pass
    _own_exit_handlers()
    signal.set_wakeup_fd(-1)
    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGCHLD, signal.SIGALRM):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if cwd is not None:
        os.chdir(cwd)
    os.environ.clear()
    os.environ.update(Handoff.from_environ(env).replace(torch_loaded_with=loaded.env).environ(env))
    script = os.path.abspath(script)
    _fresh_modules(script, env, loaded.pythonpath)
    sys.argv = [script, *argv]
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdin = open(0, closefd=False, encoding="utf-8")  # noqa: SIM115
    sys.stdout = _text_stream(1, unbuffered, "strict")
    sys.stderr = _text_stream(2, True, "backslashreplace")

    os.close(ready)
    code = _exit_code(lambda: runpy.run_path(script, run_name="__main__"))
    threading._shutdown()  # as the interpreter does at exit: wait for threads that are not daemons
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code < 0:  # died of a signal (an uncaught KeyboardInterrupt): die of it again
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def _become(new_session, die_with_parent, name, netns):
    """The child's process of its own: network namespace, session, the parent's death, its name."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if netns:
        fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"cannot enter network namespace {netns}")
        os.close(fd)
    if new_session:
        os.setsid()
    if die_with_parent:
        libc.prctl(PR_SET_PDEATHSIG, die_with_parent)
    if name:
        libc.prctl(PR_SET_NAME, name.encode()[:15])


def _own_exit_handlers():
    """The parent's exit handlers are the parent's (a driver's temporary folder, say): the child's
    exit runs only its own, and logging's flush, which every Python process runs."""
    atexit._clear()
    for finalizer in list(weakref.finalize._registry):
        finalizer.detach()
    weakref.finalize._registered_with_atexit = False  # the child's own finalizers register afresh
    atexit.register(logging.shutdown)


def _fresh_modules(script, env, loaded_pythonpath):
    """sys.path as `python SCRIPT` would have it, and no module from outside the Python installation
    (the repository's) left loaded: the script imports its own afresh."""
    loaded_paths = [p for p in loaded_pythonpath.split(os.pathsep) if p]
    base = [p for p in sys.path[1:] if p not in loaded_paths]
    sys.path[:] = [os.path.dirname(script), *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p), *base]
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if path and not any(part in path for part in LIBRARIES):
            del sys.modules[name]


def _text_stream(fd, write_through, errors):
    raw = io.FileIO(fd, "w", closefd=False)
    binary = raw if write_through else io.BufferedWriter(raw)
    return io.TextIOWrapper(
        binary, encoding="utf-8", errors=errors, write_through=write_through, line_buffering=os.isatty(fd)
    )


def _exit_code(run):
    """What `python SCRIPT` exits with; negative: the signal it dies of."""
    try:
        run()
        return 0
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code & 0xFF
        print(e.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        traceback.print_exc()
        return -signal.SIGINT
    except BaseException:
        traceback.print_exc()
        return 1


class Child:
    """A forked child of this process, handled like a subprocess.Popen without pipes."""

    def __init__(self, pid, args):
        self.pid, self.args, self.returncode = pid, args, None
        self.stdin = self.stdout = self.stderr = None

    def poll(self):
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig):
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)
