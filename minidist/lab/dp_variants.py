"""Rank programs for chapter 3's notebook: data parallelism runs that report what they measured.

Chapter 3 (数据并行). A notebook is one process; `minidist.comm.launch.run(fn, N, ...)` starts N
real MPI ranks and calls `fn` on each. Functions that the ranks import by name must live in a
module, so they live here: each trains a `DataParallelTrainer` (minidist/parallel/data_parallel.py)
or a `BalancedDataParallelTrainer` (minidist/parallel/balance.py) for a few steps in one or more
variants and returns plain dicts (losses, final weights, the timeline of every step, traffic
counters, memory), which `run` brings back to the notebook.
"""
from __future__ import annotations


def train_variants(variants: list[dict], config: dict, steps: int, batch: int, dtype: str = "float32",
                   settings: dict | None = None, seed: int = 0) -> dict:
    """Train each variant on this job's ranks; returns {variant name: measurements}.

    A variant is a dict: name, and optionally overlap (default True), bucket_kb (1024),
    accumulation (1), rows (rows per rank), balance (False: True trains a
    `BalancedDataParallelTrainer`), slow ((rank, extra seconds per row): a straggler,
    `minidist.lab.stragglers.make_straggler`). Measurements: losses (global mean per step), rows (the
    split of every step), state (final weights, rank 0),
    events (this rank's timeline on the clock all ranks share; `timeline.normalise` aligns
    them), bytes_sent and messages per step (traffic counters, set-up excluded), by_kind,
    grad_bytes, num_buckets, step_seconds, memory.
    """
    import time

    from minidist import comm as dist
    from minidist.core.data import make_task
    from minidist.comm import traffic
    from minidist.core.model import GPTConfig
    from minidist.lab.stragglers import make_straggler
    from minidist.parallel.balance import BalancedDataParallelTrainer
    from minidist.parallel.data_parallel import DataParallelTrainer
    from minidist.runtime import tune_malloc
    from minidist.core.tensor import default_dtype
    from minidist.training.train import OptimSettings

    tune_malloc()
    world = dist.get_world()
    settings = OptimSettings(**(settings or dict(lr=3e-3, steps=steps, warmup=1, min_lr=3e-4)))
    out = {}
    with default_dtype(dtype):
        task = make_task("sort", config["block_size"], seed=seed)
        for v in variants:
            kind = BalancedDataParallelTrainer if v.get("balance", False) else DataParallelTrainer
            trainer = kind(GPTConfig(**config), settings, task, batch, seed=seed, group=world,
                           overlap=v.get("overlap", True), bucket_cap_bytes=int(v.get("bucket_kb", 1024) * 1024),
                           accumulation=v.get("accumulation", 1), rows=v.get("rows"))
            slow = v.get("slow")
            if slow and world.rank == slow[0]:
                make_straggler(trainer, slow[1])
            dist.barrier()
            traffic.reset()  # count the training steps only, not the set-up broadcast
            trainer.timeline.clear()
            losses, seconds, rows = [], [], []
            for s in range(steps):
                rows.append(list(trainer.rows))
                start = time.perf_counter()
                losses.append(trainer.step(s)[0])
                seconds.append(time.perf_counter() - start)
            counts = traffic.snapshot()
            out[v["name"]] = {
                "losses": losses,
                "rows": rows,
                "state": trainer.state_dict() if world.rank == 0 else None,
                "events": list(trainer.timeline.events),
                "bytes_sent": counts["total"]["bytes_sent"] / steps,
                "messages": counts["total"]["messages"] / steps,
                "by_kind": {k: c["bytes_sent"] / steps for k, c in counts.items() if k != "total"},
                "grad_bytes": sum(p.data.nbytes for p in trainer.model.parameters()),
                "num_buckets": len(getattr(trainer.ddp, "buckets", [])),  # the naive wrapper has none
                "step_seconds": seconds,
                "memory": trainer.memory(),
            }
    return out
