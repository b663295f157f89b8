"""The one training loop of the shipped models (`training.shapes_vit.fit`): a step-exact run is reproducible, logs
its steps and writes its final checkpoint once with the run's facts."""
from __future__ import annotations

import json

import torch
from safetensors import safe_open

from training import shapes_vit as train


def run_vit(out, steps: int = 2) -> dict[str, torch.Tensor]:
    train.main(["--steps", str(steps), "--batch-size", "4", "--val-n", "4", "--threads", "1", "--log-every", "1",
                "--out", str(out)])
    with safe_open(str(out / "shapes_vit.safetensors"), "pt") as weights:
        return {name: weights.get_tensor(name) for name in weights.keys()} | {"meta": weights.metadata()}


def test_a_step_exact_run_is_reproducible_and_checkpointed_once(tmp_path):
    first, second = run_vit(tmp_path / "a"), run_vit(tmp_path / "b")
    meta = first.pop("meta")
    assert second.pop("meta")["steps"] == meta["steps"] == "2" and meta["final"] == "true"
    assert all(torch.equal(first[name], second[name]) for name in first)
    log = (tmp_path / "a" / "train.log").read_text().splitlines()
    assert [line.split("] ")[1].split(" loss")[0] for line in log if "] step " in line] == ["step 1", "step 2"]
    assert sum("done step 2" in line for line in log) == 1
    assert json.loads(meta["val"])["n"] == 4


def test_the_schedule_warms_up_then_decays_to_the_floor():
    args = train.training_parser("", minutes=1, pair_fraction=0, lr=1e-3, weight_decay=0).parse_args(["--warmup", "0.1"])
    rates = [train.learning_rate(args, p) for p in (0.0, 0.05, 0.1, 0.55, 1.0)]
    assert rates[0] == 0 and rates[1] == rates[2] / 2 and rates[2] == 1e-3
    assert rates[2] > rates[3] > rates[4] and abs(rates[4] - args.min_lr) < 1e-12
