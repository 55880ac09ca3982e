"""A run's parallel layout as one typed value, and the one rule that says which layouts are valid
(chapter 9, "composing the strategies").

One idea: a layout is a handful of numbers and switches — the degree of each axis (dp, tp, pp,
cp, ep), the ZeRO stage, sequence parallelism, the micro-batches of a step and the pipeline's
schedule, the precision, recomputation — so write it down once, as a frozen value, and let one
function judge it. The demo's flags, its tour, the planner's search, the framework readers and
the checkpoints all pass through `Layout.validate`, so a layout the planner proposes is a layout
the demo runs, and a refusal reads the same wherever it comes from:

    >>> layout = Layout.parse("dp2-tp2-zero1-m4")
    >>> layout.validate(GPTConfig(), world_size=4, batch_size=16)     # raises ValueError if not
    >>> str(layout)
    'dp2-tp2-zero1-m4'

The name lists what differs from the defaults, degrees first (dp, tp, pp, cp, ep), then the
switches: `sp` (sequence parallelism), `zeroS`, `mM` (micro-batches per replica and step: the
pipeline's, or gradient accumulation when pp = 1), the schedule (`gpipe`, `interleaved-v2`; 1F1B
is the default), `ulysses` and `contiguous` (context parallelism), `naive` and `balance` (chapter
3's variants), the precision (`bf16`, `fp16`), `fp32grads`, `recompute_full` /
`recompute_selective`, `segmentsN`, `bucketNkb`. The layout of one rank with nothing switched on
is `serial`.

`strategy(layout, moe)` names the trainer that runs a layout (the tour's and `--json`'s
"strategy": "dp", "zero2", "pp-1f1b", "dp2-tp2", ...); `strategies.build_trainer` builds it.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace

from minidist.core.model import GPTConfig
from minidist.core.moe import MoEConfig
from minidist.parallel.composed import mesh_name
from minidist.parallel.context_parallel import check_context_parallel, context_parallel_name
from minidist.parallel.context_stage import check_context_stage
from minidist.parallel.expert_parallel import check_expert_parallel
from minidist.parallel.pipeline_stage import check_pipeline_layout
from minidist.parallel.schedules import SCHEDULES
from minidist.parallel.tensor_parallel import check_tensor_parallel
from minidist.core.recompute import check_recompute

AXES = ("dp", "tp", "pp", "cp", "ep")        # the order of a layout's name
PRECISIONS = ("fp32", "bf16", "fp16")
RECOMPUTE = ("none", "full", "selective")
CP_ALGORITHMS, CP_SPLITS = ("ring", "ulysses"), ("zigzag", "contiguous")


@dataclass(frozen=True)
class Layout:
    """Every choice that shapes how a run is split over its ranks (chapter 9). The first seven
    fields are the planner's search space, in the order `Layout(dp, tp, pp, zero, m, schedule, v)`."""
    dp: int = 1                      # data-parallel replicas (chapter 3)
    tp: int = 1                      # tensor-parallel ranks (chapter 6)
    pp: int = 1                      # pipeline stages (chapters 4-5)
    zero: int = 0                    # ZeRO stage over dp (chapter 8)
    microbatches: int = 1            # per replica and step: the pipeline's, or accumulation (pp = 1)
    schedule: str | None = None      # gpipe, 1f1b, interleaved; None without a pipeline
    virtual_stages: int = 1          # model chunks per rank (interleaved)
    cp: int = 1                      # context-parallel ranks: each sequence split (chapter 11)
    ep: int = 1                      # expert-parallel ranks, inside dp (chapter 11)
    sequence_parallel: bool = False  # with tp: LayerNorms and dropouts on T/t tokens (chapter 6)
    precision: str = "fp32"          # chapter 10
    fp32_grads: bool = False         # 16-bit weights, fp32 gradient buckets (chapter 10)
    recompute: str = "none"          # activation checkpointing (chapter 11)
    segments: int | None = None      # with recompute full: runs of consecutive blocks
    naive_dp: bool = False           # one blocking all-reduce per parameter (chapter 3)
    balance: bool = False            # re-split the batch by each rank's speed (chapter 3)
    bucket_kb: int = 1024            # data parallelism's gradient bucket (chapter 3)
    cp_algorithm: str = "ring"       # ring attention or DeepSpeed-Ulysses
    cp_split: str = "zigzag"         # which tokens each cp rank holds

    def __post_init__(self):
        # one spelling per layout: a pipeline has a schedule (1F1B unless named), nothing else has one
        if self.pp > 1 and self.schedule is None:
            object.__setattr__(self, "schedule", "1f1b")
        if self.pp == 1 and self.schedule is not None and self.virtual_stages == 1:
            object.__setattr__(self, "schedule", None)

    def __repr__(self) -> str:
        return f"Layout.parse({str(self)!r})"

    @property
    def world_size(self) -> int:
        """The ranks the layout needs: ep lives inside dp, so it adds none."""
        return self.dp * self.tp * self.pp * self.cp

    def degrees(self) -> dict[str, int]:
        """The demo's `--json` "layout": {dp, tp, pp, zero}, with cp and ep where above 1."""
        out = {"dp": self.dp, "tp": self.tp, "pp": self.pp, "zero": self.zero}
        return {**out, **{axis: getattr(self, axis) for axis in ("cp", "ep") if getattr(self, axis) > 1}}

    # -- the one rule
    def why_invalid(self, config: GPTConfig, world_size: int, batch_size: int, pad_vocab: bool = False) -> str | None:
        """Why this layout cannot run `config` on `world_size` ranks with a global batch of
        `batch_size` sequences (one line naming the flags), or None if it can. Pure arithmetic:
        every rank reaches the same verdict before any message. `pad_vocab`: the vocabulary is
        padded to a multiple of tp (Megatron-LM's rule; the planner's models, not minidist's)."""
        try:
            self._check(config, world_size, batch_size, pad_vocab)
        except ValueError as why:
            return str(why)
        return None

    def validate(self, config: GPTConfig, world_size: int, batch_size: int, pad_vocab: bool = False) -> "Layout":
        """Raise ValueError in one line if the layout is invalid; return it otherwise."""
        why = self.why_invalid(config, world_size, batch_size, pad_vocab)
        if why is not None:
            raise ValueError(f"layout {self}: {why}")
        return self

    def _check(self, config, world_size: int, batch_size: int, pad_vocab: bool) -> None:
        for name in AXES + ("microbatches", "virtual_stages", "bucket_kb"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        for name, allowed in (("zero", (0, 1, 2, 3)), ("precision", PRECISIONS), ("recompute", RECOMPUTE),
                              ("cp_algorithm", CP_ALGORITHMS), ("cp_split", CP_SPLITS),
                              ("schedule", (None, *SCHEDULES))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"--{name.replace('_', '-')} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.world_size != world_size:
            given = [a for a in AXES[:4] if getattr(self, a) > 1]
            flags = " ".join(f"--{a} {getattr(self, a)}" for a in given) or "serial"
            product = " x ".join(f"{a}={getattr(self, a)}" for a in given) or "one rank"
            raise ValueError(f"{flags}: {product} needs {self.world_size} ranks, but this job has {world_size} "
                             f"(run: mpirun -n {self.world_size} python -m minidist.demo --layout {self})")
        self._check_combination(config)
        self._check_sizes(config, batch_size, pad_vocab)

    def _check_combination(self, config) -> None:
        """Which switches combine: each refusal says why, as the frameworks refuse it too."""
        moe = isinstance(config, MoEConfig)
        d, t, p, c, e, z = self.dp, self.tp, self.pp, self.cp, self.ep, self.zero
        if e > 1 and not moe:
            raise ValueError("--ep needs --experts E (expert parallelism splits the experts of a MoE model)")
        if moe:
            others = [flag for flag, on in (("--cp", c > 1), (f"--zero {z}", z >= 2),
                                            ("--sequence-parallel", self.sequence_parallel), ("--naive-dp", self.naive_dp),
                                            ("--balance", self.balance)) if on]
            if others:  # ZeRO-2/3 and cp would each need their own cut of experts against replicated weights
                raise ValueError(f"--experts combines with --dp, --ep, --tp, --pp, --zero 1 and micro-batches, not "
                                 f"with {' '.join(others)}")
        if c > 1 and z >= 2:
            raise ValueError(f"--zero {z} with --cp {c}: the mesh runs context parallelism with ZeRO 0-1 (stages "
                             "2-3 would shard gradients that its micro-batches keep whole): use --zero 1")
        if z and d == 1:
            raise ValueError("--zero needs --dp N (ZeRO partitions the data-parallel replicas)")
        if z >= 2 and p > 1:
            raise ValueError(f"--zero {z} with --pp {p}: stages 2-3 shard the gradients, which a pipeline keeps "
                             "across its micro-batches (sharding them would repeat the dp traffic per micro-batch; "
                             "DeepSpeed refuses this too): use --zero 1")
        if self.sequence_parallel and t == 1:
            raise ValueError("--sequence-parallel needs --tp N (it splits what tensor parallelism replicates)")
        if (self.balance or self.naive_dp) and (d == 1 or z or t > 1 or p > 1 or c > 1 or moe):
            flag = "--balance" if self.balance else "--naive-dp"
            raise ValueError(f"{flag} needs --dp N alone, without --zero (it changes plain data parallelism)")
        if self.schedule == "interleaved" and self.virtual_stages < 2:
            raise ValueError(f"--schedule interleaved needs --virtual-stages >= 2, got {self.virtual_stages} (with one "
                             "chunk per rank it is 1F1B: --schedule 1f1b)")
        if p == 1 and (self.schedule is not None or self.virtual_stages != 1):
            raise ValueError(f"--schedule {self.schedule} --virtual-stages {self.virtual_stages}: a schedule (and "
                             "virtual stages) needs --pp N")
        if self.fp32_grads:
            if self.precision == "fp32":
                raise ValueError("--fp32-grads keeps the gradients of 16-bit weights in fp32: it needs "
                                 "--precision bf16|fp16")
            if z or c > 1 or moe or self.naive_dp or d == 1:
                raise ValueError(f"--fp32-grads applies to data parallelism's buckets (--dp N, or a composed layout "
                                 f"without --zero), not to the {self} layout")
        self._check_recompute(moe)

    def _check_recompute(self, moe: bool) -> None:
        """--recompute reaches the layouts whose forward runs the model's blocks in a loop it owns
        (chapter 11): the whole GPT, a pipeline stage, a mesh's stage."""
        if self.recompute == "none":
            if self.segments is not None:
                raise ValueError(f"--segments {self.segments} applies to --recompute full only")
            return
        trainer = strategy(self, moe)
        fsdp = self.zero == 3 or (self.zero >= 2 and self.tp > 1)  # FSDP's own loop over the blocks
        if fsdp or self.cp > 1 or moe or trainer in ("tp", "tp-sp"):
            raise ValueError(f"--recompute {self.recompute} is not built for the {self} layout (the model's blocks "
                             "run inside FSDP's, tensor parallelism's, context or expert parallelism's own loop "
                             "there): use it with serial, --dp, --zero 1/2, --pp or a composed layout")
        if self.recompute == "selective" and self.tp > 1:
            raise ValueError("--recompute selective is written for the serial attention, not the tensor-parallel "
                             "one: use --recompute full with --tp")
        if self.segments is not None and (self.tp > 1 or self.pp > 1):
            raise ValueError("--segments groups the whole model's blocks: a pipeline or tensor-parallel stage "
                             "checkpoints each of its blocks (drop --segments)")

    def _check_sizes(self, config, batch_size: int, pad_vocab: bool) -> None:
        """The model and the batch must split as the layout cuts them."""
        if self.recompute != "none":
            check_recompute(self.recompute, self.segments, config.n_layer)
        if self.cp > 1:
            try:
                check_context_parallel(config, self.cp, self.dp, None, batch_size, self.cp_algorithm, self.cp_split)
                check_context_stage(config, self.cp, self.tp, self.cp_algorithm, self.cp_split, self.sequence_parallel)
            except ValueError as why:
                raise ValueError(f"--cp {self.cp}: {why}") from None
        if isinstance(config, MoEConfig):
            check_expert_parallel(config, self.dp, self.ep, batch_size)
        if batch_size % (self.dp * self.microbatches):
            what = "micro-batches" if self.pp > 1 else "accumulation steps"
            raise ValueError(f"--batch-size {batch_size} (the global batch) is not divisible by dp={self.dp} x "
                             f"{self.microbatches} {what} = {self.dp * self.microbatches}")
        if self.tp > 1:
            padded = replace(config, vocab_size=self.tp) if pad_vocab else config
            check_tensor_parallel(padded, self.tp, self.sequence_parallel)
        if self.pp > 1:
            check_pipeline_layout(config, batch_size // self.dp, self.pp, self.microbatches, self.schedule,
                                  self.virtual_stages)

    # -- the name, both ways
    def __str__(self) -> str:
        parts = [f"{axis}{getattr(self, axis)}" for axis in AXES if getattr(self, axis) > 1]
        parts += ["sp"] * self.sequence_parallel + [f"zero{self.zero}"] * bool(self.zero)
        parts += [f"m{self.microbatches}"] * (self.microbatches > 1)
        if self.schedule == "interleaved":
            parts.append(f"interleaved-v{self.virtual_stages}")
        elif self.schedule == "gpipe":
            parts.append("gpipe")
        parts += [word for word, on in (("ulysses", self.cp_algorithm == "ulysses"),
                                        ("contiguous", self.cp_split == "contiguous"), ("naive", self.naive_dp),
                                        ("balance", self.balance), (self.precision, self.precision != "fp32"),
                                        ("fp32grads", self.fp32_grads),
                                        (f"recompute_{self.recompute}", self.recompute != "none"),
                                        (f"segments{self.segments}", self.segments is not None),
                                        (f"bucket{self.bucket_kb}kb", self.bucket_kb != 1024)) if on]
        if not any(getattr(self, axis) > 1 for axis in AXES):
            parts.insert(0, "serial")
        return "-".join(parts)

    @classmethod
    def parse(cls, name: str) -> "Layout":
        """`str(layout)` backwards: "dp2-tp2-zero1-m4" -> Layout(dp=2, tp=2, zero=1, microbatches=4).
        ValueError names the part it cannot read."""
        values: dict = {}
        words = name.strip().split("-")
        for i, word in enumerate(words):
            if word == "serial" and i == 0:
                continue
            if word.startswith("v") and i and words[i - 1] == "interleaved":
                values["virtual_stages"] = _number(word[1:], name, word)
                continue
            for pattern, field_of in _TOKENS:
                match = re.fullmatch(pattern, word)
                if match:
                    key, value = field_of(match)
                    if key in values:
                        raise ValueError(f"layout {name!r}: {key} given twice")
                    values[key] = value
                    break
            else:
                raise ValueError(f"layout {name!r}: cannot read {word!r} (expected e.g. dp2-tp2-pp2-zero1-m4: "
                                 "degrees dp/tp/pp/cp/ep, then sp, zeroS, mM, gpipe, interleaved-vV, bf16, ...)")
        if values.get("schedule") == "interleaved" and "virtual_stages" not in values:
            raise ValueError(f"layout {name!r}: 'interleaved' needs its virtual stages ('interleaved-v2')")
        return cls(**values)

    @classmethod
    def from_args(cls, args) -> "Layout":
        """The layout the demo's flags describe (argparse Namespace; missing flags: defaults)."""
        pp = getattr(args, "pp", None) or 1
        accumulation = getattr(args, "accumulation", 1)
        if pp > 1 and accumulation != 1:
            raise ValueError("--accumulation with --pp: a pipeline's micro-batches are its accumulation "
                             "(use --microbatches)")
        schedule = getattr(args, "schedule", "1f1b") if pp > 1 else None
        return cls(dp=getattr(args, "dp", None) or 1, tp=getattr(args, "tp", None) or 1, pp=pp,
                   cp=getattr(args, "cp", None) or 1, ep=getattr(args, "ep", None) or 1,
                   zero=getattr(args, "zero", None) or 0, sequence_parallel=getattr(args, "sequence_parallel", False),
                   microbatches=getattr(args, "microbatches", 4) if pp > 1 else accumulation, schedule=schedule,
                   virtual_stages=getattr(args, "virtual_stages", 2) if schedule == "interleaved" else 1,
                   precision=getattr(args, "precision", "fp32"), fp32_grads=getattr(args, "fp32_grads", False),
                   recompute=getattr(args, "recompute", "none"), segments=getattr(args, "segments", None),
                   naive_dp=getattr(args, "naive_dp", False), balance=getattr(args, "balance", False),
                   bucket_kb=getattr(args, "bucket_kb", 1024), cp_algorithm=getattr(args, "cp_algorithm", "ring"),
                   cp_split=getattr(args, "cp_split", "zigzag"))

    def demo_settings(self) -> dict:
        """The demo's argparse attributes (dest -> value) that give this layout: `from_args` backwards."""
        s = {axis: getattr(self, axis) if getattr(self, axis) > 1 else None for axis in AXES}
        s["zero"] = self.zero or None
        if self.pp > 1:
            s.update(microbatches=self.microbatches, schedule=self.schedule, virtual_stages=self.virtual_stages
                     if self.schedule == "interleaved" else 2, accumulation=1)
        else:
            s["accumulation"] = self.microbatches
        for name in ("sequence_parallel", "precision", "fp32_grads", "recompute", "segments", "naive_dp", "balance",
                     "bucket_kb", "cp_algorithm", "cp_split"):
            s[name] = getattr(self, name)
        return s

    def demo_flags(self) -> list[str]:
        """`python -m minidist.demo` flags of this layout (those at the demo's defaults left out)."""
        defaults = Layout().demo_settings()  # a pipeline's micro-batches and schedule are always written out
        flags = []
        for dest, value in self.demo_settings().items():
            if value is None or value is False or (value == defaults.get(dest) and dest != "accumulation") or (
                    dest == "virtual_stages" and self.schedule != "interleaved") or (
                    dest == "accumulation" and value == 1):
                continue
            flag = "--" + dest.replace("_", "-")
            flags += [flag] if value is True else [flag, str(value)]
        return flags

    def to_dict(self) -> dict:
        return {**asdict(self), "name": str(self)}


LAYOUT_FLAGS = tuple(Layout().demo_settings())  # the demo's flags that a --layout name replaces


def _number(text: str, name: str, word: str) -> int:
    if not text.isdigit() or text.startswith("0"):
        raise ValueError(f"layout {name!r}: {word!r} needs a whole number >= 1")
    return int(text)


_TOKENS = [
    (r"(dp|tp|pp|cp|ep)([1-9]\d*)", lambda m: (m.group(1), int(m.group(2)))),
    (r"sp", lambda m: ("sequence_parallel", True)),
    (r"zero([0-3])", lambda m: ("zero", int(m.group(1)))),
    (r"m([1-9]\d*)", lambda m: ("microbatches", int(m.group(1)))),
    (r"(gpipe|1f1b|interleaved)", lambda m: ("schedule", m.group(1))),
    (r"(ulysses|ring)", lambda m: ("cp_algorithm", m.group(1))),
    (r"(contiguous|zigzag)", lambda m: ("cp_split", m.group(1))),
    (r"naive", lambda m: ("naive_dp", True)),
    (r"balance", lambda m: ("balance", True)),
    (r"(fp32|bf16|fp16)", lambda m: ("precision", m.group(1))),
    (r"fp32grads", lambda m: ("fp32_grads", True)),
    (r"recompute_(full|selective)", lambda m: ("recompute", m.group(1))),
    (r"segments([1-9]\d*)", lambda m: ("segments", int(m.group(1)))),
    (r"bucket([1-9]\d*)kb", lambda m: ("bucket_kb", int(m.group(1)))),
]



def strategy(layout: Layout, moe: bool = False) -> str:
    """The trainer that runs `layout` by its name in the tour and `--json` ("strategy"):

        serial, dp, dp-naive, zero1-3         one rank; data parallelism; ZeRO (chapters 1, 3, 8)
        tp, tp-sp, mp, pp-gpipe, ...          tensor or pipeline parallelism alone (chapters 4-6)
        dp2-tp2, tp2-pp2, dp2-tp2-zero3, ...  the mesh (chapter 9): two axes or more (and tensor
                                              parallelism with accumulation, tp4-m2)
        cp4, dp2-cp2-ulysses                  context parallelism (chapter 11)
        moe, dp4-ep2, dp2-pp2-ep2             a mixture of experts (chapter 11): alone, over dp, on the mesh
    """
    d, t, p = layout.dp, layout.tp, layout.pp
    if moe:  # the MoE GPT: serial (with micro-batches or not), dp x ep alone, or on the mesh
        if layout.world_size == 1:
            return "moe"
        if t == 1 and p == 1 and layout.microbatches == 1 and not layout.zero:
            return f"dp{d}-ep{layout.ep}"
        return f"{mesh_name(d, t, p, layout.zero)}-ep{layout.ep}"
    if layout.cp > 1:  # chapter 11's trainer for cp x dp alone; the mesh composes cp with the others
        if t == 1 and p == 1 and not layout.zero and layout.microbatches == 1:
            return context_parallel_name(layout.cp, d, layout.cp_algorithm, layout.cp_split)
        return mesh_name(d, t, p, layout.zero, layout.sequence_parallel, layout.cp, layout.cp_algorithm,
                         layout.cp_split)
    model_parallel = t > 1 or p > 1
    accumulating = p == 1 and layout.microbatches > 1  # tensor parallelism alone accumulates on the mesh
    if model_parallel and (d > 1 or (t > 1 and p > 1) or accumulating):
        return mesh_name(d, t, p, layout.zero, layout.sequence_parallel)
    if t > 1:
        return "tp-sp" if layout.sequence_parallel else "tp"
    if p > 1:
        return "mp" if layout.microbatches == 1 and layout.schedule != "interleaved" else f"pp-{layout.schedule}"
    if d > 1 or layout.microbatches > 1:  # one replica accumulating is data parallelism of one (chapter 3)
        if layout.zero:
            return f"zero{layout.zero}"
        return "dp-naive" if layout.naive_dp else "dp"
    return "serial"

