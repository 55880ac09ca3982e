"""The planner's step time (minidist/plan/step_time.py), term by term against the formulas by hand,
and the pipeline's simulated makespan against chapter 5's schedules. Pure arithmetic, no MPI."""
import dataclasses
import math
import random

import pytest

from minidist.comm import cost
from minidist.core.model import GPTConfig
from minidist.parallel import schedules as S
from minidist.plan.predict import (Cluster, GemmCurve, Layout, Workload, flops_per_step, group_span, predict,
                                   rank_units)
from minidist.plan.step_time import (StageCost, data_parallel_seconds, gemms_seconds, layer_gemms, pipeline_estimate,
                                     pipeline_seconds, stage_costs)
from minidist.plan.search import factorisations
from minidist.plan.workload import TransformerShape, block_weights, block_widths

CFG = GPTConfig(vocab_size=512, block_size=32, n_layer=8, n_head=8, n_embd=64)
LINKS = dict(intra_bandwidth=1e10, intra_latency=1e-6, inter_bandwidth=1e9, inter_latency=1e-5, flops=1e12,
             memory_bandwidth=1e11, gemm=GemmCurve(0.5, 1e6))


def test_a_gemm_costs_a_start_plus_its_flops_and_never_beats_its_operands():
    curve = GemmCurve(peak_fraction=0.8, half_flops=1e9)
    assert curve.seconds(1e9, 0, 100e12, 1e12) == pytest.approx(2e9 / 80e12)  # half of e·peak at W½
    assert curve.efficiency(1e9) == pytest.approx(0.4) and curve.efficiency(1e15) == pytest.approx(0.8, rel=1e-5)
    assert curve.seconds(1e3, 8e9, 100e12, 1e12) == pytest.approx(8e-3)  # memory-bound: the roofline
    cluster = Cluster(1, flops=100e12, memory_bandwidth=1e15, gemm=curve)
    one, _ = gemms_seconds([(1, 64, 64, 64 * 96)], cluster, 2)
    batched, flops = gemms_seconds([(96, 64, 64, 64)], cluster, 2)  # 96 heads at once: one start, not 96
    assert flops == 2 * 96 * 64 ** 3 and batched == pytest.approx(one, rel=1e-3)


@pytest.mark.parametrize("t", [1, 2, 4])
def test_a_layers_gemms_are_narayanans_flops(t):
    b, s, h, a = 2, 128, 256, 8
    total = sum(2 * count * m * n * k for count, m, n, k in layer_gemms(b, s, h, a, t))
    assert total == (24 * b * s * h * h + 4 * b * s * s * h) // t
    w = Workload(GPTConfig(vocab_size=1000, block_size=s, n_layer=6, n_head=a, n_embd=h), 4, s, "mixed")
    head = 2 * 4 * s * h * 1000
    assert flops_per_step(w, recompute=False) == pytest.approx(3 * (6 * total * t * 2 + head))  # b = 4: twice


@pytest.mark.parametrize("t", [1, 2, 4])
def test_grouped_query_attention_and_a_gated_mlp_count_their_own_matrices(t):
    """A TransformerShape (Llama-like: 2 key/value heads for 8 query heads, a SwiGLU MLP 3h wide) has
    its own weights per block, h·(h + 2·kv·h/a) + h² + 3·h·ffn, its GEMMs add up to them, its step's
    FLOPs count them, and tp must divide the key/value heads; minidist's GPT keeps 12h² and 7h."""
    b, s, h, a = 2, 128, 256, 8
    assert block_weights(GPTConfig(n_embd=h, n_head=a)) == (12 * h * h, 7 * h)
    shape = TransformerShape(vocab_size=1000, block_size=s, n_layer=6, n_head=a, n_embd=h, n_kv_head=2,
                             ffn_hidden=3 * h, gated_mlp=True)
    weights, biases = block_weights(shape)
    assert weights == h * (h + 2 * 2 * 32) + h * h + 3 * h * 3 * h and biases == h + 2 * 2 * 32 + 2 * 3 * h
    total = sum(2 * count * m * n * k for count, m, n, k in layer_gemms(b, s, h, a, t, *block_widths(shape)[:2], True))
    assert total == (2 * b * s * weights + 4 * b * s * s * h) // t
    w = Workload(shape, 4, s, "mixed")
    assert flops_per_step(w, recompute=False) == pytest.approx(3 * (6 * total * t * 2 + 2 * 4 * s * h * 1000))
    assert sum(rank_units(shape, 1, 1, 0)) == 1000 * h + s * h + 6 * (weights + biases + 6 * h) + 2 * h
    assert {tp for _, tp, _ in factorisations(shape, 8, 8)} == {1, 2}
    with pytest.raises(ValueError, match="must divide n_head"):
        TransformerShape(n_head=8, n_kv_head=3)


def test_a_stage_costs_its_gemms_elementwise_work_and_all_reduces():
    w = Workload(CFG, 16, 32, "fp32", "minidist", overlap=False)
    cluster = Cluster(8, 4, 1e12, **LINKS)
    layout = Layout(dp=2, tp=2, pp=2, microbatches=4, schedule="1f1b")
    first, last = (rank[0] for rank in stage_costs(w, layout, cluster, 2))
    gemm, _ = gemms_seconds(layer_gemms(2, 32, 64, 8, 2), cluster, 4)
    assert first.gemm == pytest.approx(4 * gemm)  # four layers a stage
    from minidist.plan.stage_memory import layer_activation_bytes
    assert first.elementwise == pytest.approx(4 * 2 * layer_activation_bytes(w, 2, 2) / 1e11)
    act = 2 * 32 * 64 * 4  # b s h, fp32
    assert first.tp == pytest.approx(4 * 4 * (2 * 1e-6 + act / 1e10))  # four all-reduces a layer, in a node
    # the stages are dp x tp = 4 ranks apart: different nodes of 4; one activation out per micro-batch
    assert first.message == pytest.approx(1e-5 + act / 1e9)
    head, _ = gemms_seconds([(1, 64, 256, 64)], cluster, 4)
    assert last.gemm == pytest.approx(first.gemm + head)  # the last stage also runs the head
    assert first.forward == pytest.approx(first.gemm + first.elementwise + first.tp / 2 + first.message)
    # the first stage sends no gradient back, the last no activation on: one message each per micro-batch
    assert first.backward == pytest.approx(2 * (first.gemm + first.elementwise) + first.tp / 2)
    assert last.forward == pytest.approx(last.gemm + last.elementwise + last.tp / 2)
    assert last.backward == pytest.approx(2 * (last.gemm + last.elementwise) + last.tp / 2 + last.message)
    assert first.parts()["pp"] == last.parts()["pp"] == pytest.approx(first.message)
    again = StageCost(1.0, 0.5, 0.2, True)  # recomputation runs the forward once more inside backward
    assert again.backward == pytest.approx(2 * 1.5 + 0.1 + 1.5 + 0.1)
    assert again.parts() == {"compute": pytest.approx(6.0), "tp": pytest.approx(0.3), "pp": 0.0,
                             "total": pytest.approx(again.forward + again.backward)}


@pytest.mark.parametrize("schedule, p, v", [("1f1b", 2, 1), ("gpipe", 3, 1), ("1f1b", 4, 1), ("interleaved", 2, 2),
                                          ("interleaved", 4, 2)])
def test_each_stage_pays_for_the_messages_its_schedule_sends(schedule, p, v):
    """The messages a rank is charged per step are the sends and receives in its instruction list."""
    w = Workload(GPTConfig(vocab_size=64, block_size=16, n_layer=8, n_head=2, n_embd=32), 8, 16, "fp32", "minidist")
    m = 4
    layout = Layout(pp=p, microbatches=m, schedule=schedule, virtual_stages=v)
    costs = stage_costs(w, layout, Cluster(p, p, 1e12, **LINKS, receive_overhead=3e-6), 2)
    for rank, plan in enumerate(S.all_ranks(schedule, p, m, v)):
        sends = sum(ins.kind in (S.SEND_ACT, S.SEND_GRAD) for ins in plan)
        receives = sum(ins.kind in (S.RECV_ACT, S.RECV_GRAD) for ins in plan)
        charged = m * sum(c.sends_forward + c.sends_backward for c in costs[rank])
        taken = m * sum(c.receives_forward + c.receives_backward for c in costs[rank])
        assert (charged, taken) == (sends, receives), (rank, charged, sends, taken, receives)
        assert m * sum(c.parts()["pp"] for c in costs[rank]) == pytest.approx(
            sends * costs[rank][0].message + receives * 3e-6)


def test_scatter_gather_sends_a_tp_ranks_piece_and_gathers_it_inside_the_node():
    """Megatron-LM's scatter/gather: with tp 4 and the stages on two nodes, each tp rank sends 1/4 of
    the b·s·h activation across the network, and the receivers all-gather it over their node's
    links; with sequence parallelism the pieces stay apart (no gather); without tp nothing changes."""
    w = Workload(CFG, 16, 32, "fp32", "minidist")
    cut = dataclasses.replace(w, scatter_gather=True)
    layout = Layout(tp=4, pp=2, microbatches=4, schedule="1f1b")
    cluster = Cluster(8, 4, 1e12, **LINKS)  # stage 0 on node 0, stage 1 on node 1
    b, activation = 2, 2 * 32 * 64 * 4
    whole, pieces = (stage_costs(x, layout, cluster, b)[0][0].message for x in (w, cut))
    assert whole == pytest.approx(1e-5 + activation / 1e9)
    gather = 3 * 1e-6 + 3 / 4 * activation / 1e10  # ring all-gather of 4 inside the node
    assert pieces == pytest.approx(1e-5 + activation / 4 / 1e9 + gather)
    split = dataclasses.replace(cut, sequence_parallel=True)
    assert stage_costs(split, layout, cluster, b)[0][0].message == pytest.approx(1e-5 + activation / 4 / 1e9)
    plain = Layout(pp=2, microbatches=4, schedule="1f1b")
    assert stage_costs(cut, plain, Cluster(2, 1, 1e12, **LINKS), 8)[0][0].message == \
        stage_costs(w, plain, Cluster(2, 1, 1e12, **LINKS), 8)[0][0].message
    sent = [predict(x, layout, cluster)["bytes_sent"]["pp"] for x in (w, cut)]
    assert sent[1] == pytest.approx(sent[0] / 4)


@pytest.mark.parametrize("schedule, v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_equal_stages_give_the_bubble_formula(schedule, v):
    p, m = 4, 8
    costs = tuple(tuple(StageCost(1.0, 0.0, 0.0, False) for _ in range(v)) for _ in range(p))
    makespan = pipeline_seconds(costs, schedule, p, m, v)
    work = m * v * 3.0
    assert 1 - work / makespan == pytest.approx(S.bubble_theory(p, m, v))
    assert pipeline_estimate(costs, p, m, v) == pytest.approx(makespan)


def test_a_long_pipeline_is_simulated_briefly_and_extended_exactly():
    rng = random.Random(25)
    for _ in range(12):
        schedule = rng.choice(["gpipe", "1f1b", "interleaved"])
        p = rng.choice([2, 3, 4, 6])
        v = rng.choice([2, 3]) if schedule == "interleaved" else 1
        m = p * rng.randint(6, 9)
        costs = tuple(tuple(StageCost(rng.uniform(1, 2), rng.uniform(0, 1), 0.0, False) for _ in range(v))
                      for _ in range(p))
        events = S.simulate(S.all_ranks(schedule, p, m, v), forward=lambda r, c: costs[r][c].forward,
                            backward=lambda r, c: costs[r][c].backward)
        full = max(e[3] for rank in events for e in rank)
        tolerance = 1e-12 if schedule != "interleaved" else 1e-2
        assert pipeline_seconds(costs, schedule, p, m, v) == pytest.approx(full, rel=tolerance), (schedule, p, v, m)


def test_unequal_stages_show_as_bubble():
    """The last stage also runs the head: a big vocabulary makes it the pipeline's bottleneck."""
    config = GPTConfig(vocab_size=32768, block_size=32, n_layer=4, n_head=8, n_embd=64)
    w = Workload(config, 16, 32, "fp32", "minidist")
    r = predict(w, Layout(pp=2, microbatches=8, schedule="1f1b"), Cluster(2, **LINKS))
    assert r["bubble_fraction"] > S.bubble_theory(2, 8) * 1.05  # idle of both ranks, as a real run measures it
    assert r["simulated"]


def test_groups_that_span_nodes_use_the_two_level_model():
    w = Workload(CFG, 16, 32, "fp32", "minidist", overlap=False)
    cluster = Cluster(8, 2, 1e12, **LINKS)
    assert group_span("tp", 2, 4, 1, 2) == (4, 2, 2) and group_span("dp", 2, 2, 2, 2) == (2, 1, 2)
    assert group_span("tp", 1, 8, 1, 8) == (8, 8, 1) and group_span("pp", 1, 1, 4, 4) == (4, 4, 1)
    assert group_span("embedding", 1, 1, 4, 4) == (2, 2, 1) and group_span("embedding", 2, 1, 3, 4) == (2, 1, 2)
    r = predict(w, Layout(1, 4, 2, 0, 1, "1f1b"), cluster)  # tp = 4 > 2 per node
    act = 16 * 32 * 64 * 4
    links = (1e-6, 1e-10, 1e-5, 1e-9)
    one = min(cost.predict_two_level(a, 2, 2, act, *links) for a in ("ring", "hierarchical"))
    assert r["tp"] == pytest.approx(4 * 4 * one)  # four all-reduces for each of the stage's four layers


def test_data_parallel_overlap_and_zero_traffic():
    w = Workload(CFG, 16, 32, "fp32", "minidist", overlap=False)
    cluster = Cluster(4, 4, 1e12, **LINKS)
    params = sum(rank_units(CFG, 1, 1, 0))
    grads = 4 * params
    ar = 2 * 3 * 1e-6 + 2 * 3 / 4 * grads / 1e10  # ring of 4 inside a node
    sent = [data_parallel_seconds(w, Layout(4, 1, 1, z), cluster, params, 0.0, (0.0, 0.0))[1] for z in range(4)]
    assert sent[0] == sent[1] == sent[2] == pytest.approx(2 * 3 / 4 * grads) and sent[3] == pytest.approx(1.5 * sent[0])
    recomputing = Workload(CFG, 16, 32, "fp32", "minidist", recompute=True)  # ZeRO-3 gathers a third time
    assert data_parallel_seconds(recomputing, Layout(4, 1, 1, 3), cluster, params, 0, (0, 0))[1] == pytest.approx(
        2 * sent[0])
    assert data_parallel_seconds(w, Layout(4, 1, 1, 0), cluster, params, 1.0, (0, 0))[0] == pytest.approx(ar)
    hidden = Workload(CFG, 16, 32, "fp32", "minidist", overlap=True)
    backward = ar / 3  # the last micro-batch's backward hides a third of the all-reduce
    exposed, _ = data_parallel_seconds(hidden, Layout(4, 1, 1, 0), cluster, params, backward, (0, 0),
                                       bucket_bytes=grads / 10)
    assert exposed == pytest.approx(ar - backward + cluster.overlap_cost * backward)


def test_the_speed_a_user_can_check():
    """TFLOP/s per device is Narayanan et al.'s count over the step; MFU the model's FLOPs over the peak."""
    w = Workload(CFG, 16, 32, "mixed", recompute=True)
    cluster = Cluster(4)
    r = predict(w, Layout(dp=4, microbatches=2), cluster)
    assert r["tflops_per_device"] * 1e12 == pytest.approx(flops_per_step(w) / (4 * r["step_seconds"]))
    assert r["mfu"] == pytest.approx(flops_per_step(w, recompute=False) / (4 * r["step_seconds"] * 312e12))
    parts = sum(r[k] for k in ("compute", "tp", "pp", "bubble", "dp", "optimizer", "gradients"))
    assert r["step_seconds"] == pytest.approx(parts) and math.isfinite(r["step_seconds"])


def test_the_gemm_curve_is_fitted_back_from_its_own_points():
    """bench plan --calibrate fits (e, W½) to NumPy matmuls; on points drawn from a known curve it
    finds that curve again, and on this machine's matmuls it finds a curve that predicts them."""
    from minidist.bench._yardsticks import fit_gemm_curve, layer_shapes, time_gemms
    known = GemmCurve(peak_fraction=0.6, half_flops=3e6)
    points = [(w, known.seconds(w, 0, 1e11, 1e30)) for w in (1e5, 1e6, 1e7, 1e8, 1e9)]
    fitted = fit_gemm_curve(points, 1e11)
    assert fitted.peak_fraction == pytest.approx(0.6) and fitted.half_flops == pytest.approx(3e6)
    shapes = layer_shapes(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32), 4, 2)
    assert (16, 96, 32) in shapes and (64, 48, 32) in shapes  # q/k/v of one sequence; of four, split over tp 2
    measured = time_gemms(shapes[:6], seconds=0.002)
    assert all(f > 0 and s > 0 for f, s in measured)


def test_three_serial_steps_fix_the_fixed_costs_and_the_elementwise_bandwidth():
    """bench plan's serial yardsticks: the batch at once, one sequence, the batch in 4 micro-batches,
    predicted with a known overhead per layer pass, per step and bandwidth, give all three back."""
    from minidist.bench._yardsticks import fit_serial_costs

    def serial(batch, microbatches, overhead, per_step, bandwidth):
        cluster = Cluster(1, 1, 1e12, flops=1e12, layer_overhead=overhead, step_overhead=per_step,
                          memory_bandwidth=bandwidth, gemm=GemmCurve(0.5, 1e6))
        return predict(Workload(CFG, batch, 32, "fp32", "minidist"), Layout(microbatches=microbatches),
                       cluster)["step_seconds"]

    truth = (2e-4, 3e-3, 3e9)
    measured = {"batch": serial(16, 1, *truth), "one": serial(1, 1, *truth), "accumulated": serial(16, 4, *truth)}
    assert measured["accumulated"] > measured["batch"] > measured["one"]
    fitted = fit_serial_costs(serial, CFG.n_layer, 16, 4, measured, 1e10)
    assert fitted == pytest.approx(truth, rel=1e-6)


def test_the_gradients_own_memory_passes():
    """Counted when asked (minidist's engine): accumulating m micro-batches adds m - 1 times (3
    passes each); ZeRO-2 copies each micro-batch into a bucket and adds its chunk; ZeRO-3 also
    writes each gathered layer. Not counted by default (fused GPU kernels)."""
    from minidist.plan.step_time import gradient_passes_seconds
    w = Workload(CFG, 16, 32, "fp32", "minidist", gradient_passes=True)
    cluster = Cluster(4, 4, 1e12, **LINKS)
    g = 1e6 * 4 / cluster.memory_bandwidth  # one pass over a million float32 gradients
    assert gradient_passes_seconds(w, Layout(dp=4, microbatches=1), cluster, 1e6) == 0.0
    assert gradient_passes_seconds(w, Layout(dp=4, microbatches=4), cluster, 1e6) == pytest.approx(9 * g)
    assert gradient_passes_seconds(w, Layout(dp=4, zero=2, microbatches=4), cluster, 1e6) == pytest.approx(
        4 * (2 + 3 / 4) * g)
    assert gradient_passes_seconds(w, Layout(dp=4, zero=3, microbatches=4), cluster, 1e6) == pytest.approx(
        4 * (2 + 3 / 4 + 2) * g)
    plain = Workload(CFG, 16, 32, "fp32", "minidist")
    assert gradient_passes_seconds(plain, Layout(dp=4, microbatches=4), cluster, 1e6) == 0.0
    with_passes, without = (predict(x, Layout(dp=4, microbatches=4), cluster) for x in (w, plain))
    assert with_passes["step_seconds"] == pytest.approx(without["step_seconds"] + with_passes["gradients"])


def test_the_pipeline_engines_own_time_counts_as_idle():
    """Cluster.engine_overhead: after each forward and backward a pipeline rank spends that long in
    the engine; it lengthens the step and, as a run measures it, the bubble. No pipeline, no engine."""
    w = Workload(CFG, 16, 32, "fp32", "minidist", overlap=False)
    plain, engine = Cluster(2, 2, 1e12, **LINKS), Cluster(2, 2, 1e12, **LINKS, engine_overhead=1e-4)
    pipe = Layout(pp=2, microbatches=4, schedule="1f1b")
    before, after = predict(w, pipe, plain), predict(w, pipe, engine)
    assert after["pp"] == pytest.approx(before["pp"] + 2 * 4 * 1e-4)  # a forward and a backward per micro-batch
    assert after["bubble_fraction"] > before["bubble_fraction"]
    assert predict(w, Layout(dp=2), engine)["step_seconds"] == predict(w, Layout(dp=2), plain)["step_seconds"]


def test_a_pipelines_end_waits_for_idle_ranks():
    """Cluster.pipeline_sync: after the drain, the step's last collectives wait for the ranks that
    went idle first. It lengthens every pipeline's step (and its "pp" share), at full speed when the
    ranks share cores (waiting takes no core), and no layout without a pipeline."""
    w = Workload(CFG, 16, 32, "fp32", "minidist", overlap=False)
    sync = 5e-3
    for cores in (None, 2, 1):
        plain, waiting = Cluster(4, 4, 1e12, **LINKS, cores=cores), Cluster(4, 4, 1e12, **LINKS, cores=cores,
                                                                            pipeline_sync=sync)
        for pipe in (Layout(pp=4, microbatches=1, schedule="1f1b"), Layout(pp=4, microbatches=16, schedule="1f1b")):
            before, after = predict(w, pipe, plain), predict(w, pipe, waiting)
            assert after["step_seconds"] == pytest.approx(before["step_seconds"] + sync)
            assert after["pp"] == pytest.approx(before["pp"] + sync)
            assert (before["pipeline_sync"], after["pipeline_sync"]) == (0.0, sync)
            assert after["shared_cores_seconds"] == before["shared_cores_seconds"]
        for layout in (Layout(dp=4), Layout(tp=4)):
            assert predict(w, layout, waiting)["step_seconds"] == predict(w, layout, plain)["step_seconds"]


def test_a_strategys_own_bookkeeping_is_charged_per_layer_pass_unit_or_micro_batch():
    """Cluster.strategy_overhead: tp per layer pass (in each pass, so a pipeline simulates it), ZeRO-2/3
    per unit (the layers, and the embeddings with the head) and micro-batch, the mesh engine per
    micro-batch where it runs a layout without a pipeline; none where not measured (the GPU presets)."""
    w = Workload(CFG, 16, 32, "fp32", "minidist", overlap=False)
    plain = Cluster(4, 4, 1e12, **LINKS)
    timed = Cluster(4, 4, 1e12, **LINKS, strategy_overhead=(("tp", 1e-4), ("zero2", 2e-5), ("zero3", 3e-5),
                                                            ("mesh", 5e-4)))

    def extra(layout):
        return predict(w, layout, timed)["step_seconds"] - predict(w, layout, plain)["step_seconds"]

    units = CFG.n_layer + 1
    assert extra(Layout(dp=4, zero=3, microbatches=4)) == pytest.approx(4 * units * 3e-5)
    assert extra(Layout(dp=4, zero=2, microbatches=2)) == pytest.approx(2 * units * 2e-5)
    assert extra(Layout(tp=4)) == pytest.approx(CFG.n_layer * 1e-4)  # TensorParallelTrainer: no mesh engine
    assert extra(Layout(tp=4, microbatches=2)) == pytest.approx(2 * CFG.n_layer * 1e-4 + 2 * 5e-4)
    assert extra(Layout(dp=2, tp=2)) == pytest.approx(CFG.n_layer * 1e-4 + 5e-4)
    assert extra(Layout(dp=4, microbatches=4)) == extra(Layout(dp=4, zero=1)) == 0.0
    assert predict(w, Layout(dp=4, zero=3, microbatches=4), timed)["machinery"] == pytest.approx(4 * units * 3e-5)
    # in a pipeline the tp share is in every stage's passes, simulated: 2 stages of 4 layers, 4 micro-batches
    pipe = Layout(tp=2, pp=2, microbatches=4, schedule="gpipe")
    assert extra(pipe) == pytest.approx((4 + 2 - 1) * 4 * 1e-4, rel=1e-6)


def test_the_strategy_yardsticks_become_the_clusters_units():
    """bench plan's one-rank yardstick gives seconds per micro-batch; the cluster wants tp per layer
    pass and ZeRO per unit net of the gradient passes the planner already counts."""
    from minidist.bench._yardsticks import strategy_overheads, time_strategy_overheads
    got = strategy_overheads({"tp": 8e-4, "zero2": 1e-3, "zero3": 2e-3, "mesh": -1e-5}, n_layer=4,
                             counted={"zero2": 5e-4, "zero3": 3e-3})
    assert got == pytest.approx({"tp": 2e-4, "zero2": 1e-4, "zero3": 0.0, "mesh": 0.0})
    # the yardstick itself: every trainer steps on this one process, and each difference is a time
    small = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    measured = time_strategy_overheads(small, microbatches=2, rounds=2)
    assert set(measured) == {"tp", "zero2", "zero3", "mesh"}
    assert all(math.isfinite(v) and abs(v) < 1.0 for v in measured.values())


def test_serial_steps_in_turn_keep_each_ones_fastest():
    """The three serial yardsticks step in turn; each keeps its fastest step after the first. A slow
    round slows each step by a share (here three rounds of five, by 25 %): the batch's fastest step plus
    the median of one sequence's differences from it, round by round, would have been 80 - 87.5 ms."""
    from minidist.bench._yardsticks import serial_yardsticks
    seconds = {"batch": [0.5, 0.080, 0.100, 0.081, 0.100, 0.100],
               "one": [0.2, 0.010, 0.0125, 0.011, 0.0125, 0.0125],
               "accumulated": [0.9, 0.121, 0.150, 0.120, 0.152, 0.150]}
    assert serial_yardsticks(seconds) == {"batch": 0.080, "one": 0.010, "accumulated": 0.120}
    assert serial_yardsticks({"batch": [0.07]}) == {"batch": 0.07}  # one step: that one


def test_two_measurements_of_the_yardsticks_keep_the_least_disturbed():
    """bench plan measures its yardsticks before the layouts and after each pass: every time the smallest,
    every speed the largest (each serial step its own fastest), the strategies' costs (differences of times) their
    mean, the cores that shared ranks get (a ratio of times taken in turns) the median."""
    from minidist.bench.plan import least_disturbed
    first = {"serial": {"batch": 0.08, "one": 0.010}, "accumulated": 8, "peak": 1e11, "streamed": 3e10,
             "gemms": [(1e6, 2e-5), (4e6, 5e-5)], "cores": 2, "all_reduce": [3e-5, 9e-5], "message": [2e-4, 1e-4],
             "receive": [3e-5, 2e-5],
             "effective_cores": 1.8, "engine": 6e-5, "drain": 9e-3, "strategies": {"tp": 3e-4, "zero3": 1e-3}}
    second = {**first, "serial": {"batch": 0.07, "one": 0.012}, "peak": 9e10, "streamed": 4e10,
              "gemms": [(1e6, 3e-5), (4e6, 4e-5)], "all_reduce": [4e-5, 8e-5], "message": [1e-4, 2e-4],
              "receive": [4e-5, 1e-5],
              "effective_cores": 1.9, "engine": 8e-5, "drain": 7e-3, "strategies": {"tp": 1e-4, "zero3": 2e-3}}
    merged = least_disturbed(first, second)
    assert merged["serial"] == {"batch": 0.07, "one": 0.010}  # each its own fastest
    assert (merged["peak"], merged["streamed"]) == (1e11, 4e10)
    assert merged["effective_cores"] == pytest.approx(1.85)  # a ratio taken in turns: the median, not the largest
    assert merged["gemms"] == [(1e6, 2e-5), (4e6, 4e-5)] and merged["all_reduce"] == [3e-5, 8e-5]
    assert (merged["message"], merged["engine"], merged["drain"]) == ([1e-4, 1e-4], 6e-5, 7e-3)  # each size its least
    assert merged["receive"] == [3e-5, 1e-5]
    assert merged["strategies"] == pytest.approx({"tp": 2e-4, "zero3": 1.5e-3})
    assert least_disturbed({**first, "effective_cores": None}, {**second, "effective_cores": None})["effective_cores"] is None
    # a third measurement (after another pass): each time the least of three, the strategies' mean of three
    third = {**first, "serial": {"batch": 0.09, "one": 0.001}, "gemms": [(1e6, 1e-5), (4e6, 6e-5)],
             "message": [5e-5, 3e-4], "strategies": {"tp": 6e-4, "zero3": 3e-3}}
    merged = least_disturbed(first, second, third)
    assert merged["serial"] == {"batch": 0.07, "one": 0.001} and merged["gemms"] == [(1e6, 1e-5), (4e6, 4e-5)]
    assert merged["message"] == [5e-5, 1e-4] and merged["strategies"] == pytest.approx({"tp": 1e-3 / 3, "zero3": 2e-3})
    assert merged["serial_each"] == [0.08, 0.07, 0.09]  # each measurement's batch step, for the printout
    assert merged["effective_cores"] == 1.8 and merged["effective_cores_each"] == [1.8, 1.9, 1.8]


def made_up_yardsticks(message_alpha: float = 3e-4, message_beta: float = 2e-10, receive_alpha: float = 2e-5,
                       receive_beta: float = 5e-11):
    """(config, args, measured): `measure_yardsticks`' measurements of a made-up 4-rank, 2-core
    machine, each pipeline message `message_alpha` + bytes x `message_beta` late, and taking it in
    costing `receive_alpha` + bytes x `receive_beta`."""
    import argparse
    from minidist.bench._plan_calibration import ALL_REDUCE_SIZES, message_sizes
    config = GPTConfig(vocab_size=256, block_size=16, n_layer=4, n_head=2, n_embd=32)
    gemms = [(f, f / 5e10 + 2e-6) for f in (1e5, 1e6, 1e7, 1e8)]
    measured = {"serial": {"batch": 0.030, "one": 0.004, "accumulated": 0.045}, "accumulated": 8, "peak": 6e10,
                "streamed": 2e10, "gemms": gemms, "cores": 2, "effective_cores": 1.8,
                "all_reduce": [4e-5 * (1 + size / 2 ** 20) for size in ALL_REDUCE_SIZES],
                "message": [message_alpha + size * message_beta for size in message_sizes(config, 16)],
                "receive": [receive_alpha + size * receive_beta for size in message_sizes(config, 16)],
                "engine": 5e-5, "drain": 0.009, "strategies": {"tp": 2e-4, "zero2": 1e-4, "zero3": 3e-4, "mesh": 3e-4}}
    return config, argparse.Namespace(ranks=4, batch_size=16), measured


def test_a_pipeline_messages_alpha_and_beta_are_fitted_to_its_delay_at_each_size_it_is_sent():
    """The message yardstick times the sizes the layouts' pipelines send (one micro-batch's activation
    for 1 to 16 micro-batches); fit_cluster fits alpha + bytes x beta to them, and a stage's message
    costs exactly that at its own size, not the largest message's delay plus its bytes again. The
    same for what taking a message in costs its receiver."""
    from minidist.bench.plan import fit_cluster
    from minidist.bench._plan_calibration import message_sizes
    config, args, measured = made_up_yardsticks(message_alpha=3e-5, message_beta=1e-10, receive_alpha=2e-5,
                                                receive_beta=4e-11)
    activation = 16 * 16 * 32 * 4
    assert message_sizes(config, 16) == [activation, activation // 2, activation // 4, activation // 8,
                                         activation // 16]
    cluster, facts = fit_cluster(config, args, measured)
    assert (cluster.p2p_latency, cluster.p2p_byte_seconds) == (pytest.approx(3e-5), pytest.approx(1e-10))
    assert (cluster.receive_overhead, cluster.receive_byte_seconds) == (pytest.approx(2e-5), pytest.approx(4e-11))
    assert facts["pipeline_message_seconds"] == measured["message"][0]  # the largest, as before
    assert facts["pipeline_message_each_size"][str(activation // 8)] == measured["message"][3]
    w = Workload(config, 16, 16, "fp32", "minidist", overlap=False)
    stage = stage_costs(w, Layout(pp=2, microbatches=8), cluster, 2)[0][0]
    assert stage.message == pytest.approx(3e-5 + activation / 8 * 1e-10)
    assert stage.receive == pytest.approx(2e-5 + activation / 8 * 4e-11)
    assert facts["pipeline_receive_each_size"][str(activation)] == measured["receive"][0]


def test_the_fitted_wait_at_a_pipelines_end():
    """bench plan's fit_cluster on made-up measurements: the wait at a pipeline's end is the engine
    yardstick's drain-to-end time less what the model counts there (with the cores shared, as shared)."""
    from minidist.bench.plan import ENGINE_MICROBATCHES, demo_workload, fit_cluster
    config, args, measured = made_up_yardsticks()
    cluster, facts = fit_cluster(config, args, measured)
    assert (facts["effective_cores"], cluster.overhead_cores) == (1.8, 2)
    share = facts["yardstick_python_share"]  # the array work gets fewer cores than the step as a whole
    assert 0 < share < 1 and cluster.cores < 1.8
    assert 1 / 1.8 == pytest.approx(share / 2 + (1 - share) / cluster.cores)
    yardstick = demo_workload(config, 16 // 4)  # the model gives back the cores measured, on their own step
    alone = predict(yardstick, Layout(), dataclasses.replace(cluster, gpus=1, gpus_per_node=1, cores=None))
    together = predict(yardstick, Layout(), cluster)
    assert together["step_seconds"] / alone["step_seconds"] == pytest.approx(4 / 1.8)
    engine_layout = Layout(pp=4, microbatches=ENGINE_MICROBATCHES)
    counted = predict(demo_workload(config, 16), engine_layout, dataclasses.replace(cluster, pipeline_sync=0.0))
    assert 0 < counted["outside_passes"] < 0.009
    assert cluster.pipeline_sync == pytest.approx(0.009 - counted["outside_passes"])
    assert facts["pipeline_sync_seconds"] == cluster.pipeline_sync


def test_the_shared_cores_are_the_median_round_of_ranks_times_alone_over_together():
    """effective_cores' arithmetic: each round's N x (a step alone) / (every rank's step at once, to
    the last rank's end), then the median round: 4 ranks taking twice as long together got 2 cores."""
    from minidist.bench._yardsticks import cores_from_rounds
    assert cores_from_rounds([(0.03, 0.06), (0.03, 0.08), (0.04, 0.08)], 4) == pytest.approx(2.0)
    assert cores_from_rounds([(0.03, 0.08), (0.03, 0.06), (0.02, 0.08)], 4) == pytest.approx(1.5)


def test_the_shared_steps_yardstick_steps_rank_0_alone_then_every_rank():
    """time_shared_steps under mpiexec on 2 ranks: in each round rank 0 steps while rank 1 only waits
    at the barrier, then both step and wait for each other; its wait policy is put back after it."""
    from minidist.bench._yardsticks import time_shared_steps
    from minidist.comm.launch import run
    config = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)
    ranks = run(_shared_steps_and_policy, 2, time_shared_steps, config, 2, 3, timeout=120)
    (rounds0, before0, after0), (rounds1, before1, after1) = ranks
    assert len(rounds0) == len(rounds1) == 3 and before0 == after0 and before1 == after1
    for (alone0, together0), (alone1, together1) in zip(rounds0, rounds1):
        assert alone1 < alone0  # rank 1 did not step: it only waited for rank 0 to reach the barrier
        assert together0 > 0 and together1 > 0


def _shared_steps_and_policy(program, config, batch, rounds):
    from minidist.comm import wait_policy
    before = wait_policy()
    return program(config, batch, rounds), before, wait_policy()


def test_waiting_as_puts_the_previous_policy_back():
    from minidist.comm import set_wait_policy, wait_policy, waiting_as
    before = wait_policy()
    with waiting_as(spin=0.123, polite=False):
        assert (wait_policy()["spin"], wait_policy()["polite"]) == (0.123, False)
    assert wait_policy() == before
    with pytest.raises(RuntimeError), waiting_as(max_sleep=0.5):
        raise RuntimeError("inside the block")
    assert wait_policy() == before
    set_wait_policy(**before)
