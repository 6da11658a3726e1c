"""The command line becomes one frozen Config, with the defaults resolved in one place."""

import dataclasses
import os

import pytest

import train
from utils.errors import UsageError
from utils.setup.config import Config, Outputs, from_args


def config(*argv, environ=None):
    return from_args(train.parse_args(list(argv)), environ or {})


def test_defaults_are_resolved_once():
    c = config()
    assert (c.job.rank, c.job.world_size, c.job.nproc) == (None, 2, 2)  # the local launcher
    assert (c.recipe.global_batch, c.recipe.lr, c.recipe.epochs, c.recipe.seed) == (64, 4e-3, 2, 1)
    assert (c.sync.allreduce, c.sync.chunks, c.sync.overlap, c.sync.compress) == ("two-pass", "auto", None, "none")
    assert c.sync.powersgd_rank is None and c.outputs.timeline_steps is None
    p = config("--compress", "powersgd", "--timeline", "t.json")
    assert (p.sync.powersgd_rank, p.sync.powersgd_warmup, p.outputs.timeline_steps) == (4, 10, (21, 60))
    assert config("--batch-size", "32", "--nproc", "3").recipe.global_batch == 96


def test_rank_world_and_torchrun():
    c = config("--rank", "1", "--world-size", "3", "--init-method", "tcp://127.0.0.1:1234")
    assert (c.job.rank, c.job.world_size, c.job.torchrun) == (1, 3, False)
    t = config(environ={"RANK": "2", "WORLD_SIZE": "4"})
    assert (t.job.rank, t.job.world_size, t.job.init_method, t.job.torchrun) == (2, 4, "env://", True)
    assert config("--batch-size", "16", environ={"RANK": "0", "WORLD_SIZE": "4"}).recipe.global_batch == 64


def test_it_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        config().recipe.lr = 1.0


def test_agreement_and_resume_lists_come_from_the_fields():
    c = config("--compress", "powersgd", "--powersgd-rank", "2")
    agree = c.must_agree()
    assert list(agree)[:2] == ["batch-size", "global-batch"]  # a different --batch-size is named first
    assert {
        "lr",
        "seed",
        "epochs",
        "allreduce",
        "chunks",
        "overlap",
        "lazy-update",
        "bucket-mb",
        "train-subset",
        "compress",
        "powersgd-rank",
        "powersgd-warmup",
    } <= set(agree)
    assert "timeout" not in agree and "test-subset" not in agree
    assert c.must_keep() == {
        "global-batch": 64,
        "lr": 4e-3,
        "seed": 1,
        "epochs": 2,
        "train-subset": None,
        "compress": "powersgd",
        "powersgd-rank": 2,
        "powersgd-warmup": 10,
        "sync-every": 1,
    }
    assert "powersgd-rank" not in config().must_keep()  # no PowerSGD: no such setting to keep
    assert "outer" not in config().must_keep() and "outer-lr" not in config("--sync-every", "4").must_keep()
    assert config("--sync-every", "4", "--outer", "nesterov").must_keep()["outer-lr"] == 0.7


def test_the_whole_config_goes_into_a_checkpoint():
    d = config("--timeline", "t.json").to_dict()
    assert set(d) == {"recipe", "sync", "outputs"}
    assert d["outputs"]["timeline_steps"] == (21, 60) and d["sync"]["allreduce"] == "two-pass"


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--rank", "0"], "--rank and --world-size go together"),
        (["--rank", "2", "--world-size", "2", "--init-method", "tcp://h:1"], "--rank must be between 0 and 1"),
        (["--rank", "0", "--world-size", "2"], "--init-method is required"),
        (["--init-method", "udp://h:1"], "malformed --init-method"),
        (["--init-method", "tcp://h:70000"], "out of range"),
        (["--gloo_socket_ifname", "no-such-card0"], "not found on this host"),
        (["--batch-size", "2", "--global-batch", "4"], "not both"),
        (["--no-overlap", "--lazy-update"], "--lazy-update needs --overlap"),
        (["--timeline-steps", "1:2"], "--timeline-steps needs --timeline"),
        (["--eval"], "--eval needs --model_path"),
        (["--powersgd-rank", "2"], "--powersgd-rank needs --compress powersgd"),
        (["--nproc", "3", "--balance", "5:2"], "--balance 5:2 gives 2 proportions for 3 ranks"),
        (["--balance", "5:x"], "expected 'measured' or whole-number proportions"),
        (["--balance", "5:0"], "each at least 1"),
    ],
)
def test_what_does_not_go_together_is_one_line(argv, needle):
    with pytest.raises(UsageError, match=needle.replace("-", r"\-")):
        config(*argv)


def test_outputs_name_each_file_once():
    o = Outputs(save_path="runs/x", checkpoint="runs/../runs/x", metrics="m.jsonl", timeline=None)
    assert o.files() == [("--checkpoint", "runs/../runs/x"), ("--metrics", "m.jsonl")]
    assert isinstance(config(), Config)


def test_help_groups_are_the_guides_groups():
    """train.py --help and docs/flags.md list the same flags in the same groups, in the same order."""
    import os
    import re

    from conftest import REPO

    from utils.setup.cli import make_parser

    groups = [
        (g.title.split(" (")[0].lower(), [a.option_strings[0] for a in g._group_actions])
        for g in make_parser()._action_groups
        if g._group_actions and g.title not in ("options", "positional arguments")
    ]
    doc, documented = open(os.path.join(REPO, "docs", "flags.md")).read(), []
    for section in doc.split("\n## ")[1:]:
        flags = re.findall(r"^\| `(--[\w-]+)", section, flags=re.M)
        documented.append((section.splitlines()[0].lower(), flags))
    assert groups == documented


def test_the_defaults_that_are_paths_name_the_repository():
    """The modules sit one folder down (utils/setup/): the default data folder and the program's
    digest (utils/setup/program.py) must still name the repository's own."""
    from conftest import REPO

    from utils.setup import program

    assert config().job.data_dir == os.path.join(REPO, "data") and os.path.isdir(config().job.data_dir)
    assert (program.ROOT / "train.py").is_file() and str(program.ROOT) == REPO


def test_overlap_by_default_is_on_across_hosts_and_off_on_one_unless_compressed_or_lazy():
    from utils.sync.factory import overlap_by_default

    one, two = [[0, 1]], [[0], [1]]
    assert not overlap_by_default(config().sync, one)  # python train.py: nothing on a wire to hide
    assert overlap_by_default(config().sync, two)
    assert overlap_by_default(config().sync, None)  # hosts not known: as before
    assert overlap_by_default(config("--compress", "powersgd").sync, one)  # its buckets are in its bits
    assert overlap_by_default(config("--lazy-update").sync, one)
    assert config("--no-overlap").sync.overlap is False and config("--overlap").sync.overlap is True
