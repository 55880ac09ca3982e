"""Graded check for Megatron's f and g (chapter 6): the tensor-parallel GPT on 2 ranks reproduces
the serial run in float64 (the second step's loss needs f's backward all-reduce, every loss
needs g's forward one), over the default all-reduce (not chapter 7's ring)."""
import numpy as np

from minidist.assignments.checks import demo


def test_two_tensor_parallel_ranks_equal_serial(tmp_path):
    serial = demo([], tmp_path / "serial.json")
    parallel = demo(["--tp", "2"], tmp_path / "tp.json", nprocs=2)
    assert len(parallel["losses"]) == len(serial["losses"]) == 2
    np.testing.assert_allclose(parallel["losses"], serial["losses"], rtol=1e-9)
