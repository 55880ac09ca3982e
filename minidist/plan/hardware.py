"""Hardware as data: what the planner needs to know of a device and its links (chapter 9).

The planner prices a layout from a handful of numbers: how much memory a device has, how fast its
matrix units multiply, how fast its memory streams, and how fast (and how soon) a message crosses
a link inside a node (NVLink) or between nodes (InfiniBand). `Device` holds those numbers in SI
units: bytes, bytes/s, seconds, FLOP/s. `PRESETS` are four accelerators from their vendors' data
sheets; `load_device` reads a preset or a JSON file, or measures this machine, so that minidist's
own CPU runs are predicted the same way as a GPU cluster.

Peak numbers are promises, not measurements: a real training step reaches only a fraction of them.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

PRECISIONS = ("fp64", "fp32", "tf32", "bf16", "fp16")


@dataclass(frozen=True)
class Device:
    """One accelerator and the links it sees; every rate per device, every bandwidth per direction."""
    name: str
    memory: float             # bytes
    peak_flops: tuple         # ((precision, FLOP/s), ...): dense peak of the matrix units; a dict is accepted
    memory_bandwidth: float   # bytes/s to and from device memory (HBM)
    intra_bandwidth: float    # bytes/s per device per direction inside a node (NVLink)
    intra_latency: float      # s
    inter_bandwidth: float    # bytes/s per device per direction between nodes (the node's NICs / its devices)
    inter_latency: float      # s
    gpus_per_node: int
    source: str = ""          # where the numbers come from
    gemm_curve: tuple | None = None  # (e, W½) of the GEMM curve where measured (this-machine); None: the
                                     # planner's default for large accelerators (workload.GemmCurve)

    def __post_init__(self):
        try:
            rates = dict(self.peak_flops)
        except (TypeError, ValueError):
            raise ValueError(f"device {self.name!r}: peak_flops must map precision names to FLOP/s") from None
        unknown = sorted(map(str, set(rates) - set(PRECISIONS)))
        problems = [f"unknown precisions in peak_flops: {', '.join(unknown)} (known: {', '.join(PRECISIONS)})"] \
            if unknown else []
        if "fp32" not in rates:
            problems.append("peak_flops needs an fp32 rate")
        bad = [f"peak_flops.{k}" for k, v in rates.items() if k in PRECISIONS and not _positive(v)]
        bad += [f for f in ("memory", "memory_bandwidth", "intra_bandwidth", "intra_latency",
                            "inter_bandwidth", "inter_latency") if not _positive(getattr(self, f))]
        if not (_positive(self.gpus_per_node) and isinstance(self.gpus_per_node, int)):
            bad.append("gpus_per_node (a positive integer)")
        if bad:
            problems.append(f"not a positive number: {', '.join(bad)}")
        if self.gemm_curve is not None:
            curve = tuple(self.gemm_curve) if isinstance(self.gemm_curve, (list, tuple)) else ()
            fraction, half = curve if len(curve) == 2 else (0, -1)
            if not (_positive(fraction) and fraction <= 1 and (_positive(half) or half == 0)):
                problems.append("gemm_curve must be [e, W½]: a fraction of the peak in (0, 1] and FLOPs >= 0")
            else:
                object.__setattr__(self, "gemm_curve", (float(fraction), float(half)))
        if not (isinstance(self.name, str) and self.name and isinstance(self.source, str)):
            problems.append("name and source must be strings, name not empty")
        if problems:
            raise ValueError(f"device {self.name!r}: " + "; ".join(problems))
        # a tuple of pairs, in PRECISIONS order, keeps the frozen dataclass hashable and comparable
        object.__setattr__(self, "peak_flops", tuple((k, float(rates[k])) for k in PRECISIONS if k in rates))

    def flops(self, precision: str) -> float:
        """Dense peak FLOP/s at `precision`; "mixed" is the 16-bit matrix rate (bf16, else fp16)."""
        rates = dict(self.peak_flops)
        if precision == "mixed":
            precision = "bf16" if "bf16" in rates else "fp16"
        elif precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}: choose one of {', '.join(PRECISIONS)}, mixed")
        if precision == "tf32" and "tf32" not in rates:
            return rates["fp32"]  # no TF32 units (before Ampere): an fp32 matmul runs at the plain fp32 rate
        if precision not in rates:
            raise ValueError(f"{self.name} has no {precision} matrix units (it has {', '.join(rates)})")
        return rates[precision]


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


FIELDS = tuple(f.name for f in fields(Device))

# Sources (each number checked against them, except where a comment says otherwise):
_A100 = ("NVIDIA A100 Tensor Core GPU datasheet, SXM columns (https://www.nvidia.com/content/dam/en-zz/Solutions/"
         "Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf); NVIDIA DGX A100: "
         "8 x 200 Gb/s HDR InfiniBand compute NICs for 8 GPUs")
_H100 = ("NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column (dense = half its 'with sparsity' figures); "
         "NVIDIA DGX BasePOD reference architecture, DGX H100: eight single-port ConnectX-7, up to 400 Gb/s "
         "(https://docs.nvidia.com/dgx-basepod/reference-architecture-infrastructure-foundation-enterprise-ai/"
         "latest/core-components.html)")
_V100 = ("NVIDIA Tesla V100 GPU datasheet, V100 SXM2 32GB column; NVIDIA DGX-1 with Tesla V100 System "
         "Architecture white paper: 8 GPUs in an NVLink hybrid cube-mesh, four 100 Gb/s EDR InfiniBand NICs")
# NVLink: NVIDIA quotes both directions summed (600, 900, 300 GB/s); a link carries half that each way.
# Latencies are not data-sheet numbers: 2 us inside a node, 5 us across, as `predict.Cluster` assumes.
# Memory: the data sheet's "GB" as 1e9 bytes (CUDA reports a little more, e.g. 85.2e9 on an A100 80GB).
_AMPERE = {"fp64": 19.5e12, "fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12}  # fp64: tensor core
PRESETS: dict[str, Device] = {
    "a100-40gb": Device("NVIDIA A100 40GB SXM", 40e9, _AMPERE, 1555e9, 300e9, 2e-6, 25e9, 5e-6, 8, _A100),
    "a100-80gb": Device("NVIDIA A100 80GB SXM", 80e9, _AMPERE, 2039e9, 300e9, 2e-6, 25e9, 5e-6, 8, _A100),
    "h100-80gb-sxm": Device("NVIDIA H100 80GB SXM5", 80e9,
                            {"fp64": 67e12, "fp32": 67e12, "tf32": 494.5e12, "bf16": 989.5e12, "fp16": 989.5e12},
                            3350e9, 450e9, 2e-6, 50e9, 5e-6, 8, _H100),
    # DGX-1 (8 GPUs), not DGX-2 (16 V100 SXM3 behind NVSwitch); both have 6.25 GB/s of EDR per GPU.
    # 150 GB/s is the sum of a GPU's six links: in the cube-mesh one peer is reached over one or two.
    "v100-32gb": Device("NVIDIA V100 32GB SXM2", 32e9, {"fp64": 7.8e12, "fp32": 15.7e12, "fp16": 125e12},
                        900e9, 150e9, 2e-6, 6.25e9, 5e-6, 8, _V100),
}


def load_device(spec: str) -> Device:
    """A preset name, "this-machine" (measured now), or the path of a JSON file with Device's fields."""
    if spec in PRESETS:
        return PRESETS[spec]
    if spec == "this-machine":
        return measure_this_machine()
    path = Path(spec)
    if path.suffix != ".json" and not path.exists():
        raise ValueError(f"unknown device {spec!r}: choose a preset ({', '.join(PRESETS)}), this-machine, "
                         f"or the path of a JSON file")
    if not path.is_file():
        raise ValueError(f"device file {spec} not found")
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):  # JSONDecodeError is a ValueError; its details name no field
        raise ValueError(f"device file {spec} is not valid JSON") from None
    except OSError as e:
        raise ValueError(f"device file {spec} cannot be read ({e.strerror})") from None
    if not isinstance(data, dict):
        raise ValueError(f"device file {spec}: expected a JSON object with the fields {', '.join(FIELDS)}")
    unknown = sorted(set(data) - set(FIELDS))
    missing = [f for f in FIELDS if f not in data and f not in ("source", "gemm_curve")]
    if unknown:
        raise ValueError(f"device file {spec}: unknown fields {', '.join(unknown)} (expected {', '.join(FIELDS)})")
    if missing:
        raise ValueError(f"device file {spec}: missing fields {', '.join(missing)}")
    if not isinstance(data["peak_flops"], dict):
        raise ValueError(f'device file {spec}: peak_flops must be an object, e.g. {{"fp32": 19.5e12}}')
    try:
        return Device(**{"source": f"read from {spec}", **data})
    except ValueError as e:
        raise ValueError(f"device file {spec}: {e}") from None


def measure_this_machine(seconds: float = 1.0) -> Device:
    """This CPU as a device for minidist's own runs: one core is one device, measured in about `seconds`."""
    from threadpoolctl import threadpool_limits
    with threadpool_limits(limits=1):  # one BLAS thread: a rank's share when ranks fill the cores
        fp64 = _matmul_rate(np.float64, 0.4 * seconds)
        fp32 = _matmul_rate(np.float32, 0.4 * seconds)
        curve = fit_gemm_line([time_matmul(n, n, n, budget=0.05 * seconds) for n in (16, 32, 64, 128, 256)], fp32)
    stream = _copy_rate(0.2 * seconds)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return Device(
        name="this-machine",
        memory=_physical_memory() / cores,  # the ranks share the RAM: each device's share of it
        # NumPy has no 16-bit or TF32 matrix units: those precisions run at the fp32 rate here
        peak_flops={"fp64": fp64, "fp32": fp32, "tf32": fp32, "bf16": fp32, "fp16": fp32},
        memory_bandwidth=stream,
        # a message between processes on one node is one copy through shared memory, which reads
        # and writes each byte: half the memory traffic rate
        intra_bandwidth=stream / 2, intra_latency=1e-6,
        inter_bandwidth=stream / 2, inter_latency=1e-6,  # one node: no slower link to cross
        gpus_per_node=cores,
        source=f"measured on this machine (numpy {np.__version__})", gemm_curve=curve)


def fit_gemm_line(points, peak: float) -> tuple[float, float]:
    """(e, W½) of the GEMM curve t = (W + W½)/(e·peak) through measured (W FLOPs, t seconds): a
    straight line in W, its slope 1/(e·peak) and its intercept W½/(e·peak) (least squares,
    weighted to relative error)."""
    w = np.array([p[0] for p in points])
    t = np.array([p[1] for p in points])
    slope, intercept = np.polyfit(w, t, 1, w=1 / t)
    slope = max(slope, 1e-30)
    return float(min(1.0, 1 / (slope * peak))), float(max(0.0, intercept / slope))


def time_matmul(m: int, n: int, k: int, dtype=np.float32, budget: float = 0.02) -> tuple[float, float]:
    """(FLOPs, the fastest seconds) of an (m, k) x (k, n) NumPy matmul, repeated for about `budget`
    seconds (call it under one BLAS thread: a rank's share)."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
    out = np.empty((m, n), dtype)
    work = 2.0 * m * n * k
    return work, work / _best_rate(work, lambda: np.matmul(a, b, out=out), budget)


def _best_rate(work: float, run, budget: float, at_least: int = 2) -> float:
    """The highest work/second of repeated runs, for `budget` seconds (the first run warms caches)."""
    best, start, n = 0.0, time.perf_counter(), 0
    while n < at_least or time.perf_counter() - start < budget:
        t = time.perf_counter()
        run()
        best, n = max(best, work / max(time.perf_counter() - t, 1e-9)), n + 1
    return best


def _matmul_rate(dtype, budget: float) -> float:
    rng, best = np.random.default_rng(0), 0.0
    for n in (128, 256, 512):  # small matrices fall short of the peak; the best size shows it
        a, b = rng.standard_normal((n, n)).astype(dtype), rng.standard_normal((n, n)).astype(dtype)
        out = np.empty((n, n), dtype)
        best = max(best, _best_rate(2.0 * n**3, lambda: np.matmul(a, b, out=out), budget / 3))
    return best


def _copy_rate(budget: float) -> float:
    src = np.ones(64 * 2**20 // 8)  # 64 MiB: far larger than any cache, so the copy streams from RAM
    dst = np.empty_like(src)
    return _best_rate(2.0 * src.nbytes, lambda: np.copyto(dst, src), budget, at_least=3)  # read + write


def _physical_memory() -> float:
    try:
        import psutil
    except ImportError:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return float(psutil.virtual_memory().total)


def to_json(device: Device) -> dict:
    """Device as a JSON-ready dict (peak_flops an object), the format `load_device` reads."""
    return {**asdict(device), "peak_flops": dict(device.peak_flops)}


def device_table() -> str:
    """The presets as an aligned text table (for --list-devices)."""
    head = ("device", "memory GB", "bf16|fp16 TFLOP/s", "HBM TB/s", "NVLink GB/s", "IB GB/s/GPU", "GPUs/node")
    rows = [(key, f"{d.memory / 1e9:g}", f"{d.flops('mixed') / 1e12:g}", f"{d.memory_bandwidth / 1e12:g}",
             f"{d.intra_bandwidth / 1e9:g}", f"{d.inter_bandwidth / 1e9:g}", str(d.gpus_per_node))
            for key, d in PRESETS.items()]
    width = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, width)))
             for r in [head, *rows]]
    return "\n".join(lines + ["bandwidths per GPU per direction (NVIDIA's NVLink figure sums both: twice these)"])
