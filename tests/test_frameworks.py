"""DeepSpeed configs and Megatron-LM argument lines, translated to minidist layouts (minidist/frameworks/)."""
import os
import subprocess
import sys

import pytest

from minidist import frameworks as fw
from minidist.frameworks.__main__ import main as frameworks_main
from minidist.demo import build_parser

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples", "frameworks")
ZERO2 = os.path.join(EXAMPLES, "deepspeed_zero2.json")
ZERO3 = os.path.join(EXAMPLES, "deepspeed_zero3_offload.json")
MEGATRON = os.path.join(EXAMPLES, "megatron_gpt_tp2_pp2.txt")


def megatron_example() -> str:
    with open(MEGATRON) as f:
        return f.read()


def listed(t, key: str) -> list[str]:
    """The unsupported entries about `key` (each starts with it)."""
    return [why for why in t.unsupported if why.startswith(key)]


# ----------------------------------------------------------------------------- the example files


def test_deepspeed_zero2_example():
    t = fw.from_deepspeed(ZERO2, world_size=4)
    assert (t.dp, t.tp, t.pp, t.zero) == (4, 1, 1, 2)
    assert (t.batch_size, t.micro_batch_size, t.accumulation, t.microbatches) == (16, 4, 1, 1)
    assert (t.lr, t.warmup, t.steps, t.weight_decay, t.clip) == (3e-3, 20, 200, 0.1, 1.0)
    assert t.min_lr == pytest.approx(3e-4)  # cos_min_ratio 0.1 of the optimizer's lr
    assert t.precision == "bf16" and not listed(t, "bf16")
    assert t.bucket_kb is None and listed(t, "zero_optimization.reduce_bucket_size")  # ZeRO: no DP buckets
    assert {why.split(":")[0] for why in t.unsupported} == {
        "zero_optimization.reduce_bucket_size", "zero_optimization.contiguous_gradients",
        "zero_optimization.allgather_bucket_size", "steps_per_print", "wall_clock_breakdown"}
    assert t.demo_flags()[:12] == ["--dp", "4", "--zero", "2", "--precision", "bf16", "--batch-size", "16", "--lr",
                                   "0.003", "--steps", "200"]
    flags = t.demo_flags()
    for flag, value in (("--weight-decay", "0.1"), ("--warmup", "20"), ("--clip", "1"), ("--adam-beta2", "0.95"),
                        ("--lr-decay", "cosine")):  # every optimizer key reaches the run
        assert flags[flags.index(flag) + 1] == value, flag
    assert t.applied["optimizer.params.weight_decay"] == {"value": 0.1, "flag": "weight_decay"}


def test_deepspeed_zero3_offload_example():
    t = fw.from_deepspeed(ZERO3, world_size=2)
    assert (t.dp, t.zero, t.batch_size, t.micro_batch_size, t.accumulation) == (2, 3, 4, 2, 1)
    assert (t.lr, t.min_lr, t.warmup, t.steps, t.clip) == (1e-3, 0.0, 10, 100, 1.0)
    assert t.precision == "fp16"
    assert listed(t, 'zero_optimization.offload_optimizer: device "cpu": minidist keeps every state in host memory')
    assert listed(t, "zero_optimization.offload_param")
    assert len(listed(t, "zero_optimization.stage3_")) == 5
    assert (t.betas, t.decay, t.weight_decay) == ((0.9, 0.999), "linear", 0.0)  # applied, not refused
    assert listed(t, "scheduler.params.warmup_type: log")  # DeepSpeed's default warm-up is not linear
    assert listed(t, "activation_checkpointing")
    # loss_scale 0 is dynamic, as minidist's; the start and the window apply; hysteresis 2 and a floor do not
    assert (t.initial_loss_scale, t.loss_scale_window) == (2.0**16, 1000) and not listed(t, "fp16.loss_scale")
    assert listed(t, "fp16.hysteresis: 2") and listed(t, "fp16.min_loss_scale")
    assert t.demo_flags()[:12] == ["--dp", "2", "--zero", "3", "--precision", "fp16", "--batch-size", "4", "--lr",
                                   "0.001", "--steps", "100"]


def test_megatron_example():
    t = fw.from_megatron(megatron_example(), world_size=8)
    assert (t.tp, t.pp, t.dp, t.zero) == (2, 2, 2, 1)
    assert (t.batch_size, t.micro_batch_size, t.microbatches, t.accumulation) == (16, 2, 4, 1)
    assert (t.schedule, t.virtual_stages, t.sequence_parallel) == ("1f1b", 1, True)
    assert (t.n_layer, t.n_embd, t.n_head, t.block_size, t.tie_weights) == (4, 64, 4, 32, True)
    assert (t.lr, t.min_lr, t.warmup, t.steps, t.weight_decay, t.clip) == (3e-3, 3e-4, 10, 100, 0.1, 1.0)
    assert t.precision == "bf16" and not listed(t, "--bf16") and "--precision" in t.demo_flags()
    for flag in ("--data-path", "--tokenizer-type", "--vocab-file", "--merge-file", "--split"):
        assert listed(t, flag)[0].endswith("ignored: minidist generates its data")
    assert listed(t, "--save: checkpoints/gpt") and listed(t, "--log-interval") and len(t.unsupported) == 9
    assert t.demo_flags()[:33] == ["--dp", "2", "--tp", "2", "--pp", "2", "--zero", "1", "--microbatches", "4",
                                   "--schedule", "1f1b", "--sequence-parallel", "--precision", "bf16", "--batch-size",
                                   "16", "--lr", "0.003", "--steps", "100", "--n-layer", "4", "--n-embd", "64",
                                   "--n-head", "4", "--block-size", "32", "--min-lr", "0.0003", "--warmup", "10"]
    assert (t.betas, t.eps, t.decay) == ((0.9, 0.95), 1e-8, "cosine")  # --adam-beta1/2 applied; Megatron's default eps


def test_megatron_reads_a_pasted_launch_line_and_a_list():
    line = ("torchrun --nproc_per_node 4 pretrain_gpt.py \\\n --tensor-model-parallel-size 2 \\\n"
            " --micro-batch-size=4 --global-batch-size 32 --vocab-size 50257 --untie-embeddings-and-output-weights")
    t = fw.from_megatron(line, world_size=4)
    assert (t.tp, t.dp, t.accumulation, t.microbatches, t.tie_weights, t.vocab_size) == (2, 2, 4, 1, False, 50257)
    assert listed(t, "--vocab-size: 50257: reported, not applied")
    assert "--untied" in t.demo_flags() and "--accumulation" in t.demo_flags()
    same = fw.from_megatron(["--tensor-model-parallel-size", "2", "--micro-batch-size", "4",
                             "--global-batch-size", "32", "--vocab-size", "50257",
                             "--untie-embeddings-and-output-weights"], world_size=4)
    assert same.demo_flags() == t.demo_flags()


# ----------------------------------------------------------------------------- the batch rule


def test_batch_rule_all_three_inconsistent_names_the_numbers():
    config = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    with pytest.raises(ValueError) as error:
        fw.from_deepspeed(config, world_size=2)
    assert str(error.value) == ("deepspeed config: train_batch_size=32 != train_micro_batch_size_per_gpu=4 x "
                                "gradient_accumulation_steps=2 x dp=2 = 16")


@pytest.mark.parametrize("given, expected", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, (32, 4, 2)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, (32, 4, 2)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, (32, 4, 2)),
    ({"train_batch_size": 32}, (32, 8, 1)),
    ({"train_micro_batch_size_per_gpu": 4}, (16, 4, 1)),
])
def test_batch_rule_two_given_derive_the_third(given, expected):
    t = fw.from_deepspeed(given, world_size=4)
    assert (t.batch_size, t.micro_batch_size, t.accumulation) == expected


def test_batch_rule_errors():
    with pytest.raises(ValueError, match=r"train_batch_size=30 is not divisible by "
                                         r"train_micro_batch_size_per_gpu=4 x dp=2 = 8"):
        fw.from_deepspeed({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, world_size=2)
    with pytest.raises(ValueError, match="give train_batch_size or train_micro_batch_size_per_gpu"):
        fw.from_deepspeed({"gradient_accumulation_steps": 2}, world_size=2)
    with pytest.raises(ValueError, match=r"--global-batch-size=20 is not divisible by --micro-batch-size=2 x "
                                         r"dp=4 = 8"):
        fw.from_megatron("--micro-batch-size 2 --global-batch-size 20", world_size=4)
    with pytest.raises(ValueError, match="--micro-batch-size is required"):
        fw.from_megatron("--global-batch-size 16", world_size=4)


def test_world_not_divisible_by_the_model_parallel_ranks():
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by tp=4 x pp=1 = 4"):
        fw.from_megatron("--tensor-model-parallel-size 4 --micro-batch-size 1", world_size=6)
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by tp=1 x pp=4 = 4"):
        fw.from_deepspeed({"train_batch_size": 8}, world_size=6, pp=4)


def test_gradient_accumulation_steps_are_micro_batches_in_a_pipeline():
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}
    flat, piped = fw.from_deepspeed(config, 4), fw.from_deepspeed(config, 4, pp=2)
    assert (flat.dp, flat.accumulation, flat.microbatches, flat.batch_size) == (4, 4, 1, 32)
    assert (piped.dp, piped.accumulation, piped.microbatches, piped.batch_size) == (2, 1, 4, 16)
    assert piped.demo_flags() == ["--dp", "2", "--pp", "2", "--microbatches", "4", "--schedule", "1f1b",
                                  "--batch-size", "16", "--clip", "0"]  # DeepSpeed's default: no clipping


# ----------------------------------------------------------------------------- layout rules


@pytest.mark.parametrize("stage", [2, 3])
def test_pipeline_with_zero_2_or_3_is_refused(stage):
    config = {"train_batch_size": 16, "gradient_accumulation_steps": 4, "zero_optimization": {"stage": stage}}
    with pytest.raises(ValueError, match=rf"layout dp2-pp2-zero{stage}-m4: --zero {stage} with --pp 2: stages 2-3 shard the gradients"):
        fw.from_deepspeed(config, world_size=4, pp=2)
    assert fw.from_deepspeed({**config, "zero_optimization": {"stage": 1}}, world_size=4, pp=2).zero == 1


def test_zero_over_one_replica_runs_plain():
    t = fw.from_megatron("--tensor-model-parallel-size 2 --micro-batch-size 2 --use-distributed-optimizer", 2)
    assert (t.dp, t.zero) == (1, 0) and any("nothing to partition" in note for note in t.notes)


def test_megatron_virtual_stages_and_their_rules():
    base = "--pipeline-model-parallel-size 2 --num-layers 8 --micro-batch-size 1 --global-batch-size 4"
    t = fw.from_megatron(base + " --num-layers-per-virtual-pipeline-stage 2", world_size=2)
    assert (t.schedule, t.virtual_stages, t.microbatches) == ("interleaved", 2, 4)
    assert t.demo_flags()[:8] == ["--pp", "2", "--microbatches", "4", "--schedule", "interleaved",
                                  "--virtual-stages", "2"]
    with pytest.raises(ValueError, match=r"m=3 is not a multiple of pp=2"):
        fw.from_megatron(base.replace("4", "3") + " --num-virtual-stages-per-pipeline-rank 2", world_size=2)
    with pytest.raises(ValueError, match=r"divisible by pp=2 x 3 = 6, got 8"):
        fw.from_megatron(base + " --num-layers-per-virtual-pipeline-stage 3", world_size=2)


def test_megatron_flag_without_its_value_fails_in_one_line():
    with pytest.raises(ValueError, match=r"^megatron args: --lr-decay-style needs a value$"):
        fw.from_megatron("--micro-batch-size 1 --lr-decay-style", world_size=1)
    with pytest.raises(ValueError, match=r"^megatron args: --num-layers: expected an integer >= 1, got '4 5'$"):
        fw.from_megatron("--micro-batch-size 1 --num-layers 4 5", world_size=1)


def test_megatron_sequence_parallel_needs_tp_and_fsdp_is_zero3():
    t = fw.from_megatron("--sequence-parallel --micro-batch-size 1 --use-torch-fsdp2", world_size=2)
    assert (t.sequence_parallel, t.zero) == (False, 3)
    t = fw.from_megatron("--micro-batch-size 1 --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads",
                         world_size=2)
    assert t.zero == 2


def test_megatron_context_parallel_is_cp_and_experts_are_listed():
    t = fw.from_megatron("--context-parallel-size 2 --micro-batch-size 1 --num-experts 8 "
                         "--expert-model-parallel-size 2", world_size=4)
    assert (t.cp, t.dp) == (2, 2) and "--context-parallel-size" in t.applied and "--cp" in t.demo_flags()
    assert listed(t, "--num-experts: 8: minidist's mixture of experts")
    assert listed(t, "--expert-model-parallel-size: 2: minidist's mixture of experts")
    selective = fw.from_megatron("--micro-batch-size 1 --recompute-activations", world_size=2)
    assert selective.recompute == "selective" and "--recompute" in selective.demo_flags()  # Megatron's older switch
    with pytest.raises(ValueError, match="--recompute selective is not built for the dp2-cp2"):
        fw.from_megatron("--context-parallel-size 2 --micro-batch-size 1 --recompute-activations", world_size=4)


def test_unknown_keys_are_listed_not_errors():
    t = fw.from_deepspeed({"train_batch_size": 8, "my_new_key": 1, "zero_optimization": {"stage": 1, "zz": 2},
                           "optimizer": {"type": "Lamb", "params": {"lr": 0.01}}}, world_size=2)
    assert listed(t, "my_new_key: ignored: no minidist counterpart")
    assert listed(t, "zero_optimization.zz") and listed(t, "optimizer.type: Lamb") and t.lr == 0.01
    t = fw.from_megatron("--micro-batch-size 1 --some-new-flag 3 --other", world_size=1)
    assert listed(t, "--some-new-flag: 3: ignored") and listed(t, "--other: ignored")


def test_reduce_bucket_size_is_the_dp_bucket():
    t = fw.from_deepspeed({"train_batch_size": 8, "zero_optimization": {"reduce_bucket_size": 5e5}}, world_size=2)
    flags = t.demo_flags()
    assert t.bucket_kb == 1954 and flags[flags.index("--bucket-kb") + 1] == "1954"  # 5e5 fp32 elements


def test_warmup_lr_is_constant_after_warmup():
    t = fw.from_deepspeed({"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params": {
        "warmup_max_lr": 0.01, "warmup_num_steps": 5, "warmup_type": "linear"}}}, world_size=1)
    settings = t.optim_settings()
    assert (settings.lr, settings.min_lr, settings.warmup) == (0.01, 0.01, 5)
    assert settings.lr_at(5) == settings.lr_at(250) == 0.01 and not t.unsupported


@pytest.mark.parametrize("config, message", [
    ({"train_batch_size": 8, "fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16 and bf16 are both enabled"),
    ({"train_batch_size": 0}, "train_batch_size: expected an integer >= 1, got 0"),
    ({"train_batch_size": 8, "zero_optimization": {"stage": 4}}, "zero_optimization.stage must be 0..3, got 4"),
    ({"train_batch_size": 8, "optimizer": "adam"}, "optimizer must be a JSON object"),
])
def test_bad_values_fail_in_one_line(config, message):
    with pytest.raises(ValueError, match=message) as error:
        fw.from_deepspeed(config, world_size=1)
    assert "\n" not in str(error.value)


def test_malformed_json_names_the_file(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text('{"train_batch_size": 8,}')
    with pytest.raises(ValueError) as error:
        fw.from_deepspeed(bad, world_size=1)  # a path-like works as a path
    assert str(error.value).startswith(f"{bad}: not valid JSON (line 1, column 24") and "\n" not in str(error.value)


# ----------------------------------------------------------------------------- the demo's flags


@pytest.mark.parametrize("make", [
    lambda: fw.from_deepspeed(ZERO2, 4), lambda: fw.from_deepspeed(ZERO3, 2),
    lambda: fw.from_megatron(megatron_example(), 8),
    lambda: fw.from_deepspeed({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, 4, pp=2),
    lambda: fw.from_megatron("--pipeline-model-parallel-size 2 --num-layers 8 --micro-batch-size 1 "
                             "--global-batch-size 4 --num-layers-per-virtual-pipeline-stage 2 --seed 7", 2),
], ids=["zero2", "zero3", "megatron", "ds-pipeline", "interleaved"])
def test_demo_flags_round_trip_through_the_demo_parser(make):
    t = make()
    parsed = build_parser().parse_args(t.demo_flags())
    for dest, value in t.demo_settings().items():
        assert getattr(parsed, dest) == value, dest
    applied = build_parser().parse_args([])
    t.apply(applied)
    assert vars(applied) == vars(parsed)  # apply() == parsing the flags


def test_apply_keeps_the_flags_the_user_gave():
    parser = build_parser()
    argv = ["--n-embd", "32", "--steps", "5"]
    args = parser.parse_args(argv)
    keep = fw.given_flags(parser, argv)
    assert keep == {"n_embd", "steps"}
    fw.from_megatron(megatron_example(), 8).apply(args, keep=keep)
    assert (args.n_embd, args.steps, args.n_layer, args.tp, args.microbatches) == (32, 5, 4, 2, 4)


# ----------------------------------------------------------------------------- the command line


def test_cli_prints_the_translation_and_the_command(capsys):
    assert frameworks_main(["deepspeed", ZERO2, "--world", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("DeepSpeed on 4 ranks -> minidist mesh pp 1 x dp 4 x tp 1 (tp fastest), ZeRO-2 over dp\n")
    assert "  zero_optimization.offload" not in out and "  bf16.enabled -> --precision bf16" in out
    assert "run it:\n  mpirun -n 4 python -m minidist.demo --dp 4 --zero 2 --precision bf16 --batch-size 16 --lr 0.003 " \
           "--steps 200 --min-lr 0.0003" in out
    assert frameworks_main(["megatron", "--world", "2", "--", "--pipeline-model-parallel-size", "2",
                    "--micro-batch-size", "2"]) == 0
    assert "mpirun -n 2 python -m minidist.demo --pp 2 --microbatches 1 --schedule 1f1b --batch-size 2" \
        in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["deepspeed", "BAD", "--world", "4"], "BAD: not valid JSON (line 1, column 2: "),
    (["deepspeed", ZERO2, "--world", "3"], "train_batch_size=16 is not divisible by "
                                           "train_micro_batch_size_per_gpu=4 x dp=3 = 12"),
    (["deepspeed", ZERO2, "--world", "0"], "argument --world: expected an integer >= 1, got '0'"),
    (["megatron", "--world", "8", "--file", MEGATRON, "--", "--tensor-model-parallel-size", "3"],
     "world size 8 is not divisible by tp=3 x pp=2 = 6"),
    (["megatron", "--world", "2", "--", "--micro-batch-size", "1", "--fp16", "yes"],
     "expected a --flag, got 'yes' after --fp16 (a switch takes no value)"),
    (["megatron", "--world", "2"], "give the arguments after -- or in --file PATH"),
])
def test_cli_errors_are_one_line(argv, message, capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{'single quotes': 1}")
    argv = [str(bad) if a == "BAD" else a for a in argv]
    message = message.replace("BAD", str(bad))
    with pytest.raises(SystemExit) as exit:
        frameworks_main(argv)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.count("\n") == 1 and message in err, err


def test_cli_runs_as_a_module():
    proc = subprocess.run([sys.executable, "-m", "minidist.frameworks", "deepspeed", ZERO3, "--world", "2"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "mpirun -n 2 python -m minidist.demo --dp 2 --zero 3 --precision fp16 --batch-size 4 --lr 0.001 --steps 100" in proc.stdout
    assert proc.stderr == ""


# ----------------------------------------------------------------------------- read faithfully


def test_every_key_is_applied_or_refused_never_both():
    t = fw.from_deepspeed(ZERO3, world_size=2)
    assert not set(t.applied) & set(t.refused)
    for key in ("train_micro_batch_size_per_gpu", "fp16.loss_scale_window", "optimizer.params.betas",
                "scheduler.params.total_num_steps", "zero_optimization.stage"):
        assert key in t.applied, key
    assert t.covers("activation_checkpointing.partition_activations")  # refused as a block
    assert not t.covers("no_such_key")


def test_hugging_face_auto_is_filled_as_its_trainer_fills_it():
    template = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
                "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                          "weight_decay": "auto"}},
                "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                                  "warmup_num_steps": "auto", "total_num_steps": "auto"}},
                "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                      "stage3_param_persistence_threshold": "auto"}}
    settings = {"batch_size": 16, "lr": 2e-4, "steps": 50, "n_embd": 64, "precision": "bf16"}
    t = fw.from_deepspeed(template, world_size=4, settings=settings)
    assert (t.batch_size, t.micro_batch_size, t.accumulation) == (16, 4, 1)
    assert (t.lr, t.steps, t.warmup, t.weight_decay, t.clip) == (2e-4, 50, 0, 0.0, 1.0)  # HF's defaults
    assert t.betas == (0.9, 0.999) and t.eps == 1e-8 and t.precision == "bf16"
    filled, _ = fw.deepspeed.resolve_auto(template, 4, settings)
    zero = filled["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"],
            zero["stage3_param_persistence_threshold"]) == (64 * 64, int(0.9 * 64 * 64), 640)
    assert all(t.covers(k) for k in ("zero_optimization.reduce_bucket_size", "bf16.enabled"))
    trainer_default = fw.from_deepspeed({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, 2)
    assert trainer_default.lr == 5e-5  # no --lr: the Trainer's default learning_rate


def test_loss_scale_settings_are_applied_and_static_scales_refused():
    t = fw.from_deepspeed({"train_batch_size": 8, "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
                                                           "loss_scale_window": 500, "hysteresis": 1}}, 2)
    assert (t.initial_loss_scale, t.loss_scale_window) == (4096.0, 500) and not t.refused
    flags = t.demo_flags()
    assert flags[flags.index("--initial-loss-scale") + 1] == "4096" and "--loss-scale-window" in flags
    static = fw.from_deepspeed({"train_batch_size": 8, "fp16": {"enabled": True, "loss_scale": 128}}, 2)
    assert "static" in static.refused["fp16.loss_scale"]
    m = fw.from_megatron("--micro-batch-size 1 --fp16 --initial-loss-scale 1024 --loss-scale-window 100 "
                         "--hysteresis 2 --min-loss-scale 1", 1)
    assert (m.initial_loss_scale, m.loss_scale_window) == (1024, 100)
    assert set(m.refused) == {"--hysteresis", "--min-loss-scale"}


def test_older_megatron_spellings_and_megatron_deepspeed(tmp_path):
    old = fw.from_megatron("--micro-batch-size 1 --num-layers 4 --checkpoint-activations "
                           "--activations-checkpoint-method uniform --activations-checkpoint-num-layers 1", 1)
    assert old.recompute == "full" and not old.refused
    blocks = fw.from_megatron("--micro-batch-size 1 --num-layers 4 --recompute-granularity full "
                              "--recompute-method block --recompute-num-layers 2", 1)
    assert blocks.recompute == "full" and "--recompute-method" in blocks.refused
    ds = tmp_path / "ds.json"
    ds.write_text('{"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": true}, "zero_optimization": {"stage": 1}}')
    t = fw.from_megatron(f"--micro-batch-size 1 --deepspeed --deepspeed_config {ds} --zero-stage 1", 2)
    assert (t.zero, t.precision, t.dp) == (1, "bf16", 2) and not t.refused


def test_offload_to_none_is_no_offload_and_defaults_are_the_frameworks():
    t = fw.from_deepspeed({"train_batch_size": 8, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}}},
                          2)
    assert "zero_optimization.offload_optimizer" in t.applied and t.clip == 0.0  # DeepSpeed clips only if asked
    m = fw.from_megatron("--micro-batch-size 1 --lr 1e-4", 1)
    assert (m.weight_decay, m.betas, m.decay, m.min_lr) == (0.01, (0.9, 0.999), "linear", 0.0)  # Megatron's defaults


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_decay_styles_reach_the_schedule(decay):
    from minidist.training.train import OptimSettings
    s = OptimSettings(lr=1.0, min_lr=0.0, warmup=0, steps=10, decay=decay)
    middle = {"cosine": 0.5, "linear": 0.5, "constant": 1.0}[decay]
    assert s.lr_at(5) == pytest.approx(middle) and s.lr_at(2) == pytest.approx(
        {"cosine": 0.5 * (1 + __import__("math").cos(0.2 * __import__("math").pi)), "linear": 0.8, "constant": 1.0}[decay])


def test_the_demo_trains_with_the_configs_optimizer_settings(tmp_path):
    """DeepSpeed's weight_decay 3e-7 trains exactly as --weight-decay 3e-7 (with DeepSpeed's own
    defaults where the config is silent: betas (0.9, 0.999), no clipping)."""
    import json

    import numpy as np
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {
        "lr": 0.01, "weight_decay": 3e-7}}}))
    small = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16", "--steps", "2",
             "--dtype", "float64", "--log-every", "-1"]
    runs = {}
    for name, flags in (("config", ["--deepspeed-config", str(config)]),
                        ("flags", ["--batch-size", "8", "--lr", "0.01", "--weight-decay", "3e-7", "--adam-beta2", "0.999",
                                   "--clip", "0"])):
        out = tmp_path / f"{name}.json"
        proc = subprocess.run([sys.executable, "-m", "minidist.demo", *flags, *small, "--json", str(out),
                               "--save", str(tmp_path / f"{name}.npz")], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs[name] = (json.loads(out.read_text()), dict(np.load(tmp_path / f"{name}.npz")))
    report = runs["config"][0]
    assert report["optimizer"]["weight_decay"] == 3e-7 and report["optimizer"]["betas"] == [0.9, 0.999]
    assert report["framework_config"]["applied"]["optimizer.params.weight_decay"]["used"] == 3e-7
    for name, value in runs["flags"][1].items():
        assert np.array_equal(runs["config"][1][name], value), name


def test_the_demo_prints_what_the_command_line_overrides():
    line = ("--micro-batch-size 2 --global-batch-size 4 --num-layers 24 --hidden-size 1024 --num-attention-heads 16 "
            "--seq-length 16 --train-iters 500000 --lr 1e-4")
    proc = subprocess.run([sys.executable, "-m", "minidist.demo", "--megatron-args", line, "--n-layer", "2",
                           "--n-embd", "32", "--n-head", "2", "--steps", "2", "--log-every", "-1"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "steps 500000 -> 2 (the command line's)" in proc.stdout
    assert "n_layer 24 -> 2 (the command line's), n_embd 1024 -> 32 (the command line's)" in proc.stdout
    assert "the run uses: n_layer 2, n_embd 32, n_head 2" in proc.stdout
