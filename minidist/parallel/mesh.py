"""The device mesh: the world as a grid of pp x dp x tp processes (chapter 09, composing DP x TP x PP).

One idea: to combine the strategies of chapters 3, 5 and 6, number the processes as the cells of a
3-D grid (设备网格) and give each one its coordinates (pp, dp, tp). Every rank then belongs to one
group per axis: the ranks that differ from it only in tp form its tensor-parallel group, only in
dp its data-parallel group, only in pp its pipeline. The embedding group ties the first and last
pipeline stage (they hold the tied token embedding, which both update).

The order, pp x dp x tp, fastest-varying last:

    rank = (pp * DP + dp) * TP + tp          e.g. dp=2, tp=2, pp=2 on 8 ranks:

    rank  pp dp tp   tp group  dp group  pp group
      0    0  0  0     0,1       0,2       0,4
      1    0  0  1     0,1       1,3       1,5
      2    0  1  0     2,3       0,2       2,6
      ...
      7    1  1  1     6,7       5,7       3,7

* Tensor-parallel ranks are adjacent, so they share a machine: tensor parallelism all-reduces
  activations twice per layer, forward and backward, and needs the fastest link. Data
  parallelism all-reduces once per step; the pipeline sends one activation per micro-batch, so
  its stages are the farthest apart and cross machines first.
* Megatron-LM (`megatron/core/parallel_state.py`) names its default order "tp-cp-ep-dp-pp",
  fastest-varying first: tp innermost, then context and expert parallelism (here of size 1),
  then dp, with pp outermost. The same grid.
* PyTorch's `init_device_mesh("cuda", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))` is a
  row-major array of ranks, the last dimension fastest: the same grid again.

Chapter 11's axes join the same grid: context parallelism (cp) sits between dp and tp, so the
full order is pp x dp x cp x tp (Megatron's "tp-cp-ep-dp-pp" read backwards), and expert
parallelism (ep) cuts each dp group into runs of ep adjacent replicas. Every group, of one axis
or several (`dp_cp`: the ranks that hold the same weights when sequences are split, over which
gradients are averaged, as `mesh["dp_cp"]` in PyTorch's DeviceMesh), comes from one function,
`axis_groups`, in the spirit of Megatron-LM's `generate_masked_orthogonal_rank_groups`: hold
the other coordinates, walk the named ones.

`layout` computes the whole table without MPI (test it, print it: `python -m
minidist.parallel.mesh --dp 2 --tp 2 --pp 2`); `DeviceMesh` is one rank's row of it, with each
group made a minidist `World` by `world.split` — so every rank must construct it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from minidist.comm.world import World

AXES = ("pp", "dp", "cp", "tp")  # slowest-varying first: Megatron's "tp-cp-ep-dp-pp" backwards


def axis_groups(sizes: dict[str, int], vary) -> list[tuple[int, ...]]:
    """Every group of world ranks that differ only along the axes `vary` ("tp", or ("dp", "cp")
    for a flattened group), in the grid of `sizes` (axes missing from it have size 1), ranks
    numbered row-major over AXES (tp fastest). Each group lists its ranks in world order, so a
    rank's place in a one-axis group is its coordinate along that axis.

    >>> axis_groups({"dp": 2, "tp": 2}, "tp")
    [(0, 1), (2, 3)]
    >>> axis_groups({"dp": 2, "tp": 2}, "dp")
    [(0, 2), (1, 3)]"""
    vary = (vary,) if isinstance(vary, str) else tuple(vary)
    unknown = set(vary) - set(AXES)
    if unknown:
        raise ValueError(f"device mesh: no axis {sorted(unknown)}; the axes are {AXES}")
    ### BEGIN SOLUTION assignment=mesh_groups
    grid = np.arange(math.prod(sizes.get(axis, 1) for axis in AXES)).reshape([sizes.get(a, 1) for a in AXES])
    walked = [AXES.index(axis) for axis in AXES if axis in vary]  # in grid order: members ascend
    held = [i for i in range(len(AXES)) if i not in walked]
    cells = np.transpose(grid, held + walked)  # the held coordinates first, the walked ones last
    size = math.prod(grid.shape[i] for i in walked)
    return [tuple(int(r) for r in row) for row in cells.reshape(-1, size)]
    ### END SOLUTION


def group_of(rank: int, groups: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The group (of `axis_groups`) that holds `rank`."""
    return next(group for group in groups if rank in group)


@dataclass(frozen=True)
class Place:
    """One rank's row of the mesh: its coordinates and the members (world ranks) of its groups.
    `embedding` is None on a middle pipeline stage (it holds no embedding)."""
    rank: int
    pp: int
    dp: int
    tp: int
    tp_group: tuple[int, ...]
    dp_group: tuple[int, ...]
    pp_group: tuple[int, ...]
    embedding: tuple[int, ...] | None
    cp: int = 0                                 # chapter 11: the context-parallel coordinate
    cp_group: tuple[int, ...] | None = None     # (None: the rank's own, cp = 1)


def rank_of(pp: int, dp: int, tp: int, *, dp_size: int, tp_size: int) -> int:
    """The world rank at coordinates (pp, dp, tp): row-major, tp fastest."""
    return (pp * dp_size + dp) * tp_size + tp


def coordinates(rank: int, *, dp_size: int, tp_size: int) -> tuple[int, int, int]:
    """The (pp, dp, tp) coordinates of a world rank: `rank_of` backwards."""
    ### BEGIN SOLUTION assignment=mesh_groups
    rest, tp = divmod(rank, tp_size)
    pp, dp = divmod(rest, dp_size)
    return pp, dp, tp
    ### END SOLUTION


def check_mesh(world_size: int, dp: int = 1, tp: int = 1, pp: int = 1, config=None,
               batch_size: int | None = None, microbatches: int | None = None, cp: int = 1, ep: int = 1) -> None:
    """Raise ValueError, in one line naming the numbers, if the mesh cannot be built (or cannot
    hold `config`, or split `batch_size` into `microbatches`). Pure arithmetic: every rank
    reaches the same verdict before any message (chapter 2)."""
    for name, degree in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)):
        if not isinstance(degree, int) or degree < 1:
            raise ValueError(f"device mesh: {name} must be an integer >= 1, got {degree!r}")
    if dp * tp * pp * cp != world_size:
        product = f"pp={pp} x dp={dp}" + (f" x cp={cp}" if cp > 1 else "") + f" x tp={tp}"
        raise ValueError(f"device mesh: {product} = {pp * dp * cp * tp} ranks, but the world has {world_size}")
    if dp % ep:
        raise ValueError(f"device mesh: ep={ep} does not divide dp={dp} (expert parallelism groups dp replicas)")
    if config is not None and config.n_head % tp:
        raise ValueError(f"device mesh: tp={tp} does not divide n_head={config.n_head} "
                         "(each tensor-parallel rank holds an equal share of the heads)")
    if config is not None and pp > config.n_layer:
        raise ValueError(f"device mesh: pp={pp} stages but n_layer={config.n_layer} "
                         "(each stage must hold at least one block)")
    if microbatches is not None and (not isinstance(microbatches, int) or microbatches < 1):
        raise ValueError(f"device mesh: microbatches must be an integer >= 1, got {microbatches!r}")
    if batch_size is not None:
        if batch_size % dp:
            raise ValueError(f"device mesh: global batch {batch_size} does not split over dp={dp} replicas "
                             f"({batch_size} % {dp} = {batch_size % dp})")
        per_replica, m = batch_size // dp, microbatches or 1
        if per_replica % m:
            raise ValueError(f"device mesh: each replica's batch of {per_replica} (global {batch_size} / dp={dp}) "
                             f"does not split into {m} micro-batches ({per_replica} % {m} = {per_replica % m})")


def layout(world_size: int, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1) -> list[Place]:
    """The whole mesh, without MPI: row r is world rank r's `Place`."""
    check_mesh(world_size, dp, tp, pp, cp=cp)
    sizes = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
    groups = {axis: axis_groups(sizes, axis) for axis in AXES}
    table = []
    for rank in range(world_size):
        mine = {axis: group_of(rank, groups[axis]) for axis in AXES}
        at = {axis: mine[axis].index(rank) for axis in AXES}  # a rank's place in its group: its coordinate
        pipeline = mine["pp"]
        if pp == 1:
            embedding = (rank,)  # first and last stage are this rank
        elif at["pp"] in (0, pp - 1):
            embedding = (pipeline[0], pipeline[-1])
        else:
            embedding = None
        table.append(Place(rank, at["pp"], at["dp"], at["tp"], tp_group=mine["tp"], dp_group=mine["dp"],
                           pp_group=pipeline, embedding=embedding, cp=at["cp"],
                           cp_group=mine["cp"] if cp > 1 else None))
    return table


class DeviceMesh:
    """This rank's place in the pp x dp x cp x tp grid, with its groups as `World`s.

        mesh = DeviceMesh(world, dp=2, tp=2)       # every rank of `world` constructs it
        mesh.tp_group, mesh["dp"], mesh["dp_cp"]    # one axis, or several flattened
        mesh["ep"], mesh["expert_dp"]               # with ep: runs of ep dp replicas, and across them

    Collective: every rank of `world` must construct it (each group is a `world.split`).
    A middle pipeline stage has `embedding_group = None`."""

    # the groups, with what they vary; each is labelled so its messages count as "...@label"
    GROUPS = (("tp", "tp"), ("cp", "cp"), ("dp", "dp"), ("pp", "pp"), ("dp-cp", ("dp", "cp")))

    def __init__(self, world: World, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, *,
                 config=None, batch_size: int | None = None, microbatches: int | None = None):
        check_mesh(world.size, dp, tp, pp, config, batch_size, microbatches, cp=cp, ep=ep)  # before any message
        self.world, self.dp, self.tp, self.pp, self.cp, self.ep = world, dp, tp, pp, cp, ep
        self.place = place = layout(world.size, dp=dp, tp=tp, pp=pp, cp=cp)[world.rank]
        self.coordinate = (place.pp, place.dp, place.tp)
        sizes = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
        # Color = the group's first member, so each group's ranks agree on it; members are in
        # world order, so a rank's place in its group is its coordinate along that axis.
        self.groups = {label: world.split(color=group_of(world.rank, axis_groups(sizes, vary))[0], label=label)
                       for label, vary in self.GROUPS}
        # expert parallelism (chapter 11): each dp group cut into runs of ep adjacent replicas,
        # and the replicas of one expert shard across those runs
        replicas, e = place.dp_group, place.dp % ep
        self.groups["ep"] = world.split(color=replicas[place.dp - e], label="ep")
        self.groups["expert_dp"] = world.split(color=replicas[e], label="expert_dp")
        # Middle stages take part in the split too (it is collective), in a group of their own
        # that they then drop.
        embedding = world.split(color=place.embedding[0] if place.embedding else world.size + world.rank,
                                label="embedding")
        self.groups["embedding"] = embedding if place.embedding else None

    def __getitem__(self, name: str) -> World | None:
        """A group by name: "tp", "cp", "dp", "pp", "dp_cp" (or "dp-cp"), "ep", "expert_dp",
        "embedding" (PyTorch: `mesh["dp_cp"]`, `mesh.get_group("tp")`)."""
        name = "dp-cp" if name == "dp_cp" else name
        if name not in self.groups:
            raise KeyError(f"device mesh: no group {name!r}; the groups are {sorted(self.groups)}")
        return self.groups[name]

    get_group = __getitem__

    tp_group = property(lambda self: self.groups["tp"])
    dp_group = property(lambda self: self.groups["dp"])
    pp_group = property(lambda self: self.groups["pp"])
    cp_group = property(lambda self: self.groups["cp"])
    embedding_group = property(lambda self: self.groups["embedding"])

    def __repr__(self):
        pp, dp, tp = self.coordinate
        cp = f", cp={self.place.cp}/{self.cp}" if self.cp > 1 else ""
        return f"DeviceMesh(rank={self.world.rank}, pp={pp}/{self.pp}, dp={dp}/{self.dp}{cp}, tp={tp}/{self.tp})"


def format_table(table: list[Place]) -> str:
    """The mesh as text, one line per rank."""
    def ranks(group):
        return ",".join(map(str, group)) if group else "-"

    header = f"{'rank':>4} {'pp':>3} {'dp':>3} {'tp':>3}  {'tp group':<12}{'dp group':<12}{'pp group':<12}embedding"
    rows = [f"{p.rank:>4} {p.pp:>3} {p.dp:>3} {p.tp:>3}  {ranks(p.tp_group):<12}{ranks(p.dp_group):<12}"
            f"{ranks(p.pp_group):<12}{ranks(p.embedding)}" for p in table]
    return "\n".join([header, *rows])


MAX_PRINTED = 1024  # ranks of the largest mesh `main` prints (a 1024-rank table is ~5 MB of text)


def main(argv=None) -> None:
    from minidist.cli import OneLineParser, integer

    parser = OneLineParser(prog="python -m minidist.parallel.mesh",
                           description="Print the pp x dp x tp device mesh: each rank's coordinates and groups.")
    parser.add_argument("--dp", type=integer(1), default=1, help="data-parallel replicas")
    parser.add_argument("--tp", type=integer(1), default=1, help="tensor-parallel ranks (adjacent)")
    parser.add_argument("--pp", type=integer(1), default=1, help="pipeline stages")
    parser.add_argument("--world", type=integer(1), default=None, help="world size (default: dp*tp*pp)")
    args = parser.parse_args(argv)
    world = args.world if args.world is not None else args.dp * args.tp * args.pp
    ranks = max(world, args.dp * args.tp * args.pp)
    if ranks > MAX_PRINTED:  # each line lists a group: the table grows as N^2
        given = f" --world {args.world}" if args.world is not None else ""
        parser.error(f"--dp {args.dp} --tp {args.tp} --pp {args.pp}{given}: a mesh of {ranks} ranks; the table "
                     f"prints one line per rank, for at most {MAX_PRINTED} ranks")
    try:
        table = layout(world, dp=args.dp, tp=args.tp, pp=args.pp)
    except ValueError as error:
        parser.error(f"argument --world: {error}")
    print(f"pp={args.pp} x dp={args.dp} x tp={args.tp} = {world} ranks "
          f"(tp fastest: rank = (pp*{args.dp} + dp)*{args.tp} + tp)")
    print(format_table(table))


if __name__ == "__main__":
    main()
