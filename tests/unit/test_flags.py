"""The step's flags (utils/sync/flags.py) at the limits of their encoding, through the narrowest wire
format, and the limits enforced where a world size is set."""

import pytest
import torch

import train
from utils.errors import UsageError
from utils.setup.config import from_args
from utils.sync.flags import EXACT, JOIN, MAX_RANKS, MAX_SPEED, Flags


def summed(*flags, wire=torch.bfloat16):
    """Every rank's tail added up, then carried in `wire` (what a bf16 ring's last hop sends)."""
    total = torch.tensor([f.values() for f in flags], dtype=torch.float32).sum(0)
    return total.to(wire).float().tolist()


def test_every_rank_signalled_and_a_join_read_apart_at_the_limit():
    ranks = [Flags(signalled=1, speeds=tuple(MAX_SPEED if r == i else 0 for r in range(3))) for i in range(MAX_RANKS)]
    ranks[0] = Flags(signalled=1, joining=True, speeds=ranks[0].speeds)  # the leader has a joiner
    assert Flags.from_sums(summed(*ranks)) == Flags(MAX_RANKS, True, (MAX_SPEED, MAX_SPEED, MAX_SPEED))
    assert Flags.from_sums(summed(*ranks[1:])) == Flags(MAX_RANKS - 1, False, (0, MAX_SPEED, MAX_SPEED))


def test_sixty_four_signals_are_a_stop_not_a_join():
    # (when JOIN was 64, 64 signalled ranks read as "joining, no stop")
    flags = Flags.from_sums(summed(*[Flags(signalled=1)] * 64))
    assert flags.stopping and flags.signalled == 64 and not flags.joining


def test_the_limits_are_where_bfloat16_stops_being_exact():
    assert MAX_RANKS + JOIN < EXACT and MAX_SPEED < EXACT
    assert summed(Flags(signalled=EXACT - 1)) == [EXACT - 1]
    assert summed(Flags(signalled=EXACT + 1)) != [EXACT + 1]  # past it, bf16 rounds


def test_a_world_past_the_limit_is_one_line_wherever_its_size_comes_from():
    def config(*argv, environ=None):
        return from_args(train.parse_args(list(argv)), environ or {})

    hand = ("--rank", "0", "--init-method", "tcp://127.0.0.1:1234", "--world-size")
    assert config(*hand, str(MAX_RANKS)).job.world_size == MAX_RANKS
    for argv, environ in [
        ((*hand, str(MAX_RANKS + 1)), None),
        ((), {"RANK": "0", "WORLD_SIZE": str(MAX_RANKS + 1)}),  # torchrun's
    ]:
        with pytest.raises(UsageError, match=rf"a world of {MAX_RANKS + 1} ranks .* at most {MAX_RANKS}"):
            config(*argv, environ=environ)
