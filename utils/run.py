"""Training: the epoch loop, one step at a time, with the gradients summed over the ring.

    train_step()    one step: forward, loss.backward(), the ring sum, optimizer.step()
    train_steps()   the epoch's steps left: one call per concern after each (utils/learn/callbacks.py)
    train_epochs()  the epochs left: their steps, then rank 0 evaluates, reports and saves
    run()           the epochs, inside the elastic wrapper (utils/elastic/recovery.py), then the end
    test_model()    accuracy on the test images

What one rank's run holds is a utils.learn.training.Trainer: the training state (utils/learn/state.py:
model, optimizer, schedule, position), the gradient sum and its DistributedOptimizer, the callbacks.
A signal (utils/setup/stop.py) rides with a step's sum as a flag (utils/sync/flags.py), so every
rank learns of it after the same step: rank 0 saves the checkpoint and every rank raises Stopped.
A server waiting to join rides the same way: train_steps returns GROW and the elastic wrapper takes
it in. A lost peer raises PeerError: the wrapper agrees with the survivors and goes on.
A non-finite loss on any rank rides the same way too, in that very step's sum (train_step tells the
sync after the forward): every rank raises NotFinite after it and nothing is saved; a save finds
non-finite parameters itself (utils.learn.training.Checkpointer.gather) and every rank stops there.
"""

import enum
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from utils.errors import NotFinite, PeerError, Stopped, first_line
from utils.learn.callbacks import UNPROBED
from utils.learn.model import Net
from utils.observe.report import epoch_by_rank, stopped_line
from utils.setup.distributed import check_identical_parameters
from utils.store import checkpoint


class Ended(enum.Enum):
    """How an epoch's steps ended."""

    EPOCH = "the epoch's last step"
    STOP = "a signal: stop after this step"
    GROW = "a server waits to join"
    NOT_FINITE = "a rank's loss was NaN or inf"


def train_step(model, images, labels, gradient_sum, optimizer, probe=UNPROBED):
    """One training step on `images`, as the original draws it: forward, loss.backward(), the ring
    sum, optimizer.step(). Returns the loss (a float), before the step; a non-finite one is told to
    the sum, before any of it starts, so that it rides with it to every rank. gradient_sum: a
    utils.sync GradientSync; optimizer: its DistributedOptimizer; probe: what times and draws the step."""
    with probe.step(len(images)):
        with probe.span("forward"):
            loss = F.cross_entropy(model(images), labels)
        value = loss.item()
        if not math.isfinite(value):
            gradient_sum.not_finite()
        with probe.span("backward"):
            loss.backward()
        probe.computed()
        gradient_sum.sum()  # every rank's gradients added up over the ring, divided by N (overlap: under way)
        optimizer.step()  # Adam and the learning rate's schedule, when this kind of sum calls for them
    return value


def train_steps(trainer):
    """The steps left of the state's epoch, each followed by one call to every concern. Returns
    how they ended (Ended)."""
    state, sync, (images, labels) = trainer.state, trainer.sync, trainer.data[:2]
    batches, callbacks = trainer.batches(state.position.epoch), trainer.callbacks
    trainer.model.train()
    callbacks.epoch_begins(state, len(batches))
    first = step = state.position.step
    try:
        for step in range(first + 1, len(batches) + 1):
            batch, weight, size = batches[step - 1]
            callbacks.step_begins(state, step)
            sync.begin(weight, callbacks.flags())  # this rank's share, times N, and its flags ride along
            loss = train_step(trainer.model, images[batch], labels[batch], sync, trainer.optimizer, callbacks.probe)
            state.stepped(step, loss, len(batch), size)  # done: where a lost peer goes on from
            flags = sync.flags()  # the same on every rank
            callbacks.step_ends(state, step, flags)
            if flags.interrupting:
                return Ended.NOT_FINITE if flags.not_finite else Ended.STOP if flags.stopping else Ended.GROW
        return Ended.EPOCH
    except PeerError as e:
        raise e.where(f"(epoch {state.position.epoch}, step {step})") from None
    finally:
        callbacks.steps_end(state)


def train_epochs(trainer):
    """Every epoch from the state's position to the last. Returns Ended.GROW when a server waits to
    join (the elastic wrapper takes it in and calls again), Ended.EPOCH at the end."""
    state, epochs = trainer.state, trainer.config.recipe.epochs
    trainer.callbacks.training_goes_on(state)
    while state.position.epoch <= epochs:
        ended = train_steps(trainer)
        if ended == Ended.GROW:
            return ended
        if ended != Ended.EPOCH:
            raise stop(trainer) if ended == Ended.STOP else not_finite(trainer.state)
        end_epoch(trainer, final=state.position.epoch == epochs)
    return Ended.EPOCH


def stop(trainer):
    """After a step whose flags said stop: rank 0 saves, and every rank says where (a collective)."""
    epoch, step = trainer.state.position.epoch, trainer.state.position.step
    trainer.checkpointer.save(trainer.state)
    trainer.timeline.write()
    line = stopped_line(epoch, step, trainer.steps_per_epoch, trainer.config.outputs.checkpoint)
    return Stopped(line)


def not_finite(state):
    """After a step whose flags said a loss was not finite: where, and whose (this rank's or another's)."""
    position, own = state.position, state.stats.loss_sum
    whose = f"this rank's: {own}" if not math.isfinite(own) else "another rank's"
    return NotFinite(f"the loss turned non-finite at epoch {position.epoch}, step {position.step} ({whose})")


def end_epoch(trainer, final):
    """After an epoch's last step: every rank looks that nothing is non-finite (Checkpointer.check_finite);
    rank 0 evaluates, reports and saves the model; the checkpoint of the next epoch's start. final:
    the last epoch (every rank's last changes in: --sync-every)."""
    state, epoch = trainer.state, trainer.state.position.epoch
    try:
        state.settle(final)
    except PeerError as e:
        where = "at the end of training" if final else f"while summing gradients (epoch {epoch}, last step)"
        raise PeerError(f"lost a peer {where}: {e}", e.outcome) from None
    ranks = epoch_by_rank(state.stats)
    try:
        trainer.checkpointer.check_finite(state)  # NotFinite on every rank, before anything is written
        if dist.get_rank() == 0:
            with trainer.timeline.span("evaluate"):
                trainer.accuracy = test_model(trainer.model, *trainer.data[2:])
            trainer.report.epoch(state, trainer.accuracy, ranks)
            checkpoint.save_model(trainer.model, trainer.config.outputs.save_path)
        state.next_epoch()
        trainer.checkpointer.write(state, trainer.checkpointer.gather(state))
    except PeerError as e:
        raise e.where(f"after epoch {epoch}") from None


def run(trainer, elastic):
    """Train every epoch left, inside `elastic` (utils.elastic.recovery: a lost peer costs at most
    the step in flight; or NOT_ELASTIC), then prove every rank holds the same parameters. Returns
    the last epoch's test accuracy (rank 0; None elsewhere)."""
    elastic.run(lambda: train_epochs(trainer))
    trainer.timeline.write()  # if the run ended inside the window
    try:  # also a barrier: nobody reports success before rank 0 has saved
        digest = check_identical_parameters(trainer.model)
    except RuntimeError as e:
        raise PeerError(f"lost a peer at the end of training: {first_line(e)}") from None
    if dist.get_rank() == 0:
        print(
            f"saved the model to {trainer.config.outputs.save_path}; parameters identical on all "
            f"{dist.get_world_size()} ranks (sha256 {digest})",
            flush=True,
        )
    trainer.close()
    return trainer.accuracy


TEST_BATCH = 200  # images a test batch (why 200: bench/compute/NOTES.md)


@torch.no_grad()
def test_model(model, images, labels, batch_size=TEST_BATCH):
    """Fraction of `images` classified correctly."""
    model.eval()
    correct = sum(
        (model(x).argmax(1) == y).sum().item() for x, y in zip(images.split(batch_size), labels.split(batch_size))
    )
    return correct / len(labels)


def evaluate(config, data):
    """train.py --eval: the test accuracy of --model_path."""
    model = Net(config.recipe.precision)
    checkpoint.load_model_state(model, config.job.model_path)
    accuracy = test_model(model, data[2], data[3])
    print(f"test accuracy {accuracy:.2%} ({config.job.model_path}, {len(data[3])} images)")
