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
its bytes are not the weight's. The plan is common/reshard's, checked as a
whole before anything moves (docs/ARCHITECTURE.md).
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
