"""minidist.comm: processes and messages (chapters 02 and 07).

The communication layer every parallel strategy uses. It moves NumPy arrays and knows
nothing of models. Read it in this order, one idea per file:

    errors.py        the two loud failures: CommTimeout and CollectiveMismatch
    waiting.py       the polite, timed wait that every message and collective ends in
    world.py         the world, ranks, groups (communicators) and Split
    p2p.py           point-to-point messages
    traffic.py       counting messages and bytes per rank
    algorithms.py    collectives as schedules of messages: trees, recursive doubling, rings
    consistency.py   the mismatch check every collective makes first (skipped on verified groups)
    driver.py        one collective call: its context, its steps driven, the async Work
    collectives.py   the torch.distributed-style API, what algorithm="auto" picks
    shared_memory.py the all-reduce inside one machine: a shared window, no messages
    hierarchical.py  the all-reduce across machines: inside each, then among one leader per machine
    cost.py          the alpha-beta cost model, its fit, and the message algorithm it predicts fastest
    faults.py        any rank's exception ends the whole job
    launch.py        run a function on N real MPI ranks from a test or a notebook
    sim.py           the same algorithms in one process, step by step (for notebooks)
"""
from minidist.comm.collectives import (Work, all_gather, all_reduce, all_reduce_algorithm, all_to_all, any_rank,
                                       barrier, broadcast, choose_all_reduce, reduce, reduce_scatter)
from minidist.comm.consistency import set_check, unchecked
from minidist.comm.errors import CollectiveMismatch, CommTimeout
from minidist.comm.p2p import irecv, isend, recv, send, sendrecv
from minidist.comm.waiting import Request, set_wait_policy, wait, wait_policy, waiting_as
from minidist.comm.world import VerifiedGroup, World, get_rank, get_world, get_world_size

__all__ = [
    "World", "VerifiedGroup", "get_world", "get_rank", "get_world_size",
    "send", "recv", "isend", "irecv", "sendrecv", "wait", "Request", "CommTimeout",
    "set_wait_policy", "wait_policy", "waiting_as",
    "all_reduce", "all_reduce_algorithm", "any_rank", "choose_all_reduce", "reduce", "broadcast", "reduce_scatter", "all_gather", "all_to_all", "barrier",
    "Work", "CollectiveMismatch", "set_check", "unchecked",
]
