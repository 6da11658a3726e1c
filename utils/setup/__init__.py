"""How a process comes to train: the command line, the settings, launching the ranks, the group.

cli.py          the command line (argparse), every flag and its checks
config.py       the settings: frozen dataclasses built from the command line in one place
precision.py    --precision, and whether this CPU has it (torch-free)
launch.py       the local launcher: --nproc ranks on this machine, supervised, with a hard timeout
fork.py         ranks forked from a process that has loaded torch once
slurm.py        what a task takes from Slurm; the requeue before the time limit
stop.py         signals: stop after a step, with the checkpoint saved
keeper.py       --restart on-failure: a server's training started again when it fails
lifecycle.py    a rank's supervisor: start, look for its job, wait for it, join it; what a lost job leaves
handoff.py      what one process hands the next it starts (keeper, re-exec, launcher, fork): RING_HANDOFF
process.py      how a run of train.py ends: one line and an exit code
memory.py       glibc's malloc told to keep a step's freed buffers
program.py      torch's version and the program's digest, compared at start-up
distributed.py  the gloo group bound to a card, the ranks' agreement on settings, identical parameters
"""
