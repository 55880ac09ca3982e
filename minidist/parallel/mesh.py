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

`layout` computes the whole table without MPI (test it, print it: `python -m
minidist.parallel.mesh --dp 2 --tp 2 --pp 2`); `DeviceMesh` is one rank's row of it, with each
group made a minidist `World` by `world.split` — so every rank must construct it.
"""
from __future__ import annotations

from dataclasses import dataclass

from minidist.comm.world import World

AXES = ("pp", "dp", "tp")  # slowest-varying first


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


def rank_of(pp: int, dp: int, tp: int, *, dp_size: int, tp_size: int) -> int:
    """The world rank at coordinates (pp, dp, tp): row-major, tp fastest."""
    return (pp * dp_size + dp) * tp_size + tp


def coordinates(rank: int, *, dp_size: int, tp_size: int) -> tuple[int, int, int]:
    """The (pp, dp, tp) coordinates of a world rank: `rank_of` backwards."""
    rest, tp = divmod(rank, tp_size)
    pp, dp = divmod(rest, dp_size)
    return pp, dp, tp


def check_mesh(world_size: int, dp: int = 1, tp: int = 1, pp: int = 1, config=None,
               batch_size: int | None = None, microbatches: int | None = None) -> None:
    """Raise ValueError, in one line naming the numbers, if the mesh cannot be built (or cannot
    hold `config`, or split `batch_size` into `microbatches`). Pure arithmetic: every rank
    reaches the same verdict before any message (chapter 2)."""
    for name, degree in (("dp", dp), ("tp", tp), ("pp", pp)):
        if not isinstance(degree, int) or degree < 1:
            raise ValueError(f"device mesh: {name} must be an integer >= 1, got {degree!r}")
    if dp * tp * pp != world_size:
        raise ValueError(f"device mesh: pp={pp} x dp={dp} x tp={tp} = {pp * dp * tp} ranks, "
                         f"but the world has {world_size}")
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


def layout(world_size: int, dp: int = 1, tp: int = 1, pp: int = 1) -> list[Place]:
    """The whole mesh, without MPI: row r is world rank r's `Place`."""
    check_mesh(world_size, dp, tp, pp)

    def members(vary: str, at: tuple[int, int, int]) -> tuple[int, ...]:
        """The world ranks of the group along axis `vary` through the cell `at` = (pp, dp, tp)."""
        ### BEGIN SOLUTION assignment=mesh_groups
        size = {"pp": pp, "dp": dp, "tp": tp}[vary]
        axis = AXES.index(vary)
        cells = [at[:axis] + (i,) + at[axis + 1:] for i in range(size)]  # walk one axis, hold the others
        return tuple(rank_of(*cell, dp_size=dp, tp_size=tp) for cell in cells)
        ### END SOLUTION

    table = []
    for rank in range(world_size):
        at = coordinates(rank, dp_size=dp, tp_size=tp)
        pipeline = members("pp", at)
        if pp == 1:
            embedding = (rank,)  # first and last stage are this rank
        elif at[0] in (0, pp - 1):
            embedding = (pipeline[0], pipeline[-1])
        else:
            embedding = None
        table.append(Place(rank, *at, tp_group=members("tp", at), dp_group=members("dp", at),
                           pp_group=pipeline, embedding=embedding))
    return table


class DeviceMesh:
    """This rank's place in the pp x dp x tp grid, with its groups as `World`s.

    Collective: every rank of `world` must construct it (each group is a `world.split`).
    A middle pipeline stage has `embedding_group = None`."""

    def __init__(self, world: World, dp: int = 1, tp: int = 1, pp: int = 1, *, config=None,
                 batch_size: int | None = None, microbatches: int | None = None):
        check_mesh(world.size, dp, tp, pp, config, batch_size, microbatches)  # before any message
        self.world, self.dp, self.tp, self.pp = world, dp, tp, pp
        self.place = place = layout(world.size, dp=dp, tp=tp, pp=pp)[world.rank]
        self.coordinate = (place.pp, place.dp, place.tp)
        # Color = the group's first member, so each group's ranks agree on it; members are in
        # world order, so a rank's place in its group is its coordinate along that axis.
        # Each group is labelled with its axis: its messages are counted as "...@tp" etc.
        self.tp_group = world.split(color=place.tp_group[0], label="tp")
        self.dp_group = world.split(color=place.dp_group[0], label="dp")
        self.pp_group = world.split(color=place.pp_group[0], label="pp")
        # Middle stages take part in the split too (it is collective), in a group of their own
        # that they then drop.
        embedding = world.split(color=place.embedding[0] if place.embedding else world.size + world.rank,
                                label="embedding")
        self.embedding_group = embedding if place.embedding else None

    def get_group(self, axis: str) -> World | None:
        """The group along "tp", "dp", "pp" or "embedding" (PyTorch: `mesh.get_group("tp")`)."""
        return {"tp": self.tp_group, "dp": self.dp_group, "pp": self.pp_group,
                "embedding": self.embedding_group}[axis]

    def __repr__(self):
        pp, dp, tp = self.coordinate
        return (f"DeviceMesh(rank={self.world.rank}, pp={pp}/{self.pp}, dp={dp}/{self.dp}, tp={tp}/{self.tp})")


def format_table(table: list[Place]) -> str:
    """The mesh as text, one line per rank."""
    def ranks(group):
        return ",".join(map(str, group)) if group else "-"

    header = f"{'rank':>4} {'pp':>3} {'dp':>3} {'tp':>3}  {'tp group':<12}{'dp group':<12}{'pp group':<12}embedding"
    rows = [f"{p.rank:>4} {p.pp:>3} {p.dp:>3} {p.tp:>3}  {ranks(p.tp_group):<12}{ranks(p.dp_group):<12}"
            f"{ranks(p.pp_group):<12}{ranks(p.embedding)}" for p in table]
    return "\n".join([header, *rows])


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
    try:
        table = layout(world, dp=args.dp, tp=args.tp, pp=args.pp)
    except ValueError as error:
        parser.error(f"argument --world: {error}")
    print(f"pp={args.pp} x dp={args.dp} x tp={args.tp} = {world} ranks "
          f"(tp fastest: rank = (pp*{args.dp} + dp)*{args.tp} + tp)")
    print(format_table(table))


if __name__ == "__main__":
    main()
