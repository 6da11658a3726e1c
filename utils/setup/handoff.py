"""What one process of a job hands the next one it starts: one typed message in RING_HANDOFF.

    handoff = Handoff.from_environ(environ)     what this process was handed (defaults: started by hand)
    env = handoff.replace(restarts=2).environ(base)   the environment of the process it starts

A server's training process is started by hand (or systemd), by its keeper (--restart, utils/setup/keeper.py),
by itself afresh when it lost the job (utils/setup/lifecycle.py), or by the local launcher (utils/setup/launch.py),
and its ranks may be forked from a process that loaded torch (utils/setup/fork.py). Each of them tells
the next process a few facts: they travel together as one JSON object in one variable, read in one
place and checked there (a malformed one is one line and exit 2, as any bad input). A child inherits its
parent's handoff, as it inherits the rest of the environment; who starts a process changes only its own fields.
"""

import dataclasses
import json
import math
import os
from dataclasses import dataclass

from utils.errors import UsageError

VARIABLE = "RING_HANDOFF"
MAX_TEXT = 65536  # a handoff is a few hundred bytes: more is not one of ours
MAX_COUNT = 10**9  # restarts and rejoins: counts, never near this (--status shows them)


@dataclass(frozen=True)
class Handoff:
    keeper_pipe: int | None = None  # the pipe to this process's keeper (keeper.trained() writes a byte into it)
    restarts: int = 0  # the keeper's restarts of this server's training so far (heartbeats carry it: --status)
    out_since: float | None = None  # when this server left its job (time.time()): its heal line says how long
    rejoins: int = 0  # how many times this server waited for its job to take it back (--status)
    rejoin_until: float | None = None  # a server that lost its job waits for it until then (time.time())
    launched_locally: bool = False  # a rank of the local launcher, not a server's own command
    resume_command: str | None = None  # the command that resumes the job (the local launcher's, not a rank's)
    job_pid: int | None = None  # the pid that stands for the job in its lock file (the local launcher's)
    torch_loaded_with: dict | None = None  # a forked process's torch loaded with these variables (fork.AT_LOAD)
    threads_from_launcher: bool = False  # OMP_NUM_THREADS is a launcher's, not the user's (setup/threads.py)

    @classmethod
    def from_environ(cls, environ=os.environ):
        """The handoff in `environ`; the defaults without one. UsageError: one that is not a handoff."""
        text = environ.get(VARIABLE)
        if not text:
            return cls()
        try:
            fields = json.loads(text) if len(text) <= MAX_TEXT else None
        except ValueError:
            fields = None
        if not isinstance(fields, dict):
            raise UsageError(f"malformed {VARIABLE} in the environment: expected a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise UsageError(f"malformed {VARIABLE} in the environment: unknown field {unknown[0]!r}")
        handoff = cls(**fields)
        handoff.check()
        return handoff

    def check(self):
        """UsageError naming the first field whose value is out of its type or range."""
        for name, good in (
            ("keeper_pipe", self.keeper_pipe is None or _whole(self.keeper_pipe, 0, 2**31)),
            ("restarts", _whole(self.restarts, 0, MAX_COUNT)),
            ("out_since", self.out_since is None or _time(self.out_since)),
            ("rejoins", _whole(self.rejoins, 0, MAX_COUNT)),
            ("rejoin_until", self.rejoin_until is None or _time(self.rejoin_until)),
            ("launched_locally", isinstance(self.launched_locally, bool)),
            ("resume_command", self.resume_command is None or isinstance(self.resume_command, str)),
            ("job_pid", self.job_pid is None or _whole(self.job_pid, 1, 2**31)),
            ("torch_loaded_with", self.torch_loaded_with is None or _names_to_texts(self.torch_loaded_with)),
            ("threads_from_launcher", isinstance(self.threads_from_launcher, bool)),
        ):
            if not good:
                said = repr(getattr(self, name))[:100]
                raise UsageError(f"malformed {VARIABLE} in the environment: {name} is {said}")

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    def environ(self, base):
        """`base` (an environment: a mapping) with this handoff in it; without the variable if it is the default."""
        env = {name: value for name, value in base.items() if name != VARIABLE}
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        given = {name: value for name, value in fields.items() if value != _DEFAULTS[name]}
        if given:
            env[VARIABLE] = json.dumps(given, sort_keys=True)
        return env


def _whole(value, low, high):
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < high


def _time(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _names_to_texts(value):
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Handoff)}
