"""The planner held to published training runs (chapter 9): `python -m minidist.plan.against_published`.

Each run of `published.py` states its model, its cluster, its layout and the speed it reached.
`compare` predicts that layout on that cluster, and searches the planner's own best layout of the
same model, batch and devices (with the frameworks the run had: no ZeRO for Megatron-LM 2021's
PTD-P, as its Table 1 ran, and only the layouts Megatron-LM runs: layers cut evenly over the
stages, its interleaved schedule's rules; `framework_accepts`), so that two questions get numbers:

* Does the model know how fast a layout runs? predicted TFLOP/s per GPU against the measured.
* Does the planner choose what the people who trained it chose? its best tensor-parallel size
  against theirs, and how much slower it predicts their layout than its own choice.

What the runs counted decides what is compared: Narayanan et al. and BLOOM count recomputation's
extra forward (`tflops_per_device`), Llama 3 and Nemotron-4 the model's FLOPs only (MFU x peak).
"""
from __future__ import annotations

import sys
from dataclasses import replace

from minidist.frameworks.megatron import why_megatron_refuses
from minidist.plan.hardware import load_device
from minidist.plan.predict import Cluster, Workload, predict
from minidist.plan.workload import TransformerShape
from minidist.plan.published import ALL_RUNS, PublishedRun
from minidist.plan.search import plan
from minidist.training.layout import Layout


def workload_of(run: PublishedRun) -> Workload:
    """The run's model and batch as the planner sees them. Megatron-LM 2021's own data parallelism
    all-reduced the gradients after backward (no overlap); PyTorch's DDP (Table 1's smaller models),
    DeepSpeed's ZeRO-3, Llama 3's FSDP and the distributed optimizer of Nemotron-4's Megatron-LM (its
    overlap flags on in NVIDIA's recipes) overlap theirs, and PyTorch's DDP keeps its buckets as a
    second copy of the gradients; and Megatron-LM's pipelined schedules never enter DDP's no_sync
    (megatron/schedules.py: only `forward_backward_no_pipelining` does), so with PyTorch's DDP a
    pipeline stage would all-reduce its gradients in every micro-batch's backward
    (`sync_every_microbatch`): the authors' script runs PyTorch's DDP only where there is no
    pipeline, and the search prices a pipeline under it as that code would run it. The model
    states are the bytes the run's framework keeps (`state_bytes`: Megatron-LM's fp16 optimizer 20 per parameter) where documented. The H100 runs
    of 2024 (Llama 3, Nemotron-4) use FlashAttention, which never stores the s x s scores, and
    sequence parallelism. Where the source does not say whether activations were recomputed, they
    were if the stated layout does not fit without: recomputation costs a third of the step, and
    nobody pays it who need not."""
    config = TransformerShape(vocab_size=run.vocab_size, block_size=run.seq, n_layer=run.n_layer, n_head=run.n_head,
                              n_embd=run.n_embd, tie_weights=run.tie_embeddings, n_kv_head=run.n_kv_head,
                              ffn_hidden=run.ffn_hidden, gated_mlp=run.gated_mlp)
    modern = run.device.startswith("h100")  # H100-era runs (2024) use FlashAttention and sequence parallelism
    torch_ddp = run.ddp == "torch"
    w = Workload(config, run.global_batch, run.seq, "mixed", "megatron", recompute=run.recompute in ("full", "unknown"),
                 selective=run.recompute == "selective",
                 sequence_parallel=run.sequence_parallel or modern, overlap=run.zero >= 2 or modern or torch_ddp,
                 pad_vocab=True, flash_attention=modern, state_bytes=run.state_bytes,
                 gradient_copies=2 if torch_ddp else 1, dropout=run.dropout, ends_as_layers=run.ends_as_layers,
                 sync_every_microbatch=torch_ddp and run.framework == "megatron-lm")
    if run.recompute == "unknown":
        without = replace(w, recompute=False)
        if predict(without, stated_layout(run), cluster_of(run))["fits"]:
            return without
    return w


def cluster_of(run: PublishedRun) -> Cluster:
    """The run's GPUs as the device preset describes them, with the network the source states where
    it differs from the preset's."""
    network = {"inter_bandwidth": run.inter_bandwidth} if run.inter_bandwidth else {}
    return Cluster.of(load_device(run.device), run.gpus, "mixed", gpus_per_node=run.gpus_per_node, **network)


def stated_layout(run: PublishedRun) -> Layout:
    """The run's layout as a minidist Layout: its micro-batch where stated (else one sequence, as
    Megatron-LM's runs used), its interleaved schedule where the chunks are stated (else 1F1B),
    ZeRO-2 with a pipeline as ZeRO-1 (minidist refuses the first)."""
    b = run.micro_batch or 1
    zero = min(run.zero, 1) if run.pp > 1 else run.zero
    interleaved = run.pp > 1 and run.virtual_stages
    schedule = "interleaved" if interleaved else "1f1b" if run.pp > 1 else None
    return Layout(dp=run.dp, tp=run.tp, pp=run.pp, zero=zero, microbatches=run.global_batch // (run.dp * b),
                  schedule=schedule, virtual_stages=run.virtual_stages if interleaved else 1)


def measured_kind(run: PublishedRun) -> str:
    return "mfu" if run.reports_mfu else "tflops_per_device"


def achieved(prediction: dict, run: PublishedRun, cluster: Cluster) -> float:
    """Predicted TFLOP/s per GPU counted as the run counted them."""
    if measured_kind(run) == "mfu":
        return prediction["mfu"] * cluster.flops / 1e12
    return prediction["tflops_per_device"]


def compare(run: PublishedRun, search: bool = True, schedules=("1f1b", "interleaved")) -> dict:
    """The prediction of the run's layout, and (with `search`) the planner's best layout."""
    w, cluster, layout = workload_of(run), cluster_of(run), stated_layout(run)
    mine = predict(w, layout, cluster)
    out = {"name": run.name, "layout": str(layout), "measured": run.tflops_per_gpu,
           "predicted": achieved(mine, run, cluster), "fits": mine["fits"]}
    out["error"] = out["predicted"] / run.tflops_per_gpu - 1
    if search:
        zero = (0,) if run.zero == 0 else (0, 1, 2, 3)
        rows = plan(w, cluster, zero_stages=zero, schedules=schedules, accept=framework_accepts(run))
        best = rows[0]
        same = [r for r in rows if (r["layout"]["tp"], r["layout"]["pp"], r["layout"]["zero"]) ==
                (run.tp, run.pp, layout.zero) and r["fits"]]
        theirs = min(same, key=lambda r: r["step_seconds"]) if same else None
        out.update(best=best["name"], best_tp=best["layout"]["tp"], best_predicted=achieved(best, run, cluster),
                   slower_than_best=theirs["step_seconds"] / best["step_seconds"] - 1 if theirs else None)
    return out


def framework_accepts(run: PublishedRun):
    """The layouts the run's framework could have run, as a filter for `plan` (None: any valid one).
    Megatron-LM cuts the layers evenly over the stages and has rules for its interleaved schedule
    (`frameworks.megatron.why_megatron_refuses`); a layout it refuses was never a choice for the
    people who trained with it."""
    if run.framework != "megatron-lm":
        return None
    return lambda layout: why_megatron_refuses(layout, run.n_layer) is None


def table(runs=ALL_RUNS, search: bool = True) -> str:
    """The comparison as text, one run a line (the runs minidist cannot express are left out)."""
    lines = [f"{'run':<48}{'layout':<36}{'measured':>9}{'predicted':>10}{'error':>7}"
             + (f"  {'planner best':<36}{'tp':>3}{'theirs slower':>14}" if search else "")]
    for run in runs:
        if run.context_parallel > 1:
            continue  # context parallelism is not in the planner's search
        c = compare(run, search)
        line = f"{c['name']:<48}{c['layout']:<36}{c['measured']:>9.0f}{c['predicted']:>10.0f}{c['error']:>+7.0%}"
        if search:
            slower = "-" if c["slower_than_best"] is None else f"{c['slower_than_best']:+.1%}"
            line += f"  {c['best']:<36}{c['best_tp']:>3}{slower:>14}"
        lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> int:
    """Print the table (`--no-search`: the stated layouts' predictions only, in seconds)."""
    argv = sys.argv[1:] if argv is None else argv
    print(table(search="--no-search" not in argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
