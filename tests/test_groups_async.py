"""Group objects, two groups in one process, futures as concurrent.futures and
asyncio see them."""

import asyncio
import os
import select

import pytest
import zmq
from conftest import touch, wait_for

import zcollective as zc
import zcollective._future
from zcollective.testing import free_port, run_replicas


def two_groups(port_a, port_b):
    rank = int(os.environ["ZCOLLECTIVE_REPLICA_RANK"])
    # a data-parallel group of all three, and a control group of ranks 1 and 2
    # with rank 2 as its rank 0: independent sequences, sockets and coordinators
    with zc.Group(master_port=port_a, rank=rank, size=3) as data:
        control = None
        if rank > 0:
            control = zc.Group(master_port=port_b, rank=2 - rank, size=2)
        f_data = data.allreduce_async(rank)
        got = {"data": data.allgather(rank), "size": (data.rank, data.size)}
        if control is not None:
            got["control"] = control.allgather(rank)
            got["control_rank"] = (control.rank, control.size)
            got["control_sum"] = control.allreduce_async(10 * rank).result(timeout=30)
            control.teardown()
            assert control.closed
        got["async"] = f_data.result(timeout=30)
    assert data.closed
    with pytest.raises(RuntimeError, match="torn down"):
        data.barrier()
    return got


def test_a_process_can_hold_two_independent_groups():
    outs = run_replicas(two_groups, 3, free_port(), free_port(), initialize=False)
    assert [o["data"] for o in outs] == [[0, 1, 2]] * 3
    assert [o["async"] for o in outs] == [3, 3, 3]
    assert [o["size"] for o in outs] == [(0, 3), (1, 3), (2, 3)]
    assert outs[1]["control"] == [2, 1] and outs[2]["control"] == [2, 1]
    assert outs[1]["control_rank"] == (1, 2) and outs[2]["control_rank"] == (0, 2)
    assert outs[1]["control_sum"] == outs[2]["control_sum"] == 30
    assert "control" not in outs[0]


def futures_like_concurrent():
    r = zc.get_rank()
    seen = []
    f = zc.allgather_async(r)
    f.add_done_callback(lambda fut: seen.append(("cb", fut.result())))
    g = zc.allreduce_async(r, lambda a, b: a / 0)
    assert g.exception(timeout=30) is not None and g.done()
    assert f.done() and seen == [("cb", [0, 1, 2])]
    f.add_done_callback(lambda fut: seen.append("late"))  # runs at once when already done
    assert seen[-1] == "late"
    assert not f.cancel() and not f.cancelled() and not f.running()
    with pytest.raises(zc.RemoteError, match="ZeroDivisionError"):
        g.result()
    return type(g.exception()).__name__


def test_futures_behave_like_concurrent_futures():
    assert run_replicas(futures_like_concurrent, 3) == ["RemoteError"] * 3


def awaited():
    r = zc.get_rank()

    async def main():
        ticks = 0

        async def ticker():  # proves the loop is not blocked while we await
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        tick_task = asyncio.create_task(ticker())
        if r == 1:
            await asyncio.sleep(0.5)  # the others wait in `await` meanwhile
        futures = [zc.allreduce_async(i + r) for i in range(3)]
        b = zc.broadcast_async("root says hi", root=2)
        results = [await futures[2], await futures[0], await futures[1], await b]
        gathered = await asyncio.gather(zc.allgather_async(r), zc.scatter_async([7, 8, 9], root=0))
        tick_task.cancel()
        return results, gathered, ticks

    results, gathered, ticks = asyncio.run(main())
    return results, gathered, ticks


def test_futures_are_awaitable_without_blocking_the_event_loop():
    outs = run_replicas(awaited, 3)
    for r, (results, gathered, ticks) in enumerate(outs):
        assert results == [9, 3, 6, "root says hi"]
        assert gathered == [[0, 1, 2], [7, 8, 9][r]]
        if r != 1:
            assert ticks >= 10, ticks  # the loop ran while this rank awaited rank 1


# Long enough that a future left to the recheck timer would outlast every bound below:
# each future must be woken by its own call finishing.
SLOW_RECHECK_S = 30


def gathered(markers):
    zcollective._future.ASYNC_RECHECK_S = SLOW_RECHECK_S
    r = zc.get_rank()

    async def main():
        many = await asyncio.wait_for(asyncio.gather(*[zc.allreduce_async(i) for i in range(100)]), 10)
        pairs = []
        for step in range(5):
            pair = asyncio.gather(zc.allreduce_async(step + r), zc.allgather_async(r))
            pairs.append(await asyncio.wait_for(pair, 10))
        readers_left = len(zcollective._future._waiters)
        # an await given up on (rank 1 comes late) leaves the group's reader too
        if r == 1:
            wait_for(*(os.path.join(markers, f"gave-up{k}") for k in (0, 2)))
        late = zc.allreduce_async(r)
        gave_up = False
        try:
            await asyncio.wait_for(late, 0.2)
        except asyncio.TimeoutError:
            gave_up = True
            readers_left += len(zcollective._future._waiters)
            touch(os.path.join(markers, f"gave-up{r}"))
        return many, pairs, gave_up, await asyncio.wait_for(late, 10), readers_left

    return asyncio.run(main())


def test_futures_awaited_together_each_wake_when_their_call_finishes(tmp_path):
    outs = run_replicas(gathered, 3, str(tmp_path), timeout=40)
    for r, (many, pairs, gave_up, late, readers_left) in enumerate(outs):
        assert many == [3 * i for i in range(100)]
        assert pairs == [[3 * step + 3, [0, 1, 2]] for step in range(5)]
        assert late == 3
        assert readers_left == 0
        if r != 1:
            assert gave_up  # it waited for rank 1, then left while its call was pending


def sent_while_awaiting(port_a, port_b, markers):
    """Rank 1 awaits its first call's result in a task while its loop is
    blocked; the result reaches its socket (ZeroMQ signals the fd the task
    sleeps on); then it sends a second call, which makes ZeroMQ take in its
    commands and so swallows that edge: the result waits in the socket with
    nothing left to wake the task, but the send itself."""
    zcollective._future.ASYNC_RECHECK_S = SLOW_RECHECK_S
    rank = int(os.environ["ZCOLLECTIVE_REPLICA_RANK"])
    with zc.Group(master_port=port_a, rank=rank, size=3) as data, \
            zc.Group(master_port=port_b, rank=rank, size=3) as control:
        async def main():
            if rank != 1:
                wait_for(os.path.join(markers, "asleep1"))  # so its result comes only then
                got = await asyncio.wait_for(data.allreduce_async(rank), 10)
                touch(os.path.join(markers, f"first{rank}"))  # rank 0 sent every rank its result
                control.barrier(timeout=20)  # no traffic on `data` until rank 1 has its result
                return got, await asyncio.wait_for(data.allreduce_async(rank), 10), None

            async def await_first():
                return await first

            first = data.allreduce_async(rank)
            awaiting = asyncio.create_task(await_first())
            await asyncio.sleep(0)  # it runs up to its `await`, asleep on the group's reader
            touch(os.path.join(markers, "asleep1"))
            # the loop blocked from here to the send: the task cannot take the result in
            wait_for(*(os.path.join(markers, f"first{r}") for r in (0, 2)))
            dealer = data._life.driver.dealer
            arrived = bool(select.select([dealer.FD], [], [], 10)[0])  # the edge the task sleeps on
            second = data.allreduce_async(rank)
            scenario = {"arrived": arrived, "edge left": bool(select.select([dealer.FD], [], [], 0)[0]),
                        "waiting in the socket": bool(dealer.getsockopt(zmq.EVENTS) & zmq.POLLIN),
                        "taken in": first._done}
            got = await asyncio.wait_for(awaiting, 10)
            control.barrier(timeout=20)
            return got, await asyncio.wait_for(second, 10), scenario

        return asyncio.run(main())


def test_a_call_sent_while_others_await_does_not_hide_their_results(tmp_path):
    outs = run_replicas(sent_while_awaiting, 3, free_port(), free_port(), str(tmp_path),
                        initialize=False, timeout=40)
    assert [out[:2] for out in outs] == [(3, 3)] * 3
    # the case this test is for happened: a result in the socket, its edge swallowed by the send
    assert outs[1][2] == {"arrived": True, "edge left": False, "waiting in the socket": True,
                          "taken in": False}, outs[1][2]


def test_rank_and_size_at_module_level_and_on_a_group():
    outs = run_replicas(lambda: (zc.get_rank(), zc.get_world_size(), zc.is_initialized()), 2)
    assert outs == [(0, 2, True), (1, 2, True)]
    with zc.Group(size=1) as g:
        assert (g.rank, g.size) == (0, 1)
