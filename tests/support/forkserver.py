"""A fork server: a process that loads torch once and forks the Python scripts it is asked for.

    server = ForkServer(env)        start one; torch loads with `env` (its AT_LOAD variables)
    server.popen(argv, ...)         like subprocess.Popen(argv, ...) for argv `python [-u] SCRIPT ...`
    server.close()

The server is started afresh, so it has never run torch and can fork safely (utils/setup/fork.py); it
is single-threaded, gone with its parent, and passes each child's exit code on through a pipe, so
that the handle (Forked) is a real process's: its pid, signals, process group and exit code are
the child's own. The tests use one per pytest worker (tests/support/forker.py), the benchmarks one per
driver for their loopback workers (bench/common/harness.py).
"""

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading

from utils.setup import fork

HERE = os.path.dirname(os.path.abspath(__file__))  # tests/support: this module
REPO = os.path.dirname(os.path.dirname(HERE))
SERVE = "import sys; from forkserver import serve; serve(int(sys.argv[1]))"


class ForkServer:
    """A server process whose torch loaded with `env`: it forks children whose variables read at
    load (OMP_NUM_THREADS among them) are the same (fork.forkable(child_env, server.env))."""

    def __init__(self, env):
        paths = [REPO, HERE, *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p not in ("", REPO, HERE))]
        self.env = dict(env, PYTHONPATH=os.pathsep.join(paths))  # where the server finds utils/ and this module
        self.lock = threading.Lock()
        self.socket, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        serving = [sys.executable, "-c", SERVE, str(theirs.fileno())]
        self.process = subprocess.Popen(serving, pass_fds=[theirs.fileno()], env=self.env)
        theirs.close()
        atexit.register(self.close)

    def alive(self):
        return self.process.poll() is None

    def popen(self, argv, **kwargs):
        """subprocess.Popen(argv, **kwargs) for argv = `python [-u] SCRIPT ARGS`, forked here; also
        netns=NAME: in that network namespace; name=NAME: what `top` calls it. The caller checks
        fork.forkable(env, self.env)."""
        argv = [str(a) for a in argv]
        unbuffered = argv[1] == "-u"
        env = kwargs.pop("env", None)
        env = dict(os.environ if env is None else env)
        if unbuffered:
            env["PYTHONUNBUFFERED"] = "1"
        script_at = 2 if unbuffered else 1
        return Forked(self, argv, argv[script_at], argv[script_at + 1 :], env, **kwargs)

    def close(self):
        self.process.kill()
        self.process.wait()
        self.socket.close()


class Forked(fork.Child):
    """A process forked by a ForkServer, handled like the subprocess.Popen it stands for (its exit
    code comes from the server, which reaps it)."""

    def __init__(
        self,
        server,
        args,
        script,
        argv,
        env,
        stdin=None,
        stdout=None,
        stderr=None,
        text=False,
        cwd=None,
        start_new_session=False,
        netns=None,
        name=None,
    ):
        self.args, self.returncode = args, None
        ends, mine = [], []  # the child's ends (sent, then closed here) and ours

        def stream(spec, fd, reading):
            if spec is None:
                return fd, None
            if spec == subprocess.DEVNULL:
                end = os.open(os.devnull, os.O_RDWR)
                ends.append(end)
                return end, None
            if spec == subprocess.PIPE:
                read, write = os.pipe()
                child_end, our_end = (read, write) if reading else (write, read)
                ends.append(child_end)
                return child_end, open(our_end, "w" if reading else "r", encoding="utf-8") if text else open(
                    our_end, "wb" if reading else "rb", buffering=0 if reading else -1
                )
            if spec == subprocess.STDOUT:
                return -2, None
            return (spec if isinstance(spec, int) else spec.fileno()), None

        fds = []
        for target, spec in enumerate((stdin, stdout, stderr)):
            fd, handle = stream(spec, target, reading=target == 0)
            fds.append(fd)
            mine.append(handle)
        if fds[2] == -2:
            fds[2] = fds[1]
        self.stdin, self.stdout, self.stderr = mine
        self._status, status_write = os.pipe()
        ends.append(status_write)
        request = {
            "script": script,
            "argv": argv,
            "env": env,
            "cwd": os.fspath(cwd or os.getcwd()),
            "session": start_new_session,
            "netns": netns,
            "name": name,
        }
        with server.lock:
            socket.send_fds(server.socket, [json.dumps(request).encode()], [*fds, status_write])
            reply = server.socket.recv(64)
        for fd in ends:
            os.close(fd)
        if not reply or reply == b"-":
            raise OSError(f"the fork server could not start {script}")
        self.pid = int(reply)

    def poll(self):
        if self.returncode is None and select.select([self._status], [], [], 0)[0]:
            self._read_status()
        return self.returncode

    def send_signal(self, sig):
        # The server reaps the child before its exit code reaches us, so between the two the pid is
        # gone while poll() still says running: that is an exit, not an error.
        try:
            super().send_signal(sig)
        except ProcessLookupError:
            pass

    def _read_status(self):
        said = b""
        while chunk := os.read(self._status, 64):
            said += chunk
        os.close(self._status)
        self.returncode = int(said) if said else -signal.SIGKILL  # no word: the server died with it

    def wait(self, timeout=None):
        if self.returncode is None:
            if not select.select([self._status], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read_status()
        return self.returncode

    def communicate(self, input=None, timeout=None):
        if input is not None:
            self.stdin.write(input)
        if self.stdin is not None:
            self.stdin.close()
        parts = {}
        readers = [
            threading.Thread(target=lambda n=n, s=s: parts.__setitem__(n, s.read()), daemon=True)
            for n, s in (("out", self.stdout), ("err", self.stderr))
            if s is not None
        ]
        for reader in readers:
            reader.start()
        self.wait(timeout)
        for reader in readers:
            reader.join()
        return parts.get("out"), parts.get("err")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for s in (self.stdin, self.stdout, self.stderr):
            if s is not None:
                s.close()
        self.wait()


def serve(fd):
    """The server: load torch, then fork what is asked and pass each child's exit code on."""
    libc = __import__("ctypes").CDLL("libc.so.6", use_errno=True)
    libc.prctl(fork.PR_SET_PDEATHSIG, signal.SIGKILL)  # gone with the process it serves
    loaded = fork.preload()
    server = socket.socket(fileno=fd)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    status = {}  # pid -> the pipe its exit code goes to
    while True:
        ready = select.select([server, wake_read], [], [], 1.0)[0]
        if wake_read in ready:
            os.read(wake_read, 4096)
        while True:
            try:
                pid, code = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if not pid:
                break
            if pid in status:
                end = status.pop(pid)
                os.write(end, str(os.waitstatus_to_exitcode(code)).encode())
                os.close(end)
        if server in ready:
            message, fds, _, _ = socket.recv_fds(server, 1 << 20, 4)
            if not message:
                return  # the process it serves is gone
            stdio, status_write = fds[:3], fds[3]
            try:
                request = json.loads(message)
                pid = fork.start(
                    loaded,
                    request["script"],
                    request["argv"],
                    request["env"],
                    request["cwd"],
                    stdio,
                    new_session=request["session"],
                    netns=request["netns"],
                    name=request["name"],
                )
            except Exception as e:  # a bad request fails its test, not the server
                print(f"forker: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                os.close(status_write)
                pid = "-"
            else:
                status[pid] = status_write
            for end in set(stdio):
                if end > 2:
                    os.close(end)
            server.send(str(pid).encode())
