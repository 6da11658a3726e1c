"""utils/setup/launch.py's helpers that need no ranks."""

import socket

from utils.setup.launch import LOWEST_PORT, free_port


def test_a_free_port_is_below_the_ephemeral_range_and_free():
    # below the range that bind(0), gloo's listeners and outgoing connections draw from: a port
    # from there could be taken by another job's socket before the store binds it
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral = int(f.read().split()[0])
    ports = [free_port() for _ in range(20)]
    assert all(LOWEST_PORT <= p < ephemeral for p in ports) and len(set(ports)) > 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # free, as it says
