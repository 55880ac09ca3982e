"""The assignments: each names a region of minidist's own source, marked in nbgrader's syntax

    ### BEGIN SOLUTION assignment=<name>
    ... the reference code, the code the library runs ...
    ### END SOLUTION

and the tests that grade it (pytest node ids, relative to the repository root). Each graded
test reaches its own region only, so one assignment's grade never depends on another's."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Assignment:
    name: str
    chapter: int
    points: int
    minutes: int          # estimated time for a student
    where: str            # the function(s) the student writes
    tests: tuple[str, ...]
    env: dict = field(default_factory=dict)  # environment the graded tests run under


ASSIGNMENTS = [
    Assignment("adamw_update", 1, 2, 20, "minidist/optim.py adamw_update (the plain equations)",
               ("tests/test_optim.py::test_adamw_matches_hand_computed_steps",
                "tests/test_optim.py::test_adamw_first_step_moves_each_weight_by_lr",
                "tests/test_optim.py::test_adamw_update_function_in_place"),
               env={"MINIDIST_KERNELS": "plain"}),  # the default fast kernels take another path
    Assignment("ddp_bucket_hook", 3, 3, 45,
               "minidist/parallel/data_parallel.py DistributedDataParallel._grad_ready and _launch",
               ("minidist/assignments/checks/test_ddp_bucket_hook.py",)),
    Assignment("one_f_one_b", 5, 2, 30, "minidist/parallel/schedules.py one_f_one_b",
               ("tests/test_schedules.py::test_1f1b_warmup_is_p_minus_rank_minus_1_forwards",
                "tests/test_schedules.py::test_activations_held_gpipe_m_and_1f1b_p_minus_rank")),
    Assignment("tensor_parallel_f_g", 6, 2, 30,
               "minidist/parallel/tensor_layers.py f (CopyToTensorParallelRegion.backward) and "
               "g (ReduceFromTensorParallelRegion.forward)",
               ("minidist/assignments/checks/test_tensor_parallel_f_g.py",)),
    Assignment("ring_all_reduce", 7, 3, 45,
               "minidist/comm/algorithms.py all_reduce_ring and _ring_reduce_scatter_inplace",
               ("tests/test_comm_sim.py::test_ring_traffic_is_2_n_minus_1_over_n",
                "tests/test_comm_sim.py::test_all_reduce_algorithms")),
    Assignment("mesh_groups", 9, 2, 30, "minidist/parallel/mesh.py layout's members (a rank's group along one axis)",
               ("tests/test_mesh.py::test_layout_groups_partition_the_world",
                "tests/test_mesh.py::test_layout_of_eight_ranks_is_megatrons")),
]

BY_NAME = {a.name: a for a in ASSIGNMENTS}
