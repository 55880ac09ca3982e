"""One attempt of a job: mpiexec started, watched, and ended for good (chapter 11, fault tolerance).

`run_attempt(command, world, env)` starts `mpiexec -n world command` as `minidist.comm.launch.run`
does (the same mpiexec, next to this Python; one thread per rank for BLAS; MINIDIST_NODES and
MINIDIST_TCP honoured), in a process group of its own, and waits. Meanwhile it

* passes the job's output through unchanged, reading in it what the job reports: the steps done
  (the demo's progress bar, `5/8`, redrawn after every step with its loss; its `step 4 |` lines),
  the step it resumed at, a rank's traceback, the rank an injected fault (MINIDIST_KILL) is about
  to kill, and mpiexec's word on how the first process died
  (`Killed (signal 9)`);
* notes which process is which rank (each rank's environment holds PMI_RANK, set by MPICH's
  proxy), and which of them ended first (`_watch`).

When mpiexec returns, whatever is left of the attempt is SIGKILLed and waited for: a rank stuck
in a system call, or a proxy slow to go, must not train on beside the next attempt, nor hold its
files. `Outcome` says in words what died.
"""
from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from minidist.comm.launch import TCP_ENV, find_mpiexec, node_flags, ranks_per_node

DONE_BAR = re.compile(rb"(\d+)/\d+ \[")            # tqdm's bar: steps done / steps
DONE_LINE = re.compile(rb"step\s+(\d+) \|")        # the demo's log line of a step just done
RESUMED = re.compile(rb"resuming from .*?: step (\d+) of (\d+)")
DEAD_SIGNAL = re.compile(rb"\(signal (\d+)\)")
DEAD_EXIT = re.compile(rb"EXIT CODE: (\d+)")
RAISED = re.compile(rb"\[rank (\d+)\] Traceback")   # faults.abort's traceback, prefixed by rank
INJECTED = re.compile(rb"\[rank (\d+)\] MINIDIST_KILL: SIGKILL")  # an injected fault names its rank


_mid_line = [False]  # the job's stderr ended without a newline (a progress bar, redrawn with \r)


def say(message: str) -> None:
    """The agent's own lines, on stderr, each on a line of its own starting `[launch]`."""
    print(("\n" if _mid_line[0] else "") + f"[launch] {message}", file=sys.stderr, flush=True)
    _mid_line[0] = False


@dataclass
class Outcome:
    """How an attempt ended, and what it reported on the way."""
    code: int = 0                          # mpiexec's exit status (negative: killed by that signal)
    steps_done: int | None = None          # the last count of steps done the job reported
    resumed_at: int | None = None          # the step it resumed from (the demo's line)
    ranks: dict = field(default_factory=dict)   # pid -> rank, of every rank seen alive
    members: dict = field(default_factory=dict)  # pid -> start time, of every process seen below mpiexec
    first_dead: list = field(default_factory=list)  # the rank pids that ended first (one, normally)
    dead_signal: int | None = None
    dead_exit: int | None = None
    raised: int | None = None              # the rank whose traceback was printed
    injected: int | None = None            # the rank that said it kills itself (MINIDIST_KILL)
    leftover: list = field(default_factory=list)  # processes that would not go

    @property
    def exit_status(self) -> int:
        """What a shell would say: 128 + N for a signal."""
        return 128 - self.code if self.code < 0 else self.code

    def what_died(self) -> str:
        """One line: which rank (watched, or named by its traceback), how, and mpiexec's status."""
        if self.injected is not None:  # its own word beats the watch, which a busy machine can race
            pids = [pid for pid, rank in self.ranks.items() if rank == self.injected]
            who = f"rank {self.injected}" + (f" (pid {pids[0]})" if pids else "")
        elif self.first_dead:
            who = " or ".join(f"rank {self.ranks[pid]} (pid {pid})" for pid in self.first_dead)
            who += " (they ended together)" if len(self.first_dead) > 1 else ""
        elif self.raised is not None:
            who = f"rank {self.raised}"
        else:
            who = "a rank (which one, neither the output nor the processes say)"
        if self.dead_signal is not None:
            how = f"was killed by signal {self.dead_signal} ({signal_name(self.dead_signal)})"
        elif self.raised is not None:
            how = "raised (its traceback is above) and aborted the job"
        elif self.dead_exit is not None:
            how = f"exited with status {self.dead_exit}"
        else:
            how = "ended the job"
        job = (f"mpiexec was killed by signal {-self.code} ({signal_name(-self.code)})" if self.code < 0
               else f"mpiexec exited with status {self.code}")
        return f"{who} {how}; {job}"


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown signal"


def run_attempt(command: list[str], world: int, env: dict) -> Outcome:
    """Run `command` on `world` ranks under mpiexec until it ends; every process of it gone after."""
    with tempfile.TemporaryDirectory(prefix="minidist-launch-") as job:
        child_env = dict(env, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        if env.get("MINIDIST_TCP") == "1":
            child_env.update(TCP_ENV)
        mpiexec = [find_mpiexec(), *node_flags(ranks_per_node(world), Path(job)), "-n", str(world), *command]
        outcome = Outcome()
        proc = subprocess.Popen(mpiexec, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env,
                                start_new_session=True)  # its own process group: every process of it findable
        readers = [threading.Thread(target=_pass_through, args=(pipe, out, outcome), daemon=True)
                   for pipe, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr))]
        watcher = threading.Thread(target=_watch, args=(proc, world, outcome), daemon=True)
        for thread in (*readers, watcher):
            thread.start()
        try:
            outcome.code = proc.wait()
        except BaseException:  # the agent itself is stopped (Ctrl-C, SIGTERM): the job stops too
            _terminate(proc)
            raise
        finally:
            outcome.leftover = end_attempt(proc.pid, outcome.members)
            for thread in (*readers, watcher):
                thread.join(timeout=5)
        return outcome


def _pass_through(pipe, out, outcome: Outcome) -> None:
    """Copy the job's bytes as they come (progress bars redraw with \\r, not lines), and read them."""
    carry = b""
    for chunk in iter(lambda: os.read(pipe.fileno(), 1 << 16), b""):
        out.buffer.write(chunk)
        out.flush()
        if out is sys.stderr:
            _mid_line[0] = not chunk.endswith(b"\n")
        text = carry + chunk
        _read(text, outcome)
        carry = text[-200:]  # a report cut between two chunks is read whole in the next
    pipe.close()


def _read(text: bytes, outcome: Outcome) -> None:
    done = [int(m) for m in DONE_BAR.findall(text)] + [int(m) + 1 for m in DONE_LINE.findall(text)]
    if done:
        outcome.steps_done = max(done + [outcome.steps_done or 0])
    for pattern, name in ((DEAD_SIGNAL, "dead_signal"), (DEAD_EXIT, "dead_exit"),
                          (RAISED, "raised"), (INJECTED, "injected")):
        match = pattern.search(text)
        if match and getattr(outcome, name) is None:
            setattr(outcome, name, int(match.group(1)))
    match = RESUMED.search(text)
    if match:
        outcome.resumed_at = int(match.group(1))


def _watch(proc, world: int, outcome: Outcome) -> None:
    """While the job runs: its processes (mpiexec's descendants), which is which rank, and which
    rank ended first. mpiexec names a dead process only by pid, and not reliably (MPICH 4 names
    its proxy's first rank, whichever died), so each rank is watched through a pidfd, which
    becomes readable the moment that process ends: before mpiexec has even heard of it, and
    before it kills the others."""
    watched: dict[int, int] = {}  # pidfd -> pid
    try:
        while proc.poll() is None and not outcome.first_dead:
            if len(outcome.ranks) < world:
                table = processes()
                for pid in descendants([proc.pid], table):
                    outcome.members.setdefault(pid, table[pid].start)
                    rank = None if pid in outcome.ranks else _pmi_rank(pid)
                    if rank is not None:
                        outcome.ranks[pid] = rank
                        fd = _pidfd(pid)
                        if fd is not None:
                            watched[fd] = pid
            ended = select.select(list(watched), [], [], 0.1)[0] if watched else time.sleep(0.1)
            if ended:
                outcome.first_dead = sorted(watched[fd] for fd in ended)
    finally:
        for fd in watched:
            os.close(fd)


def _pidfd(pid: int) -> int | None:
    """A file descriptor that becomes readable when `pid` ends (Linux 5.3; None elsewhere)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


@dataclass(frozen=True)
class Process:
    parent: int
    group: int
    start: int  # clock ticks after boot: with the pid, names one process (pids are reused)


def processes() -> dict[int, Process]:
    """Every live process (zombies are gone already), read from /proc; empty where there is none."""
    table = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # the name, in parentheses, may hold anything
        except (OSError, IndexError):
            continue  # gone meanwhile
        if fields[0] not in ("Z", "X"):
            table[int(entry)] = Process(parent=int(fields[1]), group=int(fields[2]), start=int(fields[19]))
    return table


def descendants(roots: list[int], table: dict[int, Process]) -> list[int]:
    """The processes below `roots` (children, their children, ...)."""
    found, frontier = [], set(roots)
    while frontier:
        frontier = {pid for pid, p in table.items() if p.parent in frontier and pid not in found}
        found.extend(frontier)
    return found


def _pmi_rank(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            variables = f.read().split(b"\0")
    except OSError:
        return None
    for variable in variables:
        if variable.startswith(b"PMI_RANK="):
            return int(variable[len(b"PMI_RANK="):])
    return None


def end_attempt(group: int, members: dict[int, int], patience: float = 10.0) -> list[int]:
    """SIGKILL what is left of the attempt until nothing is: its process group (mpiexec and its
    proxies) and every process seen below mpiexec (the ranks: MPICH's proxy starts each in a
    session of its own, so the group alone would miss them), each only while its start time is
    the one noted (a pid reused meanwhile is another process). The pids that outlived
    `patience` seconds (none, normally)."""
    deadline = time.monotonic() + patience
    while True:
        table = processes()
        ours = {pid for pid, p in table.items() if p.group == group}
        ours |= {pid for pid, start in members.items() if pid in table and table[pid].start == start}
        alive = sorted(ours | set(descendants(list(ours), table)))
        if not alive or time.monotonic() > deadline:
            return alive
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def _terminate(proc) -> None:
    """SIGTERM first: mpiexec passes it on and each rank removes its shared memory (chapter 2)."""
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=5)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
