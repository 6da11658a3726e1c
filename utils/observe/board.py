"""--tensorboard DIR: rank 0's TensorBoard event files, written by tensorboard's own writer.

    board = Board(folder, resumed_at)    opens the run's event file (torch.utils.tensorboard.SummaryWriter)
    board.scalars(step, {tag: value})    curves: utils/observe/watch.py says which, and when
    board.text(tag, words, step)         a change of members, a re-balance

`tensorboard --logdir DIR` shows them while the job runs: utils/observe/watch.py flushes after each
progress report (ten an epoch), a text, and an epoch (and the writer every FLUSH_SECONDS). A
resume appends to the same DIR: a new event file whose first event purges (purge_step) what an
earlier file holds from the step after the checkpoint's on, so that the steps trained again are
not drawn twice; a run started afresh in the same DIR purges everything before it. tensorboard
is imported only here, only with --tensorboard.
"""

FLUSH_SECONDS = 10


class Board:
    def __init__(self, folder, resumed_at):
        """resumed_at: the global step of the checkpoint this run continues from (0: none)."""
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(folder, purge_step=resumed_at + 1 if resumed_at else 0, flush_secs=FLUSH_SECONDS)

    def scalars(self, step, values):
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def text(self, tag, words, step):
        self.writer.add_text(tag, words, step)
        self.writer.flush()

    def flush(self):
        self.writer.flush()

    def close(self):
        self.writer.close()
