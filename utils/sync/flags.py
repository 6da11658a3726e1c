"""What a step's sum carries beside the gradient: stop signals, a server waiting to join, a
non-finite loss, and --balance's speeds. No message of their own: whole numbers in the tail of
the last bucket's buffer, summed with it, so every rank reads the same flags after the same step.

    tail[0]      the ranks that got a stop signal, plus JOIN while the leader has a server waiting;
                 NaN from a rank whose loss was not finite (NaN or inf)
    tail[1 + r]  --balance: rank r's speed code (utils/balance/shares.py); every other rank puts 0 there

A NaN needs no slot of its own: whatever the others add, a sum with one NaN in it is NaN, in every
wire format, so one rank's non-finite loss reaches every rank with the step's sum (and stops the
job there: utils/run.py); the signals and the join of that step are drowned in it, and moot.

Every wire format must carry these sums exactly, and bfloat16, the narrowest, holds the whole
numbers up to 256. Hence the limits: JOIN is 128, so at most MAX_RANKS = 127 ranks can signal
at once and still read apart from a join (checked where a world size is set: utils/setup/config.py,
and by the leader when a server asks to join), and a speed code is at most MAX_SPEED = 255. The
compressors (utils/comm/compress.py) see the tail only as its length: `extras` values that travel
unscaled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

EXACT = 256  # whole numbers up to this are exact in bfloat16
JOIN = 128  # tail[0]'s part that says a server waits to join
MAX_RANKS = JOIN - 1  # ranks in a job: each may add 1 to tail[0] for its signal
MAX_SPEED = EXACT - 1  # a speed code, alone in its slot


@dataclass(frozen=True)
class Flags:
    """This rank's flags (values(): the tail it adds to the sum), or every rank's summed (from_sums)."""

    signalled: int = 0  # ranks that got a stop signal (SIGTERM, SIGINT, SIGUSR1)
    joining: bool = False  # the leader has a server waiting to join (utils/elastic/growth.py)
    speeds: tuple[int, ...] = ()  # --balance: each rank's speed code (utils/balance/shares.py); () without
    not_finite: bool = False  # a rank's loss was NaN or inf

    @property
    def stopping(self) -> bool:
        return self.signalled > 0

    @property
    def interrupting(self) -> bool:
        """The epoch's steps end after this one: a stop, a server waiting to join, a non-finite loss."""
        return self.signalled > 0 or self.joining or self.not_finite

    def values(self) -> list[float]:
        first = math.nan if self.not_finite else float(self.signalled) + (JOIN if self.joining else 0.0)
        return [first, *map(float, self.speeds)]

    @classmethod
    def from_sums(cls, sums: list[float]) -> Flags:
        if not sums:  # (no sum has carried them yet)
            return cls()
        if math.isnan(sums[0]):
            return cls(speeds=tuple(map(round, sums[1:])), not_finite=True)
        total = round(sums[0])
        return cls(signalled=total % JOIN, joining=total >= JOIN, speeds=tuple(map(round, sums[1:])))


NO_FLAGS = Flags()  # a step with nothing to raise
