"""Pipeline stages cut by measured cost, not by block count (chapter 5).

`pipeline_stage.partition` gives every stage the same number of blocks. But the first stage also
runs the embedding, and the last the final LayerNorm, the LM head and the loss: with a large
vocabulary the head costs as much as a block or more. The last stage is then the slowest, every
other stage waits for it once per micro-batch, and the bubble grows past (p - 1) / (m + p - 1).
torchgpipe's `balance_by_time` answers by timing each layer on a sample batch and cutting where
the sums come out even; so does this file:

- `piece_costs(config, rows)`: seconds of forward + backward of the three kinds of piece of the
  serial GPT on one micro-batch of `rows` rows: the embedding, one block (every block has the
  same shapes, so one is timed and stands for all: equal blocks cut evenly, with no noise to
  break the tie), and the head with the loss.
- `cut_by_cost(costs, stages)`: the blocks cut into consecutive stages, at least one each, so that
  the slowest stage is as fast as it can be (a small dynamic programme over the cut points).
- `balanced_blocks(config, stages, rows, group)`: measured on every rank of `group`, averaged by
  an all-reduce (so that every rank holds the same numbers and makes the same cut), then cut.

`PipelineTrainer(..., stage_blocks=...)` builds the stages from such a cut; parallel still equals
serial, since only who computes which block changes (`python -m minidist.bench pipeline
--balance-stages time`).
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from minidist.core.model import GPTConfig
from minidist.core.tensor import Tensor


def stage_costs(costs: list[float], blocks: list[int]) -> list[float]:
    """Seconds of each stage for `costs` = [embedding, block 0, ..., block L-1, head] and a cut
    `blocks` (block counts per stage): the first stage adds the embedding, the last the head."""
    bounds = np.cumsum([0, *blocks])
    per = [float(sum(costs[1 + bounds[s]:1 + bounds[s + 1]])) for s in range(len(blocks))]
    per[0] += costs[0]
    per[-1] += costs[-1]
    return per


def cut_by_cost(costs: list[float], stages: int) -> list[int]:
    """The cut of the L blocks into `stages` consecutive stages (>= 1 block each) whose slowest
    stage is fastest; `costs` = [embedding, block 0, ..., block L-1, head]. Among equally good
    cuts, the one with the most blocks early (the order the search tries them)."""
    block = list(costs[1:-1])
    n = len(block)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} blocks into {stages} stages of at least one block each")
    prefix = np.cumsum([0.0, *block])

    def cost(s: int, start: int, end: int) -> float:  # stage s holding blocks start..end-1
        return prefix[end] - prefix[start] + (costs[0] if s == 0 else 0.0) + (costs[-1] if s == stages - 1 else 0.0)

    # best[s][e]: the slowest stage's seconds when stages s.. hold blocks e..n-1 (and its first cut)
    best = [[(np.inf, -1)] * (n + 1) for _ in range(stages + 1)]
    best[stages][n] = (0.0, n)
    for s in range(stages - 1, -1, -1):
        for start in range(n - (stages - s) + 1):
            for end in range(n - (stages - s - 1), start, -1):  # the most blocks first: ties go early
                slowest = max(cost(s, start, end), best[s + 1][end][0])
                if slowest < best[s][start][0]:
                    best[s][start] = (slowest, end)
    blocks, start = [], 0
    for s in range(stages):
        end = best[s][start][1]
        blocks.append(end - start)
        start = end
    return blocks


def median_seconds(run, repeats: int) -> float:
    """Median seconds of `run()` over `repeats` calls, after one warm-up."""
    run()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    return float(np.median(seconds))


def piece_costs(config: GPTConfig, rows: int, repeats: int = 3, seed: int = 0) -> list[float]:
    """[embedding, block 0, ..., block L-1, head and loss]: seconds of forward + backward of each
    on `rows` rows of `config.block_size` tokens, in the current default dtype."""
    from minidist.parallel.pipeline_stage import PipelineStage

    probe = PipelineStage(dataclasses.replace(config, n_layer=1), 0, 1, seed)  # one block stands for all
    rng = np.random.default_rng(seed)
    tokens = rng.integers(config.vocab_size, size=(rows, config.block_size))
    hidden = rng.standard_normal((rows, config.block_size, config.n_embd)).astype(probe.wpe.weight.dtype)

    def embedding():
        out = probe.embed(tokens)
        out.backward(np.ones_like(out.data))

    def block():
        x = Tensor(hidden, requires_grad=True)
        out = probe.chunks[0][0](x)
        out.backward(np.ones_like(out.data))

    def head():
        _, loss = probe.head(Tensor(hidden, requires_grad=True), tokens)
        loss.backward()

    one = [median_seconds(piece, repeats) for piece in (embedding, block, head)]
    return [one[0], *[one[1]] * config.n_layer, one[2]]


def balanced_blocks(config: GPTConfig, stages: int, rows: int, group=None) -> list[int]:
    """The cut by time, the same on every rank of `group`: each measures, the costs are averaged."""
    from minidist.comm import all_reduce
    from minidist.comm.world import resolve

    world = resolve(group)
    costs = np.array(piece_costs(config, rows))
    all_reduce(costs, op="sum", group=world)
    return cut_by_cost(list(costs / world.size), stages)
