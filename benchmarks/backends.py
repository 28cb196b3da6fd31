"""The backends the benchmark compares, each behind one small interface:
``allreduce(value, fn)``, ``allreduce_async(value, fn) -> object with .result()``,
``broadcast(value)``, ``close()``; and for point to point (``bench.py --p2p``),
``send(value, dest)`` and ``recv(source)``, with ``PairFloor`` as their floor.
Each worker process builds one. A backend with ``arrays_only`` runs only the
allreduces of float32 arrays (``MPI4PyBuffer``, ``Gloo``; ``shm_floor.py``,
the shared-memory floor, is a script of its own)."""

from __future__ import annotations

import os
import pickle
import threading
import time
from typing import Any, Callable

import zmq


class Done:
    """A future that is already resolved (backends without async calls)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def result(self, timeout: float | None = None) -> Any:
        return self.value


class ZCollective:
    def __init__(self, rank: int, size: int, port: int, secret: str | None = None) -> None:
        import zcollective

        self.zc = zcollective
        zcollective.initialize("127.0.0.1", port, rank, size, timeout=120, secret=secret)
        self.allreduce = zcollective.allreduce
        self.allreduce_async = zcollective.allreduce_async
        self.broadcast = zcollective.broadcast

    def send(self, value: Any, dest: int) -> None:
        self.zc.send(value, dest, 0)

    def recv(self, source: int) -> Any:
        return self.zc.recv(source, 0)

    def close(self) -> None:
        self.zc.teardown()


class PairFloor:
    """The point-to-point floor: two bare PAIR sockets over TCP (rank 0 binds),
    pickle protocol 5 with out-of-band buffers sent without a copy, no checks:
    a small object is ``pickle.dumps(obj, protocol=5)``, an array a short
    pickle and its bytes as a frame of their own."""

    def __init__(self, rank: int, size: int, port: int) -> None:
        if size != 2:
            raise ValueError("the PAIR floor joins exactly two ranks")
        self.ctx = zmq.Context()
        self.pair = self.ctx.socket(zmq.PAIR)
        if rank == 0:
            self.pair.bind(f"tcp://127.0.0.1:{port}")
        else:
            self.pair.connect(f"tcp://127.0.0.1:{port}")

    def send(self, value: Any, dest: int) -> None:
        self.pair.send_multipart(dumps(value), copy=False)

    def recv(self, source: int) -> Any:
        frames = self.pair.recv_multipart(copy=False)
        return pickle.loads(frames[0], buffers=frames[1:])

    def close(self) -> None:
        self.pair.close(linger=1000)
        self.ctx.term()


class Floor:
    """The bare star: ROUTER at rank 0 in a thread, a DEALER per rank (rank 0's
    too, over TCP), pickle protocol 5 with out-of-band buffers, no checks."""

    def __init__(self, rank: int, size: int, port: int, fns: dict[str, Callable[[Any, Any], Any]]) -> None:
        self.ctx = zmq.Context()
        self.fns = fns
        self.size = size
        if rank == 0:
            ready = threading.Event()
            self.server = threading.Thread(target=self._serve, args=(port, ready), daemon=True)
            self.server.start()
            ready.wait(10)
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.ROUTING_ID, b"r%d" % rank)
        self.dealer.connect(f"tcp://127.0.0.1:{port}")
        self.dealer.send_multipart([b"hello"])
        self.dealer.recv_multipart()  # everyone connected

    def _serve(self, port: int, ready: threading.Event) -> None:
        router = self.ctx.socket(zmq.ROUTER)
        router.bind(f"tcp://127.0.0.1:{port}")
        ready.set()
        peers = [router.recv_multipart()[0] for _ in range(self.size)]
        for peer in peers:
            router.send_multipart([peer, b"go"])
        order = sorted(peers, key=lambda p: int(p[1:]))
        pending: dict[bytes, list[list[Any]]] = {}
        while True:
            frames = router.recv_multipart(copy=False)
            peer = frames[0].bytes
            pending.setdefault(peer, []).append(frames[1:])
            if all(pending.get(p) for p in order):
                contributions = [pending[p].pop(0) for p in order]
                op = contributions[0][0].bytes
                if op == b"stop":
                    break
                if op == b"bcast":
                    out = contributions[0][1:]
                else:
                    fn = self.fns[op.decode()]
                    values = [pickle.loads(c[1], buffers=c[2:]) for c in contributions]
                    acc = values[0]
                    for v in values[1:]:
                        acc = fn(acc, v)
                    out = dumps(acc)
                for p in order:
                    router.send_multipart([p, *out], copy=False)
        router.close(linger=1000)

    def allreduce_async(self, value: Any, fn: str) -> Any:
        self.dealer.send_multipart([fn.encode(), *dumps(value)], copy=False)
        return self

    def result(self, timeout: float | None = None) -> Any:
        frames = self.dealer.recv_multipart(copy=False)
        return pickle.loads(frames[0], buffers=frames[1:])

    def allreduce(self, value: Any, fn: str) -> Any:
        return self.allreduce_async(value, fn).result()

    def broadcast(self, value: Any) -> Any:
        self.dealer.send_multipart([b"bcast", *dumps(value)], copy=False)
        return self.result()

    def close(self) -> None:
        self.dealer.send_multipart([b"stop", b""])
        time.sleep(0.2)
        self.dealer.close(linger=0)


def dumps(value: Any) -> list[Any]:
    buffers: list[Any] = []
    main = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    return [main, *(b.raw() for b in buffers)]


class AdaptDL:
    def __init__(self, rank: int, size: int, port: int) -> None:
        import logging

        from adaptdl.reducer import Reducer

        logging.getLogger("adaptdl.reducer").setLevel(logging.WARNING)
        if rank != 0:
            time.sleep(1.0)  # adaptdl sleeps 5 s after a refused connect; let rank 0 bind first
        self.reducer = Reducer(rank, size, "127.0.0.1", port)
        self.allreduce = self.reducer.allreduce
        self.allreduce_async = self.reducer.allreduce_async
        self.broadcast = self.reducer.broadcast

    def close(self) -> None:
        self.reducer.allreduce(0)


class Torch:
    """torch.distributed's object collectives on gloo: all_gather_object and a
    rank-order reduce (there is no allreduce for objects), broadcast_object_list."""

    def __init__(self, rank: int, size: int, port: int) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.size = size
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=size)

    def allreduce(self, value: Any, fn: Callable[[Any, Any], Any]) -> Any:
        values: list[Any] = [None] * self.size
        self.dist.all_gather_object(values, value)
        acc = values[0]
        for v in values[1:]:
            acc = fn(acc, v)
        return acc

    def allreduce_async(self, value: Any, fn: Callable[[Any, Any], Any]) -> Done:
        return Done(self.allreduce(value, fn))  # no async object collectives

    def broadcast(self, value: Any) -> Any:
        box = [value]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        self.dist.barrier()
        self.dist.destroy_process_group()


class MPI4Py:
    """mpi4py's lowercase (pickle-based) API under Open MPI."""

    def __init__(self, rank: int, size: int, port: int) -> None:
        from mpi4py import MPI

        self.comm = MPI.COMM_WORLD
        self.ops: dict[Any, Any] = {}

    def allreduce(self, value: Any, fn: Callable[[Any, Any], Any]) -> Any:
        from mpi4py import MPI

        op = self.ops.get(fn)
        if op is None:
            op = self.ops[fn] = MPI.Op.Create(lambda a, b, datatype=None: fn(a, b), commute=False)
        return self.comm.allreduce(value, op=op)

    def allreduce_async(self, value: Any, fn: Callable[[Any, Any], Any]) -> Done:
        return Done(self.allreduce(value, fn))  # no non-blocking object allreduce

    def broadcast(self, value: Any) -> Any:
        return self.comm.bcast(value, root=0)

    def send(self, value: Any, dest: int) -> None:
        self.comm.send(value, dest=dest, tag=0)

    def recv(self, source: int) -> Any:
        return self.comm.recv(source=source, tag=0)

    def close(self) -> None:
        self.comm.Barrier()


class MPI4PyBuffer:
    """mpi4py's buffer ``Allreduce`` (a C sum of numpy buffers, through Open MPI's shared
    memory on one host) into a new array, as an allreduce returning its result must."""

    arrays_only = True

    def __init__(self, rank: int, size: int, port: int) -> None:
        from mpi4py import MPI

        self.MPI, self.comm = MPI, MPI.COMM_WORLD

    def allreduce(self, value: Any, fn: Any) -> Any:
        import numpy as np

        out = np.empty_like(value)
        self.comm.Allreduce(value, out, op=self.MPI.SUM)
        return out

    def close(self) -> None:
        self.comm.Barrier()


class Gloo:
    """torch.distributed's tensor ``all_reduce`` on gloo: in place, on the tensor sharing
    the array's memory (the array passed is a fresh copy: the benchmark's, untimed)."""

    arrays_only = True

    def __init__(self, rank: int, size: int, port: int) -> None:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # N replicas share the cores: torch's own threads would fight them
        self.dist, self.torch = dist, torch
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=size)

    def allreduce(self, value: Any, fn: Any) -> Any:
        tensor = value if isinstance(value, self.torch.Tensor) else self.torch.from_numpy(value)
        self.dist.all_reduce(tensor)
        return value

    def close(self) -> None:
        self.dist.barrier()
        self.dist.destroy_process_group()


def rank_from_mpi() -> tuple[int, int]:
    for rank_var, size_var in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE")):
        if rank_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    raise RuntimeError("not started by mpirun")
