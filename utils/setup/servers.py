"""The servers of `train.py --hosts` / `--hostfile`: who they are, how many ranks each, in which folder.

    servers_of(hosts, hostfile)   [Server], in rank order: rank 0 is the first host's first slot
    ranks_of(servers)             [(server, rank)] for every rank of the job

--hosts node0,node1:2 (horovodrun's spelling) or --hostfile FILE (DeepSpeed's), one server a line:

    # name as ssh knows it   ranks on it   its folder, if not the launcher's
    node0                    slots=2
    node1                                  dir=/scratch/me/mnist-ring

No torch here: a bad host list is answered at once.
"""

import re
from dataclasses import dataclass

from utils.errors import UsageError

HOST = re.compile(r"[A-Za-z0-9_.@-]{1,253}")  # an ssh destination: a name of ~/.ssh/config, user@host, an address
MAX_SLOTS = 64  # as --nproc: more ranks on one server's cores would look like a hang


@dataclass(frozen=True)
class Server:
    host: str  # as ssh knows it
    slots: int = 1  # ranks on this server
    folder: str | None = None  # the job's folder there (None: --remote-dir, else the launcher's own)


@dataclass(frozen=True)
class Launch:
    """train.py --hosts/--hostfile: this process starts the job on those servers (utils/setup/remote.py)."""

    servers: tuple  # utils.setup.servers.Server, rank 0's first
    remote_dir: str | None = None
    python: str | None = None
    port: int | None = None  # rank 0's port (None: 23456, or a free one)
    init_address: str | None = None  # rank 0's address from --init-method (None: as ssh reached it)
    detach: bool = False


def servers_of(hosts, hostfile):
    """The servers of --hosts or --hostfile (one of the two); UsageError naming what is wrong."""
    if hosts and hostfile:
        raise UsageError("give --hosts or --hostfile, not both")
    servers = from_hosts(hosts) if hosts else from_hostfile(hostfile)
    seen = set()
    for s in servers:
        if (s.host, s.folder) in seen:
            raise UsageError(f"{s.host} is named twice; give it slots=N (or HOST:N) for several ranks")
        seen.add((s.host, s.folder))
    return servers


def from_hosts(text):
    servers = []
    for item in text.split(","):
        host, _, slots = item.strip().partition(":")
        servers.append(server(host, slots or "1", "--hosts", item))
    return servers


def from_hostfile(path):
    try:
        with open(path) as f:
            lines = f.read(1_000_000).splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read --hostfile {path}: {getattr(e, 'strerror', None) or e}") from None
    servers = []
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"--hostfile {path} line {number}"
        fields = dict(word.partition("=")[::2] for word in words[1:])
        unknown = sorted(set(fields) - {"slots", "dir"})
        if unknown or any("=" not in w for w in words[1:]):
            raise UsageError(f"{where}: expected HOST [slots=N] [dir=PATH], got {line.strip()!r}")
        servers.append(server(words[0], fields.get("slots", "1"), where, line.strip(), fields.get("dir")))
    if not servers:
        raise UsageError(f"--hostfile {path} names no server")
    return servers


def server(host, slots, where, said, folder=None):
    if not HOST.fullmatch(host):
        raise UsageError(f"{where}: {said!r} is not a host name as ssh takes it")
    if not slots.isdigit() or not 1 <= int(slots) <= MAX_SLOTS:
        raise UsageError(f"{where}: slots must be 1..{MAX_SLOTS}, got {said!r}")
    if folder is not None and not folder.startswith("/"):
        raise UsageError(f"{where}: dir= must be an absolute path, got {folder!r}")
    return Server(host, int(slots), folder)


def ranks_of(servers):
    """[(server, rank)]: each server's ranks, consecutive, in the order the servers are named."""
    return [(s, rank) for rank, s in enumerate(s for s in servers for _ in range(s.slots))]
