"""What a prediction is about: the cluster and the workload (chapter 9's planner).

`Cluster`: the devices, their links and their speed (from `hardware.py`'s presets, or measured).
`Workload`: the model, the batch and how it is trained. Both are frozen values, so predictions
can be cached and compared.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from minidist.core.model import GPTConfig
from minidist.parallel.pipeline_stage import chunk_layers as _chunk_layers
from minidist.plan.memory import PRECISIONS

ACTIVATION_BYTES = {"fp32": 4, "fp64": 8, "mixed": 2}  # bytes per activation element
STATE_BYTES = {**PRECISIONS, "fp64": (8, 8, 16)}        # (params, grads, optimizer) bytes per parameter


@dataclass(frozen=True)
class GemmCurve:
    """Achieved speed of a matrix multiply of W FLOPs: (W + W½) / (e · peak) seconds, a fixed start
    plus the FLOPs at the best fraction e of the peak (chapter 7's alpha-beta model, for compute),
    and never faster than moving its operands at memory bandwidth (the roofline)."""
    peak_fraction: float = 0.75  # e: what large, well-shaped GEMMs reach of the data sheet's peak
    half_flops: float = 4e9      # W½: a GEMM of this many FLOPs runs at e/2 of the peak

    def seconds(self, flops: float, operand_bytes: float, peak: float, bandwidth: float) -> float:
        return max((flops + self.half_flops) / (self.peak_fraction * peak), operand_bytes / bandwidth)

    def efficiency(self, flops: float) -> float:
        """The fraction of the peak a GEMM of `flops` FLOPs reaches (roofline aside)."""
        return self.peak_fraction * flops / (flops + self.half_flops)


@dataclass(frozen=True)
class Cluster:
    """N devices, `gpus_per_node` to a node; bandwidths in bytes/s, latencies in s, memory in bytes.
    The defaults are A100 80 GB SXM nodes (`hardware.py`'s "a100-80gb"); `Cluster.of` builds one
    from any device."""
    gpus: int
    gpus_per_node: int = 8
    memory: float = 80e9
    intra_bandwidth: float = 300e9  # NVLink, per direction, inside a node
    intra_latency: float = 2e-6
    inter_bandwidth: float = 25e9   # per device, between nodes (one 200 Gb/s NIC per GPU)
    inter_latency: float = 5e-6
    flops: float = 312e12           # peak FLOP/s of one device's matrix units in the run's precision
    layer_overhead: float = 0.0     # s per layer and micro-batch (forward + backward) that no split shrinks:
                                    # Python's per-operation cost in minidist, kernel launches on a GPU
    memory_bandwidth: float = 2.0e12  # bytes/s of device memory: element-wise work and the optimizer
    step_overhead: float = 0.0      # s per step that no split shrinks: the optimizer's and the step's own
                                    # bookkeeping, per parameter tensor (Python's cost in minidist)
    gemm: GemmCurve = GemmCurve()
    overlap_cost: float = 0.3       # of each second a collective hides behind compute, what the compute
                                    # loses (its kernels take SMs and memory bandwidth); fitted, chapter 9
    p2p_latency: float | None = None  # s from a pipeline send to its receiver noticing it (None: the link's
                                      # latency); minidist's polite wait notices up to one back-off late
    p2p_byte_seconds: float | None = None  # s per byte of a pipeline message (None: the link's beta)
    receive_overhead: float = 0.0      # s a pipeline stage spends taking in each message (its buffer, the receive
    receive_byte_seconds: float = 0.0  # posted, found, copied out), + s per byte: minidist's Python and MPI's
                                       # copy, a wait as a run measures it; 0 on a GPU, where the kernel hides it
    engine_overhead: float = 0.0      # s a pipeline engine spends after each forward or backward (posting
                                      # sends, polling, bookkeeping): idle, as a run measures it
    cores: float | None = None  # CPU cores the ranks share (None: a device each); with fewer cores than
                                # ranks a step takes at least the ranks' busy time spread over the cores
    overhead_cores: float | None = None  # the cores the Python-bound part of that work (the fixed costs:
                                         # per layer pass, step, engine, strategy) shares; None: `cores`
    strategy_overhead: tuple = ()  # ((engine, s), ...): what a strategy's own bookkeeping adds beyond plain
                                   # training: per layer pass ("tp"), per unit and micro-batch ("zero2",
                                   # "zero3"), per micro-batch ("mesh"); minidist's Python, measured on one rank
                                   # where every message is free (bench plan); none on a GPU, whose queue
                                   # hides the host
    pipeline_sync: float = 0.0  # s a pipeline step's end waits, beyond what the model counts, for ranks that
                                # idled through the drain (minidist's polite wait wakes them late); 0 on a GPU
    rails: int = 1  # NICs of a node one ring across nodes sends through: 1, a group's traffic leaves each node at
                    # one device's share; NCCL runs a ring per NIC, up to the group's members there (chapter 9)

    def overhead(self, engine: str) -> float:
        """`strategy_overhead`'s seconds for `engine` (0 where not measured)."""
        return dict(self.strategy_overhead).get(engine, 0.0)

    @classmethod
    def of(cls, device, gpus: int, precision: str = "mixed", **changes) -> "Cluster":
        """The cluster of `gpus` devices like `device` (a `hardware.Device`), its peak for `precision`."""
        fields = dict(gpus_per_node=device.gpus_per_node, memory=device.memory,
                      intra_bandwidth=device.intra_bandwidth, intra_latency=device.intra_latency,
                      inter_bandwidth=device.inter_bandwidth, inter_latency=device.inter_latency,
                      flops=device.flops(precision), memory_bandwidth=device.memory_bandwidth)
        if getattr(device, "gemm_curve", None):  # measured (this-machine): small GEMMs as this CPU runs them
            fields["gemm"] = GemmCurve(*device.gemm_curve)
        return cls(gpus, **{**fields, **changes})

    def link(self, inside: bool) -> tuple[float, float]:
        """(alpha, beta) of a message inside a node or between nodes."""
        return (self.intra_latency, 1 / self.intra_bandwidth) if inside else \
            (self.inter_latency, 1 / self.inter_bandwidth)


@dataclass
class TransformerShape(GPTConfig):
    """A GPT with its blocks shaped as recent production models ship them, for the planner only
    (minidist's own GPT is the default: as many key/value heads as query heads, an MLP 4·n_embd
    wide, no gate). Grouped-query attention shares n_kv_head key/value heads among the query heads
    (Ainslie et al. 2023: Llama 3, Nemotron-4); a gated MLP (SwiGLU, Shazeer 2020) multiplies by
    three matrices, gate, up and down, ffn_hidden wide."""
    n_kv_head: int = 0        # 0: n_head (plain multi-head attention)
    ffn_hidden: int = 0       # 0: 4·n_embd
    gated_mlp: bool = False

    def __post_init__(self):
        super().__post_init__()
        kv = self.n_kv_head or self.n_head
        if self.n_kv_head < 0 or self.ffn_hidden < 0 or self.n_head % kv:
            raise ValueError(f"n_kv_head {self.n_kv_head} must divide n_head {self.n_head} and ffn_hidden "
                             f"{self.ffn_hidden} be positive (0: the defaults)")


def block_widths(config) -> tuple[int, int, int]:
    """(key/value heads, the MLP's width, its input matrices) of one block: (n_head, 4h, 1) for
    minidist's GPT, a TransformerShape's own (a gated MLP has two input matrices, gate and up)."""
    return (getattr(config, "n_kv_head", 0) or config.n_head, getattr(config, "ffn_hidden", 0) or 4 * config.n_embd,
            2 if getattr(config, "gated_mlp", False) else 1)


def block_weights(config) -> tuple[int, int]:
    """(weights of one block's matrices, their biases): 12h² and 7h for minidist's GPT. q, k and v
    project h to h + 2·kv·h/a, the attention's output h to h, the MLP h to ffn (once per input
    matrix) and back; the biases are q, k, v's and the MLP's input matrices' (chapter 6 splits these)."""
    h = config.n_embd
    kv, ffn, inputs = block_widths(config)
    qkv = h + 2 * kv * (h // config.n_head)
    return h * qkv + h * h + (inputs + 1) * h * ffn, qkv + inputs * ffn


@dataclass(frozen=True)
class Workload:
    """What is trained: a GPTConfig, the global batch of sequences of length `seq`, and how."""
    config: object                 # minidist.core.model.GPTConfig
    global_batch: int
    seq: int
    precision: str = "mixed"       # "fp32" (4+4+8 bytes per parameter, as minidist runs), "fp64", "mixed" (2+2+12)
    activations: str = "megatron"  # "minidist": this implementation's count; "megatron": Korthikanti et al.
    recompute: bool = False        # full activation recomputation (keep each layer's input only)
    sequence_parallel: bool = False
    overlap: bool = True           # data-parallel communication hides behind backward where it can
    pad_vocab: bool = False        # Megatron-LM pads V to a multiple of 128·t
    flash_attention: bool = False  # attention without storing its s x s scores (Dao et al. 2022; after 2022)
    gradient_passes: bool = False  # count the gradients' own memory passes (adding micro-batches, ZeRO-2/3's
                                   # buckets), as minidist's engine makes them; fused GPU kernels mostly do not
    state_bytes: tuple | None = None  # (params, grads, optimizer) bytes per parameter where a framework keeps
                                      # other than STATE_BYTES[precision]: Megatron-LM's fp16 optimizer 2 + 2 + 16
    gradient_copies: int = 1       # copies of the gradients a rank holds: 2 under PyTorch's DDP when its
                                   # buckets copy them (gradient_as_bucket_view off, its default)
    scatter_gather: bool = False   # Megatron-LM's scatter/gather of pipeline messages: each tp rank sends its
                                   # 1/t of the activation, the receivers all-gather it inside their node
    sync_every_microbatch: bool = False  # a pipeline stage all-reduces its gradients in every micro-batch's backward,
                                   # not once a step: PyTorch's DDP under Megatron-LM's pipelined schedules, which
                                   # never enter its no_sync (only the schedule without a pipeline does)
    dropout: bool = True           # the blocks drop out (GPT-3's 0.1): Korthikanti et al.'s count keeps a 1-byte
                                   # mask per dropout; False for blocks without (Llama)
    ends_as_layers: bool = False   # the pipeline's cut counts the embedding and the head as a layer each, so
                                   # the first and last stages hold fewer blocks (Llama 3; Megatron-Core's
                                   # --account-for-embedding-in-pipeline-split and ...-loss-...)
    selective: bool = False        # selective recomputation (Korthikanti et al. 2022): keep all but the attention
                                   # core's s x s tensors, and run the core again in backward


def bytes_per_param(w: Workload) -> tuple:
    """(params, grads, optimizer) bytes per parameter of workload `w`: its framework's, where given,
    else its precision's (the ZeRO paper's 2 + 2 + 12 for mixed precision)."""
    return w.state_bytes or STATE_BYTES[w.precision]


@functools.lru_cache(maxsize=4096)
def chunk_layers(n_layer: int, pp: int, stage: int, virtual_stages: int = 1, ends_as_layers: bool = False) -> tuple:
    """`pipeline.chunk_layers`, remembered: the search asks for the same few partitions many times.
    With `ends_as_layers` the cut is made over n_layer + 2 layers, the embedding before the first
    block and the head after the last counting one each: 126 blocks on 16 stages are 7 + 14 x 8 + 7
    (Llama 3 405B, "The Llama 3 Herd of Models" §3.3.2)."""
    if not ends_as_layers:
        return tuple(_chunk_layers(n_layer, pp, stage, virtual_stages))
    return tuple((max(start - 1, 0), min(end - 1, n_layer))
                 for start, end in _chunk_layers(n_layer + 2, pp, stage, virtual_stages))


def padded_vocab(vocab: int, tp: int, multiple: int = 128) -> int:
    """Megatron-LM's vocabulary padding (`--make-vocab-size-divisible-by 128`, times t): the
    embedding gets dummy rows so that each tp rank holds an equal slice. 50257 -> 50304 (t = 1)."""
    step = multiple * tp
    return -(-vocab // step) * step


def config_for(w: Workload, tp: int):
    """The model as the tp ranks hold it: with pad_vocab, V padded as Megatron-LM pads it."""
    return replace(w.config, vocab_size=padded_vocab(w.config.vocab_size, tp)) if w.pad_vocab else w.config
