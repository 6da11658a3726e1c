"""The trainer's parts, a folder to a job (docs/code-map.md has each module):

run.py                the epoch loop (train_step, train_model, run)
setup/                how a process comes to train: the command line, the settings, the launcher, the group
learn/                what is trained: the model, the optimizer, MNIST, and what the loop holds (Trainer)
comm/                 the gradient sum over one flat tensor: the ring kernels, the algorithms, compression
sync/                 what the loop calls between backward and the next forward (buckets, lazy, periodic)
elastic/              live recovery and joins: membership, agreement, the control plane
balance/              --balance: each rank's share of a step from its measured speed
store/                the files: checkpoint and model, atomic writes, one output folder one job
observe/              watching a run: the log lines, --status's record, TensorBoard
errors.py, exchange.py, timeline.py   what the rest share
(the tests' and benchmarks' fork server is tests/support/forkserver.py)
"""
