"""The one training loop: AdamW with warm-up and cosine decay, on a step or wall-clock
budget, with resumable checkpoints. ``paradraft distill`` and the demo models' recipe
(``lab/train_demo_models.py``) both train through it; each brings only its loss.

``loss_fn(step)`` builds step ``step``'s batch as a pure function of the step index, so a
resumed run sees the batches it would have seen, and returns (loss, scalars to log, target
tokens in the batch).
"""

from __future__ import annotations

import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

LossFn = Callable[[int], tuple[torch.Tensor, dict[str, float], int]]
EMA = 0.98  # smoothing of the logged loss and scalars


@dataclass
class Schedule:
    lr: float
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1  # the cosine decays to this share of ``lr``
    weight_decay: float = 0.01  # on matrices only; norms and biases are not decayed
    betas: tuple[float, float] = (0.9, 0.98)
    grad_clip: float = 1.0


def log(msg: str) -> None:
    tqdm.write(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stdout)
    sys.stdout.flush()


def make_optimizer(model: torch.nn.Module, schedule: Schedule) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2],
               "weight_decay": schedule.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=schedule.lr, betas=schedule.betas, eps=1e-8)


def lr_at(step: int, progress: float, schedule: Schedule) -> float:
    """Linear warm-up over ``warmup_steps``, then a cosine over ``progress`` in [0, 1]."""
    warmup = min(1.0, (step + 1) / schedule.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return schedule.lr * warmup * (schedule.min_lr_ratio + (1 - schedule.min_lr_ratio) * cosine)


def progress_of(step: int, elapsed: float, max_steps: int | None, budget_s: float) -> float:
    """How far the run is: by steps or by the wall clock, whichever ends it first."""
    by_steps = step / max_steps if max_steps else 0.0
    by_time = elapsed / budget_s if math.isfinite(budget_s) else 0.0
    return min(1.0, max(by_steps, by_time))


class ThreadTuner:
    """Re-picks torch's intra-op thread count (1..max) from measured step times.

    On a CPU shared with other (higher-priority) jobs one thread is often faster than two,
    because every parallel op waits for its slowest thread. Every ``period`` steps each
    candidate runs ``probe`` real training steps; the fastest is kept until the next probe.
    """

    def __init__(self, max_threads: int, enabled: bool, period: int = 80,
                 probe: int = 3) -> None:
        self.options = list(range(1, max_threads + 1)) if enabled else [max_threads]
        self.period, self.probe = period, probe
        self.best = max_threads
        self.times: dict[int, list[float]] = {}
        torch.set_num_threads(max_threads)

    def before_step(self, step: int) -> None:
        if len(self.options) == 1:
            return
        phase = step % self.period
        n_probe = self.probe * len(self.options)
        if phase == 0:
            self.times = {}
        if phase < n_probe:
            torch.set_num_threads(self.options[phase // self.probe])
        elif phase == n_probe and self.times:
            self.best = min(self.times, key=lambda t: float(np.mean(self.times[t])))
            torch.set_num_threads(self.best)

    def after_step(self, step: int, seconds: float) -> None:
        phase = step % self.period
        # the first step after a switch is not timed
        if len(self.options) > 1 and phase < self.probe * len(self.options) \
                and phase % self.probe != 0:
            self.times.setdefault(torch.get_num_threads(), []).append(seconds)


def save_checkpoint(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer,
                    state: dict) -> None:
    payload = {"model": model.state_dict(), "optimizer": opt.state_dict(), "state": state,
               "torch_rng": torch.get_rng_state(), "numpy_rng": np.random.get_state(),
               "python_rng": random.getstate()}
    tmp = path.with_suffix(".tmp")
    torch.save(payload, tmp)
    tmp.replace(path)  # a run stopped mid-write keeps the previous checkpoint


def load_checkpoint(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer
                    ) -> dict | None:
    if not path.is_file():
        return None
    payload = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(payload["model"])
    opt.load_state_dict(payload["optimizer"])
    torch.set_rng_state(payload["torch_rng"])
    np.random.set_state(payload["numpy_rng"])
    random.setstate(payload["python_rng"])
    log(f"resumed {path.stem} at step {payload['state']['step']}")
    return payload["state"]


def train_loop(model: torch.nn.Module, loss_fn: LossFn, schedule: Schedule, *,
               ckpt_file: Path, desc: str, max_steps: int | None = None,
               budget_s: float = math.inf, resume: bool = True, ckpt_minutes: float = 3.0,
               history_every: int = 25, evaluate: Callable[[], dict[str, float]] | None = None,
               tuner: ThreadTuner | None = None) -> dict:
    """Optimise until ``max_steps`` or ``budget_s`` seconds, whichever comes first. Every
    ``history_every`` steps a history entry is logged, with ``evaluate()``'s figures when
    given; ``ckpt_file`` is written every ``ckpt_minutes`` and at the end."""
    if max_steps is None and not math.isfinite(budget_s):
        raise ValueError("train_loop needs max_steps or a finite budget_s")
    opt = make_optimizer(model, schedule)
    state = (load_checkpoint(ckpt_file, model, opt) if resume else None) or {
        "step": 0, "elapsed": 0.0, "tokens": 0, "loss_ema": None, "scalar_ema": {},
        "history": []}
    finite = math.isfinite(budget_s)
    bar = tqdm(total=round(budget_s) if finite else max_steps, desc=desc,
               unit="s" if finite else "step", mininterval=5, ncols=110,
               initial=min(round(state["elapsed"]), round(budget_s)) if finite
               else state["step"])
    t_start, last_ckpt = time.time() - state["elapsed"], time.time()
    stop_reason = "steps"
    model.train()
    while True:
        step, elapsed = state["step"], time.time() - t_start
        if max_steps is not None and step >= max_steps:
            break
        if elapsed >= budget_s:
            stop_reason = "wall_clock"
            break
        lr = lr_at(step, progress_of(step, elapsed, max_steps, budget_s), schedule)
        for group in opt.param_groups:
            group["lr"] = lr
        if tuner is not None:
            tuner.before_step(step)
        t_step = time.time()
        loss, scalars, num_tokens = loss_fn(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                         schedule.grad_clip))
        opt.step()
        if tuner is not None:
            tuner.after_step(step, time.time() - t_step)
        state["step"] = step + 1
        state["tokens"] += num_tokens
        for name, value in {"loss": loss.item(), **scalars}.items():
            old = state["loss_ema"] if name == "loss" else state["scalar_ema"].get(name)
            new = value if old is None else EMA * old + (1 - EMA) * value
            if name == "loss":
                state["loss_ema"] = new
            else:
                state["scalar_ema"][name] = new
        if state["step"] % history_every == 0:
            elapsed = time.time() - t_start
            entry = {"step": state["step"], "loss_ema": round(state["loss_ema"], 4),
                     "lr": lr, "grad_norm": round(grad_norm, 3), "elapsed": round(elapsed, 1),
                     "threads": torch.get_num_threads(),
                     **{k: round(v, 4) for k, v in scalars.items()}}
            if evaluate is not None:
                entry.update({k: round(v, 4) for k, v in evaluate().items()})
                model.train()
            state["history"].append(entry)
            log(f"{desc} " + " ".join(f"{k}={v}" for k, v in entry.items())
                + f" tok/s={state['tokens'] / max(elapsed, 1e-9):.0f}")
        bar.update((min(round(time.time() - t_start), round(budget_s)) if finite
                    else state["step"]) - bar.n)
        bar.set_postfix(step=state["step"], loss=f"{state['loss_ema']:.3f}", lr=f"{lr:.1e}")
        if time.time() - last_ckpt >= ckpt_minutes * 60:
            state["elapsed"] = time.time() - t_start
            save_checkpoint(ckpt_file, model, opt, state)
            last_ckpt = time.time()
    bar.close()
    state["elapsed"] = time.time() - t_start
    save_checkpoint(ckpt_file, model, opt, state)
    model.eval()
    return {
        "steps": state["step"], "max_steps": max_steps, "stop_reason": stop_reason,
        "tokens_seen": state["tokens"], "wall_seconds": round(state["elapsed"], 1),
        "final_train_loss_ema": None if state["loss_ema"] is None
        else round(state["loss_ema"], 4),
        "final_train_scalars_ema": {k: round(v, 4) for k, v in state["scalar_ema"].items()},
        "history": state["history"],
        "schedule": asdict(schedule),
    }
