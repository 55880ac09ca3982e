"""torchtitan TOML job configs, translated to minidist layouts (minidist/frameworks/torchtitan.py)."""
import json
import os
import subprocess
import sys
import tomllib

import pytest

from minidist import frameworks as fw
from minidist.comm.launch import find_mpiexec
from minidist.demo import build_parser
from minidist.frameworks.__main__ import main as frameworks_main

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples", "frameworks")
LLAMA8B = os.path.join(EXAMPLES, "torchtitan_llama3_8b.toml")
LLAMA70B = os.path.join(EXAMPLES, "torchtitan_llama3_70b.toml")
HSDP_TP = os.path.join(EXAMPLES, "torchtitan_hsdp_tp.toml")
SMALL = {"n_layer": 2, "n_embd": 64, "n_head": 8, "block_size": 16}  # a model tp 8 can cut


def key_paths(path) -> list[str]:
    """Every key path of a TOML file ("section.key"; an empty table is its own path)."""
    with open(path, "rb") as f:
        data = tomllib.load(f)

    def walk(node, prefix):
        if isinstance(node, dict) and node:
            return [p for k, v in node.items() for p in walk(v, f"{prefix}.{k}" if prefix else k)]
        return [prefix]
    return walk(data, "")


def refused(t, key: str) -> str:
    return t.refused[key]


# ----------------------------------------------------------------------------- the example files


def test_llama3_8b_example_is_fsdp_over_every_rank():
    t = fw.from_torchtitan(LLAMA8B, world_size=8)
    assert (t.source, t.dp, t.tp, t.pp, t.cp, t.zero) == ("torchtitan", 8, 1, 1, 1, 3)  # shard -1: all 8 ranks
    assert (t.batch_size, t.micro_batch_size, t.accumulation, t.microbatches) == (8, 1, 1, 1)
    assert (t.lr, t.eps, t.betas, t.weight_decay) == (3e-4, 1e-8, (0.9, 0.95), 0.1)  # torchtitan's defaults: betas, wd
    assert (t.warmup, t.decay, t.min_lr, t.clip, t.steps, t.block_size) == (200, "linear", 0.0, 1.0, 1000, 8192)
    assert t.precision == "bf16" and t.applied["training.mixed_precision_param"]["flag"] == "precision"
    # minidist's ZeRO-3 runs the blocks inside FSDP's own loop: no recomputation there, and the reason says so
    assert t.recompute is None and "not built for" in refused(t, "activation_checkpoint.mode")
    assert "32 layers, dim 4096, 32 heads" in refused(t, "model.flavor")
    assert "GPT-2's" in refused(t, "model.name")
    assert set(t.refused) == {"model.name", "model.flavor", "model.hf_assets_path", "training.dataset", "job",
                              "metrics", "profiling", "checkpoint", "compile", "float8", "activation_checkpoint.mode",
                              "activation_checkpoint.selective_ac_option"}
    assert all(why.startswith("ignored") for key, why in t.refused.items()
               if key in ("job", "metrics", "profiling", "checkpoint", "compile", "float8", "training.dataset"))
    assert t.demo_flags()[:8] == ["--dp", "8", "--zero", "3", "--precision", "bf16", "--batch-size", "8"]
    flags = t.demo_flags()
    for flag, value in (("--lr", "0.0003"), ("--adam-eps", "1e-08"), ("--adam-beta2", "0.95"), ("--warmup", "200"),
                        ("--lr-decay", "linear"), ("--min-lr", "0"), ("--clip", "1"), ("--weight-decay", "0.1")):
        assert flags[flags.index(flag) + 1] == value, flag
    assert "--recompute" not in flags


def test_llama3_70b_example_is_fsdp_with_tensor_parallelism():
    t = fw.from_torchtitan(LLAMA70B, world_size=64, settings=SMALL)
    assert (t.dp, t.tp, t.pp, t.zero, t.sequence_parallel) == (8, 8, 1, 3, True)  # its TP plan: SequenceParallel
    assert (t.batch_size, t.micro_batch_size, t.accumulation) == (64, 8, 1)
    assert (t.lr, t.eps, t.warmup, t.decay, t.min_lr) == (1.5e-4, 1e-8, 200, "linear", 0.0)  # defaults: linear to 0
    assert t.precision == "bf16" and t.recompute is None
    assert refused(t, "activation_checkpoint.mode").startswith("full: --recompute full is not built for")
    assert "80 layers, dim 8192, 64 heads" in refused(t, "model.flavor")
    assert t.applied["parallelism.enable_async_tensor_parallel"] == {"value": False, "flag": None}
    assert t.demo_flags()[:8] == ["--dp", "8", "--tp", "8", "--zero", "3", "--sequence-parallel", "--precision"]
    assert (t.n_head, t.n_embd) == (8, 64)  # the command line's model
    # judged on the demo's default model (4 heads), tp 8 cannot cut it: one line says so and which flags to give
    with pytest.raises(ValueError) as error:
        fw.from_torchtitan(LLAMA70B, world_size=64)
    assert "n_head=4" in str(error.value) and "--n-head" in str(error.value) and "\n" not in str(error.value)


def test_hsdp_tp_example_replicates_shards_and_accumulates():
    t = fw.from_torchtitan(HSDP_TP, world_size=8)
    assert (t.dp, t.tp, t.pp, t.zero, t.sequence_parallel) == (4, 2, 1, 3, True)  # dp = replicate 2 x shard 2
    assert (t.batch_size, t.micro_batch_size, t.accumulation) == (32, 2, 4)  # 32 = 2 x 4 steps x dp 4
    assert (t.lr, t.betas, t.eps, t.weight_decay) == (3e-4, (0.9, 0.95), 1e-8, 0.1)
    assert (t.warmup, t.decay, t.min_lr, t.steps, t.seed) == (100, "cosine", 3e-5, 2000, 42)  # lr_min: a fraction
    assert any("HSDP" in note and "all dp = 4 ranks" in note for note in t.notes)
    assert "fp32-grads" in refused(t, "training.mixed_precision_reduce")
    assert refused(t, "comm").startswith("ignored") and refused(t, "checkpoint").startswith("ignored")
    assert t.applied["optimizer.implementation"] == {"value": "fused", "flag": None}  # a kernel, not the math
    assert t.applied["parallelism.fsdp_reshard_after_forward"] == {"value": "default", "flag": "zero"}
    flags = t.demo_flags()
    assert flags[:12] == ["--dp", "4", "--tp", "2", "--zero", "3", "--accumulation", "4", "--sequence-parallel",
                          "--precision", "bf16", "--batch-size"]
    assert flags[flags.index("--min-lr") + 1] == "3e-05" and flags[flags.index("--lr-decay") + 1] == "cosine"


@pytest.mark.parametrize("path, world", [(LLAMA8B, 64), (LLAMA70B, 64), (HSDP_TP, 8)],
                         ids=["8b", "70b", "hsdp-tp"])
def test_every_key_path_is_applied_or_refused_never_both(path, world):
    t = fw.from_torchtitan(path, world_size=world, settings=SMALL)
    assert not set(t.applied) & set(t.refused)
    missing = [key for key in key_paths(path) if not t.covers(key)]
    assert not missing
    assert not t.covers("no_such_section.key")


def test_the_examples_say_how_to_run_them(capsys):
    for path, ranks in ((LLAMA8B, "mpirun -n 2"), (LLAMA70B, "mpirun -n 16"), (HSDP_TP, "mpirun -n 8")):
        with open(path) as f:
            head = f.read().split("\n[", 1)[0]
        assert "Shaped like torchtitan's" in head and ranks in head and "--torchtitan-config" in head, path
        line = next(line for line in head.splitlines() if "python -m minidist.frameworks torchtitan" in line)
        argv = line.split("python -m minidist.frameworks ", 1)[1].split()
        argv[1] = os.path.join(EXAMPLES, os.path.basename(argv[1]))
        assert frameworks_main(argv) == 0, line  # the command the file shows works as written
        assert "run it:" in capsys.readouterr().out


# ----------------------------------------------------------------------------- the rules


def test_fsdp_with_a_pipeline_runs_zero1_and_says_why():
    config = {"parallelism": {"data_parallel_shard_degree": 2, "pipeline_parallel_degree": 2,
                              "pipeline_parallel_microbatch_size": 1},
              "training": {"local_batch_size": 2, "global_batch_size": 8}}
    t = fw.from_torchtitan(config, world_size=4)
    assert (t.dp, t.pp, t.zero, t.schedule, t.virtual_stages) == (2, 2, 1, "1f1b", 1)
    # 8 = local 2 x 2 accumulation steps x dp 2; each local batch is 2 micro-batches of 1: 4 per step
    assert (t.batch_size, t.micro_batch_size, t.microbatches, t.accumulation) == (8, 1, 4, 1)
    why = refused(t, "parallelism.data_parallel_shard_degree")
    assert "ZeRO-2" in why and "--pp 2" in why and "ZeRO-1" in why  # torchtitan's default keeps weights with pp
    assert t.demo_flags()[:10] == ["--dp", "2", "--pp", "2", "--zero", "1", "--microbatches", "4", "--schedule", "1f1b"]


@pytest.mark.parametrize("schedule, extra, expected", [
    ("GPipe", {}, ("gpipe", 1)),
    ("interleaved1f1b", {}, ("interleaved", 2)),  # looped: torchtitan's default 2 chunks per rank
    ("Interleaved1F1B", {"pipeline_parallel_layers_per_stage": 2}, ("interleaved", 2)),  # ceil((6 + 2) / 2) / pp 2
    ("Interleaved1F1B", {"pipeline_parallel_split_points": ["layers.1", "layers.3", "layers.4"]}, ("interleaved", 2)),
    ("ZBVZeroBubble", {}, ("interleaved", 2)),
])
def test_pipeline_schedules_and_their_chunks(schedule, extra, expected):
    config = {"parallelism": {"pipeline_parallel_degree": 2, "pipeline_parallel_schedule": schedule, **extra},
              "training": {"local_batch_size": 4}}
    t = fw.from_torchtitan(config, world_size=2, settings={"n_layer": 6})
    assert (t.schedule, t.virtual_stages, t.microbatches, t.micro_batch_size) == (*expected, 4, 1)
    if schedule == "ZBVZeroBubble":
        assert "minidist runs --schedule interleaved" in refused(t, "parallelism.pipeline_parallel_schedule")
    else:
        assert t.applied["parallelism.pipeline_parallel_schedule"]["flag"] == "schedule"
    parsed = build_parser().parse_args(t.demo_flags())
    assert (parsed.schedule, parsed.microbatches) == (expected[0], 4)


def test_pipeline_chunks_that_do_not_fit_fail_in_one_line():
    base = {"parallelism": {"pipeline_parallel_degree": 2, "pipeline_parallel_layers_per_stage": 2},
            "training": {"local_batch_size": 4}}
    with pytest.raises(ValueError, match=r"= 2 per pipeline rank, but 1F1B runs exactly 1 per rank \(give the demo's "
                                         r"--n-layer"):
        fw.from_torchtitan(base, world_size=2, settings={"n_layer": 6})
    with pytest.raises(ValueError, match="local_batch_size 3 is not divisible by "
                                         "parallelism.pipeline_parallel_microbatch_size 2"):
        fw.from_torchtitan({"parallelism": {"pipeline_parallel_degree": 2, "pipeline_parallel_microbatch_size": 2},
                            "training": {"local_batch_size": 3}}, world_size=2)


def test_context_parallelism_is_applied_on_the_mesh():
    config = {"parallelism": {"context_parallel_degree": 2, "context_parallel_rotate_method": "allgather"},
              "training": {"local_batch_size": 2, "seq_len": 16}, "activation_checkpoint": {"mode": "full"}}
    t = fw.from_torchtitan(config, world_size=4)
    assert (t.cp, t.dp, t.zero, t.recompute) == (2, 2, 1, None)  # FSDP -> ZeRO-1 with cp; no recomputation with cp
    assert "--cp 2" in refused(t, "parallelism.data_parallel_shard_degree")
    assert "ring attention" in refused(t, "parallelism.context_parallel_rotate_method")
    assert "not built for" in refused(t, "activation_checkpoint.mode")
    assert t.layout().cp == 2 and str(t.layout()) == "dp2-cp2-zero1-bf16"
    assert t.demo_flags()[:6] == ["--dp", "2", "--cp", "2", "--zero", "1"]
    assert t.describe().startswith("torchtitan on 4 ranks -> minidist mesh pp 1 x dp 2 x cp 2 x tp 1")


def test_ddp_recomputes_and_replicas_are_plain_data_parallelism():
    config = {"parallelism": {"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 1},
              "activation_checkpoint": {"mode": "full"}, "training": {"local_batch_size": 2}}
    t = fw.from_torchtitan(config, world_size=2)
    assert (t.dp, t.zero, t.recompute, t.precision) == (2, 0, "full", "bf16")  # DDP: bf16 by autocast
    assert t.demo_flags()[:4] == ["--dp", "2", "--precision", "bf16"] and "--recompute" in t.demo_flags()
    every_second = fw.from_torchtitan({"activation_checkpoint": {"mode": "selective", "selective_ac_option": "2"}}, 1)
    assert every_second.recompute is None and "not one block in N" in refused(every_second,
                                                                              "activation_checkpoint.mode")
    each = fw.from_torchtitan({"activation_checkpoint": {"mode": "selective", "selective_ac_option": 1}}, 1)
    op = fw.from_torchtitan({"activation_checkpoint": {"mode": "selective", "selective_ac_option": "op"}}, 1)
    assert (each.recompute, op.recompute) == ("full", "selective") and not each.refused and not op.refused
    assert any("attention's core" in note for note in op.notes)


def test_precision_follows_where_torchtitan_applies_it():
    tp_alone = fw.from_torchtitan({"parallelism": {"tensor_parallel_degree": 2}}, 2)  # no FSDP, no autocast
    assert tp_alone.precision == "fp32" and any("not with tp or pp alone" in note for note in tp_alone.notes)
    fp32 = fw.from_torchtitan({"training": {"mixed_precision_param": "float32"}}, 2)
    assert fp32.precision == "fp32" and fp32.zero == 3
    fp8 = fw.from_torchtitan({"model": {"converters": ["float8"]}, "float8": {"recipe_name": "rowwise"}}, 1)
    assert "MLP only" in refused(fp8, "model.converters") and "MLP only" in refused(fp8, "float8")


def test_schedule_and_optimizer_defaults_and_refusals():
    t = fw.from_torchtitan({}, 1)  # every value torchtitan's own default (torchtitan/config/job_config.py)
    assert (t.lr, t.betas, t.eps, t.weight_decay, t.warmup, t.decay, t.min_lr, t.clip) == (
        8e-4, (0.9, 0.95), 1e-8, 0.1, 200, "linear", 0.0, 1.0)
    assert (t.batch_size, t.precision, t.steps) == (8, "bf16", None)  # local_batch_size 8; bf16 by autocast
    assert not t.applied and not t.refused
    sqrt = fw.from_torchtitan({"lr_scheduler": {"decay_type": "sqrt"}}, 1)
    assert sqrt.decay is None and "cosine, linearly or not at all" in refused(sqrt, "lr_scheduler.decay_type")
    wsd = fw.from_torchtitan({"lr_scheduler": {"warmup_steps": 10, "decay_ratio": 0.5}, "training": {"steps": 100}}, 1)
    assert "warmup-stable-decay" in refused(wsd, "lr_scheduler.decay_ratio") and wsd.steps == 100
    plain = fw.from_torchtitan({"lr_scheduler": {"warmup_steps": 10, "decay_ratio": 0.9}, "training": {"steps": 100}},
                               1)
    assert "lr_scheduler.decay_ratio" in plain.applied  # 10 + 90 = 100: decay right after warm-up
    adam = fw.from_torchtitan({"optimizer": {"name": "Adam", "weight_decay": 0.1}}, 1)
    assert "(L2)" in refused(adam, "optimizer.name")
    assert "optimizer.name" in fw.from_torchtitan({"optimizer": {"name": "Adam", "weight_decay": 0.0}}, 1).applied
    assert "AdamW only" in refused(fw.from_torchtitan({"optimizer": {"name": "Muon"}}, 1), "optimizer.name")


def test_older_torchtitan_spellings():
    old = {"training": {"batch_size": 2, "warmup_steps": 5, "data_parallel_shard_degree": 2,
                        "tensor_parallel_degree": 1},
           "experimental": {"pipeline_parallel_degree": 1}}
    t = fw.from_torchtitan(old, 2)
    assert (t.micro_batch_size, t.batch_size, t.warmup, t.dp, t.zero) == (2, 4, 5, 2, 3)
    for key in ("training.batch_size", "training.warmup_steps", "training.data_parallel_shard_degree",
                "experimental.pipeline_parallel_degree"):
        assert key in t.applied, key
    with pytest.raises(ValueError, match="training.local_batch_size and training.batch_size are the same setting"):
        fw.from_torchtitan({"training": {"batch_size": 1, "local_batch_size": 2}}, 1)


@pytest.mark.parametrize("config, world, message", [
    ({"parallelism": {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2}}, 2,
     "data_parallel_shard_degree 2 x tensor_parallel_degree 2 = 4 ranks, but the world has 2"),
    ({"parallelism": {"tensor_parallel_degree": 3}}, 4,
     "world size 4 is not divisible by tensor_parallel_degree 3 = 3 (data_parallel_shard_degree -1"),
    ({"parallelism": {"tensor_parallel_degree": 0}}, 1, "parallelism.tensor_parallel_degree: expected an integer >= 1"),
    ({"training": {"global_batch_size": 30, "local_batch_size": 4}}, 2,
     "training.global_batch_size=30 is not divisible by training.local_batch_size=4 x dp=2 = 8"),
    ({"optimizer": {"lr": -1}}, 1, "optimizer.lr: expected a number > 0, got -1"),
    ({"optimizer": {"beta2": 1.5}}, 1, "optimizer.beta2: expected a number < 1"),
    ({"parallelism": {"pipeline_parallel_degree": 2, "pipeline_parallel_schedule": "Zigzag"}}, 2,
     "'Zigzag' is not one of torch.distributed.pipelining's schedules"),
    ({"parallelism": 3}, 1, "[parallelism] must be a table of keys"),
    ({"training": {"mixed_precision_param": "float16"}}, 1, "expected one of bfloat16, float32, got 'float16'"),
    ({"activation_checkpoint": {"mode": 1}}, 1, "activation_checkpoint.mode: expected a string, got 1"),
])
def test_bad_values_fail_in_one_line_naming_the_key(config, world, message):
    with pytest.raises(ValueError) as error:
        fw.from_torchtitan(config, world_size=world)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert str(error.value).startswith("torchtitan config: ")


def test_bad_files_fail_in_one_line_naming_the_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[training]\nlocal_batch_size = 2\nseq_len = \n")
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00\x00\x00\xff\xfe")
    for path, message in ((bad, f"{bad}: not valid TOML (line 3, column 11: "),
                          (binary, f"{binary}: not a text file"),
                          (tmp_path / "none.toml", f"{tmp_path / 'none.toml'}: cannot read it (No such file"),
                          (tmp_path, f"{tmp_path}: cannot read it")):
        with pytest.raises(ValueError) as error:
            fw.from_torchtitan(path, world_size=1)
        assert str(error.value).startswith(message) and "\n" not in str(error.value), str(error.value)
        assert "Traceback" not in str(error.value) and "tomllib" not in str(error.value)


def test_unknown_keys_and_sections_are_refused_not_errors():
    t = fw.from_torchtitan({"training": {"local_batch_size": 1, "my_new_knob": 3}, "my_section": {"a": 1},
                            "parallelism": {"some_new_degree": 2}}, world_size=1)
    assert refused(t, "training.my_new_knob").startswith("ignored") and t.covers("my_section.a")
    assert t.covers("parallelism.some_new_degree")


# ----------------------------------------------------------------------------- the demo and the command line


@pytest.mark.parametrize("make", [
    lambda: fw.from_torchtitan(LLAMA8B, 8), lambda: fw.from_torchtitan(LLAMA70B, 64, settings=SMALL),
    lambda: fw.from_torchtitan(HSDP_TP, 8),
    lambda: fw.from_torchtitan({"parallelism": {"pipeline_parallel_degree": 2, "pipeline_parallel_schedule":
                                                "Interleaved1F1B"}, "training": {"local_batch_size": 4}}, 2),
    lambda: fw.from_torchtitan({"parallelism": {"context_parallel_degree": 2}, "training": {"seq_len": 16}}, 4),
], ids=["8b", "70b", "hsdp-tp", "interleaved", "cp"])
def test_demo_flags_round_trip_through_the_demo_parser(make):
    t = make()
    parsed = build_parser().parse_args(t.demo_flags())
    for dest, value in t.demo_settings().items():
        assert getattr(parsed, dest) == value, dest
    applied = build_parser().parse_args([])
    t.apply(applied)
    assert vars(applied) == vars(parsed)  # apply() == parsing the flags


def test_cli_prints_the_translation_and_the_command(capsys):
    assert frameworks_main(["torchtitan", HSDP_TP, "--world", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("torchtitan on 8 ranks -> minidist mesh pp 1 x dp 4 x tp 2 (tp fastest), ZeRO-3 over dp, "
                          "sequence parallel\n")
    assert "run it:\n  mpirun -n 8 python -m minidist.demo --dp 4 --tp 2 --zero 3 --accumulation 4" in out
    assert "  training.mixed_precision_reduce: float32:" in out
    assert frameworks_main(["torchtitan", LLAMA70B, "--world", "64", "--n-head", "8", "--n-embd", "64"]) == 0
    assert "--n-embd 64 --n-head 8" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit:
        frameworks_main(["torchtitan", HSDP_TP, "--world", "4"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.count("\n") == 1 and "= 8 ranks, but the world has 4" in err, err


def test_the_demo_takes_one_framework_config_at_a_time(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "minidist.demo", "--torchtitan-config", LLAMA8B,
                           "--deepspeed-config", os.path.join(EXAMPLES, "deepspeed_zero2.json")],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "give one framework config, not --deepspeed-config and --torchtitan-config" in proc.stderr


def test_the_demo_runs_a_torchtitan_config(tmp_path):
    """Two ranks of FSDP (ZeRO-3) in bf16, with the config's AdamW settings; the command line's model."""
    config = tmp_path / "titan.toml"
    config.write_text("""
[model]
name = "llama3"
flavor = "debugmodel"
[optimizer]
name = "AdamW"
lr = 2e-3
beta1 = 0.85
beta2 = 0.98
eps = 1e-7
weight_decay = 0.05
[lr_scheduler]
warmup_steps = 1
decay_type = "cosine"
[training]
local_batch_size = 2
global_batch_size = 8
seq_len = 2048
steps = 50
max_norm = 0.5
[parallelism]
data_parallel_shard_degree = 2
[metrics]
log_freq = 1
""")
    out = tmp_path / "out.json"
    proc = subprocess.run([find_mpiexec(), "-n", "2", sys.executable, "-m", "minidist.demo", "--torchtitan-config",
                           str(config), "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "16",
                           "--steps", "2", "--json", str(out)], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:] + proc.stdout[-2000:]
    report = json.loads(out.read_text())
    assert report["layout"] == {"dp": 2, "tp": 1, "pp": 1, "zero": 3} and report["precision"] == "bf16"
    assert report["config"]["n_embd"] == 32  # the command line's model
    optimizer = report["optimizer"]
    assert (optimizer["lr"], optimizer["eps"], optimizer["betas"], optimizer["weight_decay"]) == (
        2e-3, 1e-7, [0.85, 0.98], 0.05)
    assert (optimizer["clip"], optimizer["warmup"], optimizer["decay"], optimizer["steps"]) == (0.5, 1, "cosine", 2)
    framework = report["framework_config"]
    assert framework["source"] == "torchtitan"
    applied = framework["applied"]
    for key, used in (("optimizer.lr", 2e-3), ("optimizer.beta1", 0.85), ("optimizer.beta2", 0.98),
                      ("optimizer.eps", 1e-7), ("optimizer.weight_decay", 0.05), ("training.global_batch_size", 8),
                      ("training.max_norm", 0.5), ("lr_scheduler.decay_type", "cosine")):
        assert applied[key]["used"] == used, key
    assert applied["training.seq_len"]["used"] == 16 and applied["training.seq_len"]["overridden"]
    assert applied["training.steps"]["used"] == 2 and applied["training.steps"]["overridden"]
    assert set(framework["refused"]) == {"model.name", "model.flavor", "metrics"}
    assert "not supported: model.flavor: debugmodel" in proc.stdout
