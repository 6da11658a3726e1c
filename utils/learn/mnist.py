"""MNIST's files: the four original IDX files, shipped gzip-compressed in data/MNIST/raw/.

They are decompressed once (atomically, so ranks starting together don't trip over each other)
and checked against the published md5 sums. Only when data/ has none of them does torchvision
try to download them. No torch here: the local launcher prepares the files before its ranks
start, without loading torch (utils/learn/data.py reads them into tensors).
"""

import gzip
import hashlib
import os
import shutil

from utils.errors import UsageError

MD5 = {
    "train-images-idx3-ubyte": "6bbc9ace898e44ae57da46a324031adb",
    "train-labels-idx1-ubyte": "a25bea736e30d166cdddb491f175f624",
    "t10k-images-idx3-ubyte": "2646ac647ad5339dbf082846283269ea",
    "t10k-labels-idx1-ubyte": "27ae3e4e09519cfbb04c329615203637",
}


def _md5(path):
    digest = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _decompress(gz_path, path):
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with gzip.open(gz_path, "rb") as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.replace(tmp, path)
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise UsageError(f"damaged data file {gz_path} ({e}); restore it with `git checkout -- {gz_path}`") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def prepare_raw_files(root):
    """Make data/MNIST/raw/ hold the four verified IDX files. Returns False if none are there."""
    raw = os.path.join(root, "MNIST", "raw")
    present = [n for n in MD5 if os.path.exists(os.path.join(raw, n)) or os.path.exists(os.path.join(raw, n + ".gz"))]
    if not present:
        return False
    for name, md5 in MD5.items():
        path = os.path.join(raw, name)
        if not os.path.exists(path):
            if not os.path.exists(path + ".gz"):
                raise UsageError(f"missing data file {path}.gz; restore it with `git checkout -- {raw}`")
            _decompress(path + ".gz", path)
        if _md5(path) != md5:
            os.remove(path)  # a bad copy; the next start decompresses it again from the .gz
            source = path + ".gz" if os.path.exists(path + ".gz") else path
            raise UsageError(f"damaged data file {source} (md5 mismatch); restore it with `git checkout -- {raw}`")
    return True


def ensure_mnist(root="data"):
    """Make root/MNIST/raw/ hold the four verified files, downloading them only if none are there."""
    if prepare_raw_files(root):
        return
    from torchvision.datasets import MNIST  # only to download: a second of start-up otherwise spent for nothing

    existed = os.path.exists(root)
    try:
        for train in (True, False):
            MNIST(root, train=train, download=True)
    except (RuntimeError, OSError) as e:
        if not existed:  # torchvision made the folders for its download: leave no empty tree behind
            shutil.rmtree(root, ignore_errors=True)
        reason = " ".join(str(e).split())  # torchvision's message spans lines, one per mirror
        raise UsageError(f"MNIST is not in {root}/MNIST/raw and could not be downloaded: {reason[:300]}") from None
