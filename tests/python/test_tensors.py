"""Tensors in and out over DLPack: zero copy, every dtype, clear errors."""

import pytest

torch = pytest.importorskip("torch")
import numpy  # noqa: E402

import paramcast  # noqa: E402
from paramcast import _core  # noqa: E402
from paramcast._tensors import for_dlpack, to_framework  # noqa: E402
from cluster import config_dict  # noqa: E402

TORCH_DTYPES = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "BOOL": torch.bool,
}
FP8 = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def import_torch(name, t):
    obj, dtype, _ = for_dlpack(t)
    return _core.check_tensor(name, obj, dtype)


@pytest.mark.parametrize("pc_dtype", sorted(TORCH_DTYPES))
def test_torch_dtypes_map_both_ways_without_copies(pc_dtype):
    t = torch.zeros(3, 5, dtype=TORCH_DTYPES[pc_dtype])
    dtype, shape, device, ptr = import_torch("w", t)
    assert (dtype, shape, device, ptr) == (pc_dtype, [3, 5], "cpu", t.data_ptr())

    # Out: a ParamCast buffer lent to torch shares its bytes.
    size = t.element_size() * t.numel()
    buf = bytearray(range(size)) if pc_dtype != "BOOL" else bytearray([1, 0] * 7 + [1])
    ref = _core.export_bytes_for_test(buf, pc_dtype, [3, 5])
    out = to_framework(ref)
    assert out.dtype == TORCH_DTYPES[pc_dtype] and list(out.shape) == [3, 5]
    assert bytes(out.view(torch.uint8).flatten().tolist()) == bytes(buf)
    buf[0] ^= 1
    assert out.view(torch.uint8).flatten()[0].item() == buf[0], "the torch tensor must share the buffer"


@pytest.mark.parametrize("pc_dtype", sorted(FP8))
def test_fp8_dtypes(pc_dtype):
    if not hasattr(torch, FP8[pc_dtype]):
        pytest.skip(f"torch {torch.__version__} has no torch.{FP8[pc_dtype]}; {pc_dtype} arrives as uint8")
    t = torch.zeros(4, dtype=getattr(torch, FP8[pc_dtype]))
    assert import_torch("w", t)[0] == pc_dtype
    buf = bytearray(4)
    out = to_framework(_core.export_bytes_for_test(buf, pc_dtype, [4]))
    assert out.dtype == getattr(torch, FP8[pc_dtype])


def test_fp8_without_torch_support_arrives_as_bytes():
    buf = bytearray(b"\x01\x02")  # lent, not copied: it must outlive `out`
    out = to_framework(_core.export_bytes_for_test(buf, "F8_E4M3", [2]))
    expected = getattr(torch, "float8_e4m3fn", torch.uint8)
    assert out.dtype == expected and out.view(torch.uint8).tolist() == [1, 2]


def test_numpy_arrays_and_parameters_that_require_grad():
    a = numpy.arange(6, dtype=numpy.int32).reshape(2, 3)
    assert _core.check_tensor("a", a) == ("I32", [2, 3], "cpu", a.ctypes.data)
    p = torch.nn.Parameter(torch.ones(2, 2))
    assert import_torch("p", p)[3] == p.data_ptr()
    # A contiguous slice keeps its offset: no copy.
    base = torch.arange(10, dtype=torch.float32)
    assert import_torch("s", base[4:8])[3] == base.data_ptr() + 16


def test_non_contiguous_tensor_raises_value_error_naming_it():
    t = torch.zeros(4, 6).t()
    with pytest.raises(ValueError, match=r"tensor 'layers.0.w': expected a contiguous tensor, got shape \[6, 4\] "
                                         r"with strides \[1, 6\]"):
        import_torch("layers.0.w", t)


def test_unsupported_dtype_and_non_tensors_raise_value_error():
    with pytest.raises(ValueError, match=r"tensor 'c': dtype complex64 is not supported; expected one of F32"):
        import_torch("c", torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"tensor 'x': expected a tensor with __dlpack__.*got list"):
        _core.check_tensor("x", [1, 2])
    with pytest.raises(ValueError, match=r"tensor 'u': dtype F32 does not fit the DLPack element uint8"):
        _core.check_tensor("u", torch.zeros(2, dtype=torch.uint8), "F32")


def test_tensor_on_the_wrong_device_raises_value_error():
    cfg = config_dict(subscribers=1)
    cfg["subscriber"] = {"device": "cuda:0"}
    cfg["data_plane"]["backend"] = "nccl"
    sub = paramcast.Subscriber(cfg, "engine-1")
    with pytest.raises(ValueError, match=r"tensor 'w': expected a tensor on cuda:0, got one on cpu"):
        sub.register({"w": torch.zeros(2)})
    sub.stop()


def test_publisher_rejects_bad_tensors_before_anything_is_sent():
    with paramcast.Publisher(config_dict(subscribers=1)) as pub:
        with pytest.raises(ValueError, match=r"tensor 'b': expected a contiguous tensor"):
            pub.weight_update({"a": torch.zeros(2), "b": torch.zeros(3, 3).t()})
        with pytest.raises(TypeError, match=r"weight_update: item 0 is not a \(name, tensor\) pair"):
            pub.weight_update([("a",)])
        with pytest.raises(TypeError, match=r"weight_update: item 0: the name must be a str, got int"):
            pub.weight_update({0: torch.zeros(2)})


def test_a_registered_tensor_whose_storage_moved_fails_the_update_naming_it():
    """An engine's registered tensor whose storage was replaced after it was registered
    (share_memory_(), as sending it through a multiprocessing pipe does; a new .data; resize_())
    no longer holds the memory ParamCast writes: the engine fails the next update before any
    byte moves, naming the tensor, and keeps its version. Registered again, it updates.
    (Before, the update wrote into the freed buffer after share_memory_(): a corrupted heap or a
    crash; after a new .data, into the old storage, which the model no longer reads.)"""
    w, b = torch.zeros(4096), torch.zeros(16)
    with paramcast.Publisher(config_dict(subscribers=1)) as pub:
        cfg = config_dict(endpoint=pub.endpoint, subscribers=1)
        sub = paramcast.Subscriber(cfg, "engine-1")
        try:
            sub.register({"w": w, "b": b}).start()
            pub.start()
            src = {"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(16)}
            assert pub.weight_update(src).ok
            assert torch.equal(w, src["w"]) and torch.equal(b, src["b"])
            before = w.data_ptr()
            w.share_memory_()  # the same values, in new memory
            assert w.data_ptr() != before
            src["w"] += 1
            with pytest.raises(paramcast.UpdateError) as e:
                pub.weight_update(src)
            assert "'w': expected its bytes where they were registered" in str(e.value), str(e.value)
            assert "its storage moved to" in str(e.value), str(e.value)
            assert (sub.state, sub.version) == ("consistent", 1)
            assert torch.equal(w, src["w"] - 1), "nothing of the refused update was written"
            sub.register({"w": w})
            r = pub.weight_update(src)
            assert r.ok and torch.equal(w, src["w"]) and torch.equal(b, src["b"])
            b.data = torch.zeros(16)  # the tensor now reads other memory
            src["b"] += 1
            with pytest.raises(paramcast.UpdateError, match=r"'b': expected its bytes where they were registered"):
                pub.weight_update(src)
            assert (sub.state, sub.version) == ("consistent", r.version)
            sub.register({"b": b})
            r = pub.weight_update(src)
            assert r.ok and torch.equal(b, src["b"]) and torch.equal(w, src["w"])
        finally:
            sub.stop()
