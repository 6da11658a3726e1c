"""--balance: each rank's share of a step's images, from its measured speed.

shares.py  the speeds, their codes in the step's flags, the shares and when they move
cpu.py     a rank's own CPU time and its stalls (cgroup quotas, other processes)
"""
