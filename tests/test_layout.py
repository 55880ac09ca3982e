"""The layout (chapter 9): one value, one rule, read the same by the planner and the demo.

What the planner ranks, the demo must run, and it must run it equal to serial: the set of
layouts `plan.candidate_layouts` enumerates for small worlds is exactly the set `Layout.validate`
accepts, the demo's own flag checking (`demo.check_args`) accepts each with the same layout, and
a seeded sample of them, run under real mpiexec, reproduces the serial weights in float64.
"""
from __future__ import annotations

import itertools
import random
import subprocess
import sys

import numpy as np
import pytest

from minidist import demo
from minidist.comm.launch import find_mpiexec
from minidist.training.layout import Layout, strategy
from minidist.core.model import GPTConfig
from minidist.core.moe import MoEConfig
from minidist.plan.search import SCHEDULES, candidate_layouts, divisors

SMALL = dict(n_layer=2, n_embd=32, n_head=2, block_size=16)
SMALL_FLAGS = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "16"]
DEMO = GPTConfig(**SMALL)
BATCH = 8


def every_layout(world: int, config, batch: int):
    """Every point of the planner's search space for `world` ranks, valid or not (a superset of
    what the planner writes down: every divisor triple, ZeRO stage, m up to the batch, schedule, v)."""
    for dp, tp in itertools.product(divisors(world), repeat=2):
        if world % (dp * tp):
            continue
        pp = world // (dp * tp)
        for zero, m in itertools.product(range(4), range(1, batch + 1)):
            for schedule, v in [(None, 1), *((s, 1) for s in SCHEDULES), ("interleaved", 2), ("interleaved", 3)]:
                yield Layout(dp, tp, pp, zero, m, schedule, v)


def demo_layout(layout: Layout, world: int, extra=()) -> Layout:
    """The layout the demo makes of `layout`'s flags (its own parser and check, no MPI)."""
    args = demo.build_parser().parse_args([*layout.demo_flags(), *SMALL_FLAGS, "--batch-size", str(BATCH), *extra])
    args.steps = 4
    _, _, got = demo.check_args(args, world)
    return got


@pytest.mark.parametrize("world", range(1, 9))
def test_planner_enumerates_exactly_what_validate_accepts_and_the_demo_runs(world):
    accepted = {lay for lay in every_layout(world, DEMO, BATCH) if lay.why_invalid(DEMO, world, BATCH) is None}
    planned = candidate_layouts(DEMO, world, BATCH)
    assert len(planned) == len(set(planned)) and set(planned) == accepted
    for layout in planned:  # the demo takes each one's flags and reads the same layout back
        assert demo_layout(layout, world) == layout, layout
        assert Layout.parse(str(layout)) == layout


def test_names_parse_back():
    rng = random.Random(0)
    choices = dict(dp=[1, 2, 4], tp=[1, 2], pp=[1, 2, 3], zero=[0, 1, 3], microbatches=[1, 4],
                   schedule=[None, "gpipe", "1f1b"], cp=[1, 2], ep=[1, 2], sequence_parallel=[False, True],
                   precision=["fp32", "bf16", "fp16"], fp32_grads=[False, True], recompute=["none", "full"],
                   naive_dp=[False, True], balance=[False, True], bucket_kb=[1024, 64],
                   cp_algorithm=["ring", "ulysses"], cp_split=["zigzag", "contiguous"])
    for _ in range(300):
        layout = Layout(**{k: rng.choice(v) for k, v in choices.items()})
        assert Layout.parse(str(layout)) == layout, str(layout)
    assert str(Layout()) == "serial" and Layout.parse("serial") == Layout()
    assert str(Layout(2, 2, 1, 1, 4)) == "dp2-tp2-zero1-m4"
    assert str(Layout(pp=4, microbatches=8, schedule="interleaved", virtual_stages=2)) == "pp4-m8-interleaved-v2"
    assert Layout.parse("tp2-pp2-sp-m4-gpipe-bf16") == Layout(tp=2, pp=2, sequence_parallel=True, microbatches=4,
                                                              schedule="gpipe", precision="bf16")
    for bad in ("dp0", "dp2-dp2", "tp2-zero7", "pp2-interleaved", "dp2-banana", "m04"):
        with pytest.raises(ValueError, match="layout"):
            Layout.parse(bad)


@pytest.mark.parametrize("layout, world, message", [
    (Layout(dp=2, pp=2, zero=2, microbatches=2), 4, "--zero 2 with --pp 2"),
    (Layout(tp=2, zero=1), 2, "--zero needs --dp N"),
    (Layout(dp=2, sequence_parallel=True), 2, "--sequence-parallel needs --tp N"),
    (Layout(dp=2, tp=2, balance=True), 4, "--balance needs --dp N alone"),
    (Layout(dp=4), 2, "dp=4 needs 4 ranks, but this job has 2"),
    (Layout(dp=2, cp=2, zero=2), 4, "--zero 2 with --cp 2"),
    (Layout(dp=3), 3, "not divisible by dp=3"),
    (Layout(dp=2, precision="bf16", fp32_grads=True, zero=1), 2, "--fp32-grads applies to data parallelism"),
    (Layout(dp=2, zero=3, recompute="full"), 2, "--recompute full is not built for the dp2-zero3"),
    (Layout(pp=3), 3, "pp=3 stages needs at least 3 layers"),
])
def test_refusals_are_one_line_naming_the_flags(layout, world, message):
    why = layout.why_invalid(DEMO, world, BATCH)
    assert why is not None and message in why and "\n" not in why
    with pytest.raises(ValueError, match=f"layout {layout}"):
        layout.validate(DEMO, world, BATCH)


def test_what_the_frameworks_compose_is_valid_now():
    """ZeRO with gradient accumulation (DeepSpeed's commonest configuration), ZeRO-2/3 over a
    tensor-parallel mesh with accumulation, tensor parallelism with accumulation."""
    for layout in (Layout(dp=4, zero=1, microbatches=2), Layout(dp=4, zero=2, microbatches=2),
                   Layout(dp=4, zero=3, microbatches=2), Layout(dp=2, tp=2, zero=3, microbatches=2),
                   Layout(tp=2, microbatches=2)):
        assert layout.why_invalid(DEMO, layout.world_size, BATCH) is None, layout
    moe = MoEConfig(**SMALL, num_experts=4)
    assert strategy(Layout(dp=4, ep=2), moe=True) == "dp4-ep2" and Layout(dp=4, ep=2).why_invalid(moe, 4, 8) is None
    for layout in (Layout(dp=2, tp=2, ep=2), Layout(dp=2, pp=2, ep=2, microbatches=2), Layout(dp=4, microbatches=2)):
        assert layout.why_invalid(moe, 4, 8) is None, layout  # expert parallelism on the mesh (expert_stage.py)
    assert strategy(Layout(dp=2, pp=2, ep=2, microbatches=2), moe=True) == "dp2-pp2-ep2"
    assert "--experts combines with --dp, --ep, --tp, --pp" in Layout(dp=2, zero=2).why_invalid(moe, 2, 8)


def test_demo_layout_flag_and_its_clashes():
    args = demo.build_parser().parse_args(["--layout", "dp2-tp2-zero1-m2", *SMALL_FLAGS])
    demo.apply_layout_name(args, given=set())
    _, _, layout = demo.check_args(args, 4)
    assert layout == Layout(dp=2, tp=2, zero=1, microbatches=2)
    with pytest.raises(ValueError, match="drop --dp"):
        demo.apply_layout_name(args, given={"dp"})


def run_demo(flags, ranks, path, batch):
    command = [sys.executable, "-m", "minidist.demo", *flags, *SMALL_FLAGS, "--batch-size", str(batch), "--steps",
               "3", "--dtype", "float64", "--log-every", "-1", "--save", str(path)]
    if ranks > 1:
        command = [find_mpiexec(), "-n", str(ranks), *command]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return dict(np.load(path))


@pytest.mark.full  # five demo jobs; the quick tier runs the demo's tour
def test_a_seeded_sample_of_planned_layouts_runs_equal_to_serial(tmp_path):
    batch = 12  # splits over 2, 3 and 4 replicas
    serial = run_demo([], 1, tmp_path / "serial.npz", batch)
    rng = random.Random(24)
    sample = [rng.choice(candidate_layouts(DEMO, world, batch)) for world in (2, 3, 4, 4)]
    for i, layout in enumerate(sample):
        weights = run_demo(["--layout", str(layout)], layout.world_size, tmp_path / f"{i}.npz", batch)
        for name, value in serial.items():
            scale = max(np.max(np.abs(value)), 1e-2)
            assert np.max(np.abs(weights[name] - value)) / scale < 1e-9, (str(layout), name)


@pytest.mark.full  # seven demo jobs
def test_compositions_the_frameworks_use_run_equal_to_serial(tmp_path):
    """ZeRO 1-3 with gradient accumulation (alone and over a tensor-parallel mesh), tensor
    parallelism with accumulation, and a DeepSpeed config of ZeRO-1 with two accumulation steps,
    each under real mpiexec against the serial run in float64."""
    batch = 12
    serial = run_demo([], 1, tmp_path / "serial.npz", batch)
    config = tmp_path / "ds.json"
    config.write_text('{"train_batch_size": 12, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1}, '
                      '"gradient_clipping": 1.0}')  # DeepSpeed clips only when asked; the serial run clips at 1
    runs = [(["--layout", "dp3-zero1-m2"], 3), (["--layout", "dp2-zero2-m3"], 2), (["--layout", "dp4-zero3-m3"], 4),
            (["--layout", "dp2-tp2-zero3-m2"], 4), (["--layout", "tp2-m2"], 2),
            (["--deepspeed-config", str(config)], 2)]
    for i, (flags, ranks) in enumerate(runs):
        weights = run_demo(flags, ranks, tmp_path / f"{i}.npz", batch)
        for name, value in serial.items():
            scale = max(np.max(np.abs(value)), 1e-2)
            assert np.max(np.abs(weights[name] - value)) / scale < 1e-9, (flags, name)


@pytest.mark.full  # four demo jobs; tests/test_parallel_context_mesh.py runs the trainers in the quick tier
def test_context_parallel_inside_the_mesh_runs_equal_to_serial(tmp_path):
    """cp composed with tp, with a pipeline, and with ZeRO-1 over dp (the mesh's context stages),
    through the demo's --layout, against the serial run in float64."""
    batch = 8
    serial = run_demo([], 1, tmp_path / "serial.npz", batch)
    for i, name in enumerate(("tp2-cp2", "pp2-cp2-m2", "dp2-cp2-zero1-ulysses", "cp4-m2")):
        layout = Layout.parse(name)
        assert layout.why_invalid(DEMO, 4, batch) is None and strategy(layout) == name.replace("-m2", "")
        weights = run_demo(["--layout", name], 4, tmp_path / f"{i}.npz", batch)
        for key, value in serial.items():
            assert np.max(np.abs(weights[key] - value)) / max(np.max(np.abs(value)), 1e-2) < 1e-9, (name, key)
