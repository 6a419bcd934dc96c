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
    import multiprocessing
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
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
