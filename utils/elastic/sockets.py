"""This process's network: the address of a card, and cutting every connection at once.

utils/elastic/membership.py ends a generation with cut_connections; utils/elastic/join.py finds the
address of gloo's card for the control sockets with card_address.
"""

import fcntl
import os
import socket
import struct


def card_address(ifname, toward="127.0.0.1"):
    """The IPv4 address of network card `ifname`, or else of the card that reaches host `toward`."""
    if ifname:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname.split(",")[0][:15].encode()))
                return socket.inet_ntoa(packed[20:24])  # SIOCGIFADDR
            except OSError:
                pass
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
