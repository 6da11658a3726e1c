"""Finding gloo's card on this machine (utils/setup/card.py, utils/elastic/sockets.py card_toward): a
loopback address gives lo, the machine's own address its card, another address the card of its route,
a name that does not resolve one UsageError line. (On emulated servers with other card names, and an
address with no route: tests/cluster/test_multihost.py.)"""

import socket

import pytest

from utils.elastic.sockets import card_toward, ipv4_of
from utils.errors import UsageError
from utils.setup.card import with_card
from utils.setup.config import Job


def own_cards():
    """{card: IPv4 address} of this machine's cards other than lo."""
    found = {name: ipv4_of(name) for _, name in socket.if_nameindex() if name != "lo"}
    return {name: address for name, address in found.items() if address}


def default_route_card():
    """The card of the IPv4 default route (/proc/net/route), or None."""
    with open("/proc/net/route") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return next((row[0] for row in rows if row[1] == "00000000" and row[7] == "00000000"), None)


def test_a_loopback_address_gives_lo():
    assert card_toward("127.0.0.1") == ("lo", "127.0.0.1", "127.0.0.1")
    assert card_toward("127.0.0.2") == ("lo", "127.0.0.1", "127.0.0.2")  # all of 127/8 is lo's
    assert card_toward("localhost")[0] == "lo"


def test_this_machine_s_own_address_gives_its_card_not_lo():
    cards = own_cards()
    assert cards, "this machine has no card with an IPv4 address but lo"
    for card, address in cards.items():  # (the kernel routes them over lo: rank 0 must not take that)
        assert card_toward(address) == (card, address, address)


def test_another_address_gives_the_card_of_its_route_or_none():
    card = default_route_card()
    if card is None:  # nothing routes a foreign address here
        with pytest.raises(OSError):
            card_toward("203.0.113.7")
    else:
        assert card_toward("203.0.113.7") == (card, ipv4_of(card), "203.0.113.7")


def test_the_ipv6_loopback_gives_lo_where_it_is_configured():
    with open("/proc/net/if_inet6") as f:
        configured = any(line.split()[0] == "0" * 31 + "1" for line in f)
    if configured:
        assert card_toward("::1") == ("lo", "::1", "::1")
    else:
        with pytest.raises(OSError):
            card_toward("::1")


def test_a_rank_finds_its_card_and_says_it_once_a_given_one_it_keeps_silently():
    job = Job(rank=1, world_size=2, init_method="tcp://127.0.0.1:23456")
    found, line = with_card(job, {})
    assert found.ifname == "lo"
    assert line == "rank 1: gloo over lo (127.0.0.1), the card holding rank 0's address 127.0.0.1"
    assert with_card(found, {}) == (found, None)  # given (--gloo_socket_ifname): as it is, no line
    assert with_card(job, {"GLOO_SOCKET_IFNAME": "eth7"}) == (Job(1, 2, job.init_method, "eth7"), None)
    card, address = sorted(own_cards().items())[0]
    rank_0 = Job(rank=0, world_size=2, init_method=f"tcp://{address}:23456")
    assert with_card(rank_0, {}) == (
        Job(0, 2, rank_0.init_method, card),
        f"rank 0: gloo over {card} ({address}), the card holding rank 0's address {address}",
    )


def test_env_rendezvous_and_join_find_the_card_toward_their_host():
    torchrun = Job(rank=3, world_size=4, init_method="env://", torchrun=True)
    assert with_card(torchrun, {"MASTER_ADDR": "localhost"})[1] == (
        "rank 3: gloo over lo (127.0.0.1), the card holding rank 0's address localhost (127.0.0.1)"
    )
    assert with_card(torchrun, {}) == (torchrun, None)  # no MASTER_ADDR: the rendezvous says so, as before
    joiner = Job(rank=2, world_size=3, init_method="tcp://10.9.9.9:23456", join="127.0.0.1:23457")
    assert with_card(joiner, {})[1] == (
        "rank 2: gloo over lo (127.0.0.1), the card holding the member's address 127.0.0.1"
    )


def test_a_host_that_does_not_resolve_is_one_line_that_asks_for_the_flag():
    job = Job(rank=1, world_size=2, init_method="tcp://no-such-host.invalid:23456")
    with pytest.raises(UsageError) as e:
        with_card(job, {})
    assert str(e.value) == (
        "found no network card toward rank 0 at no-such-host.invalid (it does not resolve); "
        "pass --gloo_socket_ifname CARD"
    )
