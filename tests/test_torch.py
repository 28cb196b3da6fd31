"""CPU torch tensors travel as numpy arrays do: their bytes out of band, without
copies, rebuilt writable with the same dtype and shape. Skipped without torch
(``pip install torch --index-url https://download.pytorch.org/whl/cpu``)."""

import os
import pickle
import subprocess
import sys
import textwrap
import warnings

import pytest
import zmq

import zcollective as zc
from zcollective._format import _serialize
from zcollective.testing import run_replicas

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = ["float32", "float64", "float16", "bfloat16", "bool", "int8", "int16", "int32", "int64", "uint8",
          "uint16", "uint32", "uint64", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2"]
LARGE = 1 << 17  # bytes: above the in-band limit, so the buffer is a frame of its own


def random_tensor(dtype, shape):
    """Any bit pattern (NaNs included) for numbers; 0 or 1 for bool."""
    if dtype is torch.bool:
        return torch.rand(shape) > 0.5
    count = torch.Size(shape).numel() * dtype.itemsize
    return torch.randint(0, 256, (count,), dtype=torch.uint8).view(dtype).reshape(shape)


def same_bytes(a, b):
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def address(buffer):
    return torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()  # frombuffer shares, never copies


@pytest.fixture(scope="module")
def through_frames():
    """Send a segment and return it as a receiver holds it: zmq frames, sent
    and received without copies (as the library's sockets do)."""
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://test-torch")
    b.connect("inproc://test-torch")

    def send(segment):
        a.send_multipart(segment, copy=False)
        assert b.poll(10_000), "the frames did not arrive"
        return b.recv_multipart(copy=False)
    yield send
    a.close(linger=0)
    b.close(linger=0)
    ctx.term()


@pytest.mark.parametrize("dtype", [d for d in DTYPES if hasattr(torch, d)])
@pytest.mark.parametrize("shape", [(3, 5), (), (0, 4), "large"])
def test_every_dtype_round_trips_with_its_shape(dtype, shape, through_frames):
    dtype = getattr(torch, dtype)
    if shape == "large":
        shape = (4, LARGE // 4 // dtype.itemsize)
    tensor = random_tensor(dtype, shape)
    segment = _serialize.dumps(tensor)
    assert len(segment) == (2 if tensor.nbytes >= _serialize.INBAND_MAX_BYTES else 1)
    assert b"_rebuild_tensor" not in segment[0]  # not torch's own pickling
    out = _serialize.loads(through_frames(segment))
    assert type(out) is torch.Tensor and out.dtype == dtype and out.shape == tensor.shape
    assert same_bytes(out, tensor)


def test_large_tensor_is_one_frame_that_is_the_tensors_memory(through_frames):
    tensor = torch.rand(4 << 20)  # 16 MiB
    segment = _serialize.dumps(tensor)
    assert len(segment) == 2 and len(segment[0]) < 200  # the pickle holds no data
    assert address(segment[1]) == tensor.data_ptr() and memoryview(segment[1]).nbytes == 16 << 20
    assert _serialize.loads(segment).data_ptr() == tensor.data_ptr()  # nor is the data copied back
    received = through_frames(segment)
    out = _serialize.loads(received)
    assert out.data_ptr() == address(received[1])  # the tensor is the received frame
    assert torch.equal(out, tensor)


def test_rebuilt_tensors_are_writable_and_add_in_place(through_frames):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when it wraps a read-only buffer
        for size in (10, LARGE):  # in band, out of band
            a = _serialize.loads(through_frames(_serialize.dumps(torch.ones(size))))
            b = _serialize.loads(through_frames(_serialize.dumps(torch.full((size,), 2.0))))
            where = a.data_ptr()
            assert zc.default_reduce_fn(a, b) is a and a.data_ptr() == where
            assert torch.equal(a, torch.full((size,), 3.0))
        segment = _serialize.dumps(torch.ones(LARGE))  # a read-only buffer gets a copy of its own
        out = _serialize.loads([segment[0], bytes(segment[1])])
        out += 1
        assert torch.equal(out, torch.full((LARGE,), 2.0))


def test_misaligned_buffer_is_copied_to_an_aligned_tensor():
    tensor = torch.arange(LARGE // 8, dtype=torch.float64)
    segment = _serialize.dumps(tensor)
    shifted = memoryview(bytearray(LARGE + 1))[1:]
    shifted[:] = memoryview(segment[1]).cast("B")
    out = _serialize.loads([segment[0], shifted])
    assert out.data_ptr() % 8 == 0 and torch.equal(out, tensor)


def test_one_tensor_twice_travels_once():
    tensor = torch.rand(LARGE // 4)
    segment = _serialize.dumps([tensor, tensor, {"again": tensor}])
    assert len(segment) == 2
    a, b, c = _serialize.loads(segment)
    assert a is b is c["again"]


def test_non_contiguous_tensor_arrives_contiguous_with_only_its_own_elements():
    storage = torch.rand(512, 512)  # 1 MiB
    column = storage[:, :3]  # 6 KiB visible; torch's pickle would send the whole 1 MiB storage
    transposed = torch.rand(64, 1024).T
    for tensor in (column, transposed):
        assert not tensor.is_contiguous()
        segment = _serialize.dumps(tensor)
        out = _serialize.loads(segment)
        assert out.is_contiguous() and out.shape == tensor.shape and torch.equal(out, tensor)
        assert sum(memoryview(f).nbytes for f in segment) < tensor.nbytes + 200
    assert len(pickle.dumps(column)) > storage.nbytes
    assert len(_serialize.dumps(transposed)) == 2  # made contiguous, then out of band


def test_conjugate_and_negative_views_arrive_resolved():
    z = torch.randn(8, dtype=torch.complex64)
    for view in (z.conj(), torch._neg_view(z)):
        out = _serialize.loads(_serialize.dumps(view))
        assert not out.is_conj() and not out.is_neg() and torch.equal(out, view)


def test_requires_grad_tensor_pickles_as_torch_does():
    leaf = torch.rand(LARGE // 4, requires_grad=True)
    segment = _serialize.dumps(leaf)
    assert len(segment) == 1 and b"_rebuild_tensor" in segment[0]  # torch's pickling, in band
    out, ref = _serialize.loads(segment), pickle.loads(pickle.dumps(leaf))
    for t in (out, ref):
        assert t.requires_grad and t.is_leaf and torch.equal(t.detach(), leaf.detach())
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        zc.default_reduce_fn(out, out)  # as with pickle: send .detach() to reduce in place
    assert _serialize.loads(_serialize.dumps(leaf * 2)).requires_grad  # a non-leaf arrives as a leaf


def test_subclasses_and_tensors_with_attributes_pickle_as_torch_does():
    param = torch.nn.Parameter(torch.rand(3), requires_grad=False)
    tagged = torch.rand(3)
    tagged.tag = "weights"
    out_param, out_tagged = _serialize.loads(_serialize.dumps([param, tagged]))
    assert type(out_param) is torch.nn.Parameter and torch.equal(out_param, param)
    assert out_tagged.tag == "weights" and torch.equal(out_tagged, tagged)


def tensor_operations():
    r, n = zc.get_rank(), zc.get_world_size()
    tri = n * (n + 1) // 2
    out = {}
    total = zc.allreduce(torch.full((4, 1000), float(r + 1)))
    assert total.dtype == torch.float32 and total.shape == (4, 1000)
    total += 1  # results are the caller's to mutate
    out["float32"] = total[0, 0].item()
    big = zc.allreduce(torch.full((4 << 20,), r + 1, dtype=torch.float32))  # 16 MiB, out of band
    out["big"] = (big[0].item(), big[-1].item(), tuple(big.shape), big.dtype is torch.float32)
    half = zc.allreduce(torch.full((3, 3), r + 1, dtype=torch.bfloat16))
    out["bfloat16"] = (str(half.dtype), half.sum().item())
    longs = zc.allreduce(torch.arange(LARGE // 8, dtype=torch.int64) * (r + 1))
    out["int64"] = (str(longs.dtype), longs[1].item(), longs[-1].item() == (LARGE // 8 - 1) * tri)
    flags = zc.allreduce(torch.tensor([r == 0, r == 1, False]), lambda a, b: a | b)
    out["bool"] = (str(flags.dtype), flags.tolist())
    value = torch.arange(6, dtype=torch.float16).reshape(2, 3)
    got = zc.broadcast(value if r == 0 else None)
    out["broadcast"] = (got is value) if r == 0 else (str(got.dtype), got.tolist())
    mine = torch.full((LARGE // 4,), r, dtype=torch.int32)
    everyone = zc.allgather(mine)
    assert everyone[r] is mine  # one's own value is never a copy
    out["allgather"] = [(str(t.dtype), t[0].item(), t.shape[0]) for t in everyone]
    strided = zc.broadcast(torch.arange(12.0).reshape(3, 4).T if r == 0 else None)
    out["transposed"] = (strided.is_contiguous(), strided.tolist())
    grads = zc.allgather(torch.ones(2, requires_grad=True))
    out["requires_grad"] = [t.requires_grad for t in grads]
    try:
        zc.allreduce(torch.ones(2, requires_grad=True))  # in place on a leaf, as under pickle
    except zc.RemoteError as exc:
        out["reduce_grad"] = exc.remote_message
    try:  # broadcasting would have returned a (3,) of 6 (issue 26): torch and MPI refuse too
        zc.allreduce(torch.ones(1) if r == 1 else torch.ones(3))
    except zc.CallMismatchError as exc:
        out["shapes"] = str(exc)
    return out


def test_operations_on_tensors_between_processes():
    n = 3  # rank 0 and two remote ranks; each process imports torch (~2 s of CPU)
    tri = n * (n + 1) // 2
    transposed = torch.arange(12.0).reshape(3, 4).T.tolist()
    for r, out in enumerate(run_replicas(tensor_operations, n, timeout=90)):
        assert out["float32"] == tri + 1
        assert out["big"] == (tri, tri, (4 << 20,), True)
        assert out["bfloat16"] == ("torch.bfloat16", 9.0 * tri)
        assert out["int64"] == ("torch.int64", tri, True)
        assert out["bool"] == ("torch.bool", [True, n > 1, False])
        assert out["broadcast"] == (True if r == 0 else ("torch.float16", [[0, 1, 2], [3, 4, 5]]))
        assert out["allgather"] == [("torch.int32", i, LARGE // 4) for i in range(n)]
        assert out["transposed"] == (r != 0, transposed)  # the root has its own view back
        assert out["requires_grad"] == [True] * n
        assert "leaf Variable that requires grad" in out["reduce_grad"]
        assert ("rank 1 passed a torch.float32 array of shape (1,) reduced with add at test_torch.py:"
                in out["shapes"] and "ranks 0,2 passed a torch.float32 array of shape (3,)" in out["shapes"])


def tensor_reduce_scatter():
    r, n = zc.get_rank(), zc.get_world_size()
    parts = [torch.full((1000, 100), float(10 * r + i)) for i in range(n)]  # 400 KB each
    mine = zc.reduce_scatter(parts)
    grads = zc.reduce_scatter([torch.ones(3, requires_grad=True) for _ in range(n)],
                              lambda a, b: a.detach() + b.detach())  # the star: pickled as torch does
    return (type(mine).__name__, str(mine.dtype), tuple(mine.shape), mine[0, 0].item(),
            zc._current()._life.here.data, grads.tolist())


@pytest.mark.parametrize("plane", ["off", "on"])
def test_reduce_scatter_of_tensors_gives_each_rank_its_share_as_a_tensor(plane):
    n = 3
    env = {"ZCOLLECTIVE_DATA_PLANE": plane, "ZCOLLECTIVE_DATA_PLANE_MIN_BYTES": "1024",
           "ZCOLLECTIVE_SHARED_MEMORY_MIN_BYTES": "off"}
    for r, out in enumerate(run_replicas(tensor_reduce_scatter, n, env=env, timeout=90)):
        assert out == ("Tensor", "torch.float32", (1000, 100), float(10 * sum(range(n)) + n * r),
                       plane == "on", [float(n)] * 3)


NO_TORCH_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import zcollective
    from zcollective._format import _serialize
    from zcollective.testing import run_replicas

    array = _serialize.loads(_serialize.dumps(np.ones(1 << 20)))
    assert array.sum() == 1 << 20
    def replica():
        return float(zcollective.allreduce(np.ones(1 << 17))[0]), "torch" in sys.modules
    seen = run_replicas(replica, 2)
    print(seen, "torch" in sys.modules)
""")


def test_torch_is_not_imported_unless_a_tensor_is_sent():
    proc = subprocess.run([sys.executable, "-c", NO_TORCH_SCRIPT], cwd=ROOT, capture_output=True, text=True,
                          timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.split("\n")[0] == "[(2.0, False), (2.0, False)] False"


def tensors_point_to_point():
    r = zc.get_rank()
    if r == 0:
        sent = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB: out of band
        zc.send(sent, 1, tag=3)
        sent += 1  # send returned: the tensor is ours to change again
        return zc.recv(1, 4)
    got = zc.recv(0, 3)
    ok = type(got) is torch.Tensor and got.dtype == torch.float32 and float(got[-1]) == (1 << 18) - 1
    got += 1  # writable, in place
    zc.send(torch.tensor([float(got[-1]), float(ok)]), 0, tag=4)
    return None


def test_tensors_go_point_to_point_and_arrive_writable():
    received = run_replicas(tensors_point_to_point, 2)[0]
    assert received.tolist() == [float(1 << 18), 1.0]


def tensors_through_shared_memory():
    import numpy as np

    from zcollective._protocol import _ops

    r = zc.get_rank()
    assert zc._current()._life.shared is not None, "no shared memory on one host"
    out = {}
    for dtype in (torch.float32, torch.int64, torch.float16):
        t = torch.full((300, 100), r + 1, dtype=dtype)
        seen = _ops._array(t, 0)  # what is copied into the slot: the tensor's own memory
        assert np.shares_memory(seen, t.numpy()), "the tensor was copied before its slot"
        res = zc.allreduce(t)
        res += 1  # the caller's own, writable
        out[str(dtype)] = (type(res).__name__, str(res.dtype), tuple(res.shape), float(res[-1, -1]))
    out["sent"] = zc.stats()["ops"]["allreduce"]["bytes_sent"]
    return out


def test_cpu_tensors_go_through_shared_memory_and_come_back_as_tensors():
    outs = run_replicas(tensors_through_shared_memory, 2, timeout=90)
    assert outs[0] == outs[1]
    for dtype in ("torch.float32", "torch.int64", "torch.float16"):
        assert outs[0][dtype] == ("Tensor", dtype, (300, 100), 4.0)
    assert outs[0]["sent"] < 2000, outs[0]["sent"]  # descriptions, not tensors
