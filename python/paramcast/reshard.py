"""What a rank of a sharded trainer holds, read from its tensors as they are,
and the many-sender plan over every rank's holdings and every engine's wants.

    held = paramcast.reshard.holdings(model.named_parameters())   # on each trainer rank
    # [(name, dtype, global shape, (offsets, lengths))]: no gather, no full_tensor()
    plan = paramcast.reshard.plan([
        {"rank": 0, "name": "trainer-0", "tensors": specs, "holds": [(n, r) for n, _, _, r in held0]},
        ...,
        {"rank": 4, "name": "engine-1", "tensors": specs, "wants": [(n, whole(shape)) for n, _, shape in specs]},
    ])

A DTensor (FSDP2's fully_shard, a tensor-parallel layout, HSDP's 2-D mesh)
holds the region its placements give its rank on its device mesh; a plain
tensor is held whole. A Partial placement (a pending reduction) is refused:
its bytes are not the weight's. `piece_of` gives the same box from a
layout stated as data (vLLM's ParamMeta: owners, mesh shape, placements),
cut as DTensor and torch.chunk cut it. The plan is common/reshard's, checked
as a whole before anything moves (docs/ARCHITECTURE.md).
"""

from . import _core
from ._tensors import dtype_name


def whole(shape):
    """The region of a whole tensor of `shape`: (offsets, lengths)."""
    return ([0] * len(shape), [int(d) for d in shape])


def slice_of(shape, dim, start, length):
    """The region of `shape` that is [start, start + length) along `dim`."""
    offsets, lengths = whole(shape)
    offsets[dim], lengths[dim] = int(start), int(length)
    return (offsets, lengths)


class Shard:
    """This rank's box of a tensor it holds part of, stated without a DTensor (a Megatron-style
    shard, a pipeline stage's slice): ``local`` holds the box starting at ``offsets`` of the full
    tensor of ``full_shape`` (row-major, its lengths ``local.shape``)."""

    def __init__(self, local, full_shape, offsets):
        self.local = local
        self.shape = [int(d) for d in full_shape]
        self.offsets = [int(o) for o in offsets]
        if len(self.offsets) != len(self.shape) or local.dim() != len(self.shape):
            raise ValueError(f"a shard of a {len(self.shape)}-d tensor needs {len(self.shape)} offsets and a "
                             f"{len(self.shape)}-d local tensor, got {len(self.offsets)} and {local.dim()}-d")
        self.dtype = local.dtype

    def to_local(self):
        return self.local


# The usual tensor-parallel split of a Hugging Face LLaMA/Qwen-style model, as
# vLLM's parallel layers cut it: row-parallel weights along dim 1, the other
# matrices (q/k/v, gate/up, embeddings, lm_head: column- and vocab-parallel)
# along dim 0; 1-d tensors (norms, a row-parallel layer's bias) whole.
_ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")


def tp_dim(name, shape):
    """The dimension a tensor-parallel engine cuts `name` along (None: every rank holds it whole)."""
    if len(shape) != 2:
        return None
    return 1 if name.endswith(_ROW_PARALLEL) else 0


def tp_slices(specs, tp, rank, dim_of=tp_dim):
    """{name: (dim, start, length)} of the slice engine rank `rank` of `tp` serves of each tensor
    of `specs` (a module, (name, tensor) pairs, or (name, dtype, shape) triples): ceil(n / tp)
    per rank, the last short; dim None for a tensor held whole. `dim_of(name, shape)` gives the
    split of any other model."""
    if hasattr(specs, "named_parameters"):
        specs = specs.named_parameters()
    out = {}
    for item in (specs.items() if hasattr(specs, "items") else specs):
        name, shape = item[0], list(item[-1] if len(item) == 3 else item[1].shape)
        dim = dim_of(name, shape)
        if dim is None or tp == 1:
            out[name] = (None, 0, 0)
            continue
        per = (shape[dim] + tp - 1) // tp
        start = min(shape[dim], per * rank)
        out[name] = (dim, start, min(per, shape[dim] - start))
    return out


def region_of(tensor, what="tensor"):
    """(global shape, (offsets, lengths)) of what this rank holds of `tensor`."""
    if isinstance(tensor, Shard):
        return list(tensor.shape), (list(tensor.offsets), [int(d) for d in tensor.local.shape])
    try:
        from torch.distributed.tensor import DTensor, Partial
    except ImportError:  # PyTorch without DTensor: every tensor is whole
        DTensor = Partial = None
    if DTensor is None or not isinstance(tensor, DTensor):
        return [int(d) for d in tensor.shape], whole(tensor.shape)
    if any(isinstance(p, Partial) for p in tensor.placements):
        raise ValueError(f"{what}: a Partial placement ({tensor.placements}) holds a pending reduction, "
                         f"not the weight's bytes; reduce it (redistribute to Replicate or Shard) first")
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    shape = [int(d) for d in tensor.shape]
    local, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    if list(local) != list(tensor.to_local().shape):
        raise ValueError(f"{what}: its local tensor is {list(tensor.to_local().shape)} but its placements give "
                         f"{list(local)}")
    return shape, ([int(o) for o in offset], [int(n) for n in local])


def _placement_dim(placement, ndim, what):
    """The tensor dim a placement shards, or None for a Replicate; anything else is refused.

    Takes vLLM's ``Shard(dim)``/``Replicate()`` and torch's ``Shard``/``Replicate`` alike; a strided
    or partial placement holds no plain box."""
    kind = type(placement).__name__
    if kind == "Replicate":
        return None
    dim = getattr(placement, "dim", None)
    if kind == "Shard" and isinstance(dim, int) and not isinstance(dim, bool):
        if not 0 <= dim < ndim:
            raise ValueError(f"{what}: placement {placement!r} shards dim {dim} of a {ndim}-d tensor")
        return dim
    raise ValueError(f"{what}: placement {placement!r} is neither Replicate nor Shard(dim)")


def piece_of(shape, owners, mesh_shape, placements, rank, what="tensor"):
    """(offsets, lengths): the box trainer rank ``rank`` holds of a tensor of ``shape`` laid out as
    vLLM's ``ParamMeta`` says (``owners``, the row-major ``mesh_shape`` over them, one placement per
    mesh axis), exactly as DTensor's ``compute_local_shape_and_global_offset`` and ``torch.chunk``
    cut it: each ``Shard(dim)`` axis splits the extent the axes before it left into chunks of
    ceil(n / k) (the last short, trailing ones empty, an empty one at offset ``shape[dim]``), an
    outer axis before an inner one on the same dim; a ``Replicate`` axis holds the whole extent.
    ``owners`` None or ``placements`` None: the whole tensor (every owner a replica)."""
    shape = [int(d) for d in shape]
    offsets, lengths = whole(shape)
    if owners is None or placements is None:
        return offsets, lengths
    owners = tuple(owners)
    mesh_shape = (len(owners),) if mesh_shape is None else tuple(int(d) for d in mesh_shape)
    if rank not in owners:
        raise ValueError(f"{what}: rank {rank} is not one of its owners {owners}")
    if len(placements) != len(mesh_shape):
        raise ValueError(f"{what}: {len(placements)} placements for a {len(mesh_shape)}-d mesh {mesh_shape}")
    # The rank's coordinate on the mesh: its index in owners, row-major.
    index, coordinate = owners.index(rank), []
    for extent in reversed(mesh_shape):
        coordinate.append(index % extent)
        index //= extent
    coordinate.reverse()
    for axis, placement in enumerate(placements):
        dim = _placement_dim(placement, len(shape), what)
        if dim is None:
            continue
        n, k, c = lengths[dim], mesh_shape[axis], coordinate[axis]
        chunk = -(-n // k)
        start = min(n, chunk * c)
        size = max(0, min(n, start + chunk) - start)
        # DTensor puts an empty piece at the tensor's end; a non-empty one inside what the outer axes left.
        offsets[dim] = shape[dim] if size == 0 else offsets[dim] + start
        lengths[dim] = size
    return offsets, lengths


def holdings(source):
    """[(name, dtype name, global shape, (offsets, lengths))] for each named tensor of `source`
    (a module's named_parameters(), a mapping, or (name, tensor) pairs): metadata only."""
    if hasattr(source, "named_parameters"):
        source = source.named_parameters()
    items = source.items() if hasattr(source, "items") else source
    out = []
    for name, tensor in items:
        shape, region = region_of(tensor, f"'{name}'")
        out.append((name, dtype_name(tensor.dtype, f"'{name}'"), shape, region))
    return out


def plan(ranks, forward=True):
    """The many-sender plan: each rank a dict with "rank", "name", "tensors" [(name, dtype, shape)],
    "holds" and "wants" [(name, (offsets, lengths))]. Returns {"transfers": [...], "sent": {rank: bytes},
    "received": {...}, "busiest_bytes", "least_busiest_bytes"}; raises paramcast.ConfigError naming every
    gap, overlap or disagreement (tensor, range, ranks) before anything moves."""
    return _core.plan_reshard(list(ranks), forward)
