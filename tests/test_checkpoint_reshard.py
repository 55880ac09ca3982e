"""One checkpoint format for every layout: a run saved by one layout resumes on another (chapters 2, 8).

Under real mpiexec, through the demo. A run of 8 steps is killed (MINIDIST_KILL) just after its
checkpoint of step 4; another layout then resumes it with the same flags. Two things are checked
on every hop:

* the state the new layout loaded, put back together as whole global arrays (weights, AdamW
  moments, fp32 masters, loss scale, step), is the saved one bit for bit;
* the resumed run continues the uninterrupted one: in float64 its losses and final weights
  equal it to 1e-9 relative (only summation order differs between layouts); in 16 bits, within
  the format's rounding (the layouts add their 16-bit gradients in other orders).

The float64 chain has two hops: dp4-zero3 saves step 4; tp2-pp2 resumes it, runs to the end and
saves step 6 on the way; one serial process resumes that. Then bf16 dp2 -> dp4, and fp16 ZeRO-2
with gradient accumulation -> dp2-tp2 (the fp16 loss scaler's state travels too).
"""
import json

import numpy as np
import pytest
from conftest import relative_difference
from test_checkpoint import demo  # the demo under mpiexec, with MINIDIST_KILL (the chaos test's)

from minidist.training import checkpoint
from minidist.comm.launch import run
from minidist.precision import format_of
from minidist.training.train import OptimSettings

SMALL = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "16", "--batch-size", "8",
         "--log-every", "-1", "--steps", "8"]
K, KILLED = 2, 4  # --checkpoint-every; the step before which the first run dies (its last checkpoint)
CASES = {  # name: (flags, (saving layout, ranks), [(resuming layout, ranks), ...])
    "float64": (["--dtype", "float64"], ("dp4-zero3", 4), [("tp2-pp2", 4), ("serial", 1)]),
    "bf16": (["--dtype", "float32"], ("dp2-bf16", 2), [("dp4-bf16", 4)]),
    "fp16": (["--dtype", "float32"], ("dp2-zero2-m2-fp16", 2), [("dp2-tp2-fp16", 4)]),
}


def loaded_state(directory: str, flags: list[str]):
    """Rank program: the trainer the demo builds for `flags`, resumed from `directory` as the demo
    resumes; its step and, on rank 0, its state as whole global arrays."""
    from minidist import comm, demo, frameworks
    from minidist.training import strategies
    from minidist.parallel import checkpointing
    from minidist.core.tensor import set_default_dtype

    world = comm.get_world()
    parser = demo.build_parser()
    args = parser.parse_args(flags)
    demo.apply_layout_name(args, frameworks.given_flags(parser, flags))
    config, task, layout = demo.check_args(args, world.size)
    set_default_dtype(args.dtype)
    trainer = strategies.make_trainer(layout, args, config, task, world)
    step = checkpointing.resume(directory, trainer, demo.run_facts(layout, args, config, world.size), world)
    state = checkpointing.snapshot(trainer, world)  # collective
    return step, state.arrays if world.rank == 0 else None


def differing(saved: dict, loaded: dict) -> list[str]:
    """The arrays whose dtype, shape or bits differ (or that one side lacks)."""
    return sorted(name for name in set(saved) | set(loaded) if name not in saved or name not in loaded
                  or saved[name].dtype != loaded[name].dtype or saved[name].shape != loaded[name].shape
                  or saved[name].tobytes() != loaded[name].tobytes())


@pytest.fixture(scope="module", params=[pytest.param(case, marks=[pytest.mark.full] if case == "fp16" else [])
                                        for case in CASES])  # fp16 in the full tier (conftest.py)
def hops(request, tmp_path_factory):
    """Per case: the uninterrupted run, and for each hop the checkpoint it resumed, the state it
    loaded and the run it made."""
    flags, (saver, n), resumers = CASES[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    ckpt = ["--checkpoint", str(tmp / "ckpt"), "--checkpoint-every", str(K)]

    def outputs(tag):
        return ["--json", str(tmp / f"{tag}.json"), "--save", str(tmp / f"{tag}.npz")]

    straight = demo(n, *SMALL, *flags, "--layout", saver, *outputs("straight"))
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed = demo(n, *SMALL, *flags, "--layout", saver, *ckpt, kill=f"0:{KILLED}")
    assert killed.returncode != 0 and checkpoint.latest(tmp / "ckpt").name == checkpoint.step_name(KILLED)
    out = []
    for i, (layout, ranks) in enumerate(resumers):
        path = checkpoint.latest(tmp / "ckpt")
        saved = checkpoint.consolidate(path)
        step, loaded = run(loaded_state, ranks, str(tmp / "ckpt"), SMALL + flags + ["--layout", layout],
                           timeout=120)[0]
        resumed = demo(ranks, *SMALL, *flags, "--layout", layout, *ckpt, *outputs(f"hop{i}"))
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        out.append({"layout": layout, "path": path, "step": step, "saved": saved, "loaded": loaded,
                    "stdout": resumed.stdout, "run": json.loads((tmp / f"hop{i}.json").read_text()),
                    "weights": dict(np.load(tmp / f"hop{i}.npz"))})
    return request.param, json.loads((tmp / "straight.json").read_text()), dict(np.load(tmp / "straight.npz")), out


def test_the_loaded_state_is_the_saved_one_bit_for_bit(hops):
    case, _, _, out = hops
    for hop in out:
        saved, loaded = hop["saved"], hop["loaded"]
        assert hop["step"] == int(hop["path"].name.split("-")[1])
        assert differing(saved, loaded) == [], (case, hop["layout"])
        kinds = {name.split(".")[0] for name in saved}
        assert {"param", "exp_avg", "exp_avg_sq", "step"} <= kinds, kinds
        if case != "float64":  # 16 bits: the weights in their format, the fp32 masters beside them
            assert "master" in kinds and saved["param.wte.weight"].dtype == format_of(case).dtype
            assert saved["master.wte.weight"].dtype == np.float32
        if case == "fp16":
            assert "scaler" in kinds and saved["scaler.growth_tracker"] > 0  # the scaler's state moved
        assert f"resharded to {hop['layout']}" in hop["stdout"], hop["stdout"][-500:]


def test_the_resumed_run_continues_the_uninterrupted_one(hops):
    case, straight, want, out = hops
    for hop in out:
        got, first = hop["run"], hop["run"]["first_step"]
        assert first == hop["step"] and len(got["losses"]) == len(straight["losses"]) - first > 0
        expected = straight["losses"][first:]
        weights = hop["weights"]
        assert set(weights) == set(want)
        if case == "float64":  # only summation order differs between layouts
            np.testing.assert_allclose(got["losses"], expected, rtol=1e-9, err_msg=hop["layout"])
            for key, value in want.items():
                assert relative_difference(weights[key], value) <= 1e-9, (hop["layout"], key)
        else:  # 16-bit gradients add up in another order: the losses within a few of the format's
            # epsilons, each weight within its rounding and AdamW's largest steps since the resume
            # (an update moves an element by about lr whatever its gradient's size), as in
            # tests/test_parallel_precision.py
            eps = format_of(case).eps
            for g, w in zip(got["losses"], expected):
                assert abs(g - w) <= 8 * eps * w, (hop["layout"], got["losses"], expected)
            settings = OptimSettings(lr=3e-3, steps=8, warmup=0, min_lr=3e-4)  # the demo's, for 8 steps
            drift = 2 * sum(settings.lr_at(s) for s in range(first, 8))
            for key, value in want.items():
                value = value.astype(np.float64)
                bound = drift + eps * float(np.max(np.abs(value)))
                assert float(np.max(np.abs(weights[key] - value))) <= bound, (hop["layout"], key)
