"""The tour's idle ranks wait for the serial run as long as it takes: an expected wait is not a
deadlock, so it does not run under the communication timeout (chapter 2), under real mpiexec."""
import time

from minidist.comm.launch import run

SMALL = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "16", "--batch-size", "8",
         "--log-every", "-1"]


def serial_part_of_the_tour(steps):
    import minidist.comm as dist
    from minidist import demo
    from minidist.training.layout import Layout

    args = demo.build_parser().parse_args([*SMALL, "--steps", str(steps)])
    config, task, _ = demo.check_args(args, 2)
    world = dist.get_world()
    dist.set_wait_policy(timeout=0.05)  # far shorter than the serial run below
    start = time.perf_counter()
    result = demo.run(Layout(), args, config, task, world, show=False, ranks=[0])
    return time.perf_counter() - start, len(result.get("losses", []))


def test_idle_ranks_outwait_the_timeout():
    (elapsed0, losses0), (elapsed1, losses1) = run(serial_part_of_the_tour, 2, 200, timeout=120)
    assert losses0 == 200 and losses1 == 0  # rank 0 trained, rank 1 only waited
    assert elapsed1 > 0.25, f"the serial run took only {elapsed1:.2f} s: the wait was never longer than the timeout"
