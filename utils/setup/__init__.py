"""How a process comes to train: the command line, the settings, launching the ranks, the group.

cli.py          the command line (argparse), every flag and its checks
config.py       the settings: frozen dataclasses built from the command line in one place
precision.py    --precision, and whether this CPU has it (torch-free)
launch.py       the local launcher: --nproc ranks on this machine, supervised, with a hard timeout
fork.py         ranks forked from a process that has loaded torch once
slurm.py        what a task takes from Slurm; the requeue before the time limit
stop.py         signals: stop after a step, with the checkpoint saved
memory.py       glibc's malloc told to keep a step's freed buffers
program.py      torch's version and the program's digest, compared at start-up
distributed.py  the gloo group bound to a card, the ranks' agreement on settings, identical parameters
"""
