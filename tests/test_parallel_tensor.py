"""Tensor parallelism reproduces the serial run (chapter 6), under real mpiexec with 2 and 4 ranks,
and with 4 ranks as 2 nodes x 2 over TCP sockets.

One launch per world size runs everything in float64: the split layers and the f/g functions
against the serial layers (outputs and gradients), then a few training steps of the tied and
the untied GPT against `SerialTrainer` (losses, final weights), the replicated gradients
compared across ranks, the all-reduces counted per block and per step against the formula,
and the parameter bytes per rank. Sequence parallelism rides in the same launch: its three
region functions, two training variants against serial, its traffic (equal to plain tensor
parallelism's with the ring) and its activation bytes (against
`memory.sequence_parallel_activation_bytes`).
"""
import numpy as np
import pytest

from conftest import layout, ranks_on_each_node, relative_difference, serial_run
from minidist.comm.hierarchical import BETWEEN_NODES
from minidist.comm.launch import run
from minidist.core.data import make_task
from minidist.core.model import GPT, GPTConfig
from minidist.core.tensor import default_dtype
from minidist.training.train import OptimSettings

CONFIG = dict(vocab_size=256, block_size=16, n_layer=2, n_head=4, n_embd=16)
STEPS, BATCH = 3, 8
SETTINGS = dict(lr=1e-2, steps=STEPS, warmup=1, min_lr=1e-3, clip=1.0)
# a tight clip (0.05) so clipping really scales the gradients, as the 1.0 above may not
VARIANTS = {"tied": dict(tie_weights=True), "untied": dict(tie_weights=False), "tied, clipped": dict(clip=0.05),
            "tied, sequence parallel": dict(sequence_parallel=True),
            "untied, clipped, sequence parallel": dict(tie_weights=False, clip=0.05, sequence_parallel=True)}


def _variant(name):
    """(config, settings, sequence_parallel) of a variant as dicts; the serial run ignores the last."""
    extra = dict(VARIANTS[name])
    config = dict(CONFIG, tie_weights=extra.pop("tie_weights", True))
    sequence_parallel = extra.pop("sequence_parallel", False)
    return config, {**SETTINGS, **extra}, sequence_parallel


def _model(config, world, sequence_parallel):
    from minidist.parallel.tensor_parallel import SequenceParallelGPT, TensorParallelGPT

    return (SequenceParallelGPT if sequence_parallel else TensorParallelGPT)(config, world)


# ----------------------------------------------------------------------------- on every rank


def layer_checks(world):
    """Each TP layer against the serial layer holding the full weights: max relative differences."""
    from minidist.core import functional as F
    from minidist.core.nn import Embedding, Linear
    from minidist.parallel.tensor_layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                                 copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region,
                                                 vocab_parallel_cross_entropy)
    from minidist.core.tensor import Tensor

    t, r = world.size, world.rank
    rng = np.random.default_rng(0)  # the same numbers on every rank
    B, T, C, H, V = 2, 3, 8, 12, 16
    cols = lambda n: slice(r * n // t, (r + 1) * n // t)  # noqa: E731
    out = {}

    # f: identity forward; backward sums the ranks' gradients. Rank r's loss is (r + 1) * sum(y).
    x = Tensor(rng.normal(size=(B, C)), requires_grad=True)
    y = copy_to_tensor_parallel_region(x, world)
    (y * float(r + 1)).sum().backward()
    out["f forward"] = relative_difference(y.data, x.data)
    out["f backward"] = relative_difference(x.grad, np.full((B, C), t * (t + 1) / 2))
    # g: sum forward; backward hands every rank the same gradient.
    parts = rng.normal(size=(t, B, C))
    x = Tensor(parts[r].copy(), requires_grad=True)
    y = reduce_from_tensor_parallel_region(x, world)
    R = rng.normal(size=(B, C))
    (y * R).sum().backward()
    out["g forward"] = relative_difference(y.data, parts.sum(axis=0))
    out["g backward"] = relative_difference(x.grad, R)

    # linear layers: the loss sum(Y * R) serially and in parallel
    for name, kind, extra in [("column", ColumnParallelLinear, {}),
                              ("column, gathered", ColumnParallelLinear, {"gather_output": True}),
                              ("row", RowParallelLinear, {}),
                              ("row, scattered input", RowParallelLinear, {"input_is_parallel": False})]:
        serial = Linear(C, H)
        serial.weight.data[...] = rng.normal(size=(H, C))
        serial.bias.data[...] = rng.normal(size=H)
        X, R = rng.normal(size=(B, T, C)), rng.normal(size=(B, T, H))
        xs = Tensor(X, requires_grad=True)
        (serial(xs) * R).sum().backward()
        layer = kind(C, H, world, **extra)
        row = kind is RowParallelLinear
        w_index = (slice(None), cols(C)) if row else (cols(H),)
        layer.weight.data[...] = serial.weight.data[w_index]
        layer.bias.data[...] = serial.bias.data if row else serial.bias.data[cols(H)]
        x_local = X[..., cols(C)] if row and layer.input_is_parallel else X
        xp = Tensor(x_local.copy(), requires_grad=True)
        y = layer(xp)
        y_ref = serial(Tensor(X)).data
        split_out = kind is ColumnParallelLinear and not layer.gather_output
        (y * (R[..., cols(H)] if split_out else R)).sum().backward()
        out[f"{name} output"] = relative_difference(y.data, y_ref[..., cols(H)] if split_out else y_ref)
        out[f"{name} input grad"] = relative_difference(xp.grad, xs.grad[..., cols(C)] if x_local is not X else xs.grad)
        out[f"{name} weight grad"] = relative_difference(layer.weight.grad, serial.weight.grad[w_index])
        out[f"{name} bias grad"] = relative_difference(layer.bias.grad, serial.bias.grad if row else serial.bias.grad[cols(H)])

    # the vocabulary split: embedding and cross-entropy
    table = Embedding(V, C)
    table.weight.data[...] = rng.normal(size=(V, C))
    ids, R = rng.integers(0, V, size=(B, T)), rng.normal(size=(B, T, C))
    (table(ids) * R).sum().backward()
    emb = VocabParallelEmbedding(V, C, world)
    emb.weight.data[...] = table.weight.data[cols(V)]
    y = emb(ids)
    (y * R).sum().backward()
    out["embedding output"] = relative_difference(y.data, table(ids).data)
    out["embedding weight grad"] = relative_difference(emb.weight.grad, table.weight.grad[cols(V)])

    Z = rng.normal(size=(B, T, V)) * 3
    targets = rng.integers(0, V, size=(B, T))
    targets[0, 0] = -100  # an ignored position
    zs = Tensor(Z, requires_grad=True)
    loss_ref = F.cross_entropy(zs, targets)
    loss_ref.backward()
    zp = Tensor(Z[..., cols(V)].copy(), requires_grad=True)
    loss = vocab_parallel_cross_entropy(zp, targets, world, r * V // t, V)
    loss.backward()
    out["cross-entropy loss"] = relative_difference(loss.data, loss_ref.data)
    out["cross-entropy grad"] = relative_difference(zp.grad, zs.grad[..., cols(V)])
    return out


def sequence_checks(world):
    """The three sequence-parallel functions against their definitions (axis 1 is the sequence):
    max relative differences. Rank r's chunk of the T = 2t tokens is [2r, 2r + 2)."""
    from minidist.parallel.sequence import (gather_from_sequence_parallel_region,
                                            reduce_scatter_to_sequence_parallel_region,
                                            scatter_to_sequence_parallel_region)
    from minidist.core.tensor import Tensor

    t, r = world.size, world.rank
    rng = np.random.default_rng(1)  # the same numbers on every rank
    B, T, C = 2, 2 * t, 3
    mine = (slice(None), slice(2 * r, 2 * r + 2))
    X, R, parts = rng.normal(size=(B, T, C)), rng.normal(size=(B, T, C)), rng.normal(size=(t, B, T, C))
    out = {}
    # scatter: keep my tokens; backward all-gathers the chunks' gradients (dL/dX = R everywhere)
    x = Tensor(X.copy(), requires_grad=True)
    y = scatter_to_sequence_parallel_region(x, world)
    (y * R[mine]).sum().backward()
    out["scatter forward"], out["scatter backward"] = relative_difference(y.data, X[mine]), relative_difference(x.grad, R)
    # gather: all tokens; rank q's loss is (q + 1) R·y, so dL/dx_r = (1 + ... + t) R[chunk r]
    x = Tensor(X[mine].copy(), requires_grad=True)
    y = gather_from_sequence_parallel_region(x, world)
    (y * (R * (r + 1))).sum().backward()
    out["gather forward"] = relative_difference(y.data, X)
    out["gather backward"] = relative_difference(x.grad, R[mine] * t * (t + 1) / 2)
    # reduce-scatter: the sum of the parts, my tokens; backward all-gathers (dL/dparts_r = R)
    x = Tensor(parts[r].copy(), requires_grad=True)
    y = reduce_scatter_to_sequence_parallel_region(x, world)
    (y * R[mine]).sum().backward()
    out["reduce-scatter forward"] = relative_difference(y.data, parts.sum(axis=0)[mine])
    out["reduce-scatter backward"] = relative_difference(x.grad, R)
    return out


def sp_versus_tp(world):
    """One forward and backward of the same GPT with and without sequence parallelism: bytes
    sent with every all-reduce a ring (forward + backward, so no gradient all-reduce), activation
    bytes of the graph (also with dropout, where both must draw the same masks), and a sequence
    length that does not divide by t, which must fail before any message."""
    from minidist.comm import all_reduce_algorithm, traffic
    from minidist.core.tensor import graph_bytes

    task = make_task("sort", CONFIG["block_size"], seed=0)
    x, y = task.get_batch(0, BATCH)
    out = {}
    for dropout in (0.0, 0.1):
        for sp in (False, True):
            model = _model(GPTConfig(**CONFIG, dropout=dropout), world, sp)
            traffic.reset()
            with all_reduce_algorithm("ring"):
                _, loss = model(x, y)
                activations = graph_bytes(loss)
                loss.backward()
            total = traffic.snapshot()["total"]
            out[dropout, sp] = {"loss": loss.item(), "activations": activations, "bytes_sent": total["bytes_sent"],
                                "kinds": sorted(k for k in traffic.snapshot() if k != "total")}
    model = _model(GPTConfig(**CONFIG), world, True)
    traffic.reset()
    try:
        model(x[:, :world.size + 1])
    except ValueError as error:
        out["bad length"] = (str(error), traffic.snapshot()["total"]["messages"])
    return out


def block_counts(world):
    """All-reduce calls of one forward and one backward, for 1 and 2 blocks: the per-block count."""
    from minidist.comm import traffic
    from minidist.parallel.tensor_parallel import TensorParallelGPT

    task = make_task("sort", CONFIG["block_size"], seed=0)
    x, y = task.get_batch(0, BATCH)
    counts = {}
    for n_layer in (1, 2):
        model = TensorParallelGPT(GPTConfig(**{**CONFIG, "n_layer": n_layer}), world)
        traffic.reset()
        _, loss = model(x, y)
        forward = _all_reduce_calls(traffic.snapshot())
        loss.backward()
        counts[n_layer] = (forward, _all_reduce_calls(traffic.snapshot()) - forward)
    return counts


def _all_reduce_calls(snapshot):
    """All-reduce calls; the hierarchical one's leaders also count their part between nodes."""
    return sum(v["calls"] for k, v in snapshot.items() if k.startswith("all_reduce.") and k != BETWEEN_NODES)


def tp_rank_program():
    from minidist.comm import get_world, traffic
    from minidist.parallel.tensor_parallel import TensorParallelTrainer, check_tensor_parallel, consolidate_state_dict

    world = get_world()
    with default_dtype("float64"):
        out = {"per node": ranks_on_each_node(world.comm), "layers": layer_checks(world), "blocks": block_counts(world),
               "sequence": sequence_checks(world), "sp vs tp": sp_versus_tp(world)}
        task = make_task("sort", CONFIG["block_size"], seed=0)
        for name in VARIANTS:
            config, settings, sequence_parallel = _variant(name)
            trainer = TensorParallelTrainer(GPTConfig(**config), OptimSettings(**settings), task, BATCH, seed=0,
                                            group=world, sequence_parallel=sequence_parallel)
            initial = consolidate_state_dict(trainer.local_model)
            traffic.reset()
            steps = [trainer.step(s) for s in range(STEPS)]
            snap = traffic.snapshot()
            out[name] = {
                "steps": steps,
                "initial": initial,
                "state": trainer.state_dict(),
                "replicated_grads": {k: p.grad.copy() for k, p in trainer.local_model.named_parameters()
                                     if not getattr(p, "tensor_model_parallel", False)},
                "memory": trainer.memory(),
                "all_reduces": _all_reduce_calls(snap) / STEPS,
                "bytes_sent": sum(v["bytes_sent"] for k, v in snap.items() if k.startswith("all_reduce.")) / STEPS,
                "other_kinds": sorted(k for k in snap if not k.startswith("all_reduce.") and k != "total"),
                "halves": {k: (v["calls"] / STEPS, v["bytes_sent"] / STEPS) for k, v in snap.items()
                           if k in ("reduce_scatter.ring", "all_gather.ring")},
            }
        # a bad layout fails before any message (the check is arithmetic only)
        traffic.reset()
        try:
            check_tensor_parallel(GPTConfig(**{**CONFIG, "n_head": 3, "n_embd": 12, "vocab_size": 255}), world.size)
        except ValueError as error:
            out["bad layout"] = (str(error), traffic.snapshot()["total"]["messages"])
        try:  # ranks that disagree on the model are stopped when it is built (the group's one check)
            _model(GPTConfig(**{**CONFIG, "n_layer": 1 + world.rank % 2}), world, False)
        except ValueError as error:
            out["mixed layouts"] = str(error)
    return out


# ----------------------------------------------------------------------------- the test process


@pytest.fixture(scope="module")
def serial():
    return {name: serial_run(*_variant(name)[:2], BATCH, STEPS) for name in VARIANTS}


@pytest.fixture(scope="module", params=[layout(2), layout(4, full=True), layout(4, nodes=2, tcp=True, full=True)])
def parallel(request):
    n, nodes, tcp = request.param
    return n, run(tp_rank_program, n, timeout=120, nodes=nodes, tcp=tcp)


def test_layers_and_f_g_match_serial(parallel):
    t, results = parallel
    assert len(results) == t
    for rank, result in enumerate(results):
        assert len(result["layers"]) == 24  # f, g: 4; four linear layers: 16; embedding: 2; loss: 2
        for check, diff in result["layers"].items():
            assert diff <= 1e-12, f"tp={t} rank {rank}: {check} differs from serial by {diff:.1e}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tensor_parallel_equals_serial(serial, parallel, variant):
    t, results = parallel
    assert len(results) == t
    ref = serial[variant]
    assert len(ref["initial"]) == len(results[0][variant]["initial"]) > 0
    for key, value in ref["initial"].items():  # the shards are cut from the serial init
        assert np.array_equal(results[0][variant]["initial"][key], value), f"tp={t} initial {key}"
    for rank, result in enumerate(results):
        got = result[variant]
        np.testing.assert_allclose([s[0] for s in got["steps"]], [s[0] for s in ref["steps"]], rtol=1e-9,
                                   err_msg=f"tp={t} rank {rank} {variant} losses")
        assert [s[1] for s in got["steps"]] == [s[1] for s in ref["steps"]], f"tp={t} {variant} accuracies"
    state = results[0][variant]["state"]
    assert all(r[variant]["state"] is None for r in results[1:])  # consolidated on rank 0 only
    assert list(state) == list(ref["state"])
    for key, value in ref["state"].items():
        assert state[key].shape == value.shape, key
        diff = relative_difference(state[key], value)
        assert diff <= 1e-9, f"tp={t} {variant}: {key} differs from serial by {diff:.1e}"


def test_replicated_gradients_identical_on_every_rank(parallel):
    """LayerNorms, wpe and row-parallel biases: no all-reduce keeps them in step, the f/g
    functions do — every rank computes the same numbers from the same replicated activations."""
    t, results = parallel
    assert len(results) == t
    for variant in VARIANTS:
        grads = results[0][variant]["replicated_grads"]
        assert len(grads) == 6 * CONFIG["n_layer"] + 3  # per block 2 LayerNorms, 2 row biases; wpe, ln_f
        assert any(k.startswith("wpe") for k in grads) and any("c_proj.bias" in k for k in grads)
        for rank in range(1, t):
            for key, value in grads.items():
                assert np.array_equal(results[rank][variant]["replicated_grads"][key], value), (t, rank, variant, key)


def test_two_all_reduces_per_block_forward_and_backward(parallel):
    t, results = parallel
    assert len(results) == t
    for result in results:
        (f1, b1), (f2, b2) = result["blocks"][1], result["blocks"][2]
        assert (f2 - f1, b2 - b1) == (2, 2), result["blocks"]
        # outside the blocks: forward the embedding's g and the loss's two; backward the head's f
        assert (f1 - 2, b1 - 2) == (3, 1), result["blocks"]


def test_traffic_per_step_matches_formula(parallel):
    from minidist.comm.cost import tensor_parallel_traffic_per_step

    t, results = parallel
    assert len(results) == t
    per_node = results[0]["per node"]  # where the ranks run, as MPI reports it
    hierarchical = len(per_node) > 1 and max(per_node) > 1  # what all_reduce's "auto" picks then
    for variant in VARIANTS:
        config, _, sp = _variant(variant)
        config = GPTConfig(**config)
        expected = tensor_parallel_traffic_per_step(config, BATCH, t, itemsize=8, sequence_parallel=sp,
                                                    one_machine=len(per_node) == 1)
        sent = [result[variant]["bytes_sent"] + sum(b for _, b in result[variant]["halves"].values())
                for result in results]
        if hierarchical:  # bytes differ from rank to rank; all ranks together: per all-reduce of S
            # bytes, trees inside each node (p - 1 sends of S up, as many down) and the leaders' ring
            per_call = 2 * sum(p - 1 for p in per_node) + 2 * (len(per_node) - 1)
            halves = 2 * (4 * config.n_layer + 2) * (t - 1) * BATCH * config.block_size * config.n_embd * 8 if sp else 0
            want = sum(count * per_call * nbytes for nbytes, count, _ in expected["calls"]) + halves
            assert sum(sent) == want, (t, variant, sent, want)
        for result, bytes_sent in zip(results, sent):
            got = result[variant]
            if not hierarchical:
                assert bytes_sent == expected["bytes_sent"], (t, variant, bytes_sent, expected)
            if sp:  # the 4L+2 all-reduces of B·T·C became reduce-scatter + all-gather; one of gradients added
                assert got["all_reduces"] == expected["all_reduces"] == 5 + 1
                assert {k: c for k, (c, _) in got["halves"].items()} == {
                    "reduce_scatter.ring": 4 * config.n_layer + 2, "all_gather.ring": 4 * config.n_layer + 2}
                assert got["other_kinds"] == ["all_gather.ring", "reduce_scatter.ring"], got["other_kinds"]  # no check
            else:
                assert got["all_reduces"] == expected["all_reduces"] == 4 * config.n_layer + 7
                assert got["other_kinds"] == [], got["other_kinds"]  # no check, no gather during steps


def test_parameter_bytes_per_rank(parallel):
    from minidist.plan.memory import tensor_parallel_parameter_counts

    t, results = parallel
    assert len(results) == t
    for variant in VARIANTS:
        config = GPTConfig(**_variant(variant)[0])
        counts = tensor_parallel_parameter_counts(config, t)
        assert counts["split"] + counts["replicated"] == GPT(config).num_parameters()
        for result in results:
            assert result[variant]["memory"]["params"] == 8 * counts["per_rank"]
            assert result[variant]["memory"]["optimizer"] == 2 * 8 * counts["per_rank"]


def test_bad_layout_names_the_sizes_before_any_message(parallel):
    t, results = parallel
    assert len(results) == t
    for result in results:
        message, messages = result["bad layout"]
        assert messages == 0
        assert message.startswith(f"tensor parallel: n_head=3, vocab_size=255 not divisible by tp={t}"), message


def test_ranks_that_disagree_on_the_model_fail_when_it_is_built(parallel):
    t, results = parallel
    assert len(results) == t
    for result in results:
        assert result["mixed layouts"].startswith(f"the tensor-parallel layout: not the same on every rank of this "
                                                  f"group of {t}"), result["mixed layouts"]


def test_check_names_every_size():
    from minidist.parallel.tensor_parallel import check_tensor_parallel

    config = GPTConfig(vocab_size=256, n_head=2, n_embd=10)  # 4 x 10 = 40: not divisible by 3
    with pytest.raises(ValueError, match=r"n_head=2, 4\*n_embd=40, vocab_size=256 not divisible by tp=3"):
        check_tensor_parallel(config, 3)
    check_tensor_parallel(GPTConfig(), 4)  # the demo's default model splits over 4


# ----------------------------------------------------------------------------- sequence parallelism


def test_sequence_parallel_functions(parallel):
    t, results = parallel
    assert len(results) == t
    for rank, result in enumerate(results):
        assert len(result["sequence"]) == 6
        for check, diff in result["sequence"].items():
            assert diff <= 1e-12, f"tp={t} rank {rank}: {check} differs by {diff:.1e}"


def test_sequence_parallel_traffic_equals_tensor_parallel(parallel):
    """reduce-scatter + all-gather (rings) send exactly what the ring all-reduce they replace sends."""
    t, results = parallel
    assert len(results) == t
    for result in results:
        for dropout in (0.0, 0.1):
            tp, sp = result["sp vs tp"][dropout, False], result["sp vs tp"][dropout, True]
            assert tp["kinds"] == ["all_reduce.ring"], tp["kinds"]
            assert sp["kinds"] == ["all_gather.ring", "all_reduce.ring", "reduce_scatter.ring"], sp["kinds"]
            assert sp["bytes_sent"] == tp["bytes_sent"] > 0, (t, dropout, sp["bytes_sent"], tp["bytes_sent"])
            assert abs(sp["loss"] - tp["loss"]) <= 1e-12 * tp["loss"], (t, dropout)  # same dropout masks


def test_sequence_parallel_divides_the_replicated_activations_by_t(parallel):
    from minidist.plan.memory import sequence_parallel_activation_bytes

    t, results = parallel
    assert len(results) == t
    for result in results:
        for dropout in (0.0, 0.1):
            tp, sp = result["sp vs tp"][dropout, False], result["sp vs tp"][dropout, True]
            f = sequence_parallel_activation_bytes(GPTConfig(**CONFIG, dropout=dropout), BATCH, t, itemsize=8)
            assert tp["activations"] - sp["activations"] == f["saved"] > 0, (t, dropout, tp, sp, f)
            assert f["region"] - f["region"] // t - f["gathered"] == f["saved"]


def test_sequence_length_not_divisible_fails_before_any_message(parallel):
    t, results = parallel
    assert len(results) == t
    for result in results:
        message, messages = result["sp vs tp"]["bad length"]
        assert messages == 0
        assert message.startswith(f"sequence parallel: sequence length T={t + 1} is not divisible by tp={t}"), message


def test_check_names_the_block_size_for_sequence_parallelism():
    from minidist.parallel.tensor_parallel import check_tensor_parallel

    check_tensor_parallel(GPTConfig(block_size=10), 2, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"sequence parallel: sequence length T=10 is not divisible by tp=4"):
        check_tensor_parallel(GPTConfig(block_size=10), 4, sequence_parallel=True)
