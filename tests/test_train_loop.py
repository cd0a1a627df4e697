"""The shared training loop: schedule, stopping rules, and resuming where it stopped."""

import math

import pytest
import torch

from paradraft.runtime.tools.train_loop import Schedule, lr_at, progress_of, train_loop


def regression(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 1), torch.nn.LayerNorm(1))
    x = torch.randn(64, 4)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])

    def loss_fn(step: int):
        rows = torch.Generator().manual_seed(step)
        pick = torch.randint(0, 64, (16,), generator=rows)
        loss = ((model[0](x[pick]) - y[pick]) ** 2).mean()
        return loss, {"half": loss.item() / 2}, 16

    return model, loss_fn


def test_schedule_warms_up_then_decays_to_the_floor():
    s = Schedule(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, 0.0, s) == pytest.approx(0.1)
    assert lr_at(9, 0.0, s) == pytest.approx(1.0)
    assert lr_at(50, 0.5, s) == pytest.approx(0.55)
    assert lr_at(99, 1.0, s) == pytest.approx(0.1)
    assert progress_of(5, 30.0, 10, 60.0) == 0.5  # steps and seconds agree
    assert progress_of(5, 45.0, 10, 60.0) == 0.75  # the clock binds first
    assert progress_of(5, 1e9, 10, math.inf) == 0.5  # no wall budget


def test_trains_stops_and_resumes_at_the_step_it_stopped(tmp_path):
    model, loss_fn = regression()
    before = loss_fn(999)[0].item()
    ckpt = tmp_path / "ckpt.pt"
    first = train_loop(model, loss_fn, Schedule(lr=0.3, warmup_steps=5), ckpt_file=ckpt,
                       desc="t", max_steps=40, history_every=10,
                       evaluate=lambda: {"probe": loss_fn(999)[0].item()})
    assert first["steps"] == 40 and first["stop_reason"] == "steps"
    assert first["tokens_seen"] == 40 * 16
    assert [h["step"] for h in first["history"]] == [10, 20, 30, 40]
    assert "probe" in first["history"][0] and "half" in first["history"][0]
    assert loss_fn(999)[0].item() < before / 4
    # norms and biases are not decayed
    decayed = [g["weight_decay"] for g in first_optimizer_groups(model)]
    assert decayed == [0.01, 0.0]

    again, _ = regression(seed=1)  # other weights: the checkpoint must replace them
    resumed = train_loop(again, regression()[1], Schedule(lr=0.3, warmup_steps=5),
                         ckpt_file=ckpt, desc="t", max_steps=60, history_every=10)
    assert resumed["steps"] == 60
    assert [h["step"] for h in resumed["history"]] == [10, 20, 30, 40, 50, 60]
    fresh = train_loop(regression(seed=1)[0], loss_fn, Schedule(lr=0.05), resume=False,
                       ckpt_file=tmp_path / "other.pt", desc="t", max_steps=0)
    assert fresh["steps"] == 0


def test_a_wall_budget_ends_the_run_and_a_run_needs_a_limit(tmp_path):
    model, loss_fn = regression()
    result = train_loop(model, loss_fn, Schedule(lr=0.01), ckpt_file=tmp_path / "c.pt",
                        desc="t", budget_s=0.0)
    assert result["steps"] == 0 and result["stop_reason"] == "wall_clock"
    with pytest.raises(ValueError, match="max_steps"):
        train_loop(model, loss_fn, Schedule(lr=0.01), ckpt_file=tmp_path / "d.pt", desc="t")


def first_optimizer_groups(model):
    from paradraft.runtime.tools.train_loop import make_optimizer

    return make_optimizer(model, Schedule(lr=0.1)).param_groups
