"""train.py's command line, in the groups of the guides (train.py --help shows them).

utils.setup.config.from_args turns what this parses into a Config; nothing else reads it. No torch here:
a bad command line answers at once.

Why this long: it is every flag with its help, in docs/flags.md's groups and order (which
tests/unit/test_config.py holds it to); one list read beside that page, not parts of it elsewhere.
"""

import argparse
import os

from utils.comm.names import (
    ALGORITHMS,
    COMPRESSIONS,
    DEFAULT_OUTER_LR,
    DEFAULT_OUTER_MOMENTUM,
    DEFAULT_POWERSGD_RANK,
    DEFAULT_POWERSGD_WARMUP,
    OUTERS,
)
from utils.setup.config import (
    DEFAULT_TIMELINE_STEPS,
    GLOBAL_BATCH,
    MAX_HEARTBEAT,
    MAX_LR,
    MAX_NPROC,
    MAX_POWERSGD_RANK,
    MAX_RESTARTS,
    MAX_SYNC_EVERY,
    MAX_TIMEOUT,
    balance_mode,
)
from utils.setup.precision import PRECISIONS
from utils.setup.values import (
    OneLineParser,
    chunk_count,
    host_id_text,
    momentum_value,
    non_negative_float,
    non_negative_int,
    port_number,
    positive,
    seed_value,
    timeline_steps,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # (utils/setup/cli.py)
ON = argparse.BooleanOptionalAction


def parse_args(argv, prog="train.py"):
    return make_parser(prog).parse_args(argv)


def make_parser(prog="train.py"):
    p = OneLineParser(prog=prog, description="Data-parallel MNIST over a hand-written gloo ring.")

    where = p.add_argument_group("where this server is and whom it joins (docs/several-servers.md)")
    where.add_argument("--rank", type=int, help="this server's rank, 0..world size-1 (omit: every rank here)")
    where.add_argument("--world-size", "--world_size", dest="world_size", type=int, help="ranks (servers) in all")
    where.add_argument(
        "--init-method", "--init_method", dest="init_method", help="rank 0's address, e.g. tcp://192.168.0.1:23456"
    )
    card = "the network card gloo uses, e.g. eth0 (default: $GLOO_SOCKET_IFNAME, else found from the route to rank 0)"
    where.add_argument("--gloo_socket_ifname", "--gloo-socket-ifname", dest="ifname", help=card)
    where.add_argument(
        "--join",
        nargs="?",
        const="",
        metavar="HOST:PORT",
        help="join the running job at its next step, through --init-method or HOST:PORT of any member",
    )
    where.add_argument(
        "--host-id",
        type=host_id_text,
        metavar="ID",
        help="ranks with the same ID share a server, for --allreduce hierarchical (default: found out; "
        "docs/gradient-sum.md)",
    )
    where.add_argument(
        "--key-file",
        metavar="PATH",
        help="the job's key for its control messages, the same file on every server (default: $RING_KEY_FILE, "
        "$RING_JOB_KEY, or a new key per job from rank 0, kept beside --checkpoint as CHECKPOINT.key)",
    )

    servers = p.add_argument_group("every server from one terminal, over ssh (docs/several-servers.md)")
    servers.add_argument(
        "--hosts",
        metavar="H0,H1[:N],...",
        help="start the job on these servers over your ssh, rank 0 on the first (HOST:N: N ranks there)",
    )
    servers.add_argument(
        "--hostfile", metavar="FILE", help="the servers, one a line: HOST [slots=N] [dir=PATH] (# comments)"
    )
    servers.add_argument(
        "--remote-dir", metavar="PATH", help="with --hosts: the job's folder on every server (default: this one's path)"
    )
    servers.add_argument(
        "--python", metavar="PATH", help="with --hosts: the Python there (default: this one's path, then python3)"
    )
    servers.add_argument(
        "--port", type=port_number, help="with --hosts: rank 0's port (default 23456, or a free one if it is taken)"
    )
    servers.add_argument(
        "--detach", action="store_true", help="with --hosts: return once every rank has started (default: watch them)"
    )

    training = p.add_argument_group("training")
    training.add_argument(
        "--epoch",
        "--epochs",
        dest="epochs",
        type=positive(int),
        default=2,
        help="epochs to train (default %(default)s)",
    )
    training.add_argument(
        "--lr", type=positive(float, MAX_LR), default=4e-3, help="peak learning rate (default %(default)s)"
    )
    training.add_argument(
        "--global-batch",
        type=positive(int),
        help=f"images per step in all, shared by the ranks (default "
        f"{GLOBAL_BATCH}); what a resume on another number of ranks keeps",
    )
    training.add_argument(
        "--batch-size",
        "--batch_size",
        dest="batch_size",
        type=positive(int),
        help="images per step on each rank instead (the global batch is this times the world size)",
    )
    training.add_argument(
        "--seed", type=seed_value, default=1, help="for the model and the data order (default %(default)s)"
    )
    training.add_argument(
        "--model_path", "--model-path", dest="model_path", help="state dict to start from (rank 0 reads it)"
    )
    training.add_argument("--data-dir", default=os.path.join(REPO, "data"), help="MNIST's folder (default %(default)s)")
    training.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="of the forward and backward passes: bf16 on CPUs with AVX-512-BF16 or AMX (default %(default)s)",
    )
    training.add_argument("--eval", action="store_true", help="only evaluate --model_path on the test set")

    sums = p.add_argument_group("the gradient sum (docs/gradient-sum.md)")
    sums.add_argument("--allreduce", choices=ALGORITHMS, default="two-pass", help="(default %(default)s)")
    sums.add_argument(
        "--chunks", type=chunk_count, default="auto", help="pieces the two-pass ring streams (default %(default)s)"
    )
    sums.add_argument(
        "--overlap",
        action=ON,
        default=None,
        help="sum gradient buckets during backward (default: on across hosts and with --compress or "
        "--lazy-update, off on one host; --no-overlap: backward, then the sum)",
    )
    sums.add_argument(
        "--lazy-update",
        action=ON,
        default=False,
        help="with --overlap: apply each bucket's update as the next forward needs it (hiding the sums behind it)",
    )
    sums.add_argument(
        "--bucket-mb", type=positive(float), default=1.0, help="overlap bucket size (default %(default)s MB)"
    )
    sums.add_argument(
        "--compress",
        choices=COMPRESSIONS,
        default="none",
        help="what the sums carry: none (float32, default), bf16 or fp16 (16 bits a value), powersgd (low-rank)",
    )
    sums.add_argument(
        "--powersgd-rank",
        type=positive(int, MAX_POWERSGD_RANK),
        help=f"with --compress powersgd: rank of each matrix's approximation (default {DEFAULT_POWERSGD_RANK})",
    )
    sums.add_argument(
        "--powersgd-warmup",
        type=non_negative_int,
        help=f"with --compress powersgd: uncompressed steps first (default {DEFAULT_POWERSGD_WARMUP})",
    )
    sums.add_argument(
        "--sync-every",
        type=positive(int, MAX_SYNC_EVERY),
        default=1,
        metavar="H",
        help="1: sum the gradients "
        "every step (default); H: H steps per rank, then average the change behind the next H",
    )
    sums.add_argument("--outer", choices=OUTERS, help="with --sync-every H > 1: the outer step (default average)")
    sums.add_argument(
        "--merge-after",
        type=positive(int, MAX_SYNC_EVERY),
        metavar="T",
        help="with --sync-every H: merge a round's average T steps into the next round (1..H; default H/2)",
    )
    sums.add_argument(
        "--outer-lr", type=positive(float, MAX_LR), help=f"--outer nesterov's rate (default {DEFAULT_OUTER_LR})"
    )
    sums.add_argument(
        "--outer-momentum", type=momentum_value, help=f"--outer nesterov's momentum (default {DEFAULT_OUTER_MOMENTUM})"
    )
    sums.add_argument(
        "--balance",
        nargs="?",
        const="measured",
        type=balance_mode,
        metavar="A:B:...",
        help="share each step's images by the ranks' measured speeds, for servers of unequal speed (default: "
        "equal shares); A:B:...: fixed proportions, one per rank (docs/several-servers.md)",
    )

    faults = p.add_argument_group("faults, stopping and resuming (docs/stopping-and-resuming.md)")
    faults.add_argument(
        "--checkpoint",
        default=os.path.join("runs", "checkpoint.pt"),
        help="rank 0's full training checkpoint, written every epoch (default %(default)s)",
    )
    faults.add_argument(
        "--save-every",
        type=non_negative_int,
        default=0,
        help="also write the checkpoint every K steps within an epoch (default 0: per epoch only)",
    )
    faults.add_argument(
        "--resume",
        action="store_true",
        help="continue from --checkpoint if it exists (mid-epoch included), else start afresh",
    )
    faults.add_argument(
        "--recover",
        action=ON,
        default=None,
        help="when a rank is lost, the others go on without it, from the last "
        "step (default on; off under torchrun, which restarts every rank); --no-recover: they save it and exit 1",
    )
    faults.add_argument(
        "--heartbeat",
        type=positive(float, MAX_HEARTBEAT),
        default=5.0,
        help="seconds of silence after which a rank is taken for lost (default %(default)s)",
    )
    faults.add_argument(
        "--timeout",
        type=positive(float, MAX_TIMEOUT),
        default=120.0,
        help="seconds to wait for the rendezvous and for any send/recv (default %(default)s)",
    )
    faults.add_argument(
        "--restart",
        choices=("never", "on-failure"),
        default="never",
        help="on-failure: when this server's training fails (a crash, cut off, fenced out), start it again; it "
        "joins the running job by itself (default %(default)s; docs/healing.md)",
    )
    faults.add_argument(
        "--max-restarts",
        type=positive(int, MAX_RESTARTS),
        default=10,
        help="--restart gives up after this many failures in a row, none of them training a step (default %(default)s)",
    )
    faults.add_argument(
        "--rejoin-timeout",
        type=non_negative_float,
        default=300.0,
        help="seconds a server that lost the job (cut off, fenced out) waits for it and joins it again; "
        "0: it exits 1 at once (default %(default)s)",
    )

    outputs = p.add_argument_group("outputs (docs/timeline.md)")
    outputs.add_argument(
        "--save-path",
        default=os.path.join("runs", "model_state_dict.pth"),
        help="where rank 0 writes the state dict after every epoch (default %(default)s)",
    )
    outputs.add_argument(
        "--metrics",
        default=os.path.join("runs", "metrics.jsonl"),
        help="rank 0 appends one JSON line per epoch here ('' to turn off; default %(default)s)",
    )
    outputs.add_argument(
        "--timeline",
        metavar="PATH",
        help="rank 0 writes a Chrome trace of every rank's steps here (open it in ui.perfetto.dev)",
    )
    first, last = DEFAULT_TIMELINE_STEPS
    outputs.add_argument(
        "--timeline-steps",
        metavar="A:B",
        type=timeline_steps,
        help=f"with --timeline: the steps to record, counted over the whole run (default {first}:{last})",
    )

    outputs.add_argument(
        "--tensorboard",
        metavar="DIR",
        help="rank 0 writes TensorBoard event files here: loss, accuracy, step time, ... (docs/watching.md)",
    )

    watching = p.add_argument_group("watching a running job (docs/watching.md)")
    question = watching.add_mutually_exclusive_group()
    question.add_argument(
        "--status",
        nargs="?",
        const="",
        metavar="HOST:PORT",
        help="print the running job's members and their progress, asked of any member at HOST:PORT "
        "(default: --init-method's), with the job's key as --join finds it; then exit",
    )
    question.add_argument(
        "--stop",
        nargs="?",
        const="",
        metavar="HOST:PORT",
        help="stop the running job at HOST:PORT (found as --status finds it) as a SIGTERM to a rank would: every "
        "rank stops after its current step, rank 0 saves the checkpoint, each exits 3; then exit",
    )
    watching.add_argument("--json", action="store_true", help="with --status: one JSON object instead of a table")

    local = p.add_argument_group("runs on one machine")
    local.add_argument(
        "--nproc",
        type=positive(int, MAX_NPROC),
        default=2,
        help="ranks to start here, without --rank (default %(default)s)",
    )
    local.add_argument("--train-subset", type=positive(int), help="train on only the first N training images")
    local.add_argument(
        "--test-subset", type=positive(int), help="evaluate on only the first N of the 10,000 test images"
    )
    return p
