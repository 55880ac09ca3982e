"""The translation both readers produce, and the rules they share (chapter 9)."""
from __future__ import annotations

import argparse
import math
import shlex
from dataclasses import dataclass, field

from minidist.training.layout import Layout
from minidist.core.model import GPTConfig

BETAS, EPS = (0.9, 0.95), 1e-8  # minidist's AdamW (train.make_optimizer)
DEMO_VOCAB = 256                 # the demo's byte-level data
LOW_PRECISION = ("minidist's 16-bit training keeps fp32 masters and a dynamic loss scale (--initial-loss-scale, "
                 "--loss-scale-window; no hysteresis, no floor: torch GradScaler's rule), fp8 on the MLP only "
                 "(minidist.precision.fp8, chapter 10)")
NO_RECOMPUTE = ("minidist recomputes each block (--recompute full, --segments runs of blocks) or attention's core "
                "(--recompute selective), chosen by flag, not where the model's code calls a checkpoint (chapter 11)")


@dataclass
class Translation:
    """A framework's config as a minidist layout. Fields left None were not given."""
    source: str                          # "DeepSpeed", "Megatron-LM" or "torchtitan"
    world_size: int
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1                          # context parallelism: each sequence split over cp ranks (chapter 11)
    zero: int = 0
    batch_size: int | None = None        # global: sequences per optimizer step
    micro_batch_size: int | None = None  # per rank and micro-step
    microbatches: int = 1                # pipeline micro-batches (pp > 1)
    accumulation: int = 1                # gradient-accumulation micro-steps (pp == 1)
    schedule: str = "1f1b"
    virtual_stages: int = 1
    sequence_parallel: bool | None = None
    lr: float | None = None
    min_lr: float | None = None
    warmup: int | None = None
    steps: int | None = None
    weight_decay: float | None = None
    clip: float | None = None
    precision: str = "fp32"
    recompute: str | None = None        # "full" or "selective" (chapter 11)
    bucket_kb: int | None = None
    seed: int | None = None
    n_layer: int | None = None
    n_embd: int | None = None
    n_head: int | None = None
    block_size: int | None = None
    vocab_size: int | None = None
    tie_weights: bool | None = None
    betas: tuple | None = None
    eps: float | None = None
    decay: str | None = None             # "cosine", "linear" or "constant" after warm-up
    initial_loss_scale: float | None = None
    loss_scale_window: int | None = None
    applied: dict = field(default_factory=dict)   # config key -> {"value": as given, "flag": the demo's dest}
    refused: dict = field(default_factory=dict)   # config key -> why minidist does not follow it
    notes: list[str] = field(default_factory=list)

    # -- the ledger: every key of a config is applied or refused, never silently lost
    def use(self, key: str, value, flag: str | None = None, note: str | None = None) -> None:
        """`key` of the config is applied: its `value` reaches the run through the demo's `flag`
        (None: it decides the layout or the batch split, no flag of its own)."""
        self.applied[key] = {"value": value, "flag": flag}
        self.refused.pop(key, None)
        if note:
            self.notes.append(note)

    def refuse(self, key: str, why: str) -> None:
        self.refused[key] = why
        self.applied.pop(key, None)

    def refuse_line(self, line: str) -> None:
        """A refusal written as "key: why" (the key is everything before the first ': ')."""
        key, _, why = line.partition(": ")
        self.refuse(key, why)

    @property
    def unsupported(self) -> list[str]:
        """The refusals as "key: why" lines."""
        return [f"{key}: {why}" for key, why in self.refused.items()]

    def covers(self, key: str) -> bool:
        """Is `key` (a dotted path, or a flag) applied or refused, itself or through a block above it?"""
        parts = key.split(".")
        return any(".".join(parts[:i]) in self.applied or ".".join(parts[:i]) in self.refused
                   for i in range(len(parts), 0, -1))

    def report(self, args=None, given=frozenset()) -> dict:
        """The demo's `--json` "framework_config": each applied key with the value the run used
        (a command-line flag given as well wins: "overridden"), each refused key with its reason."""
        applied = {}
        for key, entry in self.applied.items():
            used = getattr(args, entry["flag"], entry["value"]) if args is not None and entry["flag"] else entry["value"]
            applied[key] = {**entry, "used": used, "overridden": entry["flag"] in given}
        return {"source": self.source, "applied": applied, "refused": dict(self.refused), "notes": list(self.notes)}

    def demo_settings(self) -> dict:
        """The demo's argparse attributes this config decides (dest -> value)."""
        s = {axis: getattr(self, axis) if getattr(self, axis) > 1 else None for axis in ("dp", "tp", "pp", "cp")}
        s["zero"] = self.zero or None
        if self.pp > 1:
            s.update(microbatches=self.microbatches, schedule=self.schedule)
            if self.schedule == "interleaved":
                s["virtual_stages"] = self.virtual_stages
        else:
            s["accumulation"] = self.accumulation
        if self.sequence_parallel is not None:
            s["sequence_parallel"] = self.sequence_parallel
        if self.precision != "fp32":
            s["precision"] = self.precision
        if self.recompute is not None:
            s["recompute"] = self.recompute
        for name in ("batch_size", "lr", "steps", "bucket_kb", "seed", "n_layer", "n_embd", "n_head", "block_size",
                     "min_lr", "warmup", "weight_decay", "clip", "initial_loss_scale", "loss_scale_window"):
            if getattr(self, name) is not None:
                s[name] = getattr(self, name)
        if self.tie_weights is not None:
            s["untied"] = not self.tie_weights
        if self.betas is not None:
            s["adam_beta1"], s["adam_beta2"] = self.betas
        if self.eps is not None:
            s["adam_eps"] = self.eps
        if self.decay is not None:
            s["lr_decay"] = self.decay
        return s

    def layout(self) -> Layout:
        """The config's layout as minidist's one typed value (`minidist/training/layout.py`)."""
        pipeline = self.pp > 1
        return Layout(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, zero=self.zero,
                      microbatches=self.microbatches if pipeline else self.accumulation,
                      schedule=self.schedule if pipeline else None,
                      virtual_stages=self.virtual_stages if pipeline else 1,
                      sequence_parallel=bool(self.sequence_parallel), precision=self.precision,
                      recompute=self.recompute or "none", bucket_kb=self.bucket_kb or 1024)

    def model_config(self) -> GPTConfig:
        """The model the config trains, on the demo's byte-level vocabulary (fields it leaves out:
        the demo's defaults)."""
        given = {k: getattr(self, k) for k in ("n_layer", "n_embd", "n_head", "block_size", "tie_weights")
                 if getattr(self, k) is not None}
        return GPTConfig(**{"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, **given,
                            "vocab_size": DEMO_VOCAB})

    def demo_flags(self) -> list[str]:
        """The equivalent `python -m minidist.demo` flags (a flag at the demo's default is left out)."""
        flags = []
        for dest, value in self.demo_settings().items():
            if value is None or value is False or (dest == "accumulation" and value == 1):
                continue
            flag = "--" + dest.replace("_", "-")
            flags += [flag] if value is True else [flag, _number(value) if isinstance(value, float) else str(value)]
        return flags

    def apply(self, args, keep=frozenset()) -> None:
        """Set the demo's argparse Namespace from this config; attributes named in `keep` (flags
        the user gave on the command line, see `given_flags`) stay as they are."""
        for dest, value in self.demo_settings().items():
            if dest not in keep:
                setattr(args, dest, value)

    def optim_settings(self):
        """minidist's OptimSettings with every value this config gives (the others: defaults)."""
        from minidist.training.train import OptimSettings
        given = {k: getattr(self, k) for k in ("lr", "min_lr", "warmup", "steps", "weight_decay", "clip", "betas",
                                                "eps", "decay", "initial_loss_scale", "loss_scale_window")}
        return OptimSettings(**{k: v for k, v in given.items() if v is not None})

    def describe(self, args=None, given=frozenset()) -> str:
        """What the config means, line by line; with the demo's `args` and the flags `given` on its
        command line, each value a flag overrides shows the config's and the one the run uses."""
        def shown(name: str) -> str:
            value = getattr(self, name)
            text = f"{value:g}" if isinstance(value, float) else str(value)
            if args is not None and name in given and getattr(args, name, value) != value:
                return f"{name} {text} -> {getattr(args, name)} (the command line's)"
            return f"{name} {text}"

        lines = [f"{self.source} on {self.world_size} ranks -> minidist mesh pp {self.pp} x dp {self.dp} x "
                 + (f"cp {self.cp} x " if self.cp > 1 else "") + f"tp {self.tp} (tp fastest)"
                 + (f", ZeRO-{self.zero} over dp" if self.zero else "")
                 + (", sequence parallel" if self.sequence_parallel else "")]
        steps = (f"{self.microbatches} pipeline micro-batches ({self.schedule}"
                 + (f", {self.virtual_stages} virtual stages" if self.schedule == "interleaved" else "") + ")"
                 if self.pp > 1 else f"{self.accumulation} accumulation micro-step(s)")
        lines.append(f"batch: {self.batch_size} sequences per step = {self.micro_batch_size} per rank x {steps} "
                     f"x dp {self.dp}")
        optim = [shown(k) for k in ("lr", "min_lr", "warmup", "steps", "weight_decay", "clip")
                 if getattr(self, k) is not None]
        if optim:
            lines.append("optimizer: AdamW, " + ", ".join(optim) + " (all applied; a flag given as well wins)")
        lines.append(f"precision: {self.precision}" + ("" if self.precision == "fp32" else
                                                        " (16-bit compute, fp32 master weights: chapter 10)"))
        model = [shown(k) for k in ("n_layer", "n_embd", "n_head", "block_size", "vocab_size", "tie_weights")
                 if getattr(self, k) is not None]
        if model:
            lines.append("model: " + ", ".join(model))
        return "\n".join(lines)

    def command(self) -> str:
        launcher = f"mpirun -n {self.world_size} " if self.world_size > 1 else ""
        return launcher + " ".join(["python -m minidist.demo", *map(shlex.quote, self.demo_flags())])


def _number(x: float) -> str:
    """The shortest text that reads back as exactly `x` (3e-3, not 0.003000...)."""
    short = f"{x:g}"
    return short if float(short) == x else repr(x)


def given_flags(parser: argparse.ArgumentParser, argv) -> set[str]:
    """The dests of the flags that `argv` really gives (not defaulted): what `apply` should keep."""
    unset = object()
    namespace = argparse.Namespace(**{a.dest: unset for a in parser._actions if a.dest != argparse.SUPPRESS})
    parser.parse_args(argv, namespace=namespace)
    return {dest for dest, value in vars(namespace).items() if value is not unset}


# ----------------------------------------------------------------------------- shared rules


def checked_number(where: str, value, lo: float = 0.0, integer: bool = False, lo_open: bool = False):
    """A config's number, checked: ValueError naming the key and the value otherwise."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and integer:
        ok = float(value).is_integer()
    if not ok or value < lo or (lo_open and value == lo):
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{where}: expected {kind} {'>' if lo_open else '>='} {lo:g}, got {value!r}")
    return int(value) if integer else float(value)


def data_parallel_size(world: int, tp: int, pp: int, who: str) -> int:
    if world % (tp * pp):
        raise ValueError(f"{who}: world size {world} is not divisible by tp={tp} x pp={pp} = {tp * pp}")
    return world // (tp * pp)


def batch_rule(dp: int, batch=None, micro=None, steps=None,
               names=("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")):
    """DeepSpeed's rule: batch = micro x steps x dp; any two given determine the third (with one
    alone, steps = 1). Returns (batch, micro, steps); a ValueError names the numbers."""
    b, m, s = names
    if batch is None and micro is None:
        raise ValueError(f"give {b} or {m} (with {s}, any two of the three determine the third)")
    if batch is None:
        return micro * (steps or 1) * dp, micro, steps or 1
    if micro is not None and steps is not None:
        if batch != micro * steps * dp:
            raise ValueError(f"{b}={batch} != {m}={micro} x {s}={steps} x dp={dp} = {micro * steps * dp}")
        return batch, micro, steps
    known, name = (micro, m) if micro is not None else (steps or 1, s)
    if batch % (known * dp):
        raise ValueError(f"{b}={batch} is not divisible by {name}={known} x dp={dp} = {known * dp}")
    return (batch, micro, batch // (micro * dp)) if micro is not None else (batch, batch // (known * dp), known)


def finish_translation(t: Translation, who: str) -> Translation:
    """The config's layout judged by minidist's one rule (`Layout.validate`, the demo's and the
    planner's too), whichever framework it came from."""
    if t.zero and t.dp == 1:
        t.notes.append(f"ZeRO-{t.zero} over dp=1 has nothing to partition: minidist runs it as plain training")
        t.zero = 0
        for key, entry in t.applied.items():
            if entry["flag"] == "zero":
                entry["flag"] = None
    if t.schedule == "interleaved" and t.pp == 1:
        raise ValueError(f"{who}: {t.virtual_stages} virtual pipeline stages need pp > 1, got pp={t.pp}")
    layout = t.layout()
    why = layout.why_invalid(t.model_config(), t.world_size, t.batch_size or t.dp * layout.microbatches)
    if why is not None:
        raise ValueError(f"{who}: layout {layout}: {why}")
    t.notes.append(f"layout {layout} (python -m minidist.demo --layout {layout})")
    if t.cp > 1:
        t.notes.append(f"mesh pp {t.pp} x dp {t.dp} x cp {t.cp} x tp {t.tp} on {t.world_size} ranks, rank = "
                       f"((pp x {t.dp} + dp) x {t.cp} + cp) x {t.tp} + tp: Megatron's default order tp-cp-ep-dp-pp")
    else:
        t.notes.append(f"mesh pp {t.pp} x dp {t.dp} x tp {t.tp} on {t.world_size} ranks, rank = (pp x {t.dp} + dp) x "
                       f"{t.tp} + tp: Megatron's default order tp-cp-ep-dp-pp, the same grid")
    return t


def set_layout_steps(t: Translation, steps: int, what: str) -> None:
    """A step's micro-steps are the pipeline's micro-batches (pp > 1) or gradient accumulation."""
    if t.pp > 1:
        t.microbatches = steps
        t.notes.append(f"{what} {steps} -> --microbatches {steps} (pp={t.pp}: the pipeline's micro-batches)")
    else:
        t.accumulation = steps
        t.notes.append(f"{what} {steps} -> --accumulation {steps} (pp=1: gradient-accumulation micro-steps)")
