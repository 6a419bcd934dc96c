"""Framework tensors to and from ParamCast's DLPack exchange.

Tensors go to the C++ core as objects with ``__dlpack__``; the core checks
contiguity, dtype and device. torch types that DLPack cannot carry (bool,
fp8) travel as uint8 views with the ParamCast dtype named beside them.
"""

_torch = None


def _torch_module():
    global _torch
    if _torch is None:
        try:
            import torch
        except ImportError:
            _torch = False
        else:
            _torch = torch
    return _torch or None


def _special_dtypes(torch):
    """torch dtypes exchanged as uint8 views, and their ParamCast names."""
    special = {torch.bool: "BOOL"}
    for attr, name in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
        if hasattr(torch, attr):
            special[getattr(torch, attr)] = name
    return special


def _is_torch(t):
    torch = _torch_module()
    return torch is not None and isinstance(t, torch.Tensor)


def named_items(named_tensors, what):
    """(name, tensor) pairs from a dict or an iterable of pairs (model.named_parameters())."""
    items = named_tensors.items() if hasattr(named_tensors, "items") else named_tensors
    out = []
    for i, pair in enumerate(items):
        try:
            name, tensor = pair
        except (TypeError, ValueError):
            raise TypeError(f"{what}: item {i} is not a (name, tensor) pair") from None
        if not isinstance(name, str):
            raise TypeError(f"{what}: item {i}: the name must be a str, got {type(name).__name__}")
        out.append((name, tensor))
    return out


def _dtype_names(torch):
    """torch dtypes and their ParamCast names (safetensors' spelling)."""
    names = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
             torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64"}
    names.update(_special_dtypes(torch))
    return names


def dtype_name(dtype, what):
    """A ParamCast dtype name from a torch dtype or a name ("BF16", "bfloat16" via torch)."""
    if isinstance(dtype, str):
        return dtype
    torch = _torch_module()
    if torch is not None and isinstance(dtype, torch.dtype):
        name = _dtype_names(torch).get(dtype)
        if name is None:
            raise TypeError(f"{what}: torch dtype {dtype} has no ParamCast equivalent")
        return name
    raise TypeError(f"{what}: dtype must be a torch.dtype or a name such as 'BF16', got {type(dtype).__name__}")


def manifest(source):
    """[(name, dtype name, shape)] from a module (its named_parameters()), a
    mapping or iterable of (name, tensor), or (name, dtype, shape) triples.

    Reads metadata only (dtype and the full, unsharded shape: an FSDP2 or
    DTensor parameter reports its global shape), never the data.
    """
    if hasattr(source, "named_parameters"):
        source = source.named_parameters()
    items = source.items() if hasattr(source, "items") else source
    out = []
    for i, item in enumerate(items):
        item = tuple(item)
        if len(item) == 3:
            name, dtype, shape = item
        elif len(item) == 2 and hasattr(item[1], "dtype") and hasattr(item[1], "shape"):
            name, dtype, shape = item[0], item[1].dtype, item[1].shape
        else:
            raise TypeError(f"manifest: item {i} is neither (name, tensor) nor (name, dtype, shape)")
        if not isinstance(name, str):
            raise TypeError(f"manifest: item {i}: the name must be a str, got {type(name).__name__}")
        out.append((name, dtype_name(dtype, f"manifest: '{name}'"), [int(d) for d in shape]))
    return out


def for_dlpack(tensor):
    """(object with __dlpack__, ParamCast dtype override or None, CUDA stream or None)."""
    if not _is_torch(tensor):
        return tensor, None, None
    torch = _torch
    t = tensor.detach()  # DLPack refuses tensors that require grad; detach shares the bytes
    dtype = _special_dtypes(torch).get(t.dtype)
    if dtype is not None:
        t = t.view(torch.uint8)
    stream = None
    if t.is_cuda:
        # The caller's current stream, which the update is ordered after. Its
        # handle 0 is the legacy default stream, which DLPack (and CUDA, as
        # cudaStreamLegacy) calls 1: DLPack reserves 0, and PyTorch refuses it.
        stream = torch.cuda.current_stream(t.device).cuda_stream or 1
    return t, dtype, stream


def to_framework(ref):
    """A tensor sharing the bytes of a lent paramcast TensorRef (torch when available, else numpy)."""
    torch = _torch_module()
    if torch is None:
        import numpy

        return numpy.from_dlpack(ref)
    t = torch.utils.dlpack.from_dlpack(ref)
    for torch_dtype, name in _special_dtypes(torch).items():
        if ref.dtype == name:
            return t.view(torch_dtype)
    return t
