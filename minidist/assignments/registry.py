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
    hidden: tuple[str, ...] = ()  # graded tests in hidden_tests/: never in the student build
    forbidden: tuple[str, ...] = ()  # names the student's regions may not use (forbidden.py): the library's answer


ASSIGNMENTS = [
    Assignment("sendrecv", 2, 1, 15, "minidist/comm/p2p.py sendrecv (send and receive at once, without deadlock)",
               ("minidist/assignments/checks/test_sendrecv.py",),
               hidden=("hidden_tests/test_hidden_sendrecv.py",),
               forbidden=("sendrecv", "Sendrecv", "Sendrecv_replace")),
    Assignment("adamw_update", 1, 2, 20, "minidist/core/optim.py plain_adamw_update (the equations)",
               ("tests/test_optim.py::test_adamw_matches_hand_computed_steps",
                "tests/test_optim.py::test_adamw_first_step_moves_each_weight_by_lr",
                "tests/test_optim.py::test_adamw_update_function_in_place"),
               env={"MINIDIST_KERNELS": "plain"},  # the default fast kernels take another path
               hidden=("hidden_tests/test_hidden_optim.py",),
               forbidden=("fused_fast", "adamw_update", "AdamW", "kernels")),
    Assignment("ddp_bucket_hook", 3, 3, 45,
               "minidist/parallel/data_parallel.py DistributedDataParallel._grad_ready and _launch",
               ("minidist/assignments/checks/test_ddp_bucket_hook.py",),
               hidden=("hidden_tests/test_hidden_ddp.py",),
               forbidden=("NaiveDistributedDataParallel", "allreduce", "Allreduce", "Iallreduce")),
    Assignment("layer_partition", 4, 1, 15, "minidist/parallel/pipeline_stage.py partition (each stage's blocks)",
               ("minidist/assignments/checks/test_partition.py",),
               hidden=("hidden_tests/test_hidden_partition.py",),
               forbidden=("array_split", "chunk_layers", "partition")),
    Assignment("one_f_one_b", 5, 2, 30, "minidist/parallel/schedules.py one_f_one_b (the warm-up) and in_1f1b_order",
               ("tests/test_schedules.py::test_1f1b_warmup_is_p_minus_rank_minus_1_forwards",
                "tests/test_schedules.py::test_activations_held_gpipe_m_and_1f1b_p_minus_rank"),
               hidden=("hidden_tests/test_hidden_schedules.py",),
               forbidden=("interleaved", "gpipe", "make_schedule", "all_ranks", "SCHEDULES", "one_f_one_b")),
    Assignment("tensor_parallel_f_g", 6, 2, 30,
               "minidist/parallel/tensor_layers.py f (CopyToTensorParallelRegion.backward) and "
               "g (ReduceFromTensorParallelRegion.forward)",
               ("minidist/assignments/checks/test_tensor_parallel_f_g.py",),
               hidden=("hidden_tests/test_hidden_tensor_parallel.py",),
               forbidden=("copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region", "CopyToTensorParallelRegion",
                          "ReduceFromTensorParallelRegion", "ColumnParallelLinear", "RowParallelLinear")),
    Assignment("ring_all_reduce", 7, 3, 45,
               "minidist/comm/algorithms.py all_reduce_ring and _ring_reduce_scatter_inplace",
               ("tests/test_comm_sim.py::test_ring_traffic_is_2_n_minus_1_over_n",
                "tests/test_comm_sim.py::test_all_reduce_algorithms"),
               hidden=("hidden_tests/test_hidden_ring.py",),
               forbidden=("reduce_scatter_ring", "all_reduce_naive", "all_reduce_tree", "all_reduce_recursive_doubling",
                          "all_reduce_halving_doubling", "reduce_tree", "reduce_naive", "all_reduce", "reduce_scatter",
                          "allreduce", "Allreduce", "Reduce_scatter", "Reduce_scatter_block", "Allgather", "ALGORITHMS")),
    Assignment("zero1_partition", 8, 3, 45,
               "minidist/parallel/zero.py Zero1Trainer._finish_gradients and all_gather_parameters "
               "(reduce-scatter each unit's gradients, all-gather the updated chunks)",
               # stages 1 and 2 (stage 3 replaces both methods with its own)
               tuple(f"tests/test_parallel_zero.py::test_zero_equals_serial[{world}-{stage}]"
                     for world in ("2", "3", "4", "4 on 2x2") for stage in (1, 2)),
               hidden=("hidden_tests/test_hidden_zero1.py",),
               forbidden=("all_reduce", "allreduce", "Allreduce", "Zero2Trainer", "Zero3Trainer", "DataParallelTrainer")),
    Assignment("mesh_groups", 9, 2, 30, "minidist/parallel/mesh.py axis_groups (the ranks that differ only along some axes) and coordinates; "
               "notebook 09's my_coordinates",
               ("tests/test_mesh.py::test_layout_groups_partition_the_world",
                "tests/test_mesh.py::test_layout_of_eight_ranks_is_megatrons",
                "minidist/assignments/checks/test_notebook_exercises.py"),  # notebook 09's exercise cell
               hidden=("hidden_tests/test_hidden_mesh.py",),
               forbidden=("layout", "Layout", "DeviceMesh", "group_of")),
    Assignment("loss_scaler_update", 10, 2, 20, "minidist/precision/loss_scale.py DynamicLossScaler.update (back off, grow)",
               ("tests/test_loss_scale.py::test_hand_derived_sequence",
                "tests/test_loss_scale.py::test_growth_stops_at_the_largest_float32"),
               hidden=("hidden_tests/test_hidden_loss_scale.py",),
               forbidden=("GradScaler", "amp")),
    Assignment("moe_capacity", 11, 2, 30,
               "minidist/core/moe.py queue_starts and assign_slots (each choice's place in its expert's queue: "
               "first choices first, then by position)",
               ("tests/test_moe.py::test_first_come_first_served_with_first_choices_before_second_choices",
                "tests/test_moe.py::test_slices_of_the_batch_get_the_places_the_whole_batch_gives",
                "tests/test_moe.py::test_tokens_over_capacity_pass_with_zero_output"),
               hidden=("hidden_tests/test_hidden_moe.py",),
               forbidden=("queue_starts", "assign_slots", "Routing", "MoELayer")),
]

BY_NAME = {a.name: a for a in ASSIGNMENTS}
