"""Every flag of every command line rejects a bad value in one line, before any work (minidist/cli.py).

One row per (program, flag, bad value): exit status 2, exactly one line on stderr that names the
flag, no traceback, and nothing written (each run starts in an empty directory and must leave
it empty; a run that trained would also outlive the subprocess timeout). Flags that only a
multi-rank job can reject run under `mpiexec -n 2`."""
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from minidist.comm.launch import find_mpiexec

DEMO, MEMORY = ["minidist.demo"], ["minidist.plan.memory"]
STEP, DP, PIPELINE, ZERO, COLLECTIVES, PLAN, PRECISION, RECOMPUTE, CONTEXT = (
    ["minidist.bench", name] for name in ("step", "dp", "pipeline", "zero", "collectives", "plan", "precision",
                                          "recompute", "context_parallel"))
NO_DIR = "no/such/dir/out.json"

CASES = [  # (program, flag, arguments, ranks)
    (DEMO, "--steps", ["--steps", "0"], 1),
    (DEMO, "--steps", ["--steps", "99999999999999999999999"], 1),  # beyond MAX_STEPS
    (DEMO, "--batch-size", ["--batch-size", "-4"], 1),
    (DEMO, "--batch-size", ["--batch-size", "10000000000"], 1),  # more memory than the machine has
    (DEMO, "--lr", ["--lr", "nan"], 1),
    (DEMO, "--lr", ["--lr", "-1"], 1),
    (DEMO, "--min-lr", ["--min-lr", "-1"], 1),
    (DEMO, "--warmup", ["--warmup", "1.5"], 1),
    (DEMO, "--lr-decay", ["--lr-decay", "step"], 1),
    (DEMO, "--weight-decay", ["--weight-decay", "inf"], 1),
    (DEMO, "--clip", ["--clip", "-0.5"], 1),
    (DEMO, "--adam-beta1", ["--adam-beta1", "1"], 1),
    (DEMO, "--adam-beta2", ["--adam-beta2", "-0.1"], 1),
    (DEMO, "--adam-eps", ["--adam-eps", "0"], 1),
    (DEMO, "--seed", ["--seed", "-1"], 1),
    (DEMO, "--dtype", ["--dtype", "float16"], 1),
    (DEMO, "--n-layer", ["--n-layer", "0"], 1),
    (DEMO, "--n-head", ["--n-head", "3"], 1),
    (DEMO, "--n-embd", ["--n-embd", "x"], 1),
    (DEMO, "--n-embd", ["--n-embd", "10000000"], 1),
    (DEMO, "--block-size", ["--block-size", "4"], 1),
    (DEMO, "--block-size", ["--block-size", "100000000"], 1),
    (DEMO, "--dropout", ["--dropout", "1.5"], 1),
    (DEMO, "--untied", ["--untied=yes"], 1),
    (DEMO, "--data", ["--data", "/proc/self/mem"], 1),
    (DEMO, "--data", ["--data", "/dev/zero"], 1),
    (DEMO, "--data", ["--data", "empty.txt"], 1),
    (DEMO, "--log-every", ["--log-every", "-2"], 1),
    (DEMO, "--layout", ["--layout", "dp2-banana"], 1),
    (DEMO, "--dp", ["--dp", "0"], 1),
    (DEMO, "--dp", ["--dp", "3"], 2),
    (DEMO, "--tp", ["--tp", "0"], 1),
    (DEMO, "--sequence-parallel", ["--sequence-parallel"], 1),
    (DEMO, "--cp", ["--cp", "0"], 1),
    (DEMO, "--cp", ["--cp", "3"], 2),
    (DEMO, "--cp-algorithm", ["--cp-algorithm", "flash"], 1),
    (DEMO, "--cp-split", ["--cp-split", "random"], 1),
    (DEMO, "--pp", ["--pp", "-1"], 1),
    (DEMO, "--microbatches", ["--microbatches", "0"], 1),
    (DEMO, "--schedule", ["--schedule", "zigzag"], 1),
    (DEMO, "--virtual-stages", ["--virtual-stages", "0"], 1),
    (DEMO, "--balance-stages", ["--balance-stages", "flops"], 1),
    (DEMO, "--balance-stages", ["--balance-stages", "time"], 1),  # no pipeline to cut
    (DEMO, "--zero", ["--zero", "4"], 1),
    (DEMO, "--accumulation", ["--accumulation", "0"], 1),
    (DEMO, "--bucket-kb", ["--bucket-kb", "0"], 1),
    (DEMO, "--naive-dp", ["--naive-dp=1"], 1),
    (DEMO, "--balance", ["--balance"], 1),
    (DEMO, "--algorithm", ["--algorithm", "magic"], 1),
    (DEMO, "--kernels", ["--kernels", "gpu"], 1),
    (DEMO, "--json", ["--json", NO_DIR], 1),
    (DEMO, "--json", ["--json", ""], 1),
    (DEMO, "--trace", ["--trace", NO_DIR], 1),
    (DEMO, "--save", ["--save", "."], 1),
    (DEMO, "--save", ["--save", "/proc/w.npz"], 1),  # a place where no file can be created, even by root
    (DEMO, "--save", ["--save", "w.npz"], 2),  # the tour keeps no weights
    (DEMO, "--checkpoint", ["--checkpoint", "ckpt"], 2),  # nor checkpoints
    (DEMO, "--checkpoint-every", ["--checkpoint-every", "0"], 1),
    (DEMO, "--precision", ["--precision", "fp8"], 1),
    (DEMO, "--precision", ["--precision", "bf16", "--dtype", "float64"], 1),
    (DEMO, "--fp32-grads", ["--fp32-grads"], 1),  # needs 16-bit weights
    (DEMO, "--fp32-grads", ["--fp32-grads", "--precision", "bf16", "--dp", "2", "--zero", "1"], 2),
    (DEMO, "--initial-loss-scale", ["--initial-loss-scale", "0"], 1),
    (DEMO, "--loss-scale-window", ["--loss-scale-window", "0"], 1),
    (DEMO, "--recompute", ["--recompute", "some"], 1),
    (DEMO, "--recompute", ["--recompute", "full", "--tp", "2"], 2),
    (DEMO, "--segments", ["--segments", "9", "--recompute", "full"], 1),
    (DEMO, "--experts", ["--experts", "1"], 1),
    (DEMO, "--top-k", ["--top-k", "3"], 1),
    (DEMO, "--capacity-factor", ["--capacity-factor", "0"], 1),
    (DEMO, "--ep", ["--ep", "2"], 1),
    (DEMO, "--deepspeed-config", ["--deepspeed-config", "no/such.json"], 1),
    (DEMO, "--megatron-args", ["--megatron-args=--tensor-model-parallel-size 3"], 1),
    (DEMO, "--torchtitan-config", ["--torchtitan-config", "no/such.toml"], 1),
    (DEMO, "--torchtitan-config", ["--torchtitan-config", "empty.txt", "--megatron-args=--seed 1"], 1),  # one config
    (MEMORY, "--params", ["--params", "1e30"], 1),
    (MEMORY, "--params", ["--params", "1e400"], 1),
    (MEMORY, "--params", ["--params", "abc"], 1),
    (MEMORY, "--dp", ["--params", "7B", "--dp", "0"], 1),
    (MEMORY, "--zero", ["--params", "7B", "--zero", "5"], 1),
    (MEMORY, "--precision", ["--params", "7B", "--precision", "fp8"], 1),
    (MEMORY, "--json", ["--params", "7B", "--json=1"], 1),
    (STEP, "--steps", ["--steps", "0"], 1),
    (STEP, "--warmup", ["--warmup", "-1"], 1),
    (STEP, "--dtype", ["--dtype", "int8"], 1),
    (STEP, "--kernels", ["--kernels", "gpu"], 1),
    (STEP, "--no-torch", ["--no-torch=1"], 1),
    (STEP, "--json", ["--json", NO_DIR], 1),
    (DP, "--dp", ["--dp", "0,2"], 1),
    (DP, "--modes", ["--modes", "naive,fast"], 1),
    (DP, "--steps", ["--steps", "0"], 1),
    (DP, "--warmup", ["--warmup", "-1"], 1),
    (DP, "--repeats", ["--repeats", "0"], 1),
    (DP, "--batch", ["--batch", "0"], 1),
    (DP, "--batch", ["--batch", "15"], 1),  # not divisible by dp=2
    (DP, "--bucket-kb", ["--bucket-kb", "0"], 1),
    (DP, "--dtype", ["--dtype", "float16"], 1),
    (DP, "--no-ceiling", ["--no-ceiling=1"], 1),
    (DP, "--slow", ["--slow", "3ms"], 1),
    (DP, "--slow", ["--dp", "1,2", "--slow", "1:3"], 1),
    (DP, "--json", ["--json", NO_DIR], 1),
    (DP, "--trace", ["--trace", NO_DIR], 1),
    (DP, "--torch", ["--torch=1"], 1),
    (PIPELINE, "--microbatches", ["--microbatches", "0"], 1),
    (PIPELINE, "--microbatches", ["--microbatches", "3"], 2),  # 16 rows do not split into 3
    (PIPELINE, "--schedules", ["--schedules", "gpipe,zigzag"], 1),
    (PIPELINE, "--virtual-stages", ["--virtual-stages", "0"], 1),
    (PIPELINE, "--steps", ["--steps", "0"], 1),
    (PIPELINE, "--batch-size", ["--batch-size", "0"], 1),
    (PIPELINE, "--json", ["--json", NO_DIR], 1),
    (PIPELINE, "--trace", ["--trace", NO_DIR], 1),
    (PIPELINE, "--balance-stages", ["--balance-stages", "flops"], 1),
    (PIPELINE, "--vocab-size", ["--vocab-size", "1"], 1),
    (PIPELINE, "--n-layer", ["--n-layer", "0"], 1),
    (PIPELINE, "--n-layer", ["--n-layer", "1"], 2),  # fewer blocks than stages
    (ZERO, "--stages", ["--stages", "0,5"], 1),
    (ZERO, "--steps", ["--steps", "0"], 1),
    (ZERO, "--batch-size", ["--batch-size", "0"], 1),
    (ZERO, "--batch-size", ["--batch-size", "3"], 2),  # not divisible by 2 ranks
    (ZERO, "--json", ["--json", NO_DIR], 1),
    (ZERO, "--trace", ["--trace", NO_DIR], 1),
    (COLLECTIVES, "--json", ["--json", NO_DIR], 1),
    (PLAN, "--calibrate", ["--calibrate=yes"], 1),
    (PLAN, "--ranks", ["--ranks", "1"], 1),
    (PLAN, "--ranks", ["--ranks", "7"], 1),
    (PLAN, "--steps", ["--steps", "1"], 1),
    (PLAN, "--repeats", ["--repeats", "0"], 1),
    (PLAN, "--batch-size", ["--batch-size", "0"], 1),
    (PLAN, "--n-layer", ["--n-layer", "0"], 1),
    (PLAN, "--n-embd", ["--n-embd", "x"], 1),
    (PLAN, "--n-head", ["--n-head", "3"], 1),
    (PLAN, "--block-size", ["--block-size", "4"], 1),
    (PLAN, "--match", ["--match", "zzz"], 1),
    (PLAN, "--timeout", ["--timeout", "0"], 1),
    (PLAN, "--json", ["--json", NO_DIR], 1),
    (PLAN, "--median-of", ["--median-of", "empty.txt", "empty.txt"], 1),  # not a recorded run
    (PLAN, "--median-of", ["--median-of", "no/such/run.json"], 1),
    (PRECISION, "--steps", ["--steps", "1"], 1),
    (PRECISION, "--batch-size", ["--batch-size", "0"], 1),
    (PRECISION, "--batch-size", ["--batch-size", "15"], 1),
    (PRECISION, "--n-layer", ["--n-layer", "0"], 1),
    (PRECISION, "--n-head", ["--n-head", "3"], 1),
    (PRECISION, "--n-embd", ["--n-embd", "x"], 1),
    (PRECISION, "--block-size", ["--block-size", "8"], 1),
    (PRECISION, "--json", ["--json", NO_DIR], 1),
    (RECOMPUTE, "--modes", ["--modes", "none,partial"], 1),
    (RECOMPUTE, "--segments", ["--segments", "0"], 1),
    (RECOMPUTE, "--segments", ["--segments", "5"], 1),  # more runs than the 4 layers
    (RECOMPUTE, "--steps", ["--steps", "0"], 1),
    (RECOMPUTE, "--batch-size", ["--batch-size", "0"], 1),
    (RECOMPUTE, "--n-layer", ["--n-layer", "0"], 1),
    (RECOMPUTE, "--n-embd", ["--n-embd", "x"], 1),
    (RECOMPUTE, "--n-head", ["--n-head", "3"], 1),  # 128 is not divisible by 3
    (RECOMPUTE, "--block-size", ["--block-size", "0"], 1),
    (RECOMPUTE, "--json", ["--json", NO_DIR], 1),
    (CONTEXT, "--cp", ["--cp", "1"], 1),
    (CONTEXT, "--cp", ["--cp", "2,3"], 1),  # 1024 tokens do not split into 2 x 3 chunks
    (CONTEXT, "--cp", ["--cp", "8"], 1),  # Ulysses: 4 heads over 8 ranks
    (CONTEXT, "--batch-size", ["--batch-size", "0"], 1),
    (CONTEXT, "--n-head", ["--n-head", "3"], 1),  # not divisible by cp=2
    (CONTEXT, "--seq-length", ["--seq-length", "30"], 1),  # not divisible by 2 x cp = 4
    (CONTEXT, "--head-dim", ["--head-dim", "0"], 1),
    (CONTEXT, "--repeats", ["--repeats", "0"], 1),
    (CONTEXT, "--timeout", ["--timeout", "0"], 1),
    (CONTEXT, "--json", ["--json", NO_DIR], 1),
    (COLLECTIVES, "--sizes", ["--sizes", "abc"], 1),
    (COLLECTIVES, "--sizes", ["--sizes", "1K,3"], 2),  # not whole float32 elements
    (COLLECTIVES, "--quick", ["--quick=1"], 1),
    (COLLECTIVES, "--algorithms", ["--algorithms", "ring,magic"], 1),
    (COLLECTIVES, "--budget", ["--budget", "0"], 1),
    (COLLECTIVES, "--rounds", ["--rounds", "0"], 1),
    (COLLECTIVES, "--no-malloc-tuning", ["--no-malloc-tuning=1"], 1),
    (COLLECTIVES, "--wait-demo", ["--wait-demo=1"], 1),
    (COLLECTIVES, "--tune", ["--tune", NO_DIR], 1),
]


def _id(case):
    program, flag, arguments, ranks = case
    return f"{' '.join(program[1:] or program)} {' '.join(arguments) or repr('')} n={ranks}"


def quick_first(cases):
    """The rows as parameters: in the quick tier the first row of one rank and the first under
    mpiexec; every row in the full tier (each one starts a process or a job, about a second)."""
    seen, params = set(), []
    for case in cases:
        ranks = case[3]
        params.append(pytest.param(case, id=_id(case), marks=[pytest.mark.full] if ranks in seen else []))
        seen.add(ranks)
    return params


def test_every_flag_of_every_program_has_a_case():
    """The table keeps up with the parsers: a new flag without a bad-value row fails here."""
    from minidist.bench import __main__ as bench

    assert bench.available() == ["collectives", "context_parallel", "dp", "pipeline", "plan", "precision", "recompute",
                                 "step", "zero"]
    programs = ["minidist.demo", "minidist.plan.memory", *(f"minidist.bench.{name}" for name in bench.available())]
    assert len(programs) == 11
    for program in programs:
        parser_module = {"minidist.demo": "minidist.demo_flags"}.get(program, program)  # where its parser lives
        source = open(importlib.util.find_spec(parser_module).origin).read()
        flags = set(re.findall(r'add_argument\(\s*"(--[a-z-]+)"', source))
        covered = {flag for prog, flag, _, _ in CASES if ".".join(prog) == program}
        assert flags and flags <= covered, (program, sorted(flags - covered))


@pytest.mark.parametrize("case", quick_first(CASES))
def test_a_bad_value_fails_in_one_line_before_any_work(case, tmp_path):
    program, flag, arguments, ranks = case
    (tmp_path / "empty.txt").write_bytes(b"")
    before = sorted(p.name for p in tmp_path.iterdir())
    command = [sys.executable, "-m", *program, *arguments]
    if ranks > 1:
        command = [find_mpiexec(), "-n", str(ranks), *command]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=60,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert flag in lines[0] and "error" in lines[0], lines
    assert proc.stdout.strip() == "" or program == DEMO, proc.stdout  # the demo's banner under mpiexec
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written
