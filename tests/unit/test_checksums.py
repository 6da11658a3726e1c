"""Nothing read back is trusted blindly (utils/store/checkpoint.py): a checkpoint's digest of its contents
and a model file's digest beside it, bytes flipped inside a tensor refused in one line and the file left
as it was, a file without a digest loaded with one line; the scan for non-finite values; the flag that
carries a non-finite loss (utils/sync/flags.py); the instruments' NaN faults."""

import hashlib
import os

import pytest
import torch
import torch.nn.functional as F
from damage import flip_inside

from utils.errors import Damaged, UsageError
from utils.learn.model import Net
from utils.learn.state import TrainingState
from utils.observe.instruments import environ_for, from_environ, parse
from utils.store import checkpoint
from utils.sync.flags import Flags

SETTINGS = {"model": "Net/421642", "global-batch": 64, "compress": "none"}


def trained_state():
    """A checkpoint dict as TrainingState makes it, after one step (Adam's moments are not zeros)."""
    model = Net()
    optimizer = torch.optim.Adam(model.parameters())
    F.cross_entropy(model(torch.randn(4, 1, 28, 28)), torch.tensor([0, 1, 2, 3])).backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-3, total_steps=10)
    return TrainingState(model, optimizer, scheduler, settings=dict(SETTINGS)).state_dict(world_size=2)


def test_the_digest_covers_every_value_and_survives_a_save():
    state = trained_state()
    digest = checkpoint.digest(state)
    assert checkpoint.digest(dict(reversed(list(state.items())))) == digest  # the keys' order, not insertion's
    saved = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"digest-{os.getpid()}.pt")
    try:
        torch.save(state, saved)
        assert checkpoint.digest(torch.load(saved, weights_only=True)) == digest
    finally:
        os.remove(saved)
    weight = state["model"]["conv1.weight"]  # channels_last: its logical values, not its memory, are hashed
    assert checkpoint.digest({**state, "model": {**state["model"], "conv1.weight": weight.contiguous()}}) == digest
    for changed in (
        {**state, "step": 1},
        {**state, "epoch_stats": {**state["epoch_stats"], "loss_sum": 1e-30}},
        {**state, "rng": state["rng"].clone().bitwise_xor_(torch.arange(len(state["rng"])) == 7)},  # one bit
        {**state, "model": {**state["model"], "fc2.bias": state["model"]["fc2.bias"].double()}},
    ):
        assert checkpoint.digest(changed) != digest
    one_bit = state["model"]["fc1.weight"].clone()
    one_bit.view(-1).view(torch.int32)[1000] ^= 1
    assert checkpoint.digest({**state, "model": {**state["model"], "fc1.weight": one_bit}}) != digest


def test_a_checkpoint_with_a_flipped_tensor_is_refused_and_left_as_it_was(tmp_path):
    path = tmp_path / "c.pt"
    state = trained_state()
    checkpoint.save(state, path)
    assert checkpoint.load(str(path), SETTINGS)["step"] == 0  # whole: it loads, its digest popped
    for name in ("model", "optimizer"):
        tensor = state["model"]["fc1.weight"] if name == "model" else state["optimizer"]["state"][4]["exp_avg_sq"]
        before = flip_inside(path, tensor)
        damaged = path.read_bytes()
        with pytest.raises(Damaged) as refused:
            checkpoint.load(str(path), SETTINGS)
        line = str(refused.value)
        assert "\n" not in line and f"checkpoint {path} is damaged" in line, line
        assert f"its digest says sha256 {checkpoint.digest(state)[:16]}" in line and "nothing was loaded" in line
        assert path.read_bytes() == damaged  # left as it was
        path.write_bytes(before)
    assert isinstance(refused.value, UsageError)  # exit code 2


def test_a_checkpoint_without_a_digest_loads_with_one_line(tmp_path, capsys):
    path = tmp_path / "old.pt"
    torch.save(trained_state(), path)  # as the program wrote it before digests
    assert checkpoint.load(str(path), SETTINGS)["epoch"] == 1
    said = f"warning: checkpoint {path} has no digest (it is older than digests): it could not be checked\n"
    assert capsys.readouterr().err == said
    checkpoint.load(str(path), SETTINGS, quiet=True)
    assert capsys.readouterr().err == ""
    with pytest.raises(UsageError, match="was made with --global-batch 64"):  # refused: one line, no warning
        checkpoint.load(str(path), {**SETTINGS, "global-batch": 96})
    assert capsys.readouterr().err == ""


def test_a_model_file_has_its_digest_beside_it_in_sha256sum_s_format(tmp_path):
    model, path = Net(), tmp_path / "m.pth"
    checkpoint.save_model(model, str(path))
    data = path.read_bytes()
    assert (tmp_path / "m.pth.sha256").read_text() == f"{hashlib.sha256(data).hexdigest()}  m.pth\n"
    assert set(torch.load(path, weights_only=True)) == set(model.state_dict())  # a plain state dict
    link = tmp_path / "link.pth"
    link.symlink_to(path)
    checkpoint.save_model(model, str(link))  # written through: the digest beside its target
    assert link.is_symlink() and not (tmp_path / "link.pth.sha256").exists()
    assert (tmp_path / "m.pth.sha256").read_text().endswith("  m.pth\n")
    checkpoint.load_model_state(Net(), str(link))
    checkpoint.save_model(model, "/dev/null")  # a device: no digest (and nothing written beside it)
    assert checkpoint.sidecar("/dev/null") is None


def test_the_shipped_model_has_its_digest():
    from conftest import REPO

    shipped = os.path.join(REPO, "model_state_dict.pth")
    assert checkpoint.check_model_file(shipped)  # it was there, and it matched


def test_a_model_file_with_a_flipped_tensor_is_refused_and_left_as_it_was(tmp_path, capsys):
    model, path = Net(), tmp_path / "m.pth"
    checkpoint.save_model(model, str(path))
    sidecar = (tmp_path / "m.pth.sha256").read_text()
    before = flip_inside(path, model.state_dict()["fc1.weight"])
    damaged = path.read_bytes()
    torch.load(path, weights_only=True)  # plain torch does not notice
    with pytest.raises(Damaged) as refused:
        checkpoint.load_model_state(Net(), str(path))
    line = str(refused.value)
    assert "\n" not in line and f"model file {path} does not match its digest" in line, line
    found = hashlib.sha256(damaged).hexdigest()
    assert f"says sha256 {sidecar[:16]}" in line and f"the file's is {found[:16]}" in line, line
    assert path.read_bytes() == damaged and (tmp_path / "m.pth.sha256").read_text() == sidecar
    (tmp_path / "m.pth.sha256").unlink()  # no digest: it loads (damaged, as asked), with one line
    checkpoint.load_model_state(Net(), str(path))
    said = f"warning: model file {path} has no digest beside it ({path}.sha256): it could not be checked\n"
    assert capsys.readouterr().err == said
    path.write_bytes(before)
    (tmp_path / "m.pth.sha256").write_text("not a digest\n")
    with pytest.raises(Damaged, match="is not a sha256sum line"):
        checkpoint.load_model_state(Net(), str(path))


def test_a_checkpoint_as_the_model_file_is_checked_by_its_own_digest(tmp_path, capsys):
    path, state = tmp_path / "c.pt", trained_state()
    checkpoint.save(state, path)
    checkpoint.load_model_state(Net(), str(path))  # no .sha256 beside it, but a digest inside: checked
    assert capsys.readouterr().err == ""
    flip_inside(path, state["model"]["fc1.weight"])
    with pytest.raises(Damaged, match=f"checkpoint {path} is damaged"):
        checkpoint.load_model_state(Net(), str(path))


def test_a_save_s_scan_names_the_first_non_finite_value():
    state = trained_state()
    assert checkpoint.not_finite(state) is None
    for bad in (float("nan"), float("inf"), -float("inf")):
        tensor = state["optimizer"]["state"][2]["exp_avg"].clone(memory_format=torch.contiguous_format)
        tensor.view(-1)[5] = bad
        moments = {**state["optimizer"]["state"], 2: {"exp_avg": tensor}}
        broken = {**state, "optimizer": {**state["optimizer"], "state": moments}}
        assert checkpoint.not_finite(broken) == "state.optimizer.state.2.exp_avg"
    assert checkpoint.not_finite({"n": torch.tensor([2**31 - 1]), "f": float("nan")}) is None  # tensors of floats only


def test_a_non_finite_loss_rides_as_a_nan_whatever_the_others_add():
    ranks = [Flags(signalled=1, speeds=(3, 0)), Flags(not_finite=True, speeds=(0, 200)), Flags(joining=True)]
    ranks[2] = Flags(joining=True, speeds=(0, 0))
    for wire in (torch.float32, torch.bfloat16, torch.float16):
        total = torch.tensor([f.values() for f in ranks], dtype=torch.float32).sum(0).to(wire).float().tolist()
        flags = Flags.from_sums(total)
        assert flags.not_finite and flags.interrupting and not flags.stopping and flags.speeds == (3, 200)
    assert Flags.from_sums(Flags(not_finite=True).values()) == Flags(not_finite=True)
    assert not Flags(speeds=(1,)).interrupting and Flags(signalled=1).interrupting and Flags(joining=True).interrupting


def test_the_nan_faults_poison_one_step_of_one_rank():
    assert parse("1:5:NAN,1:6:nangrad,0:7:TERM", 1) == [(5, "NAN", "step"), (6, "NANGRAD", "step")]
    with pytest.raises(ValueError):
        parse("1:5:NAN:sum", None)  # a NaN is put in as the step begins, nowhere else
    instruments = from_environ(environ_for(faults="0:1:NAN,0:2:NANGRAD"))
    instruments.bind(0)
    model, images, labels = Net(), torch.randn(4, 1, 28, 28), torch.tensor([0, 1, 2, 3])

    def step(n):
        model.zero_grad()
        instruments.at_step(n, model)
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        return loss.item(), int(grads.isnan().sum())

    loss, nans = step(1)  # NAN: the output, so the loss and every gradient
    assert loss != loss and nans > 100_000  # (a ReLU that was off passes no gradient, NaN or not)
    loss, nans = step(2)  # NANGRAD: one value of the gradient, the loss finite
    assert loss == loss and nans == 1
    loss, nans = step(3)  # once: the hooks took themselves away
    assert loss == loss and nans == 0


def test_a_server_s_command_run_again_refuses_a_damaged_checkpoint_rather_than_start_afresh(tmp_path, capsys):
    """Without --resume, a server's command run again resumes an unfinished checkpoint of its settings
    and starts afresh over anything else (utils/setup/preflight.py); a damaged one is refused instead."""
    import train
    from utils.setup.config import from_args
    from utils.setup.preflight import preflight

    paths = ["--checkpoint", str(tmp_path / "c.pt"), "--save-path", str(tmp_path / "m.pth"), "--metrics", ""]
    config = from_args(train.parse_args([*paths, "--epochs", "2", "--train-subset", "1280"]), {})
    state = trained_state()
    state["settings"] = {"model": "Net/421642", **config.must_keep()}
    checkpoint.save(state, tmp_path / "c.pt")
    resume_from, done = preflight(config, 2, 1280, unfinished=True)
    assert resume_from["epoch"] == 1 and not done and capsys.readouterr().err == ""
    before = flip_inside(tmp_path / "c.pt", state["model"]["fc1.weight"])
    with pytest.raises(Damaged, match="is damaged"):
        preflight(config, 2, 1280, unfinished=True)
    torch.save([1, 2], tmp_path / "c.pt")  # not a checkpoint at all: another run's, started afresh over
    assert preflight(config, 2, 1280, unfinished=True) == (None, False)
    (tmp_path / "c.pt").write_bytes(before)
