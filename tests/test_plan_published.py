"""The planner against published training runs (minidist/plan/against_published.py; the runs and
their sources in minidist/plan/published.py): Narayanan et al. 2021 ("Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", SC21, arXiv:2104.04473) Tables 1 and 2,
BLOOM-176B, Megatron-Turing NLG 530B, Llama 3 405B, Nemotron-4 340B and 15B, and Korthikanti et al.
2022's Table 5.

What holds is asserted at the bounds it holds to; the chapter (chapter 9, "Checked against the
outside") prints the whole table and explains the rows that miss."""
import dataclasses

import pytest

from minidist.core.model import GPTConfig
from minidist.plan.against_published import cluster_of, compare, stated_layout, workload_of
from minidist.plan.search import plan
from minidist.plan.predict import Cluster, Workload, predict, rank_parameter_count, stage_ledger
from minidist.plan.published import (KORTHIKANTI_RUNS, KORTHIKANTI_TABLE_5, MEGATRON_FP16_STATE_BYTES,
                                     NARAYANAN_TABLE_1, NARAYANAN_TABLE_2, OTHER_RUNS)
from minidist.training.layout import Layout


@pytest.mark.parametrize("run", NARAYANAN_TABLE_1, ids=lambda r: r.name.split(", ")[-1])
def test_table_1_speed_is_predicted_within_15_percent(run):
    c = compare(run, search=False)
    assert c["fits"] and abs(c["error"]) <= 0.15, c


@pytest.mark.full  # ten searches, about 20 s
def test_table_1_the_planner_agrees_with_the_papers_layouts():
    """Among the layouts Megatron-LM runs, its best layout has the paper's tp in 8 of the 10 rows
    (1.7-18.4B, 76.1B with the paper's very layout, 310B-1T; for 39.1B it prefers tp 2 with a
    deeper, interleaved pipeline, for 145.6B tp 4 by 0.6 %), the paper's model-parallel size tp·pp
    in 8 (all but 310B and 530B, where it takes fewer stages and more replicas), and it predicts the
    paper's own layout within 10 % of its best in every row."""
    results = [compare(run) for run in NARAYANAN_TABLE_1]
    same_tp = [c["best_tp"] == run.tp for c, run in zip(results, NARAYANAN_TABLE_1)]
    assert sum(same_tp) >= 8, [(c["name"], c["best"]) for c in results]
    assert all(same_tp[i] for i in (0, 1, 2, 3, 5, 7, 8, 9))
    assert results[5]["best"] == results[5]["layout"] == "dp32-tp8-pp4-m28-interleaved-v3"
    same_model_parallel = [Layout.parse(c["best"]).tp * Layout.parse(c["best"]).pp == run.tp * run.pp
                           for c, run in zip(results, NARAYANAN_TABLE_1)]
    assert sum(same_model_parallel) >= 8 and all(same_model_parallel[:7]), [c["best"] for c in results]
    assert all(c["slower_than_best"] is not None and c["slower_than_best"] <= 0.10 for c in results), results


def test_pytorch_ddp_in_a_megatron_pipeline_all_reduces_every_micro_batch():
    """Megatron-LM's pipelined schedules never enter PyTorch DDP's no_sync, so under --DDP-impl torch
    (Table 1 up to 18.4B) a pipeline stage all-reduces its gradients in each micro-batch's backward:
    m times the bytes, and m times what shows beside the backward. Without a pipeline (the schedule
    that does enter no_sync), and under Megatron-LM's own DDP, once a step."""
    run = next(r for r in NARAYANAN_TABLE_1 if r.name.endswith("18.4B"))
    w, cluster = workload_of(run), cluster_of(run)
    assert w.sync_every_microbatch and not workload_of(NARAYANAN_TABLE_1[4]).sync_every_microbatch
    once = dataclasses.replace(w, sync_every_microbatch=False)
    piped, flat = Layout.parse("dp32-tp2-pp4-m32-interleaved-v2"), stated_layout(run)
    each, single = predict(w, piped, cluster), predict(once, piped, cluster)
    assert each["bytes_sent"]["dp"] == pytest.approx(32 * single["bytes_sent"]["dp"])
    assert each["dp"] == pytest.approx(32 * single["dp"]) and each["step_seconds"] > 1.5 * single["step_seconds"]
    assert predict(w, flat, cluster) == predict(once, flat, cluster)


def test_the_search_keeps_to_what_megatron_lm_runs():
    """Megatron-LM cuts the layers evenly over the stages, interleaves only above 2 stages, in equal
    chunks and with micro-batches the stages divide (its asserts, frameworks/megatron.py). Every
    layout Narayanan et al. ran passes; the planner's former pick for the 76.1B model, 60 layers
    over 8 stages, does not, and the search for a Megatron-LM run leaves such layouts out."""
    from minidist.frameworks.megatron import why_megatron_refuses
    from minidist.plan.against_published import framework_accepts

    for run in NARAYANAN_TABLE_1 + NARAYANAN_TABLE_2:
        assert run.framework == "megatron-lm" and why_megatron_refuses(stated_layout(run), run.n_layer) is None
    refusals = {"dp32-tp4-pp8-m56-interleaved-v2": "60 layers do not divide evenly over pp=8 stages",
                "dp32-tp8-pp2-m12-interleaved-v2": "the interleaved schedule needs more than 2 stages, got pp=2",
                "dp32-tp8-pp4-m28-interleaved-v2": "15 layers per stage do not cut into 2 equal chunks",
                "dp32-tp8-pp4-m14-interleaved-v3": "14 micro-batches are not a multiple of pp=4"}
    for name, why in refusals.items():
        assert why in why_megatron_refuses(Layout.parse(name), 60)
    run76 = NARAYANAN_TABLE_1[5]
    accept = framework_accepts(run76)
    rows = plan(workload_of(run76), cluster_of(run76), zero_stages=(0,), accept=accept)
    assert rows and all(accept(Layout(**r["layout"])) for r in rows)
    assert all(why_megatron_refuses(Layout(**r["layout"]), 60) is None for r in rows)
    assert framework_accepts(next(r for r in OTHER_RUNS if r.name == "BLOOM 176B")) is None


@pytest.mark.full  # six searches, about 15 s
def test_table_1_model_parallel_sizes_are_the_fewest_gpus_the_model_fits_on():
    """For 1.7-76.1B the paper's tp·pp is the smallest whose layouts fit in 80 GB, with the model
    states counted as Megatron-LM and PyTorch's DDP keep them (20-22 bytes per parameter); counted
    with the ZeRO paper's 16 it is so for only 2 of the 6: the documented bytes explain the choice."""
    def fewest(w, run):
        rows = plan(w, cluster_of(run), zero_stages=(0,), schedules=("1f1b", "interleaved"))
        return min(r["layout"]["tp"] * r["layout"]["pp"] for r in rows if r["fits"])

    runs = NARAYANAN_TABLE_1[:6]
    assert [fewest(workload_of(run), run) for run in runs] == [run.tp * run.pp for run in runs]
    zero_paper = [dataclasses.replace(workload_of(run), state_bytes=None, gradient_copies=1) for run in runs]
    assert sum(fewest(w, run) == run.tp * run.pp for w, run in zip(zero_paper, runs)) == 2


def test_table_1_runs_as_the_authors_script_ran_it():
    """Micro-batch, interleaving and data-parallel code from the authors' run script for Table 1
    (Megatron-LM examples/academic_paper_scripts/sc21/run_table_1.sh)."""
    layouts = [str(stated_layout(run)) for run in NARAYANAN_TABLE_1]
    assert layouts[0] == "dp32" and layouts[3] == "dp32-tp8-m4" and layouts[4] == "dp32-tp8-pp2-m12"
    assert layouts[5] == "dp32-tp8-pp4-m28-interleaved-v3" and layouts[9] == "dp6-tp8-pp64-m512"
    small, large = workload_of(NARAYANAN_TABLE_1[0]), workload_of(NARAYANAN_TABLE_1[4])
    assert small.overlap and small.gradient_copies == 2  # PyTorch's DDP: during backward, buckets a copy
    assert not large.overlap and large.gradient_copies == 1  # Megatron-LM's own: after backward, in place


@pytest.mark.parametrize("dp", [1, 8, 64])
def test_megatron_keeps_the_bytes_its_documentation_states(dp):
    """Megatron Core developer guide, "Distributed Optimizer": with fp16 parameters and gradients,
    20 bytes per parameter, and 4 + 16/d with the distributed optimizer (ZeRO-1 over d replicas);
    PyTorch's DDP docs: its buckets hold a second copy of the gradients (gradient_as_bucket_view
    saves "the total gradients size"): 22. The ZeRO paper's mixed precision: 16."""
    config = GPTConfig(vocab_size=51200, block_size=2048, n_layer=4, n_head=16, n_embd=1024)

    def per_parameter(zero, **workload):
        w = Workload(config, 64 * dp, 2048, "mixed", "megatron", **workload)
        ledger = stage_ledger(w, Layout(dp=dp, zero=zero), 0)
        return sum(ledger[k] for k in ("params", "grads", "optimizer")) / rank_parameter_count(config, dp, 1, 1, 0)

    megatron = MEGATRON_FP16_STATE_BYTES
    assert per_parameter(0, state_bytes=megatron) == pytest.approx(20)
    assert per_parameter(1, state_bytes=megatron) == pytest.approx(4 + 16 / dp, rel=1e-3)
    assert per_parameter(0, state_bytes=megatron, gradient_copies=2) == pytest.approx(22)
    assert per_parameter(0) == pytest.approx(16)


def table_2(kind: str, gpus: int, size: str):
    return next(r for r in NARAYANAN_TABLE_2 if kind in r.name and f"{gpus} GPUs" in r.name and size in r.name)


@pytest.mark.parametrize("size, gpus", [("175B", 384), ("175B", 768), ("175B", 1536), ("530B", 1120), ("530B", 2240)])
def test_table_2_ptd_p_against_zero_3_keeps_the_papers_order_within_30_percent(size, gpus):
    ptd, zero3 = table_2("PTD-P", gpus, size), table_2("ZeRO-3", gpus, size)
    paper = ptd.tflops_per_gpu / zero3.tflops_per_gpu
    predicted = compare(ptd, search=False)["predicted"] / compare(zero3, search=False)["predicted"]
    assert predicted > 1 and abs(predicted / paper - 1) <= 0.30, (paper, predicted)


@pytest.mark.parametrize("run", NARAYANAN_TABLE_2, ids=lambda r: r.name.split(", ", 1)[-1])
def test_table_2_speed_is_predicted_within_20_percent(run):
    assert abs(compare(run, search=False)["error"]) <= 0.20


def test_zero_3_loses_at_scale_with_a_fixed_batch():
    """175B, batch 1536: ZeRO-3's predicted speed halves each time the GPUs double (each rank's
    share of the batch halves, its gathers do not), PTD-P's barely moves (the paper: 144, 88, 44
    against 153, 149, 141)."""
    zero3 = [compare(table_2("ZeRO-3", g, "175B"), search=False)["predicted"] for g in (384, 768, 1536)]
    ptd = [compare(table_2("PTD-P", g, "175B"), search=False)["predicted"] for g in (384, 768, 1536)]
    assert zero3[0] > 1.5 * zero3[1] > 2.25 * zero3[2] and ptd[0] > ptd[1] > ptd[2] > 0.85 * ptd[0]


@pytest.mark.parametrize("run", [r for r in OTHER_RUNS if r.context_parallel == 1], ids=lambda r: r.name)
def test_other_production_runs(run):
    """BLOOM (on its own cluster's network, 6.25 GB/s per GPU between nodes) and Nemotron-4 340B
    (grouped-query attention, three rows of its batch ramp-up) and Llama 3 (8192 GPUs) within 15 %;
    Nemotron-4 15B within 15 % on 768 and 1536 GPUs, and +23 % on 2304, where its MFU fell from 34.3
    to 30.5 % at the same batch per replica, which nothing in the model does (its data-parallel
    traffic hides behind the compute, and a ring's time per byte does not grow with the ring);
    Megatron-Turing NLG measured 113-126 TFLOP/s where
    the same layout in Narayanan et al.'s Table 2 ran 159-171, and the planner (the Megatron-LM
    code path) predicts the latter: 30-36 % above MT-NLG; Llama 3 on 16384 GPUs within 30 %
    (compared with plain 1F1B, the paper giving no chunk count for its interleaved schedule: 16
    micro-batches on 16 stages leave about half the step idle; with 2-4 chunks the prediction
    brackets the measured 400)."""
    c = compare(run, search=False)
    bound = {"BLOOM": 0.15, "MT-NLG": 0.40, "Llama 3 405B, 8192": 0.15, "Llama 3 405B, 16384": 0.30,
             "Nemotron-4 340B": 0.15, "Nemotron-4 15B, 2304": 0.25, "Nemotron-4 15B": 0.15}
    limit = next(v for k, v in bound.items() if run.name.startswith(k))
    assert abs(c["error"]) <= limit, c


def test_activations_counted_for_the_block_the_run_has():
    """Korthikanti et al.'s count, tensor by tensor (`stage_memory.megatron_layer_terms`): GPT's
    block gives their 10 + 24/t + 5as/(ht); Llama 3's block (8 key/value heads of 128, a SwiGLU MLP
    53,248 wide, no dropout, FlashAttention's fp32 log-sum-exp instead of the scores) 8 + 23.75/t
    + 0.03/t."""
    from minidist.plan.stage_memory import megatron_layer_terms
    gpt = Workload(GPTConfig(n_layer=96, n_head=96, n_embd=12288), 1536, 2048)
    assert megatron_layer_terms(gpt) == (10, 24, 5)
    llama = workload_of(next(r for r in OTHER_RUNS if r.name.startswith("Llama 3 405B, 8192")))
    assert megatron_layer_terms(llama) == (8, 2 + 4 * 8 / 128 + 2 + 6 * 53248 / 16384 + 4 * 128 / 16384, 0.0)


@pytest.mark.parametrize("layers", [1, 4, 7, 126])
def test_a_cut_with_the_ends_as_layers_covers_every_block_once(layers):
    """Cut over n + 2 layers, the embedding and the head among them, every block lands in exactly one
    chunk, in order, for any number of stages and chunks per stage up to one layer each; a stage may
    hold no block, only the embedding or the head (Megatron Core allows it too)."""
    from minidist.plan.workload import chunk_layers
    for p in range(1, layers + 3):
        for v in range(1, (layers + 2) // p + 1):
            chunks = sorted(c for stage in range(p) for c in chunk_layers(layers, p, stage, v, True))
            assert all(start <= end for start, end in chunks)
            assert [i for start, end in chunks for i in range(start, end)] == list(range(layers)), (p, v)


def test_llama_3_fits_as_meta_trained_it():
    """Llama 3 405B's 8K-token stage ran without recomputation on 80 GB H100s, with one layer
    fewer on the first and last stages (the paper's section 3.3.2). The planner agrees (about 73 GB
    on the first stage). With an even cut of the 126 layers (8 on the first stage) it would not fit
    (about 84 GB); counting dropout masks the block does not have would add about 4 GB."""
    from minidist.plan.workload import chunk_layers
    run = next(r for r in OTHER_RUNS if r.name.startswith("Llama 3 405B, 8192"))
    w, cluster, layout = workload_of(run), cluster_of(run), stated_layout(run)
    assert not w.recompute and [chunk_layers(126, 16, s, 1, True) for s in (0, 1, 15)] == [((0, 7),), ((7, 15),),
                                                                                             ((119, 126),)]
    peak = predict(w, layout, cluster)["memory"]["peak"]
    assert predict(w, layout, cluster)["fits"] and 70e9 < peak < 76e9
    assert not predict(dataclasses.replace(w, ends_as_layers=False), layout, cluster)["fits"]
    assert 3e9 < predict(dataclasses.replace(w, dropout=True), layout, cluster)["memory"]["peak"] - peak < 5e9


@pytest.mark.parametrize("run", KORTHIKANTI_RUNS, ids=lambda r: r.name.split("Table 5, ")[-1])
def test_korthikanti_table_5_speed_is_predicted_within_15_percent(run):
    """Korthikanti et al. 2022's four models with full recomputation (−7 to +8 %) and with sequence
    parallelism and selective recomputation (0 to +14 %), MFU as the paper counts it."""
    c = compare(run, search=False)
    assert c["fits"] and abs(c["error"]) <= 0.15, c


def test_selective_recomputation_against_full_as_korthikanti_measured():
    """The paper measured sequence parallelism with selective recomputation 1.29-1.32 times as fast as
    full recomputation; the planner predicts 1.36-1.47 (recomputing a forward costs a third of the
    layers' work in the model; the paper's runs lose a little less), each within 15 % of the paper's."""
    for model, (_, full, selective) in KORTHIKANTI_TABLE_5.items():
        slow, fast = (compare(next(r for r in KORTHIKANTI_RUNS if r.name.endswith(f"{model}, {mode}")), search=False)
                      for mode in ("full", "selective"))
        predicted = fast["predicted"] / slow["predicted"]
        assert 1.3 < predicted < 1.5 and abs(predicted / (full / selective) - 1) <= 0.15, (model, predicted)


@pytest.mark.full  # eight searches, about 10 s
def test_korthikanti_the_planner_agrees_with_its_layouts():
    """Every row ran tp 8: the planner's best among the layouts Megatron-LM runs has tp 8 for 530B and
    1T in both modes and for 175B with selective recomputation; for 22B (one node, a batch of 4) it
    prefers tp 2 with 4 interleaved stages, for 175B with full recomputation tp 4 with 16 stages. It
    predicts the paper's own layout within 10 % of its best in every row."""
    results = [compare(run) for run in KORTHIKANTI_RUNS]
    same_tp = [c["best_tp"] == 8 for c in results]
    assert same_tp == [False, False, False, True, True, True, True, True], [c["best"] for c in results]
    assert all(c["slower_than_best"] is not None and c["slower_than_best"] <= 0.10 for c in results), results


def test_selective_recomputation_keeps_what_it_should():
    """Selective recomputation keeps every activation but the attention core's 5·a·s²·b bytes, rebuilds
    one core at a time in backward, and runs the core's two batched GEMMs again; full recomputation
    keeps each layer's input only and runs the whole forward again."""
    from minidist.plan.stage_memory import attention_core_bytes, layer_activation_bytes, megatron_layer_terms
    from minidist.plan.step_time import flops_per_step
    w = Workload(GPTConfig(n_layer=4, n_head=16, n_embd=1024, block_size=2048, vocab_size=51200), 8, 2048, "mixed",
                 "megatron")
    sel = dataclasses.replace(w, selective=True)
    assert megatron_layer_terms(w) == (10, 24, 5) and megatron_layer_terms(sel) == (10, 24, 0.0)
    s, b, h, a, t = 2048, 1, 1024, 16, 2
    assert layer_activation_bytes(w, b, t) - layer_activation_bytes(sel, b, t) == attention_core_bytes(sel, b, t) \
        == 5 * a * s * s * b / t
    core = 4 * 8 * s * s * 4 * h
    assert flops_per_step(sel) - flops_per_step(w) == core and flops_per_step(sel, recompute=False) == flops_per_step(w)
    layout, cluster = Layout(tp=2, pp=2, microbatches=8, schedule="1f1b"), Cluster(gpus=4)
    none, selective = (predict(x, layout, cluster) for x in (w, sel))
    assert selective["memory"]["activations"] < none["memory"]["activations"]
    assert none["step_seconds"] < selective["step_seconds"] < predict(dataclasses.replace(w, recompute=True), layout,
                                                                      cluster)["step_seconds"]


@pytest.mark.full  # three searches, about 10 s
def test_nemotron_the_planner_agrees_with_its_layout():
    """Nemotron-4 340B on 1536, 3072 and 6144 H100s: predicted within 5 % of its MFU (+5, +5, +2 %), the planner's best
    among the layouts Megatron-LM runs has its tp 8, and its own layout comes out within 5 % of that
    best. Its activations fit without recomputation (about 50 GB of 80), so the planner, like the
    report, does not recompute; with recomputation it would predict 23-25 % below the measured."""
    runs = [r for r in OTHER_RUNS if r.name.startswith("Nemotron-4 340B")]
    results = [compare(run) for run in runs]
    assert all(abs(c["error"]) <= 0.05 and c["best_tp"] == 8 and c["slower_than_best"] <= 0.05 for c in results), results
    w = workload_of(runs[0])
    assert not w.recompute and w.config.n_kv_head == 8
    slow = predict(dataclasses.replace(w, recompute=True), stated_layout(runs[0]), cluster_of(runs[0]))
    assert -0.26 < slow["mfu"] * 989.5 / runs[0].tflops_per_gpu - 1 < -0.20


@pytest.mark.full  # three searches, about 2 s
def test_nemotron_15b_the_planner_chooses_its_layout():
    """Nemotron-4 15B on 768-2304 H100s, tp 8 and a distributed optimizer over 96-288 replicas: the
    planner's best among the layouts Megatron-LM runs is tp 8 with ZeRO-1, the run's own shape (the
    micro-batch is not stated). Counted as Megatron-LM's distributed optimizer runs with its overlap
    flags on (NVIDIA's recipe for the model sets them), its reduce-scatter hides behind the last
    backward and its all-gather ahead of the next forward; counted in the open after backward, the
    same layout would lose 19 % to plain data parallelism, whose all-reduce moves the same bytes."""
    runs = [r for r in OTHER_RUNS if r.name.startswith("Nemotron-4 15B")]
    assert [r.dp for r in runs] == [96, 192, 288] and all(workload_of(r).overlap for r in runs)
    for run in runs:
        c = compare(run)
        assert c["best_tp"] == 8 and Layout.parse(c["best"]).zero == 1 and c["slower_than_best"] <= 0.05, c
    w, cluster = workload_of(runs[0]), cluster_of(runs[0])
    plain, zero1 = (predict(w, Layout(dp=96, tp=8, zero=z), cluster) for z in (0, 1))
    assert zero1["bytes_sent"]["dp"] == pytest.approx(plain["bytes_sent"]["dp"])
    assert 0.95 * plain["step_seconds"] < zero1["step_seconds"] < plain["step_seconds"]  # its update: 1/96 of Adam
    shown = predict(dataclasses.replace(w, overlap=False), Layout(dp=96, tp=8, zero=1), cluster)
    assert shown["dp"] > 2 * zero1["dp"]


def test_a_run_on_its_own_network():
    """BLOOM's record states Jean Zay's network (four 100 Gb/s Omni-Path links for eight GPUs): the
    planner uses it, and on the A100 preset's 25 GB/s per GPU it would predict the run faster."""
    bloom = next(r for r in OTHER_RUNS if r.name == "BLOOM 176B")
    assert cluster_of(bloom).inter_bandwidth == 6.25e9 and bloom.inter_bandwidth == 6.25e9
    preset = dataclasses.replace(cluster_of(bloom), inter_bandwidth=25e9)
    own = compare(bloom, search=False)["predicted"]
    assert own < predict(workload_of(bloom), stated_layout(bloom), preset)["tflops_per_device"] < 1.07 * own


def test_megatrons_scatter_gather_left_out_and_what_it_would_move():
    """Counting Megatron-LM's scatter/gather of pipeline messages (`Workload.scatter_gather`) leaves
    Table 1's rows without a pipeline as they are and makes the pipelined ones 0.4-8 % faster."""
    gains = []
    for run in NARAYANAN_TABLE_1:
        w, cluster, layout = workload_of(run), cluster_of(run), stated_layout(run)
        plain, cut = (predict(x, layout, cluster)["tflops_per_device"]
                      for x in (w, dataclasses.replace(w, scatter_gather=True)))
        gains.append(round(100 * (cut / plain - 1), 1))
    assert gains[:4] == [0.0] * 4 and min(gains[4:]) == 0.4 and max(gains[4:]) == 8.0 == gains[8]
