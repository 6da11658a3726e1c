"""The fast tier: pure functions, the config, the checkpoint and files, the ring kernels in a tiny world."""

import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
