"""The published runs the planner is held to (minidist/plan/published.py) agree with themselves:
each layout multiplies out to its GPU count, each batch divides among its replicas, each GPT-style
model's parameter count follows from its sizes, and the papers' own totals (aggregate
petaFLOP/s, percentage of peak, training days) follow from the per-GPU numbers. A typo copied
from a paper would show here before it misleads the planner's tests. Pure arithmetic, no MPI."""
import pytest

from minidist.plan.published import (
    A100_PEAK_TFLOPS_16BIT,
    ALL_RUNS,
    KORTHIKANTI_RUNS,
    KORTHIKANTI_TABLE_5,
    NARAYANAN_TABLE_1,
    NARAYANAN_TABLE_1_AGGREGATE_PFLOPS,
    NARAYANAN_TABLE_1_PERCENT_OF_PEAK,
    NARAYANAN_TABLE_2,
    NARAYANAN_TABLE_2_DAYS_300B_TOKENS,
    NARAYANAN_TABLE_2_MODEL_PARALLEL,
    MTNLG_ITERATION_SECONDS,
    NEMOTRON_15B_TABLE_2,
    NEMOTRON_TABLE_2,
    OTHER_RUNS,
    PublishedRun,
)

DEVICES = {"a100-40gb", "a100-80gb", "h100-80gb-sxm"}  # presets of minidist/plan/hardware.py

# Llama 3 uses SwiGLU (FFN 3.25 h, three matrices) and grouped-query attention (8 KV heads),
# Nemotron-4 grouped-query attention, so Narayanan's eq. (2), written for GPT (4h FFN, full
# multi-head attention), does not apply to them: `shaped_parameters` counts theirs. Every other run
# here is GPT-style: Narayanan's Tables 1 and 2, MT-NLG 530B and BLOOM (whose ALiBi replaces the
# position table, a difference of 0.02%).
GPT_STYLE = tuple(r for r in ALL_RUNS if not (r.n_kv_head or r.ffn_hidden or r.gated_mlp))
SHAPED = tuple(r for r in ALL_RUNS if r not in GPT_STYLE)


def ids(runs):
    return [r.name for r in runs]


def narayanan_parameters(r: PublishedRun) -> float:
    """Narayanan et al. eq. (2): P = 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h))."""
    l, h, V, s = r.n_layer, r.n_embd, r.vocab_size, r.seq
    return 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))


def shaped_parameters(r: PublishedRun) -> float:
    """Weights of a model with grouped-query attention and a (gated) MLP of its own width: per layer
    q (h·h), k and v (2·h·kv·h/a), the output (h·h), the MLP's matrices (2 or, gated, 3 of h·ffn);
    the input embedding and an untied output layer (V·h each). Norms and biases left out."""
    h, kv, d = r.n_embd, r.n_kv_head or r.n_head, r.n_embd // r.n_head
    layer = 2 * h * h + 2 * h * kv * d + (3 if r.gated_mlp else 2) * h * (r.ffn_hidden or 4 * h)
    return r.n_layer * layer + r.vocab_size * h * (1 if r.tie_embeddings else 2)


def test_collections_are_what_they_say():
    assert len(NARAYANAN_TABLE_1) == 10 and len(NARAYANAN_TABLE_2) == 12 and len(OTHER_RUNS) >= 3
    assert ALL_RUNS == NARAYANAN_TABLE_1 + NARAYANAN_TABLE_2 + OTHER_RUNS + KORTHIKANTI_RUNS
    assert len(KORTHIKANTI_RUNS) == 2 * len(KORTHIKANTI_TABLE_5) == 8
    assert len({r.name for r in ALL_RUNS}) == len(ALL_RUNS), "run names must be unique"
    assert all(isinstance(r, PublishedRun) for r in ALL_RUNS)
    assert {r.name.split(',')[0] for r in SHAPED} == {'Llama 3 405B', 'Nemotron-4 340B', 'Nemotron-4 15B'}
    assert len(SHAPED) == 9


@pytest.mark.parametrize("r", ALL_RUNS, ids=ids(ALL_RUNS))
def test_fields_are_in_range(r):
    assert r.source and r.device in DEVICES
    assert r.recompute in {"full", "selective", "none", "unknown"} and r.precision == "mixed"
    assert r.zero in {0, 1, 2, 3}
    assert r.gpus % r.gpus_per_node == 0
    assert r.tflops_per_gpu > 0 and (r.parameters is None or r.parameters > 0)
    assert r.micro_batch is None or r.micro_batch >= 1
    assert r.virtual_stages is None or r.virtual_stages >= 2
    assert r.ddp in {"", "torch", "local"}
    assert r.state_bytes is None or (len(r.state_bytes) == 3 and 16 <= sum(r.state_bytes) <= 20)


@pytest.mark.parametrize("r", ALL_RUNS, ids=ids(ALL_RUNS))
def test_layout_multiplies_out_to_the_gpu_count(r):
    assert r.tp * r.pp * r.dp * r.context_parallel == r.gpus


@pytest.mark.parametrize("r", ALL_RUNS, ids=ids(ALL_RUNS))
def test_batch_divides_among_replicas(r):
    assert r.global_batch % r.dp == 0
    if r.micro_batch is not None:
        assert r.global_batch % (r.dp * r.micro_batch) == 0


@pytest.mark.parametrize("r", ALL_RUNS, ids=ids(ALL_RUNS))
def test_model_splits_as_the_layout_says(r):
    assert r.n_embd % r.n_head == 0
    assert r.n_embd % r.tp == 0 and r.n_head % r.tp == 0
    assert r.pp <= r.n_layer
    assert r.seq % (2 * r.context_parallel) == 0 or r.context_parallel == 1  # Llama 3 splits into 2·cp chunks


@pytest.mark.parametrize("r", [r for r in GPT_STYLE if r.parameters], ids=ids(r for r in GPT_STYLE if r.parameters))
def test_parameter_count_follows_from_the_sizes(r):
    assert narayanan_parameters(r) == pytest.approx(r.parameters, rel=0.03)


@pytest.mark.parametrize("r", SHAPED, ids=ids(SHAPED))
def test_shaped_parameter_count_follows_from_the_sizes(r):
    """Llama 3 405B: 405.8B; Nemotron-4 340B: 341.0B (its report's model card: 340B); Nemotron-4 15B:
    15.6B (its report: 15.7B)."""
    assert shaped_parameters(r) == pytest.approx(r.parameters, rel=0.01)


def test_nemotron_mfu_follows_from_its_iteration_times():
    """Nemotron-4's Table 2 states batch, iteration time and MFU: the model's FLOPs per step (per
    layer 2·B·s·weights and the attention's 4·B·s²·h, forward, three passes; the output layer
    6·B·s·h·V) over the time, the GPUs and 989.5 TFLOP/s give the MFU column within 0.2 points."""
    runs = [r for r in OTHER_RUNS if r.name.startswith("Nemotron-4 340B")]
    assert [r.gpus for r in runs] == sorted(NEMOTRON_TABLE_2) == [1536, 3072, 6144]
    for r in runs:
        dp, batch, seconds, mfu = NEMOTRON_TABLE_2[r.gpus]
        assert (dp, batch) == (r.dp, r.global_batch) and r.tflops_per_gpu == pytest.approx(mfu / 100 * 989.5, abs=0.05)
        B, s, L, h, V = batch, r.seq, r.n_layer, r.n_embd, r.vocab_size
        weights = (shaped_parameters(r) - 2 * V * h) / L
        flops = 3 * (2 * B * s * L * weights + 4 * B * s * s * L * h) + 6 * B * s * h * V
        assert 100 * flops / (seconds * r.gpus * 989.5e12) == pytest.approx(mfu, abs=0.2)


@pytest.mark.parametrize("r", NARAYANAN_TABLE_1, ids=ids(NARAYANAN_TABLE_1))
def test_table_1_totals(r):
    """Aggregate petaFLOP/s = GPUs × teraFLOP/s per GPU / 1000, and the percentage column is of 312."""
    assert r.gpus * r.tflops_per_gpu / 1000 == pytest.approx(NARAYANAN_TABLE_1_AGGREGATE_PFLOPS[r.name], rel=0.01)
    assert round(100 * r.tflops_per_gpu / A100_PEAK_TFLOPS_16BIT) == NARAYANAN_TABLE_1_PERCENT_OF_PEAK[r.name]


def test_table_1_is_the_weak_scaling_sweep():
    assert set(NARAYANAN_TABLE_1_AGGREGATE_PFLOPS) == set(NARAYANAN_TABLE_1_PERCENT_OF_PEAK) == set(ids(NARAYANAN_TABLE_1))
    sizes = [r.parameters for r in NARAYANAN_TABLE_1]
    assert sizes == sorted(sizes) and [r.gpus for r in NARAYANAN_TABLE_1] == sorted(r.gpus for r in NARAYANAN_TABLE_1)
    assert all(r.tp <= r.gpus_per_node for r in NARAYANAN_TABLE_1)  # tensor parallelism stays inside a node


@pytest.mark.parametrize("r", NARAYANAN_TABLE_2, ids=ids(NARAYANAN_TABLE_2))
def test_table_2_rows(r):
    assert r.tp * r.pp == NARAYANAN_TABLE_2_MODEL_PARALLEL[r.name]
    if r.zero == 3:
        assert r.tp == r.pp == 1 and r.dp == r.gpus
    else:
        assert r.zero == 0 and r.micro_batch == 1
    # the paper's eq. (4): days ≈ 8·T·P / (n·X), T = 300B tokens; eq. (4) drops small terms of eq. (3)
    days = 8 * 300e9 * r.parameters / (r.gpus * r.tflops_per_gpu * 1e12) / 86400
    assert days == pytest.approx(NARAYANAN_TABLE_2_DAYS_300B_TOKENS[r.name], rel=0.05)


def test_table_2_ptdp_beats_zero3_at_every_shared_gpu_count():
    ratios = {}
    for size in (175e9, 530e9):
        rows = [r for r in NARAYANAN_TABLE_2 if abs(r.parameters - size) / size < 0.01]
        zero3 = {r.gpus: r.tflops_per_gpu for r in rows if r.zero == 3}
        ptdp = {r.gpus: r.tflops_per_gpu for r in rows if r.zero == 0}
        for gpus in zero3.keys() & ptdp.keys():
            ratios[(size, gpus)] = ptdp[gpus] / zero3[gpus]
    assert len(ratios) == 5  # 175B at 384/768/1536; 530B at 1120/2240 (ZeRO-3 ran 640, PTD-P 560)
    assert all(ratio > 1 for ratio in ratios.values()), ratios


def test_other_runs_cover_a100_and_h100_with_context_parallelism():
    assert {r.device for r in OTHER_RUNS} == {"a100-80gb", "h100-80gb-sxm"}
    assert any(r.context_parallel > 1 for r in OTHER_RUNS)


def test_mtnlg_tflops_follow_from_its_iteration_times_counting_recomputation():
    """Smith et al. state iteration times and TFLOP/s per GPU; Narayanan et al.'s equation (3),
    96·B·s·l·h²·(1 + s/6h + V/16lh), which counts recomputation's extra forward, turns the first into
    the second to a tenth of a TFLOP/s; the model's FLOPs alone (72 instead of 96) would give 85-94."""
    runs = [r for r in OTHER_RUNS if r.name.startswith("MT-NLG")]
    assert len(runs) == len(MTNLG_ITERATION_SECONDS) == 3
    for r in runs:
        B, s, l, h, V = r.global_batch, r.seq, r.n_layer, r.n_embd, r.vocab_size
        flops = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
        per_gpu = flops / (MTNLG_ITERATION_SECONDS[r.gpus] * r.gpus) / 1e12
        assert abs(per_gpu - r.tflops_per_gpu) < 0.6, (r.name, per_gpu)
        assert per_gpu * 72 / 96 < 0.8 * r.tflops_per_gpu



def test_korthikanti_mfu_follows_from_its_iteration_times():
    """Korthikanti et al.'s Table 5 prints iteration times; the model's FLOPs, 72·B·s·L·h²·(1 + s/6h +
    V/12Lh), over them give the MFU the paper prints for its 175B, 530B and 1T rows with sequence
    parallelism and selective recomputation (51.4, 56.0, 56.3 %), and the 29-32 % speed-up of those
    over full recomputation that its abstract states (for 530B: 54.2 against 42.1 % MFU on 2240 GPUs)."""
    by_name = {r.name: r for r in KORTHIKANTI_RUNS}
    mfu = {m: by_name[f"Korthikanti 2022 Table 5, {m}, selective"].tflops_per_gpu / A100_PEAK_TFLOPS_16BIT
           for m in ("175B", "530B", "1T")}
    assert [100 * v for v in mfu.values()] == pytest.approx([51.4, 56.0, 56.3], abs=0.1)
    for model, (_, full, selective) in KORTHIKANTI_TABLE_5.items():
        assert 1.28 < full / selective < 1.33
        fast, slow = (by_name[f"Korthikanti 2022 Table 5, {model}, {mode}"] for mode in ("selective", "full"))
        assert fast.tflops_per_gpu / slow.tflops_per_gpu == pytest.approx(full / selective, rel=2e-3)
        assert fast.sequence_parallel and fast.recompute == "selective" and slow.recompute == "full"


def test_nemotron_15b_is_its_reports_model_and_ramp_up():
    """Nemotron-4 15B's report splits its parameters into 3.2B embedding (input and output, untied: 3.15B)
    and 12.5B non-embedding; its Table 2 keeps tp 8 and 4 sequences per replica as the batch ramps."""
    runs = [r for r in OTHER_RUNS if r.name.startswith("Nemotron-4 15B")]
    assert [r.gpus for r in runs] == sorted(NEMOTRON_15B_TABLE_2) == [768, 1536, 2304]
    for r in runs:
        dp, batch, mfu = NEMOTRON_15B_TABLE_2[r.gpus]
        assert (dp, batch, r.tp * r.pp * dp) == (r.dp, r.global_batch, r.gpus) and batch == 4 * dp
        assert r.tflops_per_gpu == pytest.approx(mfu / 100 * 989.5, abs=0.05)
        embedding = 2 * r.vocab_size * r.n_embd
        assert embedding / 1e9 == pytest.approx(3.2, abs=0.06)  # 3.15
        assert (shaped_parameters(r) - embedding) / 1e9 == pytest.approx(12.5, abs=0.05)
