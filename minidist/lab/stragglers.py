"""A straggler on purpose: one rank made slower, to show what balancing does (chapter 3, section 7).

A rank that stays slow, as a slower machine in a cluster would be, is hard to come by on one
shared machine, so `make_straggler` adds busy work to one rank's forward, in proportion to the
rows it processes. Two ways to size it:

- `slowdown`: a fraction of the rank's own measured compute (1.0: about twice as slow), so the
  straggler is as slow *relative to its peers* on any machine (notebook 03);
- `seconds_per_row`: a fixed time per row (`python -m minidist.bench dp --slow RANK:MS`), whose
  effect depends on how fast the machine is.
"""
from __future__ import annotations

import time

# Backward costs about twice the forward (chapter 1: 2 FLOPs per parameter and token forward,
# 4 backward), so forward + backward is about 3 forwards: the busy work scales the whole compute.
FORWARD_AND_BACKWARD_PER_FORWARD = 3.0


def busy_wait(seconds: float) -> None:
    """Keep the core busy for `seconds`, as a slower core would be (sleeping would free it)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class SlowedModel:
    """The model plus busy work after every forward: a slower device. The busy work is
    `seconds_per_row` × rows + `slowdown` × (this forward's own time × 3, its forward and
    backward); both grow with the rows. Everything but the call is the model's own."""

    def __init__(self, model, seconds_per_row: float = 0.0, slowdown: float = 0.0):
        if seconds_per_row < 0 or slowdown < 0:
            raise ValueError(f"a straggler needs seconds_per_row >= 0 and slowdown >= 0, "
                             f"got {seconds_per_row} and {slowdown}")
        self.model, self.seconds_per_row, self.slowdown = model, seconds_per_row, slowdown

    def __call__(self, x, y=None):
        start = time.perf_counter()
        out = self.model(x, y)
        compute = (time.perf_counter() - start) * FORWARD_AND_BACKWARD_PER_FORWARD
        busy_wait(self.seconds_per_row * len(x) + self.slowdown * compute)
        return out

    def __getattr__(self, name):
        return getattr(self.model, name)


def make_straggler(trainer, seconds_per_row: float = 0.0, slowdown: float = 0.0) -> None:
    """Slow this trainer down (`SlowedModel`): its data-parallel wrapper's module (the
    data-parallel trainers) or its model (any other trainer)."""
    ddp = getattr(trainer, "ddp", None)
    if ddp is not None:
        ddp.module = SlowedModel(ddp.module, seconds_per_row, slowdown)
    else:
        trainer.model = SlowedModel(trainer.model, seconds_per_row, slowdown)
