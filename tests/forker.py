"""The tests' process starter: `python SCRIPT ...` forked from a server that has loaded torch once.

    popen(argv, **popen_args)   like subprocess.Popen; a Python script is forked from the server

The suite starts some 450 processes that load torch, at about 3 s of CPU each on a 2-core machine:
more than half of its time. Each pytest worker has a server (started at its first use, gone with
the worker; one for each set of values of the variables torch reads at load) that loads torch and
forks every `python SCRIPT` a test starts (utils/fork.py: the
child runs the script as `python SCRIPT` would, in a session of its own if asked, with its own
environment, folder and streams). The handle is a real process's: its pid, signals, process group
and exit code are the child's own; the server reaps it and passes its exit code on through a pipe.

Anything else (another program, `python -c`, a Popen option this does not know, or an environment
that torch would load differently: utils.fork.forkable) is started by subprocess.Popen as before.
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

from utils import fork

KNOWN = {"stdin", "stdout", "stderr", "text", "env", "cwd", "start_new_session", "netns"}
SETS_LOG_LEVEL = ("train.py",)  # scripts that set TORCH_CPP_LOG_LEVEL=FATAL themselves before torch loads
_servers = {}  # the variables read at load -> (server process, socket, its environment)
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
    if os.path.basename(script) in SETS_LOG_LEVEL:
        env.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    if (
        os.environ.get("RING_TEST_FORK") == "0"
        or set(kwargs) - KNOWN
        or argv[0] != sys.executable
        or not script.endswith(".py")
        or not os.path.isfile(script)
        or not fork.forkable(env, _server(env)[1])
    ):
        return subprocess.Popen(["ip", "netns", "exec", netns, *argv] if netns else argv, **kwargs)
    kwargs.pop("env", None)
    return Forked(argv, script, argv[script_at + 1 :], env, netns=netns, **kwargs)


def _server(env):
    """(socket, environment) of this worker's server whose torch loaded with what `env` has of the
    variables read at load (utils.fork.AT_LOAD); started at the first call for such an environment."""
    at_load = {n: v for n, v in env.items() if n.startswith(fork.AT_LOAD) and n not in fork.OWN}
    with _lock:
        proc, sock, loaded = _servers.get(tuple(sorted(at_load.items())), (None, None, None))
        if proc is None or proc.poll() is not None:
            loaded = {n: v for n, v in os.environ.items() if not n.startswith(fork.AT_LOAD) or n in fork.OWN}
            loaded.pop("OMP_NUM_THREADS", None)
            loaded.update(at_load)
            sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            serving = [sys.executable, __file__, str(theirs.fileno())]
            proc = subprocess.Popen(serving, pass_fds=[theirs.fileno()], env=loaded)
            theirs.close()
            atexit.register(proc.kill)
            _servers[tuple(sorted(at_load.items()))] = (proc, sock, loaded)
        return sock, loaded


class Forked:
    """A process forked by the server, handled like the subprocess.Popen it stands for."""

    def __init__(
        self,
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
        }
        server = _server(env)[0]
        with _lock:
            socket.send_fds(server, [json.dumps(request).encode()], [*fds, status_write])
            reply = server.recv(64)
        for fd in ends:
            os.close(fd)
        if not reply or reply == b"-":
            raise OSError(f"the tests' fork server could not start {script}")
        self.pid = int(reply)

    def poll(self):
        if self.returncode is None and select.select([self._status], [], [], 0)[0]:
            self._read_status()
        return self.returncode

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

    def send_signal(self, sig):
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)

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
    libc.prctl(fork.PR_SET_PDEATHSIG, signal.SIGKILL)  # gone with the pytest worker
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
                return  # the pytest worker is gone
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


if __name__ == "__main__":
    serve(int(sys.argv[1]))
