"""This process's network: which card reaches a host, the address of a card, and cutting every
connection at once.

utils/setup/card.py finds gloo's card with card_toward; utils/elastic/join.py finds the address of
gloo's card for the control sockets with card_address; utils/elastic/membership.py ends a generation
with cut_connections.
"""

import fcntl
import os
import socket
import struct

SIOCGIFADDR = 0x8915  # the ioctl that reads a card's IPv4 address


def card_toward(host):
    """(card, source, destination): the network card and its address that traffic to `host` (a name
    or an address; `destination`, resolved, IPv4 first) leaves from, as `ip route get` answers. For
    an address of this host the card that holds it, not lo (lo only for a loopback address).
    OSError (socket.gaierror too) if `host` does not resolve, has no route, or no card holds the
    source address the route names."""
    found = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
    family, _, _, _, destination = min(found, key=lambda f: f[0] != socket.AF_INET)
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(destination)  # no packet is sent: this only picks the route and its source address
        source = s.getsockname()[0].split("%")[0]
    card = ipv4_holder(source) if family == socket.AF_INET else ipv6_holder(source)
    if card is None:
        raise OSError(f"no network card holds {source}, the source address of its route")
    return card, source, destination[0]


def ipv4_holder(address):
    """The card whose IPv4 address is `address`, or None."""
    return next((name for _, name in socket.if_nameindex() if ipv4_of(name) == address), None)


def ipv6_holder(address):
    """The card that holds IPv6 address `address` (/proc/net/if_inet6), or None."""
    wanted = socket.inet_pton(socket.AF_INET6, address).hex()
    try:
        with open("/proc/net/if_inet6") as f:
            return next((line.split()[-1] for line in f if line.split()[0] == wanted), None)
    except OSError:
        return None


def ipv4_of(card):
    """The IPv4 address of network card `card`, or None (no such card, or none on it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", card[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def card_address(ifname, toward="127.0.0.1"):
    """The IPv4 address of network card `ifname`, or else of the card that reaches host `toward`."""
    address = ipv4_of(ifname.split(",")[0]) if ifname else None
    if address is not None:
        return address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((toward, 9))  # no packet is sent: this only picks the route
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def cut_connections():
    """Shut down every connected TCP socket of this process (gloo's pairs, store clients): every
    wait on them fails now, here and at the other end. Listening sockets are left alone (gloo
    aborts if its listener fails); shutdown, not close, so no descriptor is reused under gloo."""
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            s = socket.socket(fileno=int(name))
        except OSError:
            continue
        try:
            if s.type == socket.SOCK_STREAM and s.family in (socket.AF_INET, socket.AF_INET6):
                s.getpeername()  # raises unless connected
                s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            s.detach()
