"""Model and pipeline parallelism reproduce the serial run (chapters 4 and 5), under real mpiexec.

One launch per world size (pp = 2, 4, and 4 as 2 nodes x 2) runs every variant — GPipe and 1F1B with m = 1, 2, 4, 8
micro-batches, untied embeddings, and interleaved 1F1B with v = 2 chunks per rank (pp = 2:
n_layer 4, m = 2 and 4; pp = 4: n_layer 8, m = 4) — for a few float64 steps (gradient clipping
is active: the serial norms are 2.3, 1.7, 1.5 > 1). The serial reference runs here, in the test
process.
"""
import numpy as np
import pytest

from conftest import layout, relative_difference, serial_run
from minidist.comm.launch import RankError, run
from minidist.core.data import make_task
from minidist.core.model import GPTConfig
from minidist.parallel.pipeline import check_pipeline_layout, chunk_layers, partition
from minidist.parallel.schedules import make_schedule, peak_in_flight
from minidist.core.tensor import default_dtype
from minidist.training.train import OptimSettings

CONFIG = dict(vocab_size=256, block_size=16, n_layer=4, n_head=2, n_embd=16)
STEPS, BATCH = 3, 8
SETTINGS = dict(lr=1e-2, steps=STEPS, warmup=1, min_lr=1e-3, clip=1.0)
VARIANTS = [(s, m, True) for s in ("gpipe", "1f1b") for m in (1, 2, 4, 8)] + [("1f1b", 4, False)]
# interleaved, per world size: (n_layer, virtual stages v, micro-batches m)
INTERLEAVED = {2: [(4, 2, 2), (4, 2, 4)], 4: [(8, 2, 4)]}


def name(variant):
    schedule, m, tied = variant
    return f"{schedule} m={m}" + ("" if tied else " untied")


def interleaved_name(n_layer, v, m):
    return f"interleaved n_layer={n_layer} v={v} m={m}"


def pp_rank_program(variants, interleaved=()):
    from minidist.comm import get_world
    from minidist.parallel.pipeline import PipelineTrainer

    out = {}
    with default_dtype("float64"):
        task = make_task("sort", CONFIG["block_size"], seed=0)
        for schedule, m, tied in variants:
            trainer = PipelineTrainer(GPTConfig(**CONFIG, tie_weights=tied), OptimSettings(**SETTINGS), task, BATCH,
                                      seed=0, group=get_world(), microbatches=m, schedule=schedule)
            results = [trainer.step(s) for s in range(STEPS)]
            out[name((schedule, m, tied))] = {"results": results, "state": trainer.state_dict(),
                                              "report": trainer.pipeline_report(), "memory": trainer.memory(),
                                              "events": trainer.step_events(), "model": trainer.model}
        for n_layer, v, m in interleaved:
            trainer = PipelineTrainer(GPTConfig(**dict(CONFIG, n_layer=n_layer)), OptimSettings(**SETTINGS), task,
                                      BATCH, seed=0, group=get_world(), microbatches=m, schedule="interleaved",
                                      virtual_stages=v)
            results = [trainer.step(s) for s in range(STEPS)]
            out[interleaved_name(n_layer, v, m)] = {"results": results, "state": trainer.state_dict(),
                                                    "report": trainer.pipeline_report(),
                                                    "events": trainer.step_events()}
        errors = []
        n = get_world().size
        for config, batch, m, schedule in [(dict(CONFIG, n_layer=n - 1), 8, 2, "1f1b"), (CONFIG, 6, 4, "1f1b"),
                                           (dict(CONFIG, n_layer=2 * n - 1), 8, n, "interleaved"),
                                           (dict(CONFIG, n_layer=2 * n), 2 * (n + 1), n + 1, "interleaved")]:
            try:
                PipelineTrainer(GPTConfig(**config), OptimSettings(**SETTINGS), task, batch, microbatches=m,
                                schedule=schedule, virtual_stages=2 if schedule == "interleaved" else None)
            except ValueError as error:
                errors.append(str(error))
        out["errors"] = errors
    return out


def serial_reference(tied, n_layer=CONFIG["n_layer"]):
    run_ = serial_run(CONFIG, SETTINGS, BATCH, STEPS, n_layer=n_layer, tie_weights=tied)
    return run_["steps"], run_["state"]


@pytest.fixture(scope="module")
def serial():
    """Keyed by tied (n_layer 4), and by ("n_layer", 8) for the p = 4 interleaved case."""
    return {True: serial_reference(True), False: serial_reference(False), ("n_layer", 8): serial_reference(True, 8)}


@pytest.fixture(scope="module", params=[layout(2), layout(4, full=True), layout(4, nodes=2, full=True)])
def parallel(request):
    n, nodes, tcp = request.param
    return n, run(pp_rank_program, n, VARIANTS, INTERLEAVED[n], timeout=240, nodes=nodes, tcp=tcp)


@pytest.mark.parametrize("variant", VARIANTS, ids=name)
def test_pipeline_equals_serial(serial, parallel, variant):
    n, results = parallel
    serial_results, serial_state = serial[variant[2]]
    full = results[0][name(variant)]["state"]
    assert list(full) == list(serial_state), "rank 0 must hold the whole model, with the serial keys in order"
    assert len(results) == n
    for rank, result in enumerate(results):
        got = result[name(variant)]
        # losses and accuracies: the same on every rank, equal to serial
        np.testing.assert_allclose(np.array(got["results"]), np.array(serial_results), rtol=1e-9,
                                   err_msg=f"pp={n} rank {rank} {name(variant)}")
        state = full if rank == 0 else got["state"]  # other ranks: their own stage's part
        for key, value in state.items():
            diff = relative_difference(value, serial_state[key])
            assert diff <= 1e-9, f"pp={n} rank {rank} {name(variant)}: {key} differs from serial by {diff:.2e}"
        assert got["model"] is None


def test_interleaved_equals_serial(serial, parallel):
    n, results = parallel
    for n_layer, v, m in INTERLEAVED[n]:
        key = interleaved_name(n_layer, v, m)
        serial_results, serial_state = serial[True] if n_layer == CONFIG["n_layer"] else serial["n_layer", n_layer]
        full = results[0][key]["state"]
        assert list(full) == list(serial_state), "rank 0 must hold the whole model, with the serial keys in order"
        assert len(results) == n
        for rank, result in enumerate(results):
            got = result[key]
            np.testing.assert_allclose(np.array(got["results"]), np.array(serial_results), rtol=1e-9,
                                       err_msg=f"pp={n} rank {rank} {key}")
            state = full if rank == 0 else got["state"]
            for name_, value in state.items():
                diff = relative_difference(value, serial_state[name_])
                assert diff <= 1e-9, f"pp={n} rank {rank} {key}: {name_} differs from serial by {diff:.2e}"
            if rank:  # rank r holds the non-adjacent chunks r, r + p, ...: e.g. p = 2, rank 1 holds h.1 and h.3
                layers = {int(k.split(".")[1]) for k in state if k.startswith("h.")}
                assert layers == {i for start, end in chunk_layers(n_layer, n, rank, v) for i in range(start, end)}
                assert layers == set(range(rank, n_layer, n))  # these cases: one block per chunk
            # the same report everywhere; the activations held are what the schedule predicts
            report = got["report"]
            assert report == results[0][key]["report"]
            assert report["schedule"] == "interleaved" and report["virtual_stages"] == v
            assert report["bubble_theory"] == pytest.approx((n - 1) / (v * m + n - 1))
            assert [a["microbatches"] for a in report["peak_activations"]] == [
                peak_in_flight(make_schedule("interleaved", r, n, m, v)) for r in range(n)]
            # every chunk's forward and backward ran: v * m of each on every rank
            kinds = [e[1] for e in got["events"]]
            assert kinds.count("forward") == kinds.count("backward") == v * m


def test_stages_hold_their_layers_and_the_tied_copy(parallel):
    n, results = parallel
    for rank, result in enumerate(results):
        state = result["gpipe m=1"]["state"] if rank else None
        if rank == 0:
            continue
        start, end = partition(CONFIG["n_layer"], n)[rank]
        layers = {int(k.split(".")[1]) for k in state if k.startswith("h.")}
        assert layers == set(range(start, end))
        assert ("wte.weight" in state) == (rank == n - 1)  # the head's copy of the tied embedding
        if rank == n - 1:  # kept equal to the first stage's copy by summing their gradients
            assert np.array_equal(state["wte.weight"], results[0]["gpipe m=1"]["state"]["wte.weight"])


@pytest.mark.parametrize("variant", VARIANTS[:-1], ids=name)
def test_peak_activations_gpipe_m_1f1b_p_minus_rank(parallel, variant):
    n, results = parallel
    schedule, m, _ = variant
    report = results[0][name(variant)]["report"]
    assert report["schedule"] == schedule and report["microbatches"] == m and report["stages"] == n
    counts = [a["microbatches"] for a in report["peak_activations"]]
    assert counts == [peak_in_flight(make_schedule(schedule, r, n, m)) for r in range(n)]
    assert counts == ([m] * n if schedule == "gpipe" else [min(m, n - r) for r in range(n)])
    for rank, result in enumerate(results):
        assert result[name(variant)]["report"] == report  # the same report on every rank
        assert result[name(variant)]["memory"]["activations"] == report["peak_activations"][rank]["bytes"] > 0
    if schedule == "1f1b":  # fewer micro-batches held means fewer bytes: compare with GPipe's
        gpipe = results[0][f"gpipe m={m}"]["report"]["peak_activations"]
        for r, (a, g) in enumerate(zip(report["peak_activations"], gpipe)):
            assert a["bytes"] * g["microbatches"] == g["bytes"] * a["microbatches"], (r, a, g)


def test_naive_model_parallelism_one_rank_works_at_a_time(parallel):
    """m = 1: stage r + 1 cannot start before stage r has sent it the batch, so the compute of
    different ranks never overlaps, and each rank idles at least (p - 1) / p of the span...
    as measured from the real timeline (a statement about causality, not about speed)."""
    n, results = parallel
    work = sorted((e[2], e[3]) for result in results for e in result["gpipe m=1"]["events"]
                  if e[1] in ("forward", "backward"))
    assert len(work) == 2 * n
    assert all(a[1] <= b[0] for a, b in zip(work, work[1:]))
    report = results[0]["gpipe m=1"]["report"]
    assert report["bubble_theory"] == pytest.approx((n - 1) / n)
    assert report["bubble_measured"] >= (n - 1) / n - 1e-9  # equal only with no message latency at all
    assert any(e[1] == "wait" for e in results[n - 1]["gpipe m=1"]["events"])


def test_bad_layouts_fail_on_every_rank_before_any_message(parallel):
    n, results = parallel
    for result in results:
        assert result["errors"] == [
            f"pipeline of pp={n} stages needs at least {n} layers, but the model has n_layer={n - 1}: "
            "each stage must hold at least one block",
            "global batch 6 does not split into 4 micro-batches (6 % 4 = 2)",
            f"interleaved pipeline of pp={n} stages x virtual_stages=2 = {2 * n} chunks needs at least {2 * n} "
            f"layers, but the model has n_layer={2 * n - 1}: each chunk must hold at least one block",
            f"interleaved schedule needs the micro-batches to be a multiple of the stages (as Megatron-LM's): "
            f"m={n + 1} is not a multiple of pp={n} ({n + 1} % {n} = 1)"]


def test_check_layout_without_mpi():
    config = GPTConfig(**CONFIG)
    check_pipeline_layout(config, 8, 4, 8, "1f1b")
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'"):
        check_pipeline_layout(config, 8, 2, 2, "zb")
    check_pipeline_layout(config, 8, 2, 2, "interleaved", 2)
    with pytest.raises(ValueError, match="m=2 is not a multiple of pp=4"):
        check_pipeline_layout(GPTConfig(**dict(CONFIG, n_layer=8)), 8, 4, 2, "interleaved", 2)
    with pytest.raises(ValueError, match="virtual_stages=2 needs schedule 'interleaved'"):
        check_pipeline_layout(config, 8, 2, 2, "1f1b", 2)
    assert chunk_layers(4, 2, 0, 2) == [(0, 1), (2, 3)] and chunk_layers(8, 2, 1, 2) == [(2, 4), (6, 8)]
    with pytest.raises(ValueError, match="microbatches must be >= 1"):
        check_pipeline_layout(config, 8, 2, 0, "gpipe")
    assert partition(5, 2) == [(0, 3), (3, 5)] and partition(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]


@pytest.mark.full
def test_rank_error_names_the_problem():
    with pytest.raises(RankError, match="does not split into 3 micro-batches"):
        run(_bad_batch_program, 2, timeout=60, echo=False)


def _bad_batch_program():
    from minidist.parallel.pipeline import PipelineTrainer

    task = make_task("sort", CONFIG["block_size"], seed=0)
    PipelineTrainer(GPTConfig(**CONFIG), OptimSettings(**SETTINGS), task, 8, microbatches=3)
