"""What every strategy's test shares: the serial reference run, and how to compare with it.

Principle 1 of the book: every parallel layout reproduces the single-process run. Each
strategy's test file runs its layouts under real mpiexec and compares them here, with the
serial run made by `serial_run` and differences measured by `relative_difference`.
"""
from __future__ import annotations

import numpy as np

from minidist.data import make_task
from minidist.model import GPTConfig
from minidist.tensor import default_dtype
from minidist.train import OptimSettings, SerialTrainer


def serial_run(config: dict, settings: dict, batch: int, steps: int, seed: int = 0, dtype: str = "float64",
               **config_changes) -> dict:
    """The serial reference: `steps` steps of SerialTrainer on the sort task, in float64.

    Returns {"steps": [(loss, accuracy), ...], "losses": [...], "initial": state_dict,
    "state": state_dict}; `config_changes` override fields of `config` (e.g. tie_weights=False)."""
    config = GPTConfig(**{**config, **config_changes})
    with default_dtype(dtype):
        task = make_task("sort", config.block_size, seed=seed)
        trainer = SerialTrainer(config, OptimSettings(**settings), task, batch, seed=seed)
        initial = trainer.state_dict()
        results = [trainer.step(s) for s in range(steps)]
    return {"steps": results, "losses": [loss for loss, _ in results], "initial": initial,
            "state": trainer.state_dict()}


def relative_difference(a, b) -> float:
    """max |a - b| relative to max |b|, or to 0.01 (the weights' scale) where max |b| is smaller.

    The floor matters for a parameter whose true gradient is zero (attention's k_proj.bias:
    softmax ignores a shift shared by every key): its values are pure round-off, ~1e-15, and a
    relative comparison of round-off means nothing."""
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / max(np.max(np.abs(b)), 1e-2))
