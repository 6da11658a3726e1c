"""Watching a job's ranks on other servers from the terminal that started them (train.py --hosts).

    follow_all(ssh, places, started, lines)   a RemoteRank per rank, for launch.supervise to watch
    Lines()                                   how their lines are shown: with host and rank; the resume command once
    StartWindow(...)                          while the job forms, a rank that fails stops the others

Each server's ranks are followed over one ssh (utils/setup/on_server.py `follow`): their new log
lines and, once written, their exit codes; a lost connection is made again from where it broke off.
Watching never ends the job: RemoteRank.kill() only stops watching.
"""

import subprocess
import threading
import time

from utils.elastic import status
from utils.setup.process import say

RECONNECT_SECONDS = 5.0


class StartWindow:
    """For supervise's while_running: until every rank is in the job (its members answer --status's
    question) or `seconds` have passed, a rank that fails stops the others at once (SIGKILL): a
    server that dies while the job starts leaves nothing running on the others."""

    def __init__(self, world, where, secret, seconds, stop_all, prog):
        self.world, self.stop_all, self.prog = world, stop_all, prog
        self.ends = time.monotonic() + seconds
        self.formed = threading.Event()
        if secret is not None:
            host, port = where.rsplit(":", 1)
            threading.Thread(target=self._ask, args=(host.strip("[]"), int(port), secret), daemon=True).start()

    def _ask(self, host, port, secret):
        while not self.formed.is_set() and time.monotonic() < self.ends:
            found = status.ask(host, port, secret, seconds=2.0)
            if found is not None and len(found[-1].members) >= self.world:
                self.formed.set()

    def __call__(self, ranks):
        if self.formed.is_set() or time.monotonic() > self.ends:
            return
        failed = next((r for r in ranks if r.poll() not in (None, 0)), None)
        if failed is not None:
            self.formed.set()  # (once)
            say(f"{self.prog}: rank {failed.rank} failed while the job started; stopping the others")
            self.stop_all()


class Lines:
    """The ranks' lines as the launcher shows them: each with its host and rank, and the command that
    resumes the job (every stopped rank ends its line with it) kept for one line of its own at the end."""

    RESUME = "; to resume: "

    def __init__(self):
        self.resume = None

    def show(self, host, rank, text):
        text, _, command = text.partition(self.RESUME)
        self.resume = command or self.resume
        say(f"[{host} rank {rank}] {text}")


def follow_all(ssh, places, started, lines):
    """A RemoteRank for every rank: what supervise watches."""
    ranks = []
    for place in places:
        follower = Follower(ssh, place, {r: started[r] for r in place.ranks}, lines)
        ranks += [RemoteRank(follower, r) for r in place.ranks]
    return ranks


class Follower:
    """One server's ranks, followed over ssh (on_server `follow`): their lines, printed with the
    host, and their exit codes. A lost connection is made again from where it broke off."""

    def __init__(self, ssh, place, offsets, lines):
        self.ssh, self.place, self.offsets, self.codes, self.lines = ssh, place, dict(offsets), {}, lines
        self.closed, self.proc = False, None
        self.lock = threading.Lock()
        threading.Thread(target=self._follow, name=f"follow-{place.host}", daemon=True).start()

    def _follow(self):
        lost = False
        while not self.closed and len(self.codes) < len(self.offsets):
            left = {str(r): o for r, o in self.offsets.items() if r not in self.codes}
            argv = self.ssh.on(self.place.host, self.place.folder, self.place.pythons, "follow", {"ranks": left})
            with self.lock:
                if self.closed:
                    return
                self.proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            for line in self.proc.stdout:
                self._take(line.decode(errors="replace").rstrip("\n"))
                lost = False
            self.proc.wait()
            if len(self.codes) < len(self.offsets) and not self.closed:
                if not lost:
                    say(f"train.py: lost contact with {self.place.host}; its ranks go on; trying again")
                lost = True
                time.sleep(RECONNECT_SECONDS)

    def _take(self, line):
        """One line of on_server `follow`, checked before it is used."""
        kind, _, rest = line.partition(" ")
        rank, _, rest = rest.partition(" ")
        if not rank.isdigit() or int(rank) not in self.offsets:
            return
        rank = int(rank)
        if kind == "E" and rest.lstrip("-").isdigit():
            self.codes[rank] = int(rest)
        elif kind == "L":
            offset, _, text = rest.partition(" ")
            if offset.isdigit():
                self.offsets[rank] = int(offset)
                self.lines.show(self.place.host, rank, text)

    def close(self):
        with self.lock:
            self.closed = True
            if self.proc is not None and self.proc.poll() is None:
                self.proc.kill()


class RemoteRank:
    """A rank on a server, as supervise watches a process: its exit code once its server's follower
    has seen it; kill() only stops watching (the job is not the launcher's to end)."""

    pid = stdout = stderr = None

    def __init__(self, follower, rank):
        self.follower, self.rank = follower, rank

    @property
    def returncode(self):
        return self.follower.codes.get(self.rank)

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        return self.returncode

    def kill(self):
        self.follower.close()

    def send_signal(self, sig):
        place = self.follower.place
        request = {"ranks": [self.rank], "signal": int(sig)}
        subprocess.Popen(
            self.follower.ssh.on(place.host, place.folder, place.pythons, "signal", request),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
