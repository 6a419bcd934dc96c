"""Many senders from Python: PyTorch 2.13 FSDP2 (fully_shard) trainer ranks over
Gloo, a transformers LLaMA, each rank publishing straight from its local
shards (Publisher.weight_update_sharded on rank 0, PublisherRank on rank 1;
no full_tensor(), no gather) to two engine processes, one in place and one
through on_weights: both hold the unsharded model's bytes exactly, version
after version. A rank whose holdings overlap another's is refused before any
byte moves, naming both.
"""
import os

import pytest

torch = pytest.importorskip("torch")
import paramcast  # noqa: E402

from cluster import BulkEngine, config_dict, sha256_of  # noqa: E402
from test_reshard import _fsdp2_available, _llama  # noqa: E402


def _zeros(specs):
    return {n: torch.zeros(shape, dtype=getattr(torch, dt)) for n, dt, shape in specs}


def _slice_index(shape, cut):
    dim, start, length = cut
    index = [slice(None)] * len(shape)
    if dim is not None:
        index[dim] = slice(start, start + length)
    return tuple(index)


def _tp_engine_main(conn, endpoint, worker_id, cfg, specs, tp, rank):
    """A tensor-parallel engine rank: registers only its slices (paramcast.reshard.tp_slices)."""
    import hashlib

    from cluster import _serve
    from paramcast.reshard import Shard, tp_slices

    torch.set_num_threads(1)
    cfg = dict(cfg)
    cfg["control"] = dict(cfg["control"], endpoint=endpoint)
    sub = paramcast.Subscriber(cfg, worker_id)
    cuts = tp_slices(specs, tp, rank)
    held = {}
    for name, dt, shape in specs:
        local = torch.zeros(shape, dtype=getattr(torch, dt))[_slice_index(shape, cuts[name])].contiguous()
        offsets = [0] * len(shape)
        if cuts[name][0] is not None:
            offsets[cuts[name][0]] = cuts[name][1]
        held[name] = local
        sub.register([(name, Shard(local, shape, offsets))])

    def digest():
        return {n: hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest() for n, t in held.items()}

    _serve(conn, sub, {"digest": digest, "bytes": lambda: sum(t.numel() * t.element_size() for t in held.values())})


class _TpEngine(BulkEngine):
    def __init__(self, endpoint, worker_id, cfg, specs, tp, rank):  # pylint: disable=super-init-not-called
        self._spawn(worker_id, _tp_engine_main, (endpoint, worker_id, cfg, specs, tp, rank))


def _config(world, endpoint="tcp://127.0.0.1:*"):
    cfg = config_dict(endpoint, subscribers=2)
    cfg["publisher"]["ranks"] = world
    return cfg


def _trainer(rank, world, port, endpoint_q, result_q, go):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    me = None
    try:
        mesh = init_device_mesh("cpu", (world,))
        model = _llama().to(torch.bfloat16)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        endpoint = [None]
        if rank == 0:
            me = paramcast.Publisher(_config(world))
            endpoint[0] = me.endpoint
            endpoint_q.put(me.endpoint)
        dist.broadcast_object_list(endpoint, src=0)
        if rank == 0:
            me.start()
        else:
            me = paramcast.PublisherRank(_config(world, endpoint[0]), rank).start()
        for step in range(3):
            if step:
                assert go[step].wait(120), "the test never let the next step start"
                with torch.no_grad():  # "an optimizer step" of the first layer only (the rest frozen), on this rank's shard
                    for name, p in model.named_parameters():
                        if name.startswith("model.layers.0."):
                            p.to_local().mul_(1.5)
            params = model.named_parameters()
            if step == 2 and rank == 1:
                # A rank that claims rows rank 0 holds: every matrix one row
                # earlier and one row longer.
                try:
                    me.weight_update(_shifted(model, -1))
                    result_q.put((rank, step, "ok", 0, []))
                except paramcast.UpdateError as e:
                    result_q.put((rank, step, "error", 0, [str(e)]))
                continue
            try:
                if rank == 0:
                    r = me.weight_update_sharded(params)
                    result_q.put((rank, step, "ok", r.version, sorted(o.worker_id for o in r.subscribers),
                                  r.delta, r.wire_bytes, r.dense_because))
                else:
                    r = me.weight_update(params)
                    result_q.put((rank, step, "ok", r.version, []))
            except paramcast.UpdateError as e:
                result_q.put((rank, step, "error", 0, [str(e)]))
    finally:
        if me is not None:
            me.close()
        dist.destroy_process_group()


def _shifted(model, shift):
    """Every matrix's shard said to start `shift` rows earlier, one row longer (a hostile or
    confused rank), as paramcast.reshard.Shard states a shard without a DTensor."""
    from paramcast.reshard import Shard, region_of

    out = []
    for name, p in model.named_parameters():
        shape, (offsets, lengths) = region_of(p)
        local = p.to_local().detach()
        if len(shape) == 2 and lengths[0] > 0 and offsets[0] + shift >= 0:
            out.append((name, Shard(torch.cat([local[:1], local], 0), shape, [offsets[0] + shift] + offsets[1:])))
        else:
            out.append((name, Shard(local, shape, offsets)))
    return out


@pytest.mark.skipif(not _fsdp2_available(), reason="needs PyTorch >= 2.6 (FSDP2 fully_shard) and transformers "
                    "(deploy/install-deps.sh installs torch 2.13 and transformers for the default python3)")
@pytest.mark.parametrize("kind,world", [("whole", 2), ("tp2", 2), ("whole", 4)])
def test_fsdp2_ranks_publish_their_shards_and_engines_hold_the_unsharded_model(kind, world):
    """whole: one engine in place, one through on_weights, each the whole model;
    tp2: two engine ranks of one TP=2 group, each registering only its slices."""
    import multiprocessing
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    endpoint_q, result_q, go = ctx.Queue(), ctx.Queue(), [ctx.Event() for _ in range(3)]
    procs = [ctx.Process(target=_trainer, args=(r, world, port, endpoint_q, result_q, go), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    engines = []
    try:
        endpoint = endpoint_q.get(timeout=240)
        ref = _llama().to(torch.bfloat16)
        state = {n: p.detach().clone() for n, p in ref.named_parameters()}
        specs = [(n, str(t.dtype).replace("torch.", ""), list(t.shape)) for n, t in state.items()]
        cfg = _config(world)
        from paramcast.reshard import tp_slices
        if kind == "whole":
            engines = [BulkEngine(endpoint, "engine-1", "inplace", cfg, specs, _zeros),
                       BulkEngine(endpoint, "engine-2", "callback", cfg, specs, _zeros)]
            wanted = {"engine-1": None, "engine-2": None}
        else:
            engines = [_TpEngine(endpoint, f"engine-{k + 1}", cfg, specs, 2, k) for k in range(2)]
            wanted = {f"engine-{k + 1}": tp_slices(specs, 2, k) for k in range(2)}
        for e in engines:
            e.wait_ready()

        def results(step):
            got = sorted(result_q.get(timeout=240) for _ in range(world))
            return {rank: rest for rank, s, *rest in got if s == step}

        for step in range(2):
            if step:
                for n, t in state.items():
                    if n.startswith("model.layers.0."):
                        t.mul_(1.5)
                go[step].set()
            got = results(step)
            assert all(got[r][0] == "ok" for r in range(world)), got
            version = got[0][1]
            assert all(got[r][1] == version for r in range(world)), "every trainer rank took part in the same version"
            assert got[0][2] == ["engine-1", "engine-2"] + [f"trainer-{r}" for r in range(1, world)]
            if step and kind == "tp2":
                # Deltas per shard (both engines apply in place): only the first
                # layer changed, so the engines received little more than its slices.
                delta, wire, why = got[0][3:]
                layer0 = sum(t.numel() * t.element_size() for n, t in state.items() if n.startswith("model.layers.0."))
                assert delta, why
                assert 0 < wire <= layer0 * 1.1, (wire, layer0)
            for e in engines:
                cuts = wanted[e.worker_id]
                want = sha256_of(state if cuts is None else
                                 {n: t[_slice_index(t.shape, cuts[n])].contiguous() for n, t in state.items()})
                assert e.call("wait", version, 60) is not None
                assert e.call("state") == ("consistent", version), e.worker_id
                digest = e.call("digest")
                bad = [n for n in want if digest.get(n) != want[n]]
                assert not bad, f"{e.worker_id}: {len(bad)} tensors differ from the unsharded model, e.g. {bad[:3]}"

        # Rank 1 claims a row of rank 0's shard of every matrix: refused
        # before any byte moves, naming both; the engines keep the last version.
        go[2].set()
        got = results(2)
        assert all(got[r][0] == "error" for r in range(world)), got  # every partner call ends with the reason
        message = got[0][2][0]
        assert "publisher" in message and "trainer-1" in message and "both claim" in message, message
        assert "refused before any byte moved" in message, message
        for e in engines:
            assert e.call("state") == ("consistent", version), e.worker_id
    finally:
        for e in engines:
            e.close()
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
