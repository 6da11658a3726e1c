"""What this server runs: torch's version and a digest of the program's own code.

Every rank compares both at start-up (utils/setup/distributed.py) and the job compares a joining
server's (utils/elastic/): mixed versions across servers hang, crash or drift apart silently.
"""

import hashlib
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the folder of train.py (this is utils/setup/program.py)


def program_digest(root=ROOT):
    """The first 16 hex digits of a sha256 over train.py and every utils/ module (path and bytes)."""
    digest = hashlib.sha256()
    for path in [root / "train.py", *sorted((root / "utils").rglob("*.py"))]:
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def identity():
    """{"torch": version, "program": digest}: what must be alike on every server of a job."""
    import torch  # (here: train.py --hosts compares digests without it)

    return {"torch": torch.__version__, "program": program_digest()}


def differences(mine, theirs, me="this server", them="the job"):
    """The one-line text of what differs between two identity()s, or None if alike."""
    names = {"torch": "torch", "program": "program (train.py and utils/)"}
    for key, name in names.items():
        if mine.get(key) != theirs.get(key):
            return f"different {name}: {me} has {mine.get(key)}, {them} has {theirs.get(key)}"
    return None
