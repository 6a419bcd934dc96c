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


_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
          "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def _fused_layout(specs, cuts):
    """As vLLM lays out a TP rank's fused parameters: for each layer, q, k and v's row slices one
    after the other in ``qkv_proj``, gate and up's in ``gate_up_proj``. Returns {fused name:
    (rows, cols, dtype)} and {tensor name: (fused name, first row)}."""
    fused, place = {}, {}
    for name, dt, shape in specs:
        module, _, leaf = name.rpartition(".")
        parent, _, proj = module.rpartition(".")
        if proj not in _FUSED or leaf != "weight":
            continue
        key = f"{parent}.{_FUSED[proj]}.weight"
        rows = cuts[name][2] if cuts[name][0] == 0 else shape[0]
        at = fused.get(key, (0, shape[1], dt))[0]
        place[name] = (key, at)
        fused[key] = (at + rows, shape[1], dt)
    return fused, place


def _tp_engine_main(conn, endpoint, worker_id, cfg, specs, tp, rank):
    """A tensor-parallel engine rank: registers only its slices (paramcast.reshard.tp_slices),
    q/k/v and gate/up as row ranges of fused parameters, the others as buffers of their own."""
    import hashlib

    from cluster import _serve
    from paramcast.reshard import Shard, tp_slices

    torch.set_num_threads(1)
    cfg = dict(cfg)
    cfg["control"] = dict(cfg["control"], endpoint=endpoint)
    sub = paramcast.Subscriber(cfg, worker_id)
    cuts = tp_slices(specs, tp, rank)
    fused_shapes, place = _fused_layout(specs, cuts)
    fused = {n: torch.zeros(r, c, dtype=getattr(torch, dt)) for n, (r, c, dt) in fused_shapes.items()}
    held = {}
    for name, dt, shape in specs:
        index = _slice_index(shape, cuts[name])
        if name in place:  # a row range of the fused parameter: written in place there
            key, at = place[name]
            local = fused[key][at:at + torch.zeros(shape)[index].shape[0]]
        else:
            local = torch.zeros(shape, dtype=getattr(torch, dt))[index].contiguous()
        offsets = [0] * len(shape)
        if cuts[name][0] is not None:
            offsets[cuts[name][0]] = cuts[name][1]
        held[name] = local
        sub.register([(name, Shard(local, shape, offsets))])

    def digest(of=held):
        return {n: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
                for n, t in of.items()}

    _serve(conn, sub, {"digest": digest, "fused": lambda: digest(fused),
                       "bytes": lambda: sum(t.numel() * t.element_size() for t in held.values())})


class _TpEngine(BulkEngine):
    def __init__(self, endpoint, worker_id, cfg, specs, tp, rank):  # pylint: disable=super-init-not-called
        self._spawn(worker_id, _tp_engine_main, (endpoint, worker_id, cfg, specs, tp, rank))


def _config(world, endpoint="tcp://127.0.0.1:*", subscribers=2):
    cfg = config_dict(endpoint, subscribers=subscribers)
    cfg["publisher"]["ranks"] = world
    return cfg


def _trainer(rank, world, port, endpoint_q, result_q, go, subscribers):
    """One trainer rank: FSDP2 over `world` ranks; with world 1, a plain model whose rank 0 calls
    the ordinary Publisher.weight_update (tensor-parallel engines make it go point to point)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    me = None
    try:
        model = _llama().to(torch.bfloat16)
        if world > 1:
            mesh = init_device_mesh("cpu", (world,))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        endpoint = [None]
        if rank == 0:
            me = paramcast.Publisher(_config(world, subscribers=subscribers))
            endpoint[0] = me.endpoint
            endpoint_q.put(me.endpoint)
        dist.broadcast_object_list(endpoint, src=0)
        if rank == 0:
            me.start()
        else:
            me = paramcast.PublisherRank(_config(world, endpoint[0], subscribers), rank).start()
        for step in range(3):
            if step == 2 and world == 1:
                break  # the overlap below needs two ranks (and the test sets no go[2] for one)
            if step:
                assert go[step].wait(120), "the test never let the next step start"
                with torch.no_grad():  # "an optimizer step" of the first layer only (the rest frozen), on this rank's shard
                    for name, p in model.named_parameters():
                        if name.startswith("model.layers.0."):
                            (p.to_local() if world > 1 else p).mul_(1.5)
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
                    r = me.weight_update_sharded(params) if world > 1 else me.weight_update(params)
                    result_q.put((rank, step, "ok", r.version, sorted(o.worker_id for o in r.subscribers),
                                  r.delta, r.wire_bytes, r.dense_because, {o.worker_id: o.bytes for o in r.subscribers}))
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
@pytest.mark.parametrize("kind,world", [("whole", 2), ("tp2", 2), ("whole", 4), ("tp2", 1)])
def test_fsdp2_ranks_publish_their_shards_and_engines_hold_the_unsharded_model(kind, world):
    """whole: one engine in place, one through on_weights, each the whole model;
    tp2: two replicas of a TP=2 engine (4 processes), each rank registering only its slices, q/k/v
    and gate/up as row ranges of fused qkv_proj/gate_up_proj buffers; world 1: a one-rank trainer
    calling the ordinary weight_update."""
    import spawning
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = spawning.context(spawning.LLAMA)
    endpoint_q, result_q, go = ctx.Queue(), ctx.Queue(), [ctx.Event() for _ in range(3)]
    subscribers = 4 if kind == "tp2" else 2
    procs = [ctx.Process(target=_trainer, args=(r, world, port, endpoint_q, result_q, go, subscribers), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    engines = []
    try:
        endpoint = endpoint_q.get(timeout=240)
        ref = _llama().to(torch.bfloat16)
        state = {n: p.detach().clone() for n, p in ref.named_parameters()}
        specs = [(n, str(t.dtype).replace("torch.", ""), list(t.shape)) for n, t in state.items()]
        cfg = _config(world, subscribers=subscribers)
        from paramcast.reshard import tp_slices
        if kind == "whole":
            engines = [BulkEngine(endpoint, "engine-1", "inplace", cfg, specs, _zeros),
                       BulkEngine(endpoint, "engine-2", "callback", cfg, specs, _zeros)]
            wanted = {"engine-1": None, "engine-2": None}
        else:
            engines = [_TpEngine(endpoint, f"engine-{i + 1}", cfg, specs, 2, i % 2) for i in range(4)]
            wanted = {f"engine-{i + 1}": tp_slices(specs, 2, i % 2) for i in range(4)}
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
            assert got[0][2] == [e.worker_id for e in engines] + [f"trainer-{r}" for r in range(1, world)]
            if not step and kind == "tp2":  # each engine rank received its slices' bytes, no more
                for e in engines:
                    assert got[0][6][e.worker_id] == e.call("bytes"), (e.worker_id, got[0][6], e.call("bytes"))
            if step and kind == "tp2":
                # Deltas per shard (the engines apply in place): only the first layer
                # changed, so each replica received little more than its slices.
                delta, wire, why = got[0][3:6]
                layer0 = sum(t.numel() * t.element_size() for n, t in state.items() if n.startswith("model.layers.0."))
                assert delta, why
                assert 0 < wire <= layer0 * (len(engines) // 2) * 1.1, (wire, layer0)
            for e in engines:
                cuts = wanted[e.worker_id]
                want = sha256_of(state if cuts is None else
                                 {n: t[_slice_index(t.shape, cuts[n])].contiguous() for n, t in state.items()})
                assert e.call("wait", version, 60) is not None
                assert e.call("state") == ("consistent", version), e.worker_id
                digest = e.call("digest")
                bad = [n for n in want if digest.get(n) != want[n]]
                assert not bad, f"{e.worker_id}: {len(bad)} tensors differ from the unsharded model, e.g. {bad[:3]}"
                if cuts is not None:  # the fused parameters hold q, k, v (gate, up) slices back to back
                    _, place = _fused_layout(specs, cuts)
                    parts = {}
                    for n in sorted(place, key=lambda n: place[n]):
                        parts.setdefault(place[n][0], []).append(state[n][_slice_index(state[n].shape, cuts[n])])
                    want_fused = sha256_of({k: torch.cat(v, 0) for k, v in parts.items()})
                    assert e.call("fused") == want_fused, e.worker_id

        if world == 1:
            return
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
