"""Data-parallel MNIST training across servers, gradients summed by a hand-written gloo ring.

On each server (one rank per server):
    nohup python3 -u train.py --init-method tcp://192.168.0.1:23456 --epoch 1200 --rank 0 \
        --world-size 2 --gloo_socket_ifname eth0 --model_path model_state_dict.pth

On one machine, all ranks over loopback:   python train.py
Under torchrun:                             torchrun --nproc-per-node 2 train.py
Evaluate a saved model:                     python train.py --eval --model_path model_state_dict.pth

Stop with SIGTERM or SIGINT (Ctrl-C) to any rank: every rank stops after the same step, rank 0
saves the checkpoint, and every rank exits with code 3; --resume continues, on this number of
servers or another.

This file sets up (arguments, NIC, process group, data, model); utils/run.py trains.
"""
import argparse
import datetime
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")  # c10d logs socket errors with stack traces; we report them in one line

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from utils import hierarchical  # noqa: E402
from utils.compress import COMPRESSIONS, DEFAULT_POWERSGD_RANK, DEFAULT_POWERSGD_WARMUP  # noqa: E402
from utils.checkpoint import check_writable, load_model_state, remove_stale_temps, safe_load  # noqa: E402
from utils.data import ensure_mnist, load_mnist  # noqa: E402
from utils import stop, timeline  # noqa: E402
from utils.errors import EXIT_BAD_INPUT, EXIT_LOST_PEER, EXIT_STOPPED, PeerError, Stopped, UsageError, first_line  # noqa: E402
from utils.model import Net  # noqa: E402
from utils.outputs import lock_outputs  # noqa: E402
from utils.ring import ALGORITHMS  # noqa: E402
from utils.run import check_identical_parameters, run, test_model  # noqa: E402

PROG = "train.py"
LOCAL_GRACE_SECONDS = 5
GLOBAL_BATCH = 64  # the recipe: 64 images per step in all, however many ranks share them
MAX_TIMEOUT = 2_000_000  # seconds (23 days): gloo keeps timeouts as 32-bit milliseconds
MAX_LR = 1e6  # Adam's first step is 10x the rate, in float32: from ~3e37 it overflows (and far below, NaN)
MAX_CHUNKS = 1024  # more pieces only add messages; 1e9 of them would look like a hang
MAX_NPROC = 64  # ranks on one machine; for more, use several servers
MAX_SEED = 2**32 - 1
MAX_POWERSGD_RANK = 64  # the model's smallest compressible matrix has 32 rows; more only costs bytes


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def positive(kind, most=None):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {'number' if kind is float else 'whole number'}, got {text!r}")
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"must be at most {most:g}, got {text!r}")
        return value
    return parse


def seed_value(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be between 0 and {MAX_SEED}, got {text!r}")
    return value


def non_negative_int(text):
    return 0 if text.strip() == "0" else positive(int)(text)


def chunk_count(text):
    return "auto" if text == "auto" else positive(int, MAX_CHUNKS)(text)


def timeline_steps(text):
    try:
        return timeline.parse_steps(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_args(argv):
    p = OneLineParser(prog=PROG, description="Data-parallel MNIST over a hand-written gloo ring.")
    p.add_argument("--rank", type=int, help="this server's rank, 0..world size-1 (omit to run every rank here)")
    p.add_argument("--world-size", "--world_size", dest="world_size", type=int, help="number of ranks (servers)")
    p.add_argument("--init-method", "--init_method", dest="init_method",
                   help="rendezvous address of rank 0, e.g. tcp://192.168.0.1:23456")
    p.add_argument("--gloo_socket_ifname", "--gloo-socket-ifname", dest="ifname",
                   help="network card gloo uses on this server, e.g. eth0")
    p.add_argument("--epoch", "--epochs", dest="epochs", type=positive(int), default=2, help="epochs (default 2)")
    p.add_argument("--model_path", "--model-path", dest="model_path", help="state dict to start from (rank 0 reads it)")
    p.add_argument("--save-path", default=os.path.join("runs", "model_state_dict.pth"),
                   help="where rank 0 writes the state dict after every epoch (default runs/model_state_dict.pth)")
    p.add_argument("--checkpoint", default=os.path.join("runs", "checkpoint.pt"),
                   help="rank 0's full training checkpoint, written every epoch (default runs/checkpoint.pt)")
    p.add_argument("--save-every", type=non_negative_int, default=0,
                   help="also write the checkpoint every K steps within an epoch (default 0: per epoch only)")
    p.add_argument("--resume", action="store_true",
                   help="continue from --checkpoint if it exists (mid-epoch included), else start afresh")
    p.add_argument("--metrics", default=os.path.join("runs", "metrics.jsonl"),
                   help="rank 0 appends one JSON line per epoch here ('' to turn off)")
    p.add_argument("--lr", type=positive(float, MAX_LR), default=4e-3, help="peak learning rate (default 0.004)")
    p.add_argument("--global-batch", type=positive(int),
                   help=f"images per step in all, shared by the ranks (default {GLOBAL_BATCH}); what a resume "
                        f"on another number of ranks keeps")
    p.add_argument("--batch-size", "--batch_size", dest="batch_size", type=positive(int),
                   help="images per step on each rank instead (the global batch is this times the world size)")
    p.add_argument("--seed", type=seed_value, default=1, help="seed for the model and the data order (default 1)")
    p.add_argument("--timeout", type=positive(float, MAX_TIMEOUT), default=120.0,
                   help="seconds to wait for rendezvous and for any send/recv (default 120)")
    p.add_argument("--allreduce", choices=ALGORITHMS, default="two-pass", help="gradient sum (default two-pass)")
    p.add_argument("--chunks", type=chunk_count, default="auto", help="pieces the two-pass ring streams (default auto)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="sum gradient buckets during backward (default on; --no-overlap: backward, then sum)")
    p.add_argument("--lazy-update", action=argparse.BooleanOptionalAction, default=False,
                   help="with --overlap: apply each bucket's update just before the next forward uses it, so "
                        "communication also overlaps the next forward (same parameters, bit for bit)")
    p.add_argument("--bucket-mb", type=positive(float), default=1.0, help="overlap bucket size in MB (default 1)")
    p.add_argument("--compress", choices=COMPRESSIONS, default="none",
                   help="what the gradient sums carry: none (float32, default), bf16 or fp16 (16 bits a value), "
                        "powersgd (low-rank; see --powersgd-rank)")
    p.add_argument("--powersgd-rank", type=positive(int, MAX_POWERSGD_RANK),
                   help=f"with --compress powersgd: rank of each matrix's approximation (default {DEFAULT_POWERSGD_RANK})")
    p.add_argument("--powersgd-warmup", type=non_negative_int,
                   help=f"with --compress powersgd: uncompressed steps first (default {DEFAULT_POWERSGD_WARMUP})")
    p.add_argument("--timeline", metavar="PATH",
                   help="rank 0 writes a Chrome trace of every rank's steps here (open it in ui.perfetto.dev)")
    p.add_argument("--timeline-steps", metavar="A:B", type=timeline_steps,
                   help=f"with --timeline: the steps to record, counted over the whole run "
                        f"(default {timeline.DEFAULT_STEPS[0]}:{timeline.DEFAULT_STEPS[1]})")
    p.add_argument("--nproc", type=positive(int, MAX_NPROC), default=2, help="ranks to start when running on this machine alone")
    p.add_argument("--train-subset", type=positive(int), help="train on only the first N training images")
    p.add_argument("--test-subset", type=positive(int),
                   help="evaluate on only the first N of the 10,000 test images (quick runs; default all)")
    p.add_argument("--data-dir", default=os.path.join(HERE, "data"), help="where MNIST lives (default ./data)")
    p.add_argument("--eval", action="store_true", help="only evaluate --model_path on the test set")
    return p.parse_args(argv)


def check_init_method(url):
    if url == "env://":
        return
    match = re.fullmatch(r"tcp://(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+):(\d+)", url)
    if match is None:
        raise UsageError(f"malformed --init-method {url!r}; expected tcp://HOST:PORT, e.g. tcp://192.168.0.1:23456")
    if not 1 <= int(match.group(2)) <= 65535:
        raise UsageError(f"port {match.group(2)} in --init-method is out of range (1-65535)")


def check_interface(name):
    names = [n for _, n in socket.if_nameindex()]
    if name not in names:
        raise UsageError(f"network interface {name!r} not found on this host; it has: {', '.join(names)}")


def loopback_interface():
    return next((n for _, n in socket.if_nameindex() if n.startswith("lo")), "lo")


def validate(args):
    if args.rank is not None or args.world_size is not None:
        if args.rank is None or args.world_size is None:
            raise UsageError("--rank and --world-size go together")
        if args.world_size < 1:
            raise UsageError(f"--world-size must be at least 1, got {args.world_size}")
        if not 0 <= args.rank < args.world_size:
            raise UsageError(f"--rank must be between 0 and {args.world_size - 1} (world size {args.world_size}), got {args.rank}")
        if args.init_method is None:
            raise UsageError("--init-method is required with --rank, e.g. --init-method tcp://192.168.0.1:23456")
    if args.init_method is not None:
        check_init_method(args.init_method)
    if args.ifname is not None:
        check_interface(args.ifname)
    if args.batch_size and args.global_batch:
        raise UsageError("give --global-batch or --batch-size (per rank), not both")
    if args.lazy_update and not args.overlap:
        raise UsageError("--lazy-update needs --overlap: it applies the update of each bucket summed during backward")
    if args.timeline_steps and not args.timeline:
        raise UsageError("--timeline-steps needs --timeline PATH")
    if args.timeline and args.timeline_steps is None:
        args.timeline_steps = timeline.DEFAULT_STEPS
    if args.eval and not args.model_path:
        raise UsageError("--eval needs --model_path")
    for option, value in (("--powersgd-rank", args.powersgd_rank), ("--powersgd-warmup", args.powersgd_warmup)):
        if value is not None and args.compress != "powersgd":
            raise UsageError(f"{option} needs --compress powersgd (this run has --compress {args.compress})")
    if args.compress == "powersgd":
        args.powersgd_rank = args.powersgd_rank or DEFAULT_POWERSGD_RANK
        args.powersgd_warmup = DEFAULT_POWERSGD_WARMUP if args.powersgd_warmup is None else args.powersgd_warmup


def check_share(train_images, world_size, global_batch=None):
    """Every rank needs at least one training image, or the job trains nothing at all (None: not given)."""
    if train_images is not None and train_images < world_size:
        raise UsageError(f"{train_images} training image(s) (--train-subset) cannot be shared by {world_size} ranks; "
                         f"give at least {world_size}")
    if global_batch is not None and global_batch < world_size:
        raise UsageError(f"a global batch of {global_batch} image(s) cannot be shared by {world_size} ranks; "
                         f"give --global-batch {world_size} or more")


def check_outputs(args):
    """Rank 0's output files must be writable before any training starts."""
    for option, path in (("--save-path", args.save_path), ("--checkpoint", args.checkpoint),
                         ("--metrics", args.metrics), ("--timeline", args.timeline)):
        if path:
            check_writable(path, option)


# --- running every rank on this machine ------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent():
    """In a child: get SIGTERM if the launcher dies, even by SIGKILL (Linux only)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def launch_local(args, argv):
    """Start args.nproc ranks of this program over loopback and wait for all of them."""
    n, port, lo = args.nproc, free_port(), loopback_interface()
    threads = max(1, (os.cpu_count() or 1) // n)
    print(f"running {n} ranks on this machine over {lo} (127.0.0.1:{port}), {threads} thread(s) each", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), RING_RESUME_COMMAND=resume_command(argv),
               RING_JOB_PID=str(os.getpid()))  # the pid a refused job names: this launcher's
    stop.install(PROG)   # SIGTERM/SIGINT to the launcher go on to its ranks, which stop after a step, saved
    procs = [subprocess.Popen([sys.executable, "-u", os.path.abspath(__file__), *argv, "--rank", str(r),
                               "--world-size", str(n), "--init-method", f"tcp://127.0.0.1:{port}",
                               "--gloo_socket_ifname", lo], env=env, preexec_fn=die_with_parent)
             for r in range(n)]
    stop.forward_to(procs)
    failed, deadline = 0, None
    try:
        while any(p.poll() is None for p in procs):
            if not failed:
                failed = next((p.returncode for p in procs if p.returncode), 0)
                if failed:  # the job is lost or stopped: let the others say what they saw, then stop them
                    deadline = time.time() + LOCAL_GRACE_SECONDS
            if deadline and time.time() > deadline:
                if failed not in (EXIT_BAD_INPUT, EXIT_STOPPED):  # those were already explained in one line
                    print(f"{PROG}: a rank failed (exit code {failed}); stopped the other ranks", file=sys.stderr)
                break
            time.sleep(0.2)
        return failed or next((p.returncode for p in procs if p.returncode), 0)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()


# --- one rank --------------------------------------------------------------------------------

def init_distributed(args, attempt_store=None):
    """Join the process group (under torchrun's agent store: through `attempt_store`)."""
    if args.rank is None:  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
        args.rank, args.world_size, args.init_method = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://"
    if args.ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = args.ifname  # gloo reads it when the group starts
    where = args.init_method if args.init_method != "env://" else \
        f"tcp://{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    timeout = datetime.timedelta(seconds=args.timeout)
    try:
        if attempt_store is not None:
            dist.init_process_group("gloo", store=attempt_store, rank=args.rank, world_size=args.world_size,
                                    timeout=timeout)
        else:
            dist.init_process_group("gloo", init_method=args.init_method, rank=args.rank,
                                    world_size=args.world_size, timeout=timeout)
    except (RuntimeError, ValueError) as e:
        text = str(e)
        if "EADDRINUSE" in text or "address already in use" in text.lower():
            raise UsageError(f"port of {where} is already in use on this host; choose another port") from None
        if "connectFullMesh" in text:  # the rendezvous worked; gloo's own connections did not
            raise PeerError(f"joined at {where} but could not connect to every other rank "
                            f"(a firewall on gloo's ports, or a peer that went away): {first_line(e)}",
                            resumable=False) from None
        if args.rank == 0 or "wait timeout" in text:  # we reached rank 0, but not everyone came
            raise PeerError(f"not every rank joined at {where} within {args.timeout:g} s "
                            f"(are all {args.world_size} started, with the same --init-method?)",
                            resumable=False) from None
        raise UsageError(f"could not reach rank 0 at {where} within {args.timeout:g} s "
                         f"(wrong address, rank 0 not running, or a firewall): {first_line(e)}") from None


def torchrun_attempt_store(rank, world_size, timeout):
    """Under torchrun's agent store: (this attempt's own store, whether rank 0 ran before in this job).

    torchrun's agent keeps one store for the whole job, and torch's env:// does not separate the
    attempts in it, so after a restart the dead ranks' gloo addresses are still there: a restarted
    rank that reads one before its peer has overwritten it gets "connection refused". So each
    attempt joins under a prefix of its own, and the ranks of an attempt agree on it through the
    store, with rank 0 as the leader:

        rank 0:   train.py/leader = A                  (A: a fresh random id)
        rank r:   train.py/A/answer/rank-r = a_r       (a_r: rank r's own fresh id)
        rank 0:   train.py/A/go = a_1,a_2,...          (once every rank has answered)
        rank r:   goes ahead when its own a_r is in A's go list

    A dead attempt's ids stay in the store, but nobody alive answered them, so a rank that reads
    a stale leader id never finds itself in its go list; it keeps watching the leader key until
    the new rank 0 writes. Counting starts per rank would not do: a rank that dies before counting
    leaves the counts apart for good. Nor would TORCHELASTIC_RESTART_COUNT: with --rdzv-backend
    c10d, the agent whose workers were healthy restarts them without counting a restart.
    """
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    try:
        agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                    is_master=False, timeout=timeout)
    except (RuntimeError, ValueError) as e:
        raise PeerError(f"could not reach torchrun's store at {where}: {first_line(e)}", resumable=False) from None
    try:
        return agree_on_attempt(agent_store, rank, world_size, timeout)
    except RuntimeError as e:   # the store went away: torchrun's agent is gone or restarting
        raise PeerError(f"lost torchrun's store at {where}: {first_line(e)}", resumable=False) from None


def agree_on_attempt(agent_store, rank, world_size, timeout):
    """The leader protocol of torchrun_attempt_store."""
    mine = os.urandom(8).hex()
    deadline = time.monotonic() + timeout.total_seconds()
    if rank == 0:
        restarted = agent_store.add("train.py/starts/rank-0", 1) > 1
        agent_store.set("train.py/leader", mine)
        answers = [f"train.py/{mine}/answer/rank-{r}" for r in range(1, world_size)]
        while answers and not agent_store.check(answers):
            if time.monotonic() > deadline:
                raise PeerError(f"not every rank of this torchrun attempt came within {timeout.total_seconds():g} s",
                                resumable=False)
            time.sleep(0.05)
        agent_store.set(f"train.py/{mine}/go", ",".join(v.decode() for v in agent_store.multi_get(answers)))
        return dist.PrefixStore(f"train.py/attempt-{mine}", agent_store), restarted
    answered = None
    while True:
        leader = agent_store.get("train.py/leader").decode() if agent_store.check(["train.py/leader"]) else None
        if leader is not None and leader != answered:
            agent_store.set(f"train.py/{leader}/answer/rank-{rank}", mine)
            answered = leader
        go = f"train.py/{answered}/go"
        if answered is not None and agent_store.check([go]) and mine in agent_store.get(go).decode().split(","):
            return dist.PrefixStore(f"train.py/attempt-{answered}", agent_store), False
        if time.monotonic() > deadline:
            raise PeerError(f"rank 0 of this torchrun attempt did not come within {timeout.total_seconds():g} s",
                            resumable=False)
        time.sleep(0.05)


def check_same_settings(args, model):
    """Every rank must train the same thing: compare the settings that must match, by name."""
    mine = {"model": f"{type(model).__name__}/{sum(p.numel() for p in model.parameters())}",
            "batch-size": args.batch_size, "global-batch": args.global_batch, "lr": args.lr, "seed": args.seed,
            "epochs": args.epochs,
            "allreduce": args.allreduce, "chunks": args.chunks, "overlap": args.overlap, "lazy-update": args.lazy_update,
            "bucket-mb": args.bucket_mb, "train-subset": args.train_subset, "compress": args.compress,
            "powersgd-rank": args.powersgd_rank, "powersgd-warmup": args.powersgd_warmup}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (mine, args.timeline_steps if args.timeline else None))
    for rank, (theirs, _) in enumerate(everyone):
        for name, value in mine.items():
            if theirs[name] != everyone[0][0][name]:
                raise UsageError(f"ranks were started with different --{name}: rank 0 has {everyone[0][0][name]}, "
                                 f"rank {rank} has {theirs[name]}")
    args.timeline_steps = everyone[0][1]   # rank 0's --timeline: every rank records, rank 0 writes


def broadcast_parameters(model):
    """Copy rank 0's parameters to every rank, then prove all ranks hold the same bits."""
    flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    dist.broadcast(flat, src=0)
    torch.nn.utils.vector_to_parameters(flat, model.parameters())
    check_identical_parameters(model)


def evaluate(args, data):
    model = Net()
    load_model_state(model, args.model_path)
    accuracy = test_model(model, data[2], data[3])
    print(f"test accuracy {accuracy:.2%} ({args.model_path}, {len(data[3])} images)")


CHECKPOINT_KEYS = {"model", "optimizer", "scheduler", "rng", "epoch", "step", "epoch_stats", "settings"}


def compression_settings(args):
    """What a resume must keep: the compression, and PowerSGD's rank and warm-up (its state depends on them)."""
    if args.compress == "powersgd":
        return {"compress": "powersgd", "powersgd-rank": args.powersgd_rank, "powersgd-warmup": args.powersgd_warmup}
    return {"compress": args.compress}


def global_batch(args, world_size):
    """Images per step in all: --global-batch, or --batch-size per rank times the ranks, or the recipe's 64."""
    return args.global_batch or (args.batch_size * world_size if args.batch_size else GLOBAL_BATCH)


def checkpoint_settings(args, model, world_size):
    """The settings a checkpoint records and a resumed run must match, by name. Not the world size:
    a job may resume on another number of ranks (utils/data.step_batches)."""
    return {"model": f"{type(model).__name__}/{sum(p.numel() for p in model.parameters())}",
            "global-batch": global_batch(args, world_size), "lr": args.lr, "seed": args.seed, "epochs": args.epochs,
            "train-subset": args.train_subset, **compression_settings(args)}


def recorded_settings(checkpoint):
    """(the settings a resume must keep, the world size) of a checkpoint; older ones held the world
    size and the batch per rank as settings, and no compression."""
    settings = {"compress": "none", **checkpoint["settings"]}
    world_size = checkpoint.get("world_size", settings.pop("world-size", None))
    if "batch-size" in settings:
        settings["global-batch"] = settings.pop("batch-size") * world_size
    return settings, world_size


def load_checkpoint(args, restarted=False):
    """Rank 0 (and the local launcher): the checkpoint to resume from, checked against this run's
    settings (args.checkpoint_settings), or None. It only reads: see say_where_training_starts.

    It may have been made on another number of ranks: the steps, the data order and the
    schedule follow from the global batch, which must match (utils/data.step_batches).
    restarted: torchrun started this rank again after a failure; it resumes without --resume."""
    if not (args.resume or restarted) or not os.path.exists(args.checkpoint):
        return None
    checkpoint = safe_load(args.checkpoint, "checkpoint")
    if not isinstance(checkpoint, dict) or not CHECKPOINT_KEYS <= set(checkpoint):
        raise UsageError(f"checkpoint {args.checkpoint} is not a training checkpoint of this program")
    settings, _ = recorded_settings(checkpoint)
    for name, value in settings.items():
        if args.checkpoint_settings.get(name) != value:
            raise UsageError(f"checkpoint {args.checkpoint} was made with --{name} {value}, this run has "
                             f"{args.checkpoint_settings.get(name)}; resume with the same settings, or "
                             f"start afresh without --resume")
    return checkpoint


def finished(checkpoint, args):
    """Whether `checkpoint` is the end of a run: every epoch done, nothing left to train."""
    return checkpoint is not None and checkpoint["epoch"] > args.epochs and checkpoint["step"] == 0


def say_finished(args):
    print(f"{args.checkpoint} is a finished run ({args.epochs} of {args.epochs} epochs); nothing to do", flush=True)


def say_where_training_starts(args, checkpoint, world_size):
    if checkpoint is not None:
        made_on = recorded_settings(checkpoint)[1]
        resized = f"; resuming on {world_size} ranks; the checkpoint was made on {made_on}" if made_on != world_size else ""
        print(f"resuming from {args.checkpoint}: epoch {checkpoint['epoch']}, after step {checkpoint['step']}{resized}",
              flush=True)
    elif args.resume:
        print(f"no checkpoint at {args.checkpoint}; starting afresh", flush=True)


def set_aside_old_checkpoint(args):
    """A fresh start keeps the previous run's checkpoint as <checkpoint>.prev instead of losing it."""
    if os.path.exists(args.checkpoint):
        os.replace(args.checkpoint, args.checkpoint + ".prev")
        print(f"starting afresh; the earlier checkpoint is kept as {args.checkpoint}.prev", flush=True)


def train(args, data):
    torch.manual_seed(args.seed)
    model = Net()
    rank = args.rank if args.rank is not None else int(os.environ["RANK"])
    world_size = args.world_size if args.world_size is not None else int(os.environ["WORLD_SIZE"])
    args.global_batch = global_batch(args, world_size)
    check_share(len(data[1]), world_size, args.global_batch)
    args.checkpoint_settings = checkpoint_settings(args, model, world_size)
    attempt_store, restarted = None, False
    if args.rank is None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        attempt_store, restarted = torchrun_attempt_store(rank, world_size, datetime.timedelta(seconds=args.timeout))
    checkpoint = None
    if rank == 0:  # before rendezvous, so that a bad file or another job's outputs fail fast
        check_outputs(args)
        checkpoint = load_checkpoint(args, restarted=restarted)
        done = finished(checkpoint, args)
        lock_outputs(args, hold=not done)  # a finished run writes nothing, not even a lock file: it only looks
        if not done:
            remove_stale_temps(args.checkpoint)  # only now: they could have been another job's saves in progress
            say_where_training_starts(args, checkpoint, world_size)
        if checkpoint is None and args.model_path:
            load_model_state(model, args.model_path)
    init_distributed(args, attempt_store)
    try:
        check_same_settings(args, model)
        shared = [checkpoint]
        dist.broadcast_object_list(shared, src=0)  # the other servers need not have the file
        checkpoint = shared[0]
        if finished(checkpoint, args):  # every rank knows it now: all stop, none trains or writes
            dist.barrier()  # nobody leaves (rank 0 hosts the rendezvous) before everyone has the news
            if rank == 0:
                say_finished(args)
            dist.destroy_process_group()
            return
        if checkpoint is not None:
            model.load_state_dict(checkpoint["model"])
        broadcast_parameters(model)
        hosts = hierarchical.discover()   # which ranks share a server: for the log, and the hierarchical sum
    except RuntimeError as e:
        raise PeerError(f"lost a peer during start-up: {first_line(e)}") from None
    if rank == 0:
        if checkpoint is None:
            set_aside_old_checkpoint(args)
        share = args.global_batch // world_size
        test_note = f" ({len(data[3]):,} test images)" if args.test_subset else ""
        per_rank = f"{share}" if args.global_batch % world_size == 0 else f"{share}-{share + 1}"
        print(f"rank 0 of {args.world_size}: {sum(p.numel() for p in model.parameters()):,} parameters, "
              f"{len(data[1]):,} training images{test_note}, batch {args.global_batch} ({per_rank} per rank), "
              f"all-reduce {args.allreduce} (chunks {args.chunks}, overlap {'on' if args.overlap else 'off'}"
              f"{', lazy update' if args.lazy_update else ''}){compression_note(args)}, {hierarchical.describe(hosts)}",
              flush=True)
        if args.allreduce == "hierarchical" and hierarchical.uneven_note(hosts):
            print(hierarchical.uneven_note(hosts), flush=True)
    stop.arm()   # from here a signal stops the job after a step, with the checkpoint saved
    run(model, data, args, resume_from=checkpoint)
    dist.destroy_process_group()


def compression_note(args):
    if args.compress == "powersgd":
        return f", compress powersgd (rank {args.powersgd_rank}, {args.powersgd_warmup} warm-up steps)"
    return f", compress {args.compress}" if args.compress != "none" else ""


def resume_command(argv):
    """The command that continues this job from its checkpoint."""
    if os.environ.get("RING_RESUME_COMMAND"):  # set by the local launcher: its command, not ours
        return os.environ["RING_RESUME_COMMAND"]
    return shlex.join(["python3", "-u", PROG, *argv, *([] if "--resume" in argv else ["--resume"])])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    rank = "?"
    try:
        args = parse_args(argv)
        validate(args)
        local = not args.eval and args.rank is None and "RANK" not in os.environ
        if local:  # check here what every rank would trip over: one error line, not one per rank
            if args.model_path:
                load_model_state(Net(), args.model_path)
            check_outputs(args)
            lock_outputs(args, hold=False)  # only a look: the lock is its rank 0's to take
            check_share(args.train_subset, args.nproc, args.global_batch)
            args.checkpoint_settings = checkpoint_settings(args, Net(), args.nproc)
            if finished(load_checkpoint(args), args):
                say_finished(args)
                return 0
            ensure_mnist(args.data_dir)
            return launch_local(args, argv)
        rank = args.rank if args.rank is not None else os.environ.get("RANK", 0)
        if not args.eval:
            stop.install(f"{PROG}: rank {rank}")
        torch.use_deterministic_algorithms(True)
        data = load_mnist(args.data_dir)
        if args.train_subset or args.test_subset:
            data = (data[0][:args.train_subset], data[1][:args.train_subset],
                    data[2][:args.test_subset], data[3][:args.test_subset])
        if args.eval:
            evaluate(args, data)
        else:
            train(args, data)
        return 0
    except UsageError as e:
        say(f"{PROG}: error: {e}")
        return EXIT_BAD_INPUT
    except PeerError as e:
        hint = f"; to resume: {resume_command(argv)}" if e.resumable else ""
        say(f"{PROG}: rank {rank}: {e}{hint}")
        return EXIT_LOST_PEER
    except Stopped as e:
        say(f"{PROG}: rank {rank}: {e}; to resume: {resume_command(argv)}")
        return EXIT_STOPPED
    except KeyboardInterrupt:
        say(f"{PROG}: rank {rank}: interrupted")
        return 130


def say(line):
    """One line to stderr in one write: ranks under torchrun or our launcher share one pipe, and
    print's two writes (text, then newline) let their lines run into each other."""
    sys.stderr.flush()
    os.write(2, (line + "\n").encode())


if __name__ == "__main__":
    code = main()
    if code:
        # After a lost peer, gloo's threads may still be blocked on it. Python's shutdown would
        # destroy them and abort the process ("terminate called without an active exception",
        # exit -6) after the one-line message. Everything worth keeping is already on disk.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
