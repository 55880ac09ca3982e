"""The traffic counters' cheap path: a collective holds a per-kind Counter and adds to it."""
from minidist.comm import traffic


def test_counter_is_shared_and_reset_in_place():
    traffic.reset()
    c = traffic.counter("all_reduce.test")
    assert traffic.counter("all_reduce.test") is c  # one Counter per kind
    c.calls += 1
    c.bytes_sent += 100
    c.messages += 1
    traffic.record_recv("all_reduce.test", 60)
    snap = traffic.snapshot()
    assert snap["all_reduce.test"] == dict(bytes_sent=100, bytes_received=60, messages=1,
                                           messages_received=1, calls=1)
    assert snap["total"]["bytes_sent"] == 100
    traffic.reset()  # a collective in flight keeps counting into the same, zeroed Counter
    assert "all_reduce.test" not in traffic.snapshot()  # kinds with nothing counted are left out
    c.messages += 1
    assert traffic.snapshot()["all_reduce.test"]["messages"] == 1
    traffic.reset()
