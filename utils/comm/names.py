"""The gradient sum's names and defaults, torch-free: what the command line offers (utils/setup/cli.py,
utils/setup/config.py) and what utils/comm and utils/sync build from, defined once here, below both."""

ALGORITHMS = ("two-pass", "ring", "gloo", "hierarchical")  # --allreduce: utils/comm/allreduce.make_allreduce
COMPRESSIONS = ("none", "bf16", "fp16", "powersgd")  # --compress: utils/comm/compress.make_compressor
# One epoch of the default recipe over five seeds (bench/results/time_to_accuracy/one-epoch-seeds.md): rank 4 with
# 10 plain steps averages 98.97% (2 ranks) and 99.00% (4 ranks), 0.02-0.03 points below no compression, as
# DDP's own PowerSGD hook does; rank 8 or 100 plain steps gain 0.01-0.03 points, less than the seeds' spread.
DEFAULT_POWERSGD_RANK = 4
DEFAULT_POWERSGD_WARMUP = 10  # uncompressed steps first
OUTERS = ("average", "nesterov")  # --sync-every's --outer: utils/sync/periodic.PeriodicSync
DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM = 0.7, 0.9  # DiLoCo's outer SGD (Douillard et al., 2023)
