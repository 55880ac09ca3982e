"""torchtitan's sections and keys, its defaults, and reading its TOML (chapter 9)."""
from __future__ import annotations

import re
import tomllib

from minidist.frameworks.translation import LOW_PRECISION

# torchtitan's JobConfig defaults (torchtitan/config/job_config.py): what a file that leaves a key out trains with
DEFAULTS = {"optimizer.lr": 8e-4, "optimizer.beta1": 0.9, "optimizer.beta2": 0.95, "optimizer.eps": 1e-8,
            "optimizer.weight_decay": 0.1, "lr_scheduler.warmup_steps": 200, "lr_scheduler.decay_type": "linear",
            "lr_scheduler.lr_min": 0.0, "training.local_batch_size": 8, "training.max_norm": 1.0,
            "training.mixed_precision_param": "bfloat16", "parallelism.pipeline_parallel_schedule": "1F1B",
            "parallelism.pipeline_parallel_microbatch_size": 1, "activation_checkpoint.selective_ac_option": "2"}
# where older torchtitan versions kept a key (its current place <- the older one)
OLDER_PLACES = {
    "training.local_batch_size": ("training.batch_size",),
    "lr_scheduler.warmup_steps": ("training.warmup_steps",),
    "lr_scheduler.lr_min": ("lr_scheduler.min_lr_factor",),  # the name in torchtitan's Python configs
    "parallelism.data_parallel_replicate_degree": ("training.data_parallel_replicate_degree",),
    "parallelism.data_parallel_shard_degree": ("training.data_parallel_shard_degree", "training.data_parallel_degree"),
    "parallelism.tensor_parallel_degree": ("training.tensor_parallel_degree",),
    "parallelism.enable_async_tensor_parallel": ("experimental.enable_async_tensor_parallel",),
    "parallelism.pipeline_parallel_degree": ("experimental.pipeline_parallel_degree",),
    "parallelism.pipeline_parallel_schedule": ("experimental.pipeline_parallel_schedule",),
    "parallelism.pipeline_parallel_split_points": ("experimental.pipeline_parallel_split_points",),
    "parallelism.context_parallel_degree": ("experimental.context_parallel_degree",),
}
SECTIONS = ("job", "profiling", "metrics", "model", "optimizer", "lr_scheduler", "training", "parallelism",
            "checkpoint", "activation_checkpoint", "float8", "mx", "comm", "memory_estimation", "fault_tolerance",
            "experimental", "validation", "compile")
IGNORED = {  # whole sections minidist does not read, and why
    "job": "ignored: the job's name and output folder (the demo prints its progress; --json PATH keeps the "
           "measurements)",
    "metrics": "ignored: logging (the demo prints its progress; --json keeps the measurements)",
    "profiling": "ignored: the torch profiler and memory snapshots (--json has each rank's memory ledger and step "
                 "times)",
    "checkpoint": "ignored: the demo checkpoints with --checkpoint DIR --checkpoint-every K",
    "comm": "ignored: NCCL's timeouts and flight recorder (minidist's messages are MPI's, chapter 2)",
    "compile": "ignored: torch.compile (minidist runs NumPy, eagerly)",
    "validation": "ignored: evaluation on a held-out set (the demo reports the training loss and accuracy)",
    "memory_estimation": "ignored: FSDP's memory estimate (python -m minidist.plan.memory estimates a layout's)",
    "fault_tolerance": "TorchFT's fault-tolerant replica groups: no minidist counterpart",
    "experimental": "ignored: custom imports and JobConfig extensions",
    "mx": "MX (microscaling) formats: " + LOW_PRECISION,
}
TRAINING_IGNORED = {
    **dict.fromkeys(("dataset", "dataset_path", "dataset_type"), "ignored: minidist generates its data (--data)"),
    **dict.fromkeys(("compile", "enable_compiled_autograd"), "ignored: torch.compile (minidist runs NumPy, eagerly)"),
    **dict.fromkeys(("gc_freq", "gc_debug"), "ignored: Python's garbage-collector schedule"),
}
FLOAT8 = ('float8 training (torchao\'s Float8Linear, on with model.converters = ["float8"]): minidist\'s fp8 is '
          "on the MLP only (minidist.precision.fp8, chapter 10), not one of the demo's --precision values")
GPT2 = "minidist's GPT is GPT-2's: LayerNorm, a GELU MLP of 4 x n_embd, learned positions, biases"
LLAMA3 = {"debugmodel": (6, 256, 16), "8B": (32, 4096, 32), "70B": (80, 8192, 64), "405B": (126, 16384, 128)}
# torch.distributed.pipelining's schedules (lower case, as torch looks them up): minidist's, and one chunk or several
SCHEDULES = {"gpipe": ("gpipe", False), "1f1b": ("1f1b", False), "interleaved1f1b": ("interleaved", True),
             "loopedbfs": ("interleaved", True), "interleavedzerobubble": ("interleaved", True),
             "zbvzerobubble": ("interleaved", True), "dualpipev": ("interleaved", True),
             "pipelineschedulesingle": ("1f1b", False), "pipelineschedulemulti": ("interleaved", True)}
SCHEDULE_REASONS = {
    "loopedbfs": "each rank runs all micro-batches through one chunk before the next (breadth first)",
    "interleavedzerobubble": "zero-bubble schedules split each backward into input and weight gradients; "
                             "minidist's backward is one piece",
    "zbvzerobubble": "zero-bubble V: split backward, chunks placed in a V (rank 0 holds the first and the last)",
    "dualpipev": "DualPipe's V placement, forward and backward of two micro-batches overlapped",
    "pipelineschedulesingle": "a schedule read from pipeline_parallel_schedule_csv",
    "pipelineschedulemulti": "a schedule read from pipeline_parallel_schedule_csv",
}




class Keys:
    """The config's key paths ("section.key"), taken one at a time; those left at the end are refused."""

    def __init__(self, data: dict, who: str):
        self.who = who
        self.flat: dict = {}
        for section, value in data.items():
            if section in SECTIONS and not isinstance(value, dict):
                raise ValueError(f"{who}: [{section}] must be a table of keys, got {section} = {value!r}")
            self._flatten(value, section)

    def _flatten(self, value, path: str) -> None:
        if isinstance(value, dict) and value:
            for key, inner in value.items():
                self._flatten(inner, f"{path}.{key}")
        else:
            self.flat[path] = value

    def take(self, path: str):
        """(the key as the file writes it, its value), or (None, None) if absent; an older place of
        the same key counts too (given in both: an error)."""
        given = [p for p in (path, *OLDER_PLACES.get(path, ())) if p in self.flat]
        if len(given) > 1:
            raise ValueError(f"{self.who}: {given[0]} and {given[1]} are the same setting (the second is an older "
                             "torchtitan's place): give one")
        return (given[0], self.flat.pop(given[0])) if given else (None, None)

    def section(self, name: str) -> dict:
        """What is left of a section: {key path: value}, taken out."""
        keys = [p for p in self.flat if p == name or p.startswith(name + ".")]
        return {p: self.flat.pop(p) for p in keys}


def read_toml(config) -> dict:
    if isinstance(config, dict):
        return config
    try:
        with open(config, "rb") as f:
            raw = f.read()
    except OSError as error:
        raise ValueError(f"{config}: cannot read it ({error.strerror})") from None
    try:
        if b"\x00" in raw:
            raise UnicodeDecodeError("utf-8", raw, 0, 1, "NUL byte")
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{config}: not a text file (a torchtitan config is UTF-8 TOML)") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        message = str(error).splitlines()[0] if str(error) else "cannot parse it"
        where = re.search(r"\(at (line \d+, column \d+|end of document)\)$", message)
        what = message[:where.start()].strip() if where else message
        raise ValueError(f"{config}: not valid TOML ({where.group(1) if where else 'somewhere'}: {what})") from None


def text_value(who: str, key: str, value, choices=None) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{who}: {key}: expected a string, got {value!r}")
    if choices is not None and value.lower() not in choices:
        raise ValueError(f"{who}: {key}: expected one of {', '.join(choices)}, got {value!r}")
    return value


def switch_value(who: str, key: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{who}: {key}: expected true or false, got {value!r}")
    return value


def only_when_off(t, keys, who: str, name: str, why_not: str) -> None:
    """A switch minidist can take only when it is off: false is used, true refused with `why_not`."""
    key, value = keys.take(name)
    if key:
        if switch_value(who, key, value):
            t.refuse(key, why_not)
        else:
            t.use(key, False, None)
