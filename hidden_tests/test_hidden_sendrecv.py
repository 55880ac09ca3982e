"""Hidden checks of sendrecv (chapter 2), under real mpiexec with 4 ranks: a ring the other way
round and swaps between partners, in a group that numbers the world's ranks backwards (dst and
src are the group's ranks); large messages round a ring and to the rank itself. Every sendrecv
waits at most WAIT seconds: an exchange that deadlocks gives up then, and only its test fails."""
import numpy as np
import pytest

from minidist.comm.launch import run

WAIT = 5       # seconds one sendrecv may take
RANKS = 4
BIG = 1 << 20  # float64 values: 8 MB, which MPI does not buffer


def exchanges():
    """On each rank, what each exchange brought (None: it timed out)."""
    from minidist.comm import CommTimeout, get_world, sendrecv

    world = get_world()
    group = world.split(0, key=world.size - 1 - world.rank)  # group rank g = world rank n - 1 - r
    n, r, g = world.size, world.rank, group.rank

    def backwards():  # small: send to g - 1, receive from g + 1, float32 of an odd size
        got = np.zeros(1001, dtype=np.float32)
        sendrecv(np.arange(1001, dtype=np.float32) + 1000 * g, (g - 1) % n, got, (g + 1) % n, tag=11,
                 group=group, timeout=WAIT)
        return got

    def partner():  # small: swap with the group's partner g ^ 1
        got = np.full(2, -1, dtype=np.int64)
        sendrecv(np.array([r, g], dtype=np.int64), g ^ 1, got, g ^ 1, tag=12, group=group, timeout=WAIT)
        return got

    def ring():  # large, round the world: send to r + 1, receive from r - 1
        got = np.empty(BIG)
        sendrecv(np.full(BIG, r + 0.5), (r + 1) % n, got, (r - 1) % n, tag=21, group=world, timeout=WAIT)
        return float(got.min()), float(got.max())

    def itself():  # large, to the rank itself (its group rank)
        got = np.empty(BIG)
        sendrecv(np.arange(BIG, dtype=np.float64) * (r + 1), g, got, g, tag=22, group=group, timeout=WAIT)
        return float(np.abs(got - np.arange(BIG, dtype=np.float64) * (r + 1)).max())

    results = {"group_rank": g}
    for exchange in (backwards, partner, ring, itself):  # distinct tags: a stuck message matches no later one
        try:
            results[exchange.__name__] = exchange()
        except CommTimeout:
            results[exchange.__name__] = None
    return results


@pytest.fixture(scope="module")
def ranks():
    return run(exchanges, RANKS, timeout=90, env={"MINIDIST_TIMEOUT": str(2 * WAIT)})


def received(ranks, what):
    for r, got in enumerate(ranks):
        assert got[what] is not None, f"rank {r}: the exchange timed out after {WAIT} s (a deadlock?)"
        yield r, got


def test_a_ring_the_other_way_round_brings_the_next_rank_s_data(ranks):
    """Sending to g - 1 and receiving from g + 1 (group ranks), small float32 arrays: each rank
    gets group rank g + 1's array, not g - 1's."""
    for r, got in received(ranks, "backwards"):
        want = np.arange(1001, dtype=np.float32) + 1000 * ((got["group_rank"] + 1) % RANKS)
        np.testing.assert_array_equal(got["backwards"], want, err_msg=f"rank {r}")


def test_ranks_are_the_group_s_own_numbers(ranks):
    """dst and src are group ranks: each rank swaps with its group partner (group rank g ^ 1),
    not with the world rank of that number."""
    world_rank = {got["group_rank"]: r for r, got in enumerate(ranks)}
    for r, got in received(ranks, "partner"):
        partner = got["group_rank"] ^ 1
        assert got["partner"].tolist() == [world_rank[partner], partner], f"rank {r}"


def test_large_messages_round_a_ring_of_four_do_not_deadlock(ranks):
    """8 MB round a ring of 4 ranks, each rank sending and receiving at once: every rank gets its
    left neighbour's array, within the time limit."""
    for r, got in received(ranks, "ring"):
        assert got["ring"] == ((r - 1) % RANKS + 0.5,) * 2, f"rank {r}"


def test_a_rank_sends_a_large_message_to_itself(ranks):
    """dst = src = the rank itself (its group rank), 8 MB: only a receive posted before waiting on
    the send completes."""
    for r, got in received(ranks, "itself"):
        assert got["itself"] == 0.0, f"rank {r} received another array than its own"
