"""paramcast.reshard: what each trainer rank holds, read from its tensors as
they are, and the many-sender plan over it.

- plain tensors are held whole; the plan names gaps and overlaps;
- PyTorch 2.13 FSDP2 (fully_shard) on 2 and 3 CPU ranks over Gloo, a
  transformers LLaMA: each rank's holdings are read from its DTensors (no
  gather), its local shard is bit-exact the region they name of the full
  parameter, and the plan over every rank's holdings to 2 whole engines, and
  to 2 replicas x TP=2 engines wanting their slices, is valid: each engine
  receives exactly what it wants, each trainer rank sends its shard.
"""
import os

import pytest
import torch

import paramcast
from paramcast import reshard


def _fsdp2_available():
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    if (major, minor) < (2, 6):
        return False
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _llama():
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=515, hidden_size=96, intermediate_size=257, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def test_plain_tensors_are_held_whole_and_the_plan_names_a_gap():
    w = torch.zeros(6, 4, dtype=torch.bfloat16)
    (name, dtype, shape, region), = reshard.holdings([("w", w)])
    assert (name, dtype, shape, region) == ("w", "BF16", [6, 4], ([0, 0], [6, 4]))
    specs = [("w", "BF16", [6, 4])]
    trainer = {"rank": 0, "name": "trainer-0", "tensors": specs, "holds": [("w", reshard.slice_of([6, 4], 0, 0, 4))]}
    engine = {"rank": 1, "name": "engine-1", "tensors": specs, "wants": [("w", reshard.whole([6, 4]))]}
    with pytest.raises(paramcast.ConfigError, match=r"tensor 'w': engine-1 wants \[4:6, 0:4\], which no rank holds"):
        reshard.plan([trainer, engine])
    with pytest.raises(ValueError, match="a region has 1 offsets and 2 lengths"):
        reshard.plan([dict(trainer, holds=[("w", ([0], [6, 4]))]), engine])
    trainer["holds"] = [("w", reshard.whole([6, 4]))]
    p = reshard.plan([trainer, engine])
    assert p["received"] == {1: 48} and p["sent"] == {0: 48}


def _fsdp_rank(rank, world, port, queue):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        model = _llama().to(torch.bfloat16)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        held = reshard.holdings(model.named_parameters())
        # The local shard is the region the holdings name, bit for bit (the
        # full tensor is gathered here only to check that).
        bad = []
        params = dict(model.named_parameters())
        for name, _, shape, (offsets, lengths) in held:
            full = params[name].full_tensor()
            index = tuple(slice(o, o + n) for o, n in zip(offsets, lengths))
            local = params[name].to_local()
            if local.numel() and not torch.equal(full[index].view(torch.int16), local.view(torch.int16)):
                bad.append(name)
        queue.put((rank, held, bad))
    finally:
        dist.destroy_process_group()


# vLLM's split of a LLaMA: column-parallel (and vocab-parallel) weights cut
# along dim 0, row-parallel ones along dim 1, norms whole.
def _tp_dim(name, shape):
    if len(shape) == 1:
        return None
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return 1
    return 0


def _engine(rank, name, specs, tp=1, k=0):
    wants = []
    for n, _, shape in specs:
        dim = _tp_dim(n, shape)
        if tp == 1 or dim is None:
            wants.append((n, reshard.whole(shape)))
            continue
        per = (shape[dim] + tp - 1) // tp
        start = min(shape[dim], per * k)
        if min(per, shape[dim] - start) > 0:
            wants.append((n, reshard.slice_of(shape, dim, start, min(per, shape[dim] - start))))
    return {"rank": rank, "name": name, "tensors": specs, "wants": wants}


def _bytes(shape, region, dtype="BF16"):
    n = 1
    for length in region[1]:
        n *= length
    return n * {"BF16": 2, "F32": 4}[dtype]


@pytest.mark.skipif(not _fsdp2_available(), reason="needs PyTorch >= 2.6 (FSDP2 fully_shard) and transformers "
                    "(deploy/install-deps.sh installs torch 2.13 and transformers for the default python3)")
@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_holdings_are_read_without_a_gather_and_plan_to_whole_and_sliced_engines(world):
    import spawning
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = spawning.context(spawning.LLAMA)
    queue = ctx.Queue()
    procs = [ctx.Process(target=_fsdp_rank, args=(r, world, port, queue), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = sorted(queue.get(timeout=240) for _ in range(world))
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    specs = [(n, d, shape) for n, d, shape, _ in results[0][1]]
    model_bytes = sum(_bytes(shape, reshard.whole(shape), d) for _, d, shape in specs)
    trainers = []
    for rank, held, bad in results:
        assert not bad, f"rank {rank}: local shards differ from the regions its holdings name: {bad[:3]}"
        assert [n for n, _, _, _ in held] == [n for n, _, _ in specs]
        trainers.append({"rank": rank, "name": f"trainer-{rank}", "tensors": specs,
                         "holds": [(n, region) for n, _, _, region in held if all(region[1])]})
    # An uneven shard: 515 vocab rows over 2 or 3 ranks.
    embed = [region for n, _, _, region in results[-1][1] if n == "model.embed_tokens.weight"][0]
    assert embed[1][0] == 515 - (world - 1) * ((515 + world - 1) // world)

    # Two engines that want whole tensors.
    whole = reshard.plan(trainers + [_engine(world, "engine-1", specs), _engine(world + 1, "engine-2", specs)])
    assert whole["received"][world] == model_bytes and whole["received"][world + 1] == model_bytes
    assert sum(whole["sent"].get(r, 0) for r in range(world)) == model_bytes  # every byte leaves the trainer once
    assert whole["busiest_bytes"] == whole["least_busiest_bytes"] == model_bytes

    # Two replicas x TP=2: each engine rank receives its slices only.
    engines = [_engine(world + 2 * rep + k, f"engine-{rep}-tp{k}", specs, tp=2, k=k) for rep in range(2) for k in range(2)]
    sliced = reshard.plan(trainers + engines)
    for e in engines:
        want = sum(_bytes(None, region, dict((n, d) for n, d, _ in specs)[n]) for n, region in e["wants"])
        assert sliced["received"][e["rank"]] == want, e["name"]
        assert want < model_bytes * 0.6, "a TP=2 rank wants about half of the parallel weights"

    # A rank that claims rows another holds (rank 0's shard of every matrix,
    # one row longer): refused before anything moves, naming both.
    grown = [(n, (o, [l[0] + 1] + l[1:])) for n, (o, l) in trainers[0]["holds"] if len(l) == 2]
    liar = dict(trainers[1], holds=grown)
    with pytest.raises(paramcast.ConfigError, match=r"trainer-0 holds \[.*\] and trainer-1 holds \[.*\]: both claim"):
        reshard.plan([trainers[0], liar] + trainers[2:] + [_engine(world, "engine-1", specs)])


# ---- piece_of: the box a layout stated as data (vLLM's ParamMeta) gives a rank ----------------------
class _VShard:  # vLLM's Shard(dim) (weight_transfer/base.py), without vLLM
    def __init__(self, dim):
        self.dim = dim

    def __repr__(self):
        return f"Shard(dim={self.dim})"


_VShard.__name__ = "Shard"


class _VReplicate:
    def __repr__(self):
        return "Replicate()"


_VReplicate.__name__ = "Replicate"


def _dtensor_offsets_available():
    try:
        from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset  # noqa: F401
    except ImportError:
        return False
    return True


def _torch_box(shape, mesh_shape, coordinate, placements):
    """DTensor's own answer: (offsets, lengths) of the piece at `coordinate` (no process group)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    theirs = [Replicate() if p is None else Shard(p) for p in placements]
    lengths, offsets = _compute_local_shape_and_global_offset(list(shape), list(mesh_shape), list(coordinate), theirs)
    return [int(o) for o in offsets], [int(n) for n in lengths]


# (shape, mesh shape, placements: a dim per mesh axis, None for Replicate)
_LAYOUTS = [
    ((8, 4), (2,), (0,)), ((7, 4), (2,), (0,)), ((515, 96), (3,), (0,)), ((2, 5), (3,), (0,)),  # even, uneven
    ((1, 5), (4,), (0,)), ((0, 3), (2,), (0,)), ((5,), (8,), (0,)),  # fewer rows than chunks: empty trailing pieces
    ((6, 10), (2,), (1,)), ((6, 11), (3,), (1,)), ((3, 3, 7), (2,), (2,)),  # Megatron-style dim-1 (and dim-2) splits
    ((9, 10), (2, 2), (0, 1)), ((9, 10), (2, 3), (1, 0)),  # 2-D meshes, each axis a dim
    # two axes on one dim: the outer one first
    ((10, 4), (2, 2), (0, 0)), ((11, 4), (2, 3), (0, 0)), ((3, 4), (2, 2), (0, 0)), ((5, 4), (3, 2), (0, 0)),
    ((3, 2), (3, 2), (0, 0)), ((2, 4), (2, 3), (0, 0)),  # an empty inner piece inside a non-last outer one
    ((9, 10), (2, 2), (None, 0)), ((9, 10), (2, 2), (1, None)), ((9, 10), (2,), (None,)),  # Replicate axes (HSDP)
    ((4, 6, 9), (2, 2, 2), (0, 2, 2)), ((13, 7), (2, 2, 2), (0, None, 0)),
]


@pytest.mark.skipif(not _dtensor_offsets_available(), reason="the reference is DTensor's own "
                    "_compute_local_shape_and_global_offset (torch.distributed.tensor._utils); here "
                    f"PyTorch {torch.__version__}")
@pytest.mark.parametrize("shape, mesh_shape, dims", _LAYOUTS)
def test_piece_of_cuts_as_dtensor_does(shape, mesh_shape, dims):
    """Every owner's box equals torch's compute_local_shape_and_global_offset for its coordinate, owners in
    a shuffled order (an owner's coordinate is its index in owners, row-major), and the boxes of one
    replica group tile the tensor exactly once."""
    import random

    n = 1
    for d in mesh_shape:
        n *= d
    owners = list(range(10, 10 + n))
    random.Random(len(shape) * 31 + n).shuffle(owners)
    placements = tuple(_VReplicate() if d is None else _VShard(d) for d in dims)
    grid = torch.arange(n).reshape(mesh_shape)
    covered = torch.zeros(shape, dtype=torch.int32)
    for index, rank in enumerate(owners):
        coordinate = [int(c) for c in (grid == index).nonzero()[0]]
        box = reshard.piece_of(shape, owners, mesh_shape, placements, rank, "'w'")
        assert box == _torch_box(shape, mesh_shape, coordinate, dims), (rank, coordinate)
        replicated_axes = [a for a, d in enumerate(dims) if d is None]
        if all(coordinate[a] == 0 for a in replicated_axes):  # one replica group
            offsets, lengths = box
            covered[tuple(slice(o, o + k) for o, k in zip(offsets, lengths))] += 1
    assert bool((covered == 1).all()), "the pieces of one replica group do not tile the tensor exactly once"
    # vLLM's ParamMeta without mesh_shape: a 1-d mesh over the owners.
    if len(mesh_shape) == 1:
        for rank in owners:
            assert reshard.piece_of(shape, owners, None, placements, rank) == \
                reshard.piece_of(shape, owners, mesh_shape, placements, rank)


def test_piece_of_holds_a_replica_whole_and_refuses_what_is_no_box():
    assert reshard.piece_of((7, 3), (0, 1), (2,), None, 1) == ([0, 0], [7, 3])  # placements None: a replica
    assert reshard.piece_of((7, 3), None, None, None, 5) == ([0, 0], [7, 3])  # owners None: every rank, whole
    with pytest.raises(ValueError, match=r"'w': rank 2 is not one of its owners \(0, 1\)"):
        reshard.piece_of((7, 3), (0, 1), (2,), (_VShard(0),), 2, "'w'")
    with pytest.raises(ValueError, match=r"'w': 1 placements for a 2-d mesh \(1, 2\)"):
        reshard.piece_of((7, 3), (0, 1), (1, 2), (_VShard(0),), 0, "'w'")
    with pytest.raises(ValueError, match=r"'w': placement Shard\(dim=2\) shards dim 2 of a 2-d tensor"):
        reshard.piece_of((7, 3), (0, 1), (2,), (_VShard(2),), 0, "'w'")
    with pytest.raises(ValueError, match=r"'w': placement Partial\(\) is neither Replicate nor Shard"):
        reshard.piece_of((7, 3), (0, 1), (2,), (type("Partial", (), {"__repr__": lambda self: "Partial()"})(),), 0,
                         "'w'")
    # A piece past the end along one dim (fewer rows than chunks) sits empty at the tensor's end.
    assert reshard.piece_of((1, 4), (0, 1, 2), (3,), (_VShard(0),), 2) == ([1, 0], [0, 4])
