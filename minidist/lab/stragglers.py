"""A straggler on purpose: one rank made slower, to show what balancing does (chapter 3, section 7).

A rank that stays slow, as a slower machine in a cluster would be, is hard to come by on one
shared machine, so `make_straggler` adds busy work per row to one rank's forward
(`python -m minidist.bench dp --slow RANK:MS`, notebook 03).
"""
from __future__ import annotations

import time


class SlowedModel:
    """The model plus `extra` seconds of busy work per row after every forward: a slower device.
    Everything but the call is the model's own."""

    def __init__(self, model, extra: float):
        self.model, self.extra = model, extra

    def __call__(self, x, y=None):
        out = self.model(x, y)
        end = time.perf_counter() + self.extra * len(x)
        while time.perf_counter() < end:  # busy, as a slower core would be (sleeping frees the core)
            pass
        return out

    def __getattr__(self, name):
        return getattr(self.model, name)


def make_straggler(trainer, seconds_per_row: float) -> None:
    """Slow this trainer down by `seconds_per_row` of busy work per row in every forward: its
    data-parallel wrapper's module (the data-parallel trainers) or its model (any other trainer)."""
    ddp = getattr(trainer, "ddp", None)
    if ddp is not None:
        ddp.module = SlowedModel(ddp.module, seconds_per_row)
    else:
        trainer.model = SlowedModel(trainer.model, seconds_per_row)
