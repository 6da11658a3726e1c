"""Which network card a rank's gloo uses, and its control plane with it: the card given
(--gloo_socket_ifname, or GLOO_SOCKET_IFNAME in the environment), else the card whose route reaches
rank 0's address, as `ip route get ADDRESS` answers (utils/elastic/sockets.py card_toward); on rank 0
that address is its own, and the card is the one that holds it (lo only for a loopback address).
Left to itself gloo would take the address this host's name resolves to: on many servers 127.0.1.1,
or another card than the one the other servers reach.

    with_card(job, environ)   the Job with its card, and the line that names it if it was found
"""

import dataclasses
import os
import socket
import urllib.parse

from utils.elastic.sockets import card_toward
from utils.errors import UsageError


def with_card(job, environ=os.environ):
    """(job with its card as `ifname`, the line that says which card was found and why, or None when
    it was given). A host that does not resolve or has no route: UsageError, one line."""
    if job.ifname:
        return job, None
    given = environ.get("GLOO_SOCKET_IFNAME")
    whom, host = peer_of(job, environ)
    if given or not host:  # (env:// without MASTER_ADDR: the rendezvous says what is missing)
        return dataclasses.replace(job, ifname=given or None), None
    try:
        card, source, address = card_toward(host)
    except OSError as e:
        why = "it does not resolve" if isinstance(e, socket.gaierror) else e.strerror or str(e)
        raise UsageError(
            f"found no network card toward {whom} at {host} ({why}); pass --gloo_socket_ifname CARD"
        ) from None
    at = host if address == host else f"{host} ({address})"
    why = f"the card holding {whom}'s address {at}" if source == address else f"the card toward {whom} at {at}"
    return dataclasses.replace(job, ifname=card), f"rank {job.rank}: gloo over {card} ({source}), {why}"


def peer_of(job, environ):
    """(who, host): whom this rank's traffic must reach, and the host it names: the member of --join
    HOST:PORT, else rank 0 at --init-method's host (env://: MASTER_ADDR)."""
    if job.join:
        return "the member", job.join.rsplit(":", 1)[0]
    if job.init_method == "env://":
        return "rank 0", environ.get("MASTER_ADDR")
    return "rank 0", urllib.parse.urlparse(job.init_method or "").hostname
