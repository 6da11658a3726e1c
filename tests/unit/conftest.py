"""The fast tier: pure functions, the config, the checkpoint and files, the ring kernels in a tiny world."""
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
