"""The run's settings: frozen dataclasses built from the command line in one place (from_args).

Why this long: the settings, how each is resolved from the command line and its checks are read
together (the argparse value types are in utils/setup/values.py).

    Recipe   what is trained: epochs, learning rate, batch, seed, data subsets
    Sync     how the gradients are summed: --allreduce, --chunks, --overlap, --compress, ...
    Outputs  what rank 0 writes: model, checkpoint, metrics, timeline, TensorBoard files
    Job      where this process runs: its rank, the world, the rendezvous, the card; --hosts' Launch
    Config   all four; the checkpoint stores it whole (Config.to_dict)

Each field says, in its metadata, the flag it comes from and whether every rank must have the
same value (agree: utils/setup/distributed.agree compares them by name) and whether a resume must
keep it (resume: utils/store/checkpoint.load compares them with the checkpoint's). Both checks read
these lists, so a new setting is checked once it is declared here. Defaults are resolved here
(the global batch, PowerSGD's rank and warm-up, the timeline's steps), never in the core.
"""

import argparse
import dataclasses
import os
import re
import socket
from dataclasses import dataclass, field

from utils.balance.shares import parse_fixed
from utils.comm.names import DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM, DEFAULT_POWERSGD_RANK, DEFAULT_POWERSGD_WARMUP
from utils.errors import UsageError
from utils.setup.servers import Launch, servers_of
from utils.setup.slurm import SlurmStep
from utils.setup.slurm import step_from as slurm_step
from utils.sync.flags import MAX_RANKS

GLOBAL_BATCH = 64  # the recipe: 64 images per step in all, however many ranks share them
DEFAULT_TIMELINE_STEPS = (21, 60)  # after the first steps' start-up costs (and PowerSGD's 10-step warm-up)
MAX_TIMEOUT = 2_000_000  # seconds (23 days): gloo keeps timeouts as 32-bit milliseconds
MAX_HEARTBEAT = 3600.0  # seconds
MAX_RESTARTS = 1000  # --max-restarts
MAX_LR = 1e6  # Adam's first step is 10x the rate, in float32: from ~3e37 it overflows (and far below, NaN)
MAX_CHUNKS = 1024  # more pieces only add messages; 1e9 of them would look like a hang
MAX_NPROC = 64  # ranks on one machine; for more, use several servers
MAX_SEED = 2**32 - 1
MAX_POWERSGD_RANK = 64  # the model's smallest compressible matrix has 32 rows; more only costs bytes
MAX_SYNC_EVERY = 100_000


def default_merge_after(every):
    """--merge-after's default for --sync-every `every`: half a round, which hides the sum of 64 steps at
    20 Mbit/s and cost no accuracy against a quarter round (docs/gradient-sum.md)."""
    return max(1, every // 2)


def setting(default, flag, agree=False, resume=False):
    return field(default=default, metadata=dict(flag=flag, agree=agree, resume=resume))


@dataclass(frozen=True)
class Recipe:
    batch_size: int | None = setting(None, "batch-size", agree=True)  # per rank, as given (or None)
    global_batch: int = setting(GLOBAL_BATCH, "global-batch", agree=True, resume=True)  # resolved
    lr: float = setting(4e-3, "lr", agree=True, resume=True)
    seed: int = setting(1, "seed", agree=True, resume=True)
    epochs: int = setting(2, "epochs", agree=True, resume=True)
    train_subset: int | None = setting(None, "train-subset", agree=True, resume=True)
    test_subset: int | None = setting(None, "test-subset")
    precision: str = setting("fp32", "precision", agree=True)  # utils/setup/precision.py


@dataclass(frozen=True)
class Sync:
    allreduce: str = setting("two-pass", "allreduce", agree=True)
    chunks: int | str = setting("auto", "chunks", agree=True)
    overlap: bool | None = setting(None, "overlap", agree=True)  # None: by the hosts (overlap_by_default)
    lazy_update: bool = setting(False, "lazy-update", agree=True)
    bucket_mb: float = setting(1.0, "bucket-mb", agree=True)
    compress: str = setting("none", "compress", agree=True, resume=True)
    powersgd_rank: int | None = setting(None, "powersgd-rank", agree=True, resume=True)  # None: not powersgd
    powersgd_warmup: int | None = setting(None, "powersgd-warmup", agree=True, resume=True)
    timeout: float = setting(120.0, "timeout")  # seconds for rendezvous and every send/recv
    sync_every: int = setting(1, "sync-every", agree=True, resume=True)  # 1: the gradients every step
    outer: str | None = setting(None, "outer", agree=True, resume=True)  # None with sync_every 1
    outer_lr: float | None = setting(None, "outer-lr", agree=True, resume=True)  # None but for nesterov
    outer_momentum: float | None = setting(None, "outer-momentum", agree=True, resume=True)
    merge_after: int | None = setting(None, "merge-after", agree=True, resume=True)  # None with sync_every 1
    balance: str | None = setting(None, "balance", agree=True)  # None: equal shares; 'measured' or 'A:B:...'


@dataclass(frozen=True)
class Outputs:
    save_path: str = setting(os.path.join("runs", "model_state_dict.pth"), "save-path")
    checkpoint: str = setting(os.path.join("runs", "checkpoint.pt"), "checkpoint")
    save_every: int = setting(0, "save-every")
    metrics: str = setting(os.path.join("runs", "metrics.jsonl"), "metrics")  # '' : off
    timeline: str | None = setting(None, "timeline")
    timeline_steps: tuple[int, int] | None = setting(None, "timeline-steps")  # set with timeline
    tensorboard: str | None = setting(None, "tensorboard")  # a folder: utils/observe/board.py

    def files(self):
        """(flag, path) of every file rank 0 writes, each file once however it is spelled."""
        seen, found = set(), []
        for option, path in (
            ("--checkpoint", self.checkpoint),
            ("--save-path", self.save_path),
            ("--metrics", self.metrics),
            ("--timeline", self.timeline),
        ):
            if path and os.path.realpath(path) not in seen:
                seen.add(os.path.realpath(path))
                found.append((option, path))
        return found


@dataclass(frozen=True)
class Job:
    rank: int | None = None  # None: the local launcher, which starts every rank here
    world_size: int = 2
    init_method: str | None = None
    ifname: str | None = None  # gloo's card: given, or found toward rank 0 when a rank starts (utils/setup/card.py)
    torchrun: bool = False  # RANK etc. came from torchrun's environment
    nproc: int = 2
    data_dir: str = "data"
    model_path: str | None = None
    resume: bool = False
    eval: bool = False
    recover: bool = True  # a lost rank: the others go on (False: they save and exit 1)
    heartbeat: float = 5.0  # seconds of silence after which a rank is taken for lost
    join: str | None = None  # join a running job: "" (through --init-method) or "HOST:PORT"
    key_file: str | None = None  # the control plane's key (utils/elastic/key.py); never the key itself
    restart: str = "never"  # "on-failure": a keeper starts this server's training again (utils/setup/keeper.py)
    max_restarts: int = 10  # failures in a row after which the keeper gives up
    rejoin_timeout: float = 300.0  # seconds a server that lost the job waits to join it again (0: exit 1)
    slurm: SlurmStep | None = None  # srun started this rank: rank, world and rendezvous came from it
    given_host_id: str | None = None  # --host-id: ranks with the same one share a server
    launch: Launch | None = None  # --hosts: start the job on those servers from here

    @property
    def host_id(self):
        """What names this rank's server for the hierarchical sum (utils.comm.hierarchical.discover):
        --host-id, else Slurm's node, which Slurm knows; None: the sum finds out by itself."""
        slurm_node = f"slurm job {self.slurm.job_id} node {self.slurm.node_id}" if self.slurm else None
        return self.given_host_id or slurm_node


@dataclass(frozen=True)
class Config:
    job: Job
    recipe: Recipe
    sync: Sync
    outputs: Outputs

    def must_agree(self):
        """{flag: value} that every rank must have alike, in a fixed order."""
        return {
            f.metadata["flag"]: getattr(part, f.name)
            for part in (self.recipe, self.sync)
            for f in dataclasses.fields(part)
            if f.metadata["agree"]
        }

    def must_keep(self):
        """{flag: value} that a resumed run must have as the checkpoint recorded it (PowerSGD's
        rank and warm-up only under --compress powersgd: None is no setting)."""
        return {
            f.metadata["flag"]: getattr(part, f.name)
            for part in (self.recipe, self.sync)
            for f in dataclasses.fields(part)
            if f.metadata["resume"]
            and not (f.name.startswith(("powersgd", "outer", "merge")) and getattr(part, f.name) is None)
        }

    def to_dict(self):
        return {
            "recipe": dataclasses.asdict(self.recipe),
            "sync": dataclasses.asdict(self.sync),
            "outputs": dataclasses.asdict(self.outputs),
        }


def from_args(args, environ=os.environ):
    """The Config of a parsed command line (train.parse_args), validated, defaults resolved.
    UsageError (one line, exit code 2) for what does not go together."""
    launch = launch_of(args)
    check_placement(args, launch)
    check_options(args, launch)
    check_sync_options(args)
    rank, world_size, init_method, torchrun, slurm = ranks_from(args, environ, launch)
    check_world(args, world_size, torchrun, slurm, launch)
    recover = (not torchrun) if args.recover is None else args.recover
    where = dict(rank=rank, world_size=world_size, init_method=init_method, torchrun=torchrun, slurm=slurm)
    global_batch = args.global_batch or (args.batch_size * world_size if args.batch_size else GLOBAL_BATCH)
    timeline_steps = (args.timeline_steps or DEFAULT_TIMELINE_STEPS) if args.timeline else None
    return Config(
        job=as_given(args, Job, recover=recover, given_host_id=args.host_id, launch=launch, **where),
        recipe=as_given(args, Recipe, global_batch=global_batch),
        sync=sync_of(args),
        outputs=as_given(args, Outputs, timeline_steps=timeline_steps, tensorboard=args.tensorboard or None),
    )


def as_given(args, kind, **resolved):
    """A `kind` (Job, Recipe, Sync or Outputs): the `resolved` fields, and every other field the
    command line's option of its name as given."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(kind) if f.name not in resolved}
    return kind(**given, **resolved)


def launch_of(args):
    """--hosts/--hostfile and their options as a Launch; None without them (their options are refused)."""
    if not (args.hosts or args.hostfile):
        for given, flag in ((args.remote_dir, "--remote-dir"), (args.python, "--python"), (args.port, "--port")):
            if given is not None:
                raise UsageError(f"{flag} goes with --hosts or --hostfile")
        if args.detach:
            raise UsageError("--detach goes with --hosts or --hostfile")
        return None
    if args.rank is not None or args.world_size is not None:
        raise UsageError("--hosts places every rank itself: leave out --rank and --world-size")
    if args.eval:
        raise UsageError("--hosts starts a job on those servers; --eval runs here")
    if args.remote_dir is not None and not args.remote_dir.startswith("/"):
        raise UsageError(f"--remote-dir must be an absolute path, got {args.remote_dir!r}")
    address, port = None, args.port
    if args.init_method is not None:
        match = re.fullmatch(r"tcp://(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+):(\d{1,5})", args.init_method)
        if match is None or not 1 <= int(match.group(2)) <= 65535:
            raise UsageError("with --hosts, --init-method is tcp://HOST:PORT of rank 0's server, or leave it out")
        address, port = match.group(1).strip("[]"), port or int(match.group(2))
    servers = tuple(servers_of(args.hosts, args.hostfile))
    return Launch(servers, args.remote_dir, args.python, port, address, args.detach)


def check_placement(args, launch=None):
    """--rank, --world-size, --init-method and --ifname, each well formed and given together."""
    if args.rank is not None or args.world_size is not None:
        if args.rank is None or args.world_size is None:
            raise UsageError("--rank and --world-size go together")
        if args.world_size < 1:
            raise UsageError(f"--world-size must be at least 1, got {args.world_size}")
        if not 0 <= args.rank < args.world_size:
            raise UsageError(
                f"--rank must be between 0 and {args.world_size - 1} (world size {args.world_size}), got {args.rank}"
            )
        if args.init_method is None:
            raise UsageError("--init-method is required with --rank, e.g. --init-method tcp://192.168.0.1:23456")
    if args.init_method is not None:
        check_init_method(args.init_method)
    if args.ifname is not None and launch is None:  # (--hosts: the servers' cards, not this machine's)
        check_interface(args.ifname)


def check_options(args, launch=None):
    """Options that need or exclude another: the batch's, --lazy-update's, the timeline's, --join's."""
    if args.batch_size and args.global_batch:
        raise UsageError("give --global-batch or --batch-size (per rank), not both")
    if args.lazy_update and args.overlap is False:
        raise UsageError("--lazy-update needs --overlap: it applies the update of each bucket summed during backward")
    if args.timeline_steps and not args.timeline:
        raise UsageError("--timeline-steps needs --timeline PATH")
    if args.json:
        raise UsageError("--json goes with --status")
    if args.join is not None:
        if args.rank is None and launch is None:
            raise UsageError("--join needs this server's --rank, --world-size and --init-method (its original command)")
        if args.join and not re.fullmatch(r"[A-Za-z0-9.-]+:\d{1,5}", args.join):
            raise UsageError(f"malformed --join {args.join!r}; expected HOST:PORT of a member, e.g. 192.168.0.2:23456")
        if args.timeline:
            raise UsageError("--join does not work with --timeline yet")


def check_sync_options(args):
    """The sum's options that need or exclude another (--sync-every's, --outer's, --compress's), and
    --eval's model (checked here, in the order a command line has always been checked)."""
    if args.sync_every == 1 and args.outer is not None:
        raise UsageError(
            f"--outer {args.outer} needs --sync-every 2 or more: with 1 the gradients are summed every step"
        )
    if args.merge_after is not None and not 1 < args.sync_every >= args.merge_after:
        raise UsageError(f"--merge-after {args.merge_after} needs --sync-every H with H >= {max(2, args.merge_after)}")
    if (args.outer_lr is not None or args.outer_momentum is not None) and args.outer != "nesterov":
        raise UsageError("--outer-lr and --outer-momentum are for --outer nesterov")
    if args.sync_every > 1 and args.compress == "powersgd":
        raise UsageError("--sync-every sends the parameter change as --compress none, bf16 or fp16, not powersgd")
    if args.sync_every > 1 and args.lazy_update:
        raise UsageError(
            "--lazy-update hides a per-step sum; with --sync-every the outer sum runs behind the inner steps"
        )
    if args.eval and not args.model_path:
        raise UsageError("--eval needs --model_path")
    for option, value in (("--powersgd-rank", args.powersgd_rank), ("--powersgd-warmup", args.powersgd_warmup)):
        if value is not None and args.compress != "powersgd":
            raise UsageError(f"{option} needs --compress powersgd (this run has --compress {args.compress})")


def ranks_from(args, environ, launch=None):
    """(rank, world size, init method, torchrun, slurm) from the command line, torchrun's environment
    or a Slurm step's; --hosts' (rank None, a rank per slot); else the local launcher's (rank None,
    --nproc ranks)."""
    if launch is not None:
        return None, sum(s.slots for s in launch.servers), args.init_method, False, None
    torchrun = args.rank is None and "RANK" in environ and not args.eval
    slurm = slurm_step(environ) if args.rank is None and not torchrun and not args.eval else None
    if args.rank is not None:
        rank, world_size, init_method = args.rank, args.world_size, args.init_method
    elif torchrun:
        rank, world_size, init_method = int(environ["RANK"]), int(environ["WORLD_SIZE"]), "env://"
    elif slurm:
        rank, world_size, init_method = slurm.rank, slurm.world_size, args.init_method or slurm.rendezvous
        check_init_method(init_method)
    else:
        rank, world_size, init_method = None, args.nproc, None
    return rank, world_size, init_method, torchrun, slurm


def check_world(args, world_size, torchrun, slurm, launch=None):
    """--restart only for a server started by hand, a world that the flags can count, --balance's
    proportions one per rank."""
    if args.restart != "never" and (torchrun or slurm):
        raise UsageError(
            f"--restart is for a server started by hand; {'torchrun' if torchrun else 'Slurm'} restarts its ranks "
            f"itself ({'--max-restarts' if torchrun else 'sbatch --requeue'}: docs/healing.md)"
        )
    if args.restart != "never" and args.rank is None and not (torchrun or slurm or launch):
        raise UsageError(
            "--restart keeps one server's rank going: give --rank, --world-size and --init-method "
            "(the local launcher's ranks go on without a lost one: --recover)"
        )
    if world_size > MAX_RANKS:  # (torchrun's and Slurm's too)
        raise UsageError(
            f"a world of {world_size} ranks is more than a job can have: at most {MAX_RANKS}, the ranks whose stop "
            "signals a step's flags can count (utils/sync/flags.py)"
        )
    if args.balance not in (None, "measured") and len(parse_fixed(args.balance)) != world_size:
        raise UsageError(
            f"--balance {args.balance} gives {len(parse_fixed(args.balance))} proportions for {world_size} ranks; "
            "give one per rank, or --balance alone to measure"
        )


def sync_of(args):
    """How the gradients are summed; the options of a kind the run does not use are None."""
    powersgd, nesterov, periodic = args.compress == "powersgd", args.outer == "nesterov", args.sync_every > 1
    return as_given(
        args,
        Sync,
        powersgd_rank=(args.powersgd_rank or DEFAULT_POWERSGD_RANK) if powersgd else None,
        powersgd_warmup=(DEFAULT_POWERSGD_WARMUP if args.powersgd_warmup is None else args.powersgd_warmup)
        if powersgd
        else None,
        outer=(args.outer or "average") if periodic else None,
        outer_lr=(DEFAULT_OUTER_LR if args.outer_lr is None else args.outer_lr) if nesterov else None,
        outer_momentum=(DEFAULT_OUTER_MOMENTUM if args.outer_momentum is None else args.outer_momentum)
        if nesterov
        else None,
        merge_after=(args.merge_after or default_merge_after(args.sync_every)) if periodic else None,
    )


def balance_mode(text):
    """--balance's value: 'measured', or proportions A:B:... (utils/balance/shares.parse_fixed)."""
    if text == "measured":
        return text
    try:
        parse_fixed(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


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


def check_share(train_images, world_size, global_batch=None):
    """Every rank needs at least one training image, or the job trains nothing at all (None: not given)."""
    if train_images is not None and train_images < world_size:
        raise UsageError(
            f"{train_images} training image(s) (--train-subset) cannot be shared by {world_size} ranks; "
            f"give at least {world_size}"
        )
    if global_batch is not None and global_batch < world_size:
        raise UsageError(
            f"a global batch of {global_batch} image(s) cannot be shared by {world_size} ranks; "
            f"give --global-batch {world_size} or more"
        )
