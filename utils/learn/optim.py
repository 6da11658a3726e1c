"""Adam and the one-cycle learning rate, written out.

Why not torch.optim: its optimizers import torch.compile's machinery (torch._dynamo, and sympy
with it) the first time they are used, even when nothing is compiled: a cost in every rank at every
start and every rejoin, on servers that other people share (measured: bench/compute/NOTES.md,
"Start-up"). The seam: utils/learn/training.make_optimizer makes the run's optimizer and schedule
from these two and nothing else in the program names them, so torch.optim's drop back in there.

These are torch.optim.Adam(fused=True)'s sums (its one-pass kernel, called directly) and
torch.optim.lr_scheduler.OneCycleLR's schedule, so the parameters come out bit for bit the
same; tests/unit/test_optim.py holds the two side by side. The state dicts have torch's layout,
so a checkpoint written with either resumes with either.
"""

import math
from collections import defaultdict

import torch

ADAM_DEFAULTS = dict(
    betas=(0.9, 0.999),
    eps=1e-08,
    # torch.optim.Adam's other settings, all off here; kept so the state dicts match its own
    weight_decay=0,
    amsgrad=False,
    maximize=False,
    foreach=None,
    capturable=False,
    differentiable=False,
    fused=True,
    decoupled_weight_decay=False,
)


class Adam:
    """Adam (Kingma and Ba) with torch.optim.Adam's defaults and interface: param_groups, state,
    step(), zero_grad(), state_dict(), load_state_dict()."""

    def __init__(self, params, lr):
        self.defaults = dict(lr=lr, **ADAM_DEFAULTS)
        self.param_groups = [dict(self.defaults, params=list(params))]
        self.state = defaultdict(dict)  # parameter -> step, exp_avg, exp_avg_sq

    @torch.no_grad()
    def step(self):
        """torch's fused Adam kernel (torch.optim.Adam(fused=True) calls the same): every sum of
        the update in one pass over each parameter, instead of the single-tensor path's seven
        (measured: bench/compute/NOTES.md)."""
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for param in params:
                state = self.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                for moment in ("exp_avg", "exp_avg_sq"):  # (a checkpoint's may be in another layout)
                    state[moment] = alike(state[moment], param)
            states = [self.state[p] for p in params]
            steps = [s["step"] for s in states]
            torch._foreach_add_(steps, 1)
            beta1, beta2 = group["betas"]
            torch._fused_adam_(
                params,
                [alike(p.grad, p) for p in params],
                [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states],
                [],
                steps,
                lr=group["lr"],
                beta1=beta1,
                beta2=beta2,
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                amsgrad=False,
                maximize=False,
            )

    def zero_grad(self, set_to_none=True):
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if set_to_none:
                    param.grad = None
                else:  # kept, as zeros (torch.distributed's optimizer wrappers may ask for that)
                    param.grad.detach_().zero_()

    def state_dict(self):
        """torch's layout: parameters numbered in order; the state's tensors are not copied."""
        number = {}
        groups = []
        for group in self.param_groups:
            for param in group["params"]:
                number.setdefault(id(param), len(number))
            packed = {k: v for k, v in group.items() if k != "params"}
            groups.append(dict(packed, params=[number[id(p)] for p in group["params"]]))
        return {"state": {number[id(p)]: s for p, s in self.state.items()}, "param_groups": groups}

    def load_state_dict(self, state_dict):
        saved_groups = [dict(g) for g in state_dict["param_groups"]]
        if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("the optimizer state is for other parameters")
        params = {}
        for saved, group in zip(saved_groups, self.param_groups):
            params.update(zip(saved["params"], group["params"]))
            saved["params"] = group["params"]
        self.state = defaultdict(dict)
        for number, saved_state in state_dict["state"].items():
            param = params[number]
            self.state[param] = {k: v if k == "step" else v.to(dtype=param.dtype) for k, v in saved_state.items()}
        self.param_groups = saved_groups


def alike(tensor, param):
    """`tensor` in `param`'s memory layout. The fused kernel walks every tensor of a parameter in
    memory order, so a gradient laid out otherwise (a summed gradient is a view of the flat sum, in
    logical order; a channels_last weight is not) would be added to the wrong elements."""
    if tensor.stride() == param.stride():
        return tensor
    return torch.empty_like(param).copy_(tensor)


class OneCycleLR:
    """torch.optim.lr_scheduler.OneCycleLR with cosine annealing, two phases, over Adam's beta1:
    the rate warms up from max_lr/25 to max_lr over pct_start of the steps, then anneals to
    max_lr/25/1e4, while beta1 goes from 0.95 down to 0.85 and back. step() after every optimizer
    step; the attributes carry torch's names, and state_dict() is exactly torch's."""

    def __init__(self, optimizer, max_lr, total_steps, pct_start):
        self.optimizer = optimizer
        self.total_steps = total_steps
        self._schedule_phases = [
            dict(end_step=float(pct_start * total_steps) - 1, start_lr="initial_lr", end_lr="max_lr"),
            dict(end_step=total_steps - 1, start_lr="max_lr", end_lr="min_lr"),
        ]
        self._schedule_phases[0].update(start_momentum="max_momentum", end_momentum="base_momentum")
        self._schedule_phases[1].update(start_momentum="base_momentum", end_momentum="max_momentum")
        self._anneal_func_type = "cos"
        self.cycle_momentum = self.use_beta1 = True
        for group in optimizer.param_groups:
            group.update(initial_lr=max_lr / 25.0, max_lr=max_lr, min_lr=max_lr / 25.0 / 1e4)
            group.update(betas=(0.95, *group["betas"][1:]), max_momentum=0.95, base_momentum=0.85)
        self.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
        self.last_epoch = -1
        self._step_count = 0
        self._is_initial = True
        self.step()  # the first step's rate and beta1
        self._is_initial = False

    def step(self):
        self._step_count += 1
        self.last_epoch += 1
        if self.last_epoch > self.total_steps:
            raise ValueError(f"stepped {self.last_epoch} times, past the schedule's {self.total_steps}")
        for group in self.optimizer.param_groups:
            start = 0.0
            for i, phase in enumerate(self._schedule_phases):
                end = phase["end_step"]
                if self.last_epoch <= end or i == len(self._schedule_phases) - 1:
                    pct = (self.last_epoch - start) / (end - start)
                    group["lr"] = anneal(group[phase["start_lr"]], group[phase["end_lr"]], pct)
                    beta1 = anneal(group[phase["start_momentum"]], group[phase["end_momentum"]], pct)
                    group["betas"] = (beta1, *group["betas"][1:])
                    break
                start = end
        self._get_lr_called_within_step = False
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def get_last_lr(self):
        return self._last_lr

    def state_dict(self):
        return {k: v for k, v in vars(self).items() if k != "optimizer"}

    def load_state_dict(self, state_dict):
        vars(self).update(state_dict)


def anneal(start, end, pct):
    """Cosine from `start` (pct 0) to `end` (pct 1)."""
    return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)
