"""What a rank shows those who watch the job while it runs: its progress, and rank 0's curves.

    watch = Watch(record, board, lr)       utils/run.py makes one per rank
    watch.begin(epoch, stats)              before an epoch's steps (or what is left of them)
    watch.step(epoch, step, steps, ...)    after every step: cheap (no system call)
    watch.members(ids, at, rank_0)         the members at each start of training (a change: noted)
    watch.rebalanced(at, shares)           --balance moved the shares
    watch.epoch(at, accuracy, bytes)       rank 0, after an epoch's evaluation: the losses reported

The record (utils/elastic/status.Record) is what this rank's heartbeats carry, so that any member
answers train.py --status for all. On rank 0, every tenth of an epoch (the plain progress line's
cadence) the mean loss of the steps since the last report goes to metrics.jsonl's `losses` and,
with --tensorboard DIR, with the step time, the share of it spent waiting for communication, the
learning rate and the number of members, to the event files (utils/observe/board.py). The x axis of every
curve is the global step, (epoch - 1) * steps per epoch + step.
"""


def every(steps):
    """A progress report every this many steps of an epoch of `steps` (and at its last step)."""
    return max(1, steps // 10)


class Watch:
    def __init__(self, record, make_board=None, lr=None, reports=False):
        self.record = record  # this rank's utils.elastic.status.Record
        self.make_board = make_board  # --tensorboard: (global step) -> a utils.observe.board.Board, opened by rank 0
        self.board = None
        self.lr = lr  # () -> the learning rate now
        self.reports = reports  # rank 0: the progress reports (metrics.jsonl's losses; the board)
        self.losses = []  # this epoch's [global step, mean loss since the last report]
        self.since = (0.0, 0, 0.0, 0.0)  # loss sum, steps, step and comm seconds at the last report
        self.ids = None

    def begin(self, epoch, stats):
        self.since = (stats.loss_sum, stats.steps, stats.step_seconds, stats.comm_seconds)
        self.losses = [] if not stats.steps else self.losses

    def step(self, epoch, step, steps, own, size, seconds, stats):
        """After `step` of `steps`: this rank took `own` of the step's `size` images in `seconds`;
        stats: the epoch's utils.learn.state.EpochStats so far."""
        self.record.stepped(epoch, step, steps, own, size, seconds, stats.loss_sum / stats.steps)
        if self.reports and (step % every(steps) == 0 or step == steps):
            self.report((epoch - 1) * steps + step, stats)

    def report(self, at, stats):
        loss, count, step_seconds, comm_seconds = self.since
        if stats.steps <= count:
            return
        mean = (stats.loss_sum - loss) / (stats.steps - count)
        self.losses.append([at, mean])
        if self.board is not None and self.reports:
            seconds = stats.step_seconds - step_seconds
            self.board.scalars(
                at,
                {
                    "train/loss": mean,
                    "time/step_seconds": seconds / (stats.steps - count),
                    "time/comm_share": (stats.comm_seconds - comm_seconds) / seconds if seconds > 0 else 0.0,
                    "train/learning_rate": self.lr(),
                    "job/members": len(self.ids or ()),
                },
            )
            self.board.flush()  # (on disk at once: tensorboard shows it, a stop or a crash loses nothing)
        self.since = (stats.loss_sum, stats.steps, stats.step_seconds, stats.comm_seconds)

    def members(self, ids, at, reports):
        """The members' ids when training starts or goes on at global step `at`; a change is noted.
        reports: whether this rank is rank 0 now (it reports; the board is written only then)."""
        ids, self.reports = list(ids), reports
        if reports and self.board is None and self.make_board is not None:  # (the start, or a new rank 0)
            try:
                self.board = self.make_board(at)
            except OSError as e:  # (checked at the start; a survivor that became rank 0 may lack the folder)
                print(f"cannot write the --tensorboard files ({e}); going on without them", flush=True)
            self.make_board = None
        if self.board is not None and reports and ids != self.ids:
            if self.ids is not None:
                lost, joined = [i for i in self.ids if i not in ids], [i for i in ids if i not in self.ids]
                change = [
                    f"{what} {', '.join(map(str, who))}" for what, who in (("lost", lost), ("joined", joined)) if who
                ]
                self.board.text(
                    "job/membership", f"{'; '.join(change)}: {len(ids)} members ({', '.join(map(str, ids))})", at
                )
            self.board.scalars(at, {"job/members": len(ids)})
            self.board.flush()
        self.ids = ids

    def rebalanced(self, at, shares):
        if self.board is not None and self.reports:
            self.board.text("job/rebalance", f"shares {'/'.join(map(str, shares))}", at)

    def epoch(self, at, accuracy, bytes_per_step):
        """Rank 0 after an epoch ending at global step `at`: its evaluation, and the losses reported."""
        losses, self.losses = self.losses, []
        if self.board is not None and self.reports:
            self.board.scalars(at, {"test/accuracy": accuracy, "comm/bytes_per_step": bytes_per_step})
            self.board.flush()
        return losses

    def close(self):
        if self.board is not None:
            self.board.close()
