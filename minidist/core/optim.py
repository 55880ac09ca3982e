"""Optimizers (SGD with momentum, AdamW), gradient clipping, and a learning-rate schedule.

Chapter 1 (and 8). AdamW is where most of a model's memory goes: besides the parameters and
gradients it keeps two moments per parameter (`exp_avg`, `exp_avg_sq`), twice the parameters'
size again. ZeRO's first stage begins by sharding exactly these arrays.

The update rules are written with in-place NumPy operations on whole arrays, in the same order
as PyTorch's, so a learner can check one step by hand (tests/test_optim.py does).
"""
from __future__ import annotations

import math

import numpy as np

from minidist.core.kernels import current


class Optimizer:
    """Holds parameter groups (dicts with "params" and hyper-parameters) and per-parameter state."""

    defaults: dict = {}

    def __init__(self, params, **hyper):
        params = list(params)
        if not params:
            raise ValueError("optimizer got an empty parameter list")
        groups = params if isinstance(params[0], dict) else [{"params": params}]
        self.param_groups = [{**self.defaults, **hyper, **g, "params": list(g["params"])} for g in groups]
        self.state: list[dict[str, np.ndarray]] = [{} for _ in self.params()]
        self.step_count = 0

    def params(self):
        return [p for group in self.param_groups for p in group["params"]]

    def zero_grad(self) -> None:
        for p in self.params():
            p.grad = None

    def step(self) -> None:
        self.step_count += 1
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.update(p.data, p.grad, self.state[index], group)
                index += 1

    def update(self, param: np.ndarray, grad: np.ndarray, state: dict, group: dict) -> None:
        raise NotImplementedError

    # -- checkpoints
    def state_dict(self) -> dict:
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        state = {i: {k: v.copy() for k, v in s.items()} for i, s in enumerate(self.state) if s}
        return {"step": self.step_count, "param_groups": hyper, "state": state}

    def load_state_dict(self, state_dict: dict) -> None:
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError(f"optimizer state has {len(state_dict['param_groups'])} parameter groups, "
                             f"this optimizer has {len(self.param_groups)}")
        params = self.params()
        for i, s in state_dict["state"].items():
            i = int(i)
            for key, value in s.items():
                if np.shape(value) != params[i].shape:
                    raise ValueError(f"optimizer state {key} of parameter {i}: shape {np.shape(value)}, "
                                     f"parameter has {params[i].shape}")
            self.state[i] = {k: np.array(v, dtype=params[i].dtype) for k, v in s.items()}
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update(saved)
        self.step_count = int(state_dict["step"])


class SGD(Optimizer):
    """p -= lr * (g + wd p), with optional momentum buffer b = momentum b + g."""

    defaults = {"lr": 0.01, "momentum": 0.0, "weight_decay": 0.0}

    def update(self, param, grad, state, group):
        g = grad + group["weight_decay"] * param if group["weight_decay"] else grad
        if group["momentum"]:
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = np.array(g, copy=True)
            else:
                buf *= group["momentum"]
                buf += g
            g = buf
        param -= group["lr"] * g


class AdamW(Optimizer):
    """Adam with decoupled weight decay (Loshchilov & Hutter), as torch.optim.AdamW.

        p  -= lr * wd * p                      (decay the weights directly, not through g)
        m   = b1 m + (1 - b1) g
        v   = b2 v + (1 - b2) g^2
        p  -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
    """

    defaults = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}

    def update(self, param, grad, state, group):
        if "exp_avg" not in state:
            state["exp_avg"] = np.zeros_like(param)
            state["exp_avg_sq"] = np.zeros_like(param)
        adamw_update(param, grad, state["exp_avg"], state["exp_avg_sq"], self.step_count, **{
            k: group[k] for k in ("lr", "betas", "eps", "weight_decay")})


def adamw_update(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay):
    """One AdamW step on arrays, in place, in torch.optim.AdamW's equations (step t counts from 1).
    Shared by AdamW and ZeRO's sharded optimizer.

    The fast kernel path (`minidist.core.kernels`, the default) runs the same equations through one
    scratch array, the bias corrections folded into scalars: `fused_fast.adamw_update`.
    """
    if current() == "fast":
        from minidist.core.fused_fast import adamw_update as fast

        return fast(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay)
    plain_adamw_update(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay)


def plain_adamw_update(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay):
    """One AdamW step on arrays, in place, written as the equations: weight decay, the two moving
    averages, their bias corrections, the step (chapter 1)."""
    ### BEGIN SOLUTION assignment=adamw_update
    beta1, beta2 = betas
    if weight_decay:
        param -= lr * weight_decay * param                          # p = p - lr wd p
    exp_avg[...] = beta1 * exp_avg + (1.0 - beta1) * grad           # m = b1 m + (1 - b1) g
    exp_avg_sq[...] = beta2 * exp_avg_sq + (1.0 - beta2) * grad * grad  # v = b2 v + (1 - b2) g^2
    m_hat = exp_avg / (1.0 - beta1**step)                           # bias corrections
    v_hat = exp_avg_sq / (1.0 - beta2**step)
    param -= lr * m_hat / (np.sqrt(v_hat) + eps)                    # p = p - lr m^ / (sqrt(v^) + eps)
    ### END SOLUTION


def weight_decay_groups(model, weight_decay: float):
    """nanoGPT's rule: decay matrices (weights of linears and embeddings), not biases or norms."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def grad_norm(grads) -> float:
    """Global L2 norm of a list of gradient arrays (None entries are skipped)."""
    return math.sqrt(sum(float(np.dot(g.ravel(), g.ravel())) for g in grads if g is not None))


def clip_grad_norm_(params, max_norm: float, total_norm: float | None = None) -> float:
    """Scale all gradients together so that their global norm is at most max_norm.

    Returns the norm before clipping (as torch.nn.utils.clip_grad_norm_ does). A strategy whose
    gradients are spread over ranks computes the whole model's norm itself and passes it as
    `total_norm`; the scaling is then the same as serial.
    """
    params = list(params)
    total = grad_norm(p.grad for p in params) if total_norm is None else total_norm
    scale = max_norm / (total + 1e-6)
    if scale < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad *= scale
    return total


DECAYS = ("cosine", "linear", "constant")


def lr_at(step: int, base_lr: float, warmup: int, total: int, min_lr: float = 0.0, decay: str = "cosine") -> float:
    """Linear warm-up for `warmup` steps, then `decay` to min_lr at step `total`: "cosine" (half
    a cosine), "linear" (a straight line, Megatron-LM's default), or "constant" (base_lr throughout)."""
    if warmup and step < warmup:
        return base_lr * (step + 1) / warmup
    if decay == "constant":
        return base_lr
    if step >= total:
        return min_lr
    progress = (step - warmup) / max(1, total - warmup)
    if decay == "linear":
        return base_lr + (min_lr - base_lr) * progress
    return min_lr + 0.5 * (base_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
