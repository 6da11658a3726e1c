"""--balance's lean (utils/balance.py): the shares solved with slower ranks as slower still
(leaned_codes), by the lean that rank 0 finds makes a whole step shortest (LeanSearch)."""

import statistics

LEAN_STEPS = 8  # a lean of 8 solves a rank at half the fastest's rate as if at a quarter of it
MAX_LEAN = 8  # leans go from 0 (equal own times) to this
SEARCH = 10  # steps of rank 0's timing in each measure of a lean
FIRST_TRIES = 2  # notches of a new lean search's tries, each measured over one review's steps, until one is no shorter
MARGIN = 0.02  # a try of a lean must make a step shorter by more than this to be kept
QUIET = 3  # measures at the best lean before rank 0 tries the other way


def leaned_codes(rate_codes, lean):
    """The rate codes the shares are solved with: each rank's drawn away from the fastest's by
    lean/LEAN_STEPS of the distance between them. Codes are a log scale, so a rank at half the
    fastest's rate is solved as if at 2**-(1 + lean/LEAN_STEPS) of it."""
    top = max(rate_codes)
    return [max(1, c - (lean * (top - c) + LEAN_STEPS // 2) // LEAN_STEPS) for c in rate_codes]


class LeanSearch:
    """Rank 0's search for the lean that makes a step shortest, on its own clock; the lean it
    settles on rides with the sums (Balance.slots), so every rank solves with the same one.

    Equal own times are not always the shortest step: a rank that has used up its CPU quota by
    the time the sum reaches it stalls in the middle of the sum, and every rank waits (measured:
    bench/README.md). So every SEARCH steps rank 0 looks at how long the last ones took (their
    median): it tries one lean further toward the faster ranks, and keeps going while each try
    is shorter than the lean it came from by more than MARGIN; a try that is not shorter is taken
    back. After QUIET looks it tries again, the other way (so a change of speeds, or of what the
    stalls cost, is found again). Never below 0: the measure's one known error leans one way,
    and a slow rank given more than it can carry is the costly mistake (every step waits for it).

    A new search (the ranks' speeds just parted) goes in strides of FIRST_TRIES notches, each
    measured over the steps between two reviews, until a try is no shorter: up from 0, or down
    from utils/balance.py's PARTED_LEAN after a slowdown (Balance.review). One notch every SEARCH
    steps took 20-80 steps for the last images of a slowdown.
    """

    def __init__(self, review):
        self.review = review  # steps between two reviews of the shares (utils/balance.py's REVIEW)
        self.held = True  # the ranks' speeds are too close for a lean (hold), or not known yet
        self.begin()

    def begin(self, lean=0):
        """A search from `lean` in quick strides: up from 0, down from any other."""
        self.best, self.trying, self.direction, self.quiet = lean, None, 1 if lean == 0 else -1, 0
        self.quick = True  # tries of FIRST_TRIES notches at every review, until one is no shorter
        self.best_seconds = None  # a step at the best lean, as last measured
        self.window = None  # the clock after the review's step, then after each step since

    @property
    def lean(self):
        """The lean to send with the next sums."""
        return self.best if self.trying is None else self.trying

    @property
    def every(self):
        """Steps between two decisions: a review's in the quick strides, then SEARCH."""
        return self.review if self.quick else SEARCH

    def timed(self, step, clock):
        """After each step: every `every` steps, decide from the steps since the last decision
        (all at the same shares, and the lean being tried), by their median (a step that saved a
        checkpoint or evaluated says nothing of the shares)."""
        if step % self.every == 0:
            self.window = [clock]
        elif self.window is not None:
            self.window.append(clock)
            if step % self.every == self.every - 1:
                self.decide(statistics.median(b - a for a, b in zip(self.window, self.window[1:])))
                self.window = None

    def disturbed(self, step):
        """The shares changed after `step`: the steps measured so far say nothing of the lean."""
        if step % self.every != 0:
            self.window = None

    def hold(self, held, restart=None):
        """At a review: whether the ranks' rates are within LEAN_FROM codes of each other. Then no
        lean (0) and no search: between ranks of about equal speed a lean is steered by the noise
        of the step times and of the rates (measured: on equal servers it wandered to 37:27 and
        cost 6%, bench/README.md). Once they part, a search starts afresh from 0; and from
        `restart` when a change of speed moved them apart or together (Balance.review: the lean
        every rank solved with at that look)."""
        if held and not self.held:
            self.begin()
        elif restart is not None:
            self.begin(restart)
        self.held = held

    def moved_nothing(self, lean):
        """The lean being tried did not move the shares (speeds too close for it): no try; the
        best lean again, and another try after a while. (So the lean does not wander on noise
        while the ranks are equal, to strike when one slows down.)"""
        if self.trying == lean:
            self.trying, self.quiet = None, QUIET

    def decide(self, seconds):
        """The window just measured took `seconds` a step at self.lean: the next lean."""
        stride = FIRST_TRIES if self.quick else 1
        if self.trying is None:
            self.best_seconds = seconds  # speeds drift: the best lean's time is refreshed
            if self.quiet > 0:
                self.quiet -= 1
                return
            if not 0 <= self.best + self.direction <= MAX_LEAN:
                self.direction = -self.direction
            self.trying = min(MAX_LEAN, max(0, self.best + stride * self.direction))
        elif seconds < self.best_seconds * (1 - MARGIN):  # shorter: keep going that way
            self.best, self.best_seconds = self.trying, seconds
            further = min(MAX_LEAN, max(0, self.trying + stride * self.direction))
            self.trying = further if further != self.trying else None
            if self.trying is None:
                self.quick = False
        else:  # no better: back, and the other way after a while, one notch at a time from now on
            self.trying, self.direction, self.quiet, self.quick = None, -self.direction, QUIET, False
