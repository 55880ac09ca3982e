"""The hierarchical all-reduce: one level inside each machine, one between machines (chapter 07).

One idea: a byte between machines (a network link) costs far more than a byte inside one
(shared memory), so an all-reduce across several machines should send as little as possible
between them. The flat ring does not care where its ranks live: with N ranks on L machines
every one of its L links between machines carries 2(N-1)/N x S bytes. The hierarchical
all-reduce, what NCCL and MPI implementations do across nodes, works in three phases:

  1. reduce inside each node onto its *leader* (the node's lowest rank): binomial tree;
  2. all-reduce among the L leaders, one per node: the ring, 2(L-1)/L x S per leader;
  3. broadcast the result inside each node from its leader: binomial tree.

Only phase 2 crosses machines, and each leader sends 2(L-1)/L x S there instead of the flat
ring's 2(N-1)/N x S per link (S vs 1.5 S on two nodes of two ranks). Phases 1 and 3 move whole
arrays, 2 ceil(log2 p) x S on the critical path for p ranks per node, but over the cheap
links. On one node phase 2 has nothing to do: it is just that node's all-reduce.
Cost on both levels: cost.py (`predict_two_level`).

The node groups come from MPI itself (`Split_type(COMM_TYPE_SHARED)`: the ranks that share
memory), made once per group and kept in `world.cache`, like the shared-memory window.
Traffic: messages inside nodes count under kind "all_reduce.hierarchical", the leaders'
messages between nodes under "all_reduce.hierarchical.between_nodes"; together they are the
call's traffic.
"""
from __future__ import annotations

import copy

from mpi4py import MPI

from minidist.comm import traffic
from minidist.comm.algorithms import all_reduce_ring, broadcast_tree, reduce_tree
from minidist.comm.world import World

BETWEEN_NODES = "all_reduce.hierarchical.between_nodes"


class Hierarchy:
    """A group seen as nodes: my node's sub-group, the leaders' sub-group (None unless I lead
    my node), and the ranks per node, in the order of the nodes' leaders."""

    def __init__(self, world: World):
        comm = world.comm
        self.node = World(comm.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank), parent=world)
        leads = self.node.rank == 0
        leaders = comm.Split(0 if leads else MPI.UNDEFINED, world.rank)
        self.leaders = World(leaders, parent=world) if leads else None
        self.per_node = [size for lead, size in comm.allgather((leads, self.node.size)) if lead]
        for group in (self.node, self.leaders):  # their collectives' communicators, made now, together
            if group is not None:
                group.coll_comm

    @property
    def spans_nodes_with_neighbours(self) -> bool:
        """Several nodes, and some node holds more than one rank: where the hierarchy pays."""
        return len(self.per_node) > 1 and max(self.per_node) > 1


def hierarchy(world: World) -> Hierarchy:
    """The group's Hierarchy, made on first use (a collective call: every rank of the group is
    inside the same all_reduce or choose_all_reduce when it happens)."""
    if "hierarchy" not in world.cache:
        world.cache["hierarchy"] = Hierarchy(world)
    return world.cache["hierarchy"]


def _on(ctx, group: World, counts):
    """The call's context, posting on a sub-group with a fresh tag of that group. It shares the
    call's list of posted messages, so the driver's wait (and a timeout) sees them all."""
    sub = copy.copy(ctx)
    sub.world, sub.comm, sub.rank, sub.size = group, group.coll_comm, group.rank, group.size
    sub.tag, sub.counts = group.next_tag(), counts
    return sub


def all_reduce_hierarchical(ctx, buf, op):
    """Reduce inside my node onto its leader, all-reduce among the leaders (ring), broadcast
    inside my node. Every rank ends with the same bits: the leaders' ring gives each leader the
    same result, and the broadcast copies it."""
    h = hierarchy(ctx.world)
    # Tags are drawn now, before the first step, in call order on every rank: asynchronous
    # calls in flight at once keep their messages apart in every sub-group.
    node = _on(ctx, h.node, ctx.counts)
    leaders = None
    if h.leaders is not None and h.leaders.size > 1:
        between = traffic.counter(BETWEEN_NODES)
        between.calls += 1
        leaders = _on(ctx, h.leaders, between)
    yield from reduce_tree(node, buf, 0, op)
    if leaders is not None:
        yield from all_reduce_ring(leaders, buf, op)
    yield from broadcast_tree(node, buf, 0)
