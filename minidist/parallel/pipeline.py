"""Model parallelism and pipeline parallelism (模型并行, 流水线并行): the GPT cut by layers.

Chapters 4 and 5. The one idea: give each of p ranks a consecutive slice of the layers (a
*stage*) and pass the activations forward and their gradients backward between neighbours
with point-to-point messages. Stage 0 also holds the embeddings; the last stage the final
LayerNorm, the LM head and the loss.

- Chapter 4, **naive model parallelism**: the whole batch goes through stage 0, then stage 1,
  ...; then backward comes back the same way. Each rank holds 1/p of the layers, but only one
  rank works at any moment. That is this file with `microbatches=1`: no separate code.
- Chapter 5, **pipeline parallelism**: cut the batch into m micro-batches, so stage 0 can start
  micro-batch 1 while stage 1 works on micro-batch 0. Who does what in which order is a
  *schedule* — GPipe or 1F1B — a list of instructions per rank made in `schedules.py`; the
  engine here (`PipelineTrainer._run`) simply executes that list. The idle time left, the
  *bubble*, is (p - 1) / (m + p - 1) of the step.
- Chapter 5, **interleaved 1F1B** (Megatron-LM's virtual pipeline stages): cut the model into
  p * v chunks instead of p, and give rank r the chunks r, r + p, r + 2p, ... (`virtual_stages=v`;
  with p = 2, v = 2 rank 0 holds blocks 0 and 2, rank 1 blocks 1 and 3). The same engine runs
  it: each instruction names its chunk, and a message goes to the next *chunk*, which on the
  last rank is chunk c + 1 on rank 0. Bubble (p - 1) / (v m + p - 1), for v times the messages.

Parallel equals serial: each stage builds only its own parameters, with the serial GPT's names
(`h.2.attn.q_proj.weight` ...), so `init_weights` draws the very numbers the serial model starts
from. Each micro-batch's mean loss is scaled by 1/m before backward, so the accumulated
gradient is the gradient of the whole batch's mean loss. With tied embeddings the first stage
(embedding) and the last (head) each hold a copy of `wte.weight`; after backward the two sum
their gradients (as Megatron-LM does), so both copies take the same update and stay equal.
Clipping needs the global gradient norm: every stage adds its squared norm (the tied weight
counted once) in an all-reduce. (Dropout > 0 draws different masks per micro-batch: such runs
train fine but do not match the serial run bit for bit.)

Messages are posted (`isend`) and received with minidist's polite wait, recorded in the
timeline as "wait": on a 2-core machine a spinning wait would steal the core from the rank that
computes, and the measured bubble would be wrong.
"""
from __future__ import annotations

import math
import time

import numpy as np

from minidist.plan import memory
from minidist.core.data import accuracy
from minidist.comm import all_reduce, any_rank, irecv, isend, sendrecv, wait
from minidist.comm.world import World, resolve
from minidist.precision.mixed_precision import Precision
from minidist.core.model import GPTConfig
from minidist.core.nn import Module
from minidist.parallel import bubble
from minidist.parallel import schedules as S
from minidist.parallel.pipeline_stage import (Layers, PipelineStage, check_pipeline_layout, chunk_layers,  # noqa: F401
                                              partition)
from minidist.core.tensor import Tensor, graph_bytes
from minidist.timeline import Timeline
from minidist.training.train import (OptimSettings, Trainer, load_training_state, make_optimizer,
                            training_state)

TIED_TAG = 1 << 20  # above every activation/gradient tag (2 * (micro * p * v + edge) + direction)


class PipelineTrainer(Trainer):
    """The serial training step, with the model cut into stages over the ranks of `group`.

    `microbatches=1` is naive model parallelism (chapter 4); m > 1 with `schedule` "gpipe" or
    "1f1b" is pipeline parallelism (chapter 5), and "interleaved" with `virtual_stages=v` gives
    each rank v chunks (m must be a multiple of p; v defaults to 2 there, and must be 1
    otherwise). `step` returns the same (loss, accuracy) on every rank; `state_dict` (a
    collective: call it on every rank) gives rank 0 the whole model. `stage_blocks` cuts the
    blocks by the given counts per stage (stage_balance.py); `explain_bubble` re-runs every step's
    schedule from its own records (bubble.py: one more small all-reduce a step), for the report's
    `bubble_simulated`, `bubble_modelled`, `bubble_replayed` and `stage_seconds`.
    """

    def __init__(self, config: GPTConfig, settings: OptimSettings, task, batch_size: int, seed: int = 0,
                 group: World | None = None, microbatches: int = 1, schedule: str = "1f1b",
                 virtual_stages: int | None = None, precision: str = "fp32", stage_blocks: list[int] | None = None,
                 explain_bubble: bool = False):
        world = resolve(group)
        self.amp = Precision(precision, settings)  # chapter 10: the format, the masters, the scaler
        self.precision, self.scaler = self.amp.name, self.amp.scaler
        v = virtual_stages if virtual_stages is not None else (2 if schedule == "interleaved" else 1)
        check_pipeline_layout(config, batch_size, world.size, microbatches, schedule, v, stage_blocks)
        self.virtual_stages, self.stage_blocks, self.explain_bubble = v, stage_blocks, explain_bubble
        self.config, self.settings, self.task = config, settings, task
        self.batch_size, self.microbatches, self.schedule_name = batch_size, microbatches, schedule
        self.name = "mp" if microbatches == 1 else f"pp-{schedule}"
        self.group = world.split(0)  # a communicator of our own: our tags meet nobody else's
        self.rank, self.stages = self.group.rank, self.group.size
        self.schedule = S.make_schedule(schedule, self.rank, self.stages, microbatches, v)
        self.every_schedule = S.all_ranks(schedule, self.stages, microbatches, v)  # to simulate with measured costs
        self.stage = self.build_stage(config, seed, v)
        self.dtype = self.stage.parameters()[0].dtype  # activations travel in the model's dtype
        self.optimizer = self.build_optimizer(settings)
        self.timeline = Timeline()
        self.bubbles: list[float] = []  # measured per step
        self.simulated: list[float] = []  # the schedule simulated with the step's measured stage costs
        self.modelled: list[float] = []  # ... each stage's mean costs, the engine's and the messages' in
        self.replayed: list[float] = []  # ... replayed: each instruction's own time, the engine's, the messages' (bubble.py)
        self.stage_seconds = np.zeros((self.stages, v, 2))  # the last step's mean forward, backward per chunk
        self.engine_seconds = 0.0  # the last step's median engine time after an instruction (explain_bubble)
        self.peak_count = [0] * self.stages  # most micro-batches of activations held, per rank
        self.peak_bytes = [0] * self.stages

    def build_stage(self, config: GPTConfig, seed: int, virtual_stages: int) -> Module:
        """This rank's part of the model (a mesh builds it from tensor-parallel layers)."""
        return self.cast(PipelineStage(config, self.rank, self.stages, seed, virtual_stages, self.stage_blocks))

    def cast(self, stage: Module) -> Module:
        """Chapter 10: 16-bit weights (so 16-bit activations between stages and 16-bit gradients),
        their fp32 masters kept for the optimizer (None in fp32)."""
        self.masters = self.amp.cast(stage)
        return stage

    def build_optimizer(self, settings: OptimSettings):
        return make_optimizer(self.stage, settings, self.masters)

    # -- one step ------------------------------------------------------------------------------
    def step(self, step: int):
        """One optimizer step on the global batch; returns (global mean loss, accuracy)."""
        x, y = self.batch(step)  # every rank: cheap, and gives the shapes
        m = self.microbatches
        self.micro_x, self.micro_y = np.split(x, m), np.split(y, m)
        self.act_shape = self.activation_shape(len(x) // m, x.shape[1])
        self.inputs, self.outputs, self.grads_in, self.held = {}, {}, {}, {}
        self.sends, self.losses, self.accuracies = [], [], []
        self.count = self.bytes = self.step_peak_count = self.step_peak_bytes = 0
        self.step_index, self.mark = step, len(self.timeline.events)
        self.work = []  # (chunk, 0 forward | 1 backward, micro-batch, index in the timeline) of this step
        self.posted, self.received = {}, {}  # tag -> when the send was posted; when the receive began, ended
        self.stage.zero_grad()
        for instruction in self.schedule:  # the engine: any schedule, read top to bottom
            getattr(self, "_" + instruction.kind)(instruction.micro, instruction.chunk)
        return self._share_results()

    def batch(self, step: int):
        """The rows this pipeline trains on: the whole global batch (a mesh gives it a slice)."""
        return self.task.get_batch(step, self.batch_size)

    def activation_shape(self, rows: int, length: int) -> tuple:
        """The shape of the activations (and their gradients) that cross a stage boundary."""
        return (rows, length, self.config.n_embd)

    def accuracy(self, logits: np.ndarray, targets) -> float:
        return accuracy(np.asarray(logits, dtype=np.float32) if self.amp.low else logits, targets)

    def backward_loss(self, loss):
        """What backward starts from: the micro-batch's part of the loss, times the loss scale
        (fp16 only)."""
        return self.amp.scale(self.loss_share(loss))

    def loss_share(self, loss):
        """loss / m: the mean over micro-batches is the mean over the batch."""
        return loss * (1.0 / self.microbatches)

    # Everything in flight is keyed by (micro-batch, chunk); without interleaving the chunk is 0.
    def _forward(self, i: int, c: int = 0):
        label = f"forward {i}" + (f".{c}" if self.virtual_stages > 1 else "")
        with self.timeline.span(label, "forward"), self.amp.autocast():  # fp32: nothing changes
            x = self.micro_x[i] if self.stage.has_input(c) else self.inputs[i, c]
            if self.stage.has_loss(c):
                logits, loss = self.stage(x, self.micro_y[i], chunk=c)
                self.losses.append(loss.item())
                self.accuracies.append(self.accuracy(logits.data, self.micro_y[i]))
                out = self.backward_loss(loss)
            else:
                out = self.stage(x, chunk=c)
            self.outputs[i, c] = out
            # activations this micro-batch holds until its backward: the graph, plus its input
            self.held[i, c] = graph_bytes(out) + (0 if self.stage.has_input(c) else self.inputs[i, c].data.nbytes)
        self.work.append((c, 0, i, len(self.timeline.events) - 1))
        self.count, self.bytes = self.count + 1, self.bytes + self.held[i, c]
        self.step_peak_count = max(self.step_peak_count, self.count)
        self.step_peak_bytes = max(self.step_peak_bytes, self.bytes)
        self._progress()

    def _backward(self, i: int, c: int = 0):
        label = f"backward {i}" + (f".{c}" if self.virtual_stages > 1 else "")
        with self.timeline.span(label, "backward"):
            out = self.outputs.pop((i, c))  # dropping it frees this micro-batch's graph
            if self.stage.has_loss(c):
                out.backward()
            else:
                out.backward(self.grads_in.pop((i, c)))
        self.work.append((c, 1, i, len(self.timeline.events) - 1))
        self.count, self.bytes = self.count - 1, self.bytes - self.held.pop((i, c))
        self._progress()

    # -- messages. Counted in virtual stages s = c * p + rank (s = rank without interleaving):
    # activations go s -> s + 1 and gradients s + 1 -> s, over the boundary ("edge") s. Tag
    # 2 * (i * p * v + edge) for the activation, + 1 for its gradient: one tag per message.
    def _edge(self, c: int, toward: int) -> tuple[int, int]:
        """(peer rank, edge) of the boundary between virtual stage c * p + rank and its neighbour."""
        s = c * self.stages + self.rank
        return (s + toward) % self.stages, min(s, s + toward)

    def _tag(self, i: int, edge: int, grad: bool) -> int:
        return 2 * (i * self.stages * self.virtual_stages + edge) + grad

    def _recv_act(self, i: int, c: int = 0):
        src, edge = self._edge(c, -1)
        self.inputs[i, c] = Tensor(self._recv(f"recv act {i}", src, self._tag(i, edge, False)), requires_grad=True)

    def _send_act(self, i: int, c: int = 0):
        dst, edge = self._edge(c, +1)
        self._send(self.outputs[i, c].data, dst, self._tag(i, edge, False))

    def _recv_grad(self, i: int, c: int = 0):
        src, edge = self._edge(c, +1)
        self.grads_in[i, c] = self._recv(f"recv grad {i}", src, self._tag(i, edge, True))

    def _send_grad(self, i: int, c: int = 0):
        dst, edge = self._edge(c, -1)
        self._send(self.inputs.pop((i, c)).grad, dst, self._tag(i, edge, True))

    def _recv(self, name: str, src: int, tag: int) -> np.ndarray:
        buffer = np.empty(self.act_shape, dtype=self.dtype)
        start = time.perf_counter()
        wait(irecv(buffer, src, tag, self.group, kind="pipeline"))  # polite: sleeps, does not spin
        self.received[tag] = (start, time.perf_counter())
        self.timeline.add(name, "wait", *self.received[tag])
        return buffer

    def _send(self, array: np.ndarray, dst: int, tag: int):
        array = np.ascontiguousarray(array)
        self.posted[tag] = time.perf_counter()
        # posted, not waited for: a blocking send deadlocks 1F1B (see schedules.py); the array
        # stays referenced here until the message is gone
        self.sends.append((isend(array, dst, tag, self.group, kind="pipeline"), array))

    def _progress(self):
        """MPI moves a large message only while the sender calls into MPI: poke it after compute."""
        self.sends = [(r, a) for r, a in self.sends if not r.test()]

    # -- the end of the step: sync the tied weight, clip by the global norm, update
    def _step(self, _micro: int, _chunk: int = 0):
        start = time.perf_counter()
        wait([r for r, _ in self.sends])
        self.sends = []
        self.timeline.add("wait sends", "wait", start, time.perf_counter())
        # the step's synchronisation point: it also waits for the last rank to finish backward
        with self.timeline.span("grad sync", "comm"):
            self.finish_gradients()
        with self.timeline.span("optimizer", "optimizer"):
            self.update()

    def finish_gradients(self):
        """After the last backward: the gradients this stage's update needs are made whole."""
        self._sync_tied_weight()

    def update(self) -> None:
        """Clip by the whole model's norm, set the learning rate, AdamW on this stage (16 bits: on
        the masters, every rank agreeing on a skip: they all hold a piece of the gradients)."""
        params = self.optimizer.params()
        self.amp.step(self.optimizer, self.step_index, agree=lambda found_inf: any_rank(found_inf, self.everyone()),
                      norm=lambda grads: self.norm_of(params, grads))

    def everyone(self) -> World:
        """Every rank that holds a piece of the model's gradients."""
        return self.group

    def _sync_tied_weight(self):
        """First and last stage add their halves of wte's gradient (embedding + head)."""
        if not self.config.tie_weights or self.stages == 1 or not (self.stage.first or self.stage.last):
            return
        weight = self.stage.wte.weight
        mine = weight.grad if weight.grad is not None else np.zeros_like(weight.data)
        theirs = np.empty_like(mine)
        peer = self.stages - 1 if self.stage.first else 0
        sendrecv(mine, peer, theirs, peer, TIED_TAG, self.group)
        weight.grad = mine + theirs  # a + b == b + a exactly: both copies get the same bits

    def norm_of(self, params: list, grads: list) -> float:
        """The whole model's gradient norm from this stage's `grads` (of `params`): the squares
        summed over the stages, the tied copy counted once."""
        tied = self.stage.tied_copy()
        squared = np.array([sum(float(np.dot(g.ravel(), g.ravel())) for p, g in zip(params, grads)
                                if g is not None and p is not tied)])
        all_reduce(squared, op="sum", group=self.group)
        return math.sqrt(squared[0])

    def _share_results(self):
        """Loss and accuracy (from the last stage), the bubble and peaks: the same on every rank."""
        p, m = self.stages, self.microbatches
        work = [e for e in self.timeline.events[self.mark:] if e[1] in ("forward", "backward")]
        totals = np.zeros(3 + 2 * p)
        if self.stage.last:
            totals[0], totals[1] = sum(self.losses) / m, sum(self.accuracies) / m  # equal token counts
        totals[2] = sum(end - start for _, _, start, end in work)
        totals[3 + self.rank], totals[3 + p + self.rank] = self.step_peak_count, self.step_peak_bytes
        all_reduce(totals, op="sum", group=self.group)
        # one clock for all ranks on one machine (timeline.py): the span of the whole pipeline
        span = np.array([-min(e[2] for e in work), max(e[3] for e in work)])
        all_reduce(span, op="max", group=self.group)
        self.bubbles.append(1.0 - totals[2] / (p * (span[0] + span[1])))
        if self.explain_bubble:
            self._explain_bubble()
        self.peak_count = [max(a, int(b)) for a, b in zip(self.peak_count, totals[3:3 + p])]
        self.peak_bytes = [max(a, int(b)) for a, b in zip(self.peak_bytes, totals[3 + p:])]
        return float(totals[0]), float(totals[1])

    def _explain_bubble(self):
        """The step re-run from its own records (bubble.py, chapter 5): every rank's compute and
        engine time per instruction and its messages' times, summed into one table everywhere."""
        p, m, v = self.stages, self.microbatches, self.virtual_stages
        shape = (p, v, 2, m, 2)  # each rank fills its row: compute and engine seconds of each instruction
        costs = bubble.instruction_costs(self.timeline.events, self.work, self.rank, shape)
        messages = bubble.message_times(self.posted, self.received, self._tag(m, 0, False))
        table = np.concatenate([costs.ravel(), messages.ravel()])
        all_reduce(table, op="sum", group=self.group)
        costs, receive = table[:costs.size].reshape(shape), bubble.receive_seconds(table[costs.size:].reshape(-1, 3))
        self.stage_seconds = costs[..., bubble.COMPUTE].mean(axis=3)
        self.engine_seconds = float(np.median(costs[..., bubble.ENGINE]))
        self.simulated.append(bubble.stage_bubble(self.every_schedule, costs))
        self.replayed.append(bubble.replayed_bubble(self.every_schedule, costs, receive))
        self.modelled.append(bubble.replayed_bubble(self.every_schedule, costs, receive, each=False))

    # -- reports -------------------------------------------------------------------------------
    def step_events(self) -> list[tuple]:
        """This rank's timeline events of the last step (for a Gantt chart of one step)."""
        return list(self.timeline.events[self.mark:])

    def pipeline_report(self) -> dict:
        """The demo's `pipeline` JSON: the bubble measured (median over steps after the first)
        against (p - 1) / (v m + p - 1), and each rank's peak activations. No messages.
        (Interleaved, "microbatches" in peak_activations counts (micro-batch, chunk) pairs, each
        about 1/v of a whole stage's activations.)"""
        def typical(per_step):  # the median over the steps after the first (which warms up), None before any
            values = per_step[1:] or per_step
            return float(np.median(values)) if values else None

        return {"schedule": self.schedule_name, "stages": self.stages, "microbatches": self.microbatches,
                "virtual_stages": self.virtual_stages,
                "bubble_measured": typical(self.bubbles),
                "bubble_theory": S.bubble_theory(self.stages, self.microbatches, self.virtual_stages),
                "bubble_simulated": typical(self.simulated),
                "bubble_replayed": typical(self.replayed),
                "bubble_modelled": typical(self.modelled),
                "stage_blocks": [sum(e - s for s, e in chunk_layers(self.config.n_layer, self.stages, r,
                                                                     self.virtual_stages, self.stage_blocks))
                                 for r in range(self.stages)],
                "stage_seconds": [{"rank": r, "chunk": c, "forward": float(self.stage_seconds[r, c, 0]),
                                   "backward": float(self.stage_seconds[r, c, 1])}
                                  for r in range(self.stages) for c in range(self.virtual_stages)],
                "peak_activations": [{"rank": r, "microbatches": c, "bytes": b}
                                     for r, (c, b) in enumerate(zip(self.peak_count, self.peak_bytes))]}

    def report(self) -> dict:
        return {"pipeline": self.pipeline_report(), **self.amp.report()}

    def memory(self) -> dict:
        """This rank's ledger: its stage's params, grads, optimizer, and its peak activations."""
        return memory.ledger(self.stage, self.optimizer, self.peak_bytes[self.rank])

    def num_parameters(self) -> int:
        """Parameters of the whole model (the tied weight once), as `GPT.num_parameters()`."""
        return memory.param_count(self.config)

    def global_state(self) -> dict:
        """This stage's weights, moments and generators (the last stage's copy of a tied wte is
        the first stage's to write)."""
        return training_state(self.stage, self.optimizer, copies=(self.stage.tied_copy(),))

    def load_global_state(self, read) -> None:
        load_training_state(self.stage, self.optimizer, read)  # the tied copy too

    def state_dict(self) -> dict:
        """Collective. Rank 0 gets the whole model's state dict (serial keys and shapes); the
        other ranks get their own stage's part."""
        mine = self.stage.state_dict()
        parts = self.group.comm.gather(mine, root=0)  # small and once: the pickle API is fine
        return merge_stage_states(parts) if self.rank == 0 else mine


def merge_stage_states(parts: list[dict]) -> dict:
    """The stages' state dicts as one, in the serial model's order: embeddings, blocks by index
    (interleaved ranks hold h.0 and h.2 ...), the head. The last stage's tied copy of wte equals
    the first stage's: it is taken once."""
    full = {}
    for part in parts:
        for key, value in part.items():
            full.setdefault(key, value)

    def position(key):
        top = key.split(".")[0]
        return (1, int(key.split(".")[1])) if top == "h" else ((0, 0) if top in ("wte", "wpe") else (2, 0))
    return dict(sorted(full.items(), key=lambda item: position(item[0])))  # stable within a block
