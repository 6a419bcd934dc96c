"""Transforms on send with real processes: a trainer with fp32 master
weights (real AdamW steps) publishes bf16, and its rules send the projection
weights as FP8 (block, channel and tensor scaling, edge blocks included) with
their `_scale_inv` tensors, or cast fp32 to bf16. Every engine's bytes equal
the plain-PyTorch reference of docs/transforms.md (fp8_reference.py), never
ParamCast's own quantizer; deltas travel on the quantized bytes; an engine
that registered what the rules do not send is refused before any byte moves."""

import time

import pytest

torch = pytest.importorskip("torch")
import paramcast  # noqa: E402

import fp8_reference as ref  # noqa: E402
from cluster import BulkEngine, config_dict, sha256_of  # noqa: E402

needs_fp8 = pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"),
                               reason=f"PyTorch {torch.__version__} has no float8_e4m3fn")

RULES = [
    {"match": "*norm*", "keep": True},
    {"match": "*k_proj.weight", "fp8": "channel"},
    {"match": "*v_proj.weight", "fp8": "tensor"},
    {"match": "*proj.weight", "fp8": "block"},
]


def scaling_of(name):
    if "norm" in name or not name.endswith("proj.weight"):
        return None
    if name.endswith("k_proj.weight"):
        return "channel"
    if name.endswith("v_proj.weight"):
        return "tensor"
    return "block"


def model_specs():
    """LLaMA-shaped, with dims that are not multiples of 128 (edge blocks)."""
    h, kv, ffn, vocab = 200, 136, 328, 300
    shapes = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(2):
        p = f"model.layers.{i}"
        shapes[f"{p}.self_attn.q_proj.weight"] = (h, h)
        shapes[f"{p}.self_attn.k_proj.weight"] = (kv, h)
        shapes[f"{p}.self_attn.v_proj.weight"] = (kv, h)
        shapes[f"{p}.self_attn.o_proj.weight"] = (h, h)
        shapes[f"{p}.mlp.gate_proj.weight"] = (ffn, h)
        shapes[f"{p}.mlp.down_proj.weight"] = (h, ffn)
        shapes[f"{p}.input_layernorm.weight"] = (h,)
    return shapes


class Trainer:
    def __init__(self):
        torch.manual_seed(0)
        self.master = {n: torch.nn.Parameter(torch.randn(s) * 0.02) for n, s in model_specs().items()}
        self.opt = torch.optim.AdamW(self.master.values(), lr=1e-4, weight_decay=0.0)

    def step(self, touch=None):
        loss = sum((p.float() ** 2).sum() * 1e-3 + p.sum() for n, p in self.master.items()
                   if touch is None or touch in n)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()

    def bf16(self):
        return {n: p.detach().to(torch.bfloat16) for n, p in self.master.items()}


def expected(weights):
    """What an FP8 engine holds after the update: the reference of each tensor."""
    out = {}
    for name, t in weights.items():
        scaling = scaling_of(name)
        if scaling is None:
            out[name] = t
        else:
            q, s = ref.quantize(t, scaling)
            out[name] = q
            out[name + "_scale_inv"] = s
    return out


DTYPES = {"F8_E4M3": "float8_e4m3fn", "F32": "float32", "BF16": "bfloat16"}


def engine_buffers(specs):
    """Zeroed buffers of (name, ParamCast dtype, shape) triples (a picklable factory)."""
    return {name: torch.zeros(shape, dtype=getattr(torch, DTYPES[dtype])) for name, dtype, shape in specs}


def wire_specs(weights):
    return [(n, "F8_E4M3" if t.dtype == torch.float8_e4m3fn else "F32" if t.dtype == torch.float32 else "BF16",
             tuple(t.shape)) for n, t in expected(weights).items()]


def check(engines, weights, version):
    want = sha256_of({n: t.contiguous() for n, t in expected(weights).items()})
    for e in engines:
        assert e.call("state") == ("consistent", version), e.worker_id
        got = e.call("digest")
        bad = [n for n in want if got.get(n) != want[n]]
        assert not bad, f"{e.worker_id} differs from the reference at v{version}: {bad[:4]}"


@needs_fp8
def test_fp8_engines_hold_the_reference_quantization_of_the_trainers_bf16_weights():
    cfg = config_dict(subscribers=2)
    cfg["data_plane"].update({"bucket_size": "64KiB", "direct_min_size": "32KiB", "checksum": "xxh64"})
    cfg["publisher"]["delta"] = "auto"
    cfg["publisher"]["transforms"] = RULES
    cfg["subscriber"] = {"delta_baseline": "host"}
    trainer = Trainer()
    weights = trainer.bf16()
    specs = wire_specs(weights)
    pub = paramcast.Publisher(cfg)
    engines = [BulkEngine(pub.endpoint, "engine-1", "inplace", cfg, specs, engine_buffers),
               BulkEngine(pub.endpoint, "engine-2", "callback", cfg, specs, engine_buffers)]
    try:
        for e in engines:
            e.wait_ready()
        pub.start()
        r = pub.weight_update(weights.items())
        check(engines, weights, r.version)
        fp8 = [n for n in weights if scaling_of(n)]
        assert r.transformed == len(fp8)
        assert r.tensors == len(weights) + len(fp8)  # each fp8 tensor travels with its scales
        bf16_bytes = sum(t.numel() * 2 for t in weights.values())
        sent = sum(t.numel() * t.element_size() for t in expected(weights).values())
        assert r.bytes == sent
        fp8_share = sum(weights[n].numel() for n in fp8) * 2 / bf16_bytes
        print(f"bf16 {bf16_bytes} B -> sent {r.bytes} B ({r.bytes / bf16_bytes:.3f}); fp8 tensors are "
              f"{fp8_share:.0%} of the bf16 bytes")
        assert r.bytes < bf16_bytes * (1 - fp8_share / 2) * 1.02

        # Real optimizer steps: each update's engines hold the reference of
        # the new weights; a step that touches only the MLP leaves the
        # attention blocks' quantized bytes as they were, so the delta of
        # the quantized bytes carries far less than the update.
        for touch in (None, "mlp", "mlp"):
            trainer.step(touch)
            weights = trainer.bf16()
            r = pub.weight_update(weights.items())
            check(engines, weights, r.version)
            if touch:
                assert r.delta, r.dense_because
                assert r.wire_bytes < r.bytes * 0.75, (r.wire_bytes, r.bytes)

        # A partial update of one quantized tensor: its scales travel with it,
        # every other tensor keeps its bytes.
        q = "model.layers.1.mlp.gate_proj.weight"
        trainer.step("layers.1.mlp.gate_proj")
        changed = trainer.bf16()[q]
        r = pub.weight_update({q: changed}, partial=True)
        assert r.tensors == 2 and r.transformed == 1
        weights = dict(weights, **{q: changed})
        check(engines, weights, r.version)

        # The same rules on a streamed update: each tensor quantized as it is sent.
        trainer.step()
        weights = trainer.bf16()
        with pub.stream(weights.items()) as u:
            for name in reversed(list(weights)):
                u.send(name, weights[name].clone())
        check(engines, weights, u.result.version)
        assert u.result.transformed == len(fp8)

        # The rules' scales are theirs to send: a trainer sending one itself is refused.
        with pytest.raises(ValueError, match="is the scales of"):
            with pub.stream(weights.items()) as u:
                u.send(fp8[0] + "_scale_inv", torch.ones(1))
    finally:
        for e in engines:
            e.close()
        pub.close()


@needs_fp8
def test_an_engine_that_registered_what_the_rules_do_not_send_is_refused_before_any_byte_moves():
    cfg = config_dict(subscribers=2)
    cfg["publisher"]["transforms"] = RULES
    trainer = Trainer()
    weights = trainer.bf16()
    good = wire_specs(weights)
    q = "model.layers.0.self_attn.q_proj.weight"
    # engine-1 kept bf16 for a tensor the rules send in FP8; engine-2 expects
    # per-row scales where the rule sends 128x128 blocks.
    as_bf16 = [(n, "BF16", s) if n == q else (n, d, s) for n, d, s in good]
    wrong_scales = [(n, d, (200, 1)) if n == q + "_scale_inv" else (n, d, s) for n, d, s in good]
    pub = paramcast.Publisher(cfg)
    engines = [BulkEngine(pub.endpoint, "engine-1", "inplace", cfg, as_bf16, engine_buffers),
               BulkEngine(pub.endpoint, "engine-2", "inplace", cfg, wrong_scales, engine_buffers)]
    try:
        for e in engines:
            e.wait_ready()
        pub.start()
        before = [e.call("digest") for e in engines]
        with pytest.raises(paramcast.UpdateError) as err:
            pub.weight_update(weights.items())
        text = str(err.value)
        assert "engine-1" in text and q in text and "F8_E4M3" in text and "BF16" in text, text
        assert "engine-2" in text and q + "_scale_inv" in text and "[2, 2]" in text and "[200, 1]" in text, text
        assert "publisher.transforms changed 12 tensors: an engine registers what travels" in text, text
        assert [e.call("digest") for e in engines] == before  # nothing moved
        # A rule that cannot apply names the tensor and the rule, before anything moves.
        with pytest.raises(paramcast.UpdateError, match=r"input_layernorm.*fp8 takes a 2-D tensor"):
            pub.weight_update(weights.items(), transforms=[{"match": "*.weight", "fp8": "block"}])
    finally:
        for e in engines:
            e.close()
        pub.close()


def test_fp32_master_weights_cast_to_bf16_on_the_way():
    cfg = config_dict(subscribers=1)
    trainer = Trainer()
    master = {n: p.detach().clone() for n, p in trainer.master.items()}
    specs = [(n, "BF16", tuple(t.shape)) for n, t in master.items()]
    pub = paramcast.Publisher(cfg)
    engine = BulkEngine(pub.endpoint, "engine-1", "inplace", cfg, specs, engine_buffers)
    try:
        engine.wait_ready()
        pub.start()
        r = pub.weight_update(master.items(), transforms=[{"match": "*", "cast": "bf16"}])
        assert r.transformed == len(master)
        assert r.bytes == sum(t.numel() * 2 for t in master.values())
        want = sha256_of({n: t.to(torch.bfloat16) for n, t in master.items()})
        assert engine.call("digest") == want
    finally:
        engine.close()
        pub.close()


# ---- many senders: each trainer rank quantizes the rows it holds ----------------------------

def _sharded_specs():
    """Two trainer ranks split every matrix's rows at `cut`; the norm is whole on both (replicated)."""
    return {"l.q_proj.weight": (256, 200), "l.k_proj.weight": (256, 200), "l.down_proj.weight": (300, 140),
            "l.norm.weight": (200,)}


def _sharded_weights(seed):
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for n, s in _sharded_specs().items()}


def _rows(weights, rank, cut):
    """This rank's part: rows [0, cut) on rank 0, [cut, end) on rank 1; the norm whole on both."""
    from paramcast.reshard import Shard

    out = []
    for name, t in weights.items():
        if t.dim() == 1:
            out.append((name, t))
            continue
        a, b = (0, cut) if rank == 0 else (cut, t.shape[0])
        out.append((name, Shard(t[a:b].contiguous(), list(t.shape), [a, 0])))
    return out


def _rank_main(conn, cfg, steps):
    """Trainer rank 1: for each (seed, cut, transforms-or-None) it is sent, publishes its rows."""
    import paramcast

    torch.set_num_threads(1)
    me = paramcast.PublisherRank(cfg, 1).start()
    try:
        while True:
            cmd = conn.recv()
            if cmd is None:
                break
            seed, cut = cmd
            try:
                r = me.weight_update(_rows(_sharded_weights(seed), 1, cut))
                conn.send(("ok", r.version, r.transformed))
            except paramcast.UpdateError as e:
                conn.send(("error", 0, str(e)))
    finally:
        me.close()


SHARDED_RULES = [{"match": "*norm*", "keep": True}, {"match": "*k_proj.weight", "fp8": "channel"},
                 {"match": "*proj.weight", "fp8": "block"}]


def _sharded_expected(weights):
    out = {}
    for name, t in weights.items():
        if t.dim() == 1:
            out[name] = t
            continue
        q, s = ref.quantize(t, "channel" if "k_proj" in name else "block")
        out[name], out[name + "_scale_inv"] = q, s
    return out


@needs_fp8
def test_each_trainer_rank_quantizes_its_own_rows_and_engines_hold_the_reference_of_the_whole():
    import spawning

    cfg = config_dict(subscribers=1)
    cfg["publisher"]["ranks"] = 2
    cfg["publisher"]["transforms"] = SHARDED_RULES
    want0 = _sharded_expected(_sharded_weights(1))
    specs = [(n, "F8_E4M3" if t.dtype == torch.float8_e4m3fn else "F32" if t.dtype == torch.float32 else "BF16",
              tuple(t.shape)) for n, t in want0.items()]
    pub = paramcast.Publisher(cfg)
    rank_cfg = dict(cfg, control=dict(cfg["control"], endpoint=pub.endpoint))
    ctx = spawning.context()
    parent, child = ctx.Pipe()
    rank1 = ctx.Process(target=_rank_main, args=(child, rank_cfg, 3), daemon=True)
    rank1.start()
    engine = BulkEngine(pub.endpoint, "engine-1", "inplace", cfg, specs, engine_buffers)
    try:
        engine.wait_ready()
        pub.start()
        # Rows split at 128: every block (and every row) within one rank.
        for seed in (1, 2):
            weights = _sharded_weights(seed)
            parent.send((seed, 128))
            r = pub.weight_update_sharded(_rows(weights, 0, 128))
            status, version, transformed = parent.recv()
            assert status == "ok" and version == r.version, (status, version, transformed)
            assert r.transformed == 3 and transformed == 3
            want = sha256_of({n: t.contiguous() for n, t in _sharded_expected(weights).items()})
            got = engine.call("digest")
            bad = [n for n in want if got.get(n) != want[n]]
            assert not bad, f"engine differs from the reference of the whole tensors at v{version}: {bad}"
            assert engine.call("state") == ("consistent", r.version)
        # Rows split at 100: a block would straddle the two senders. Each rank
        # refuses its own part, and rank 0 the update, before any byte moves.
        before = engine.call("digest")
        parent.send((3, 100))
        with pytest.raises(paramcast.UpdateError, match=r"straddle two senders") as err:
            pub.weight_update_sharded(_rows(_sharded_weights(3), 0, 100))
        assert "rows [0, 100)" in str(err.value), str(err.value)
        status, _, text = parent.recv()
        assert status == "error" and "rows [100, 256)" in text, text
        assert engine.call("digest") == before
        # Rank 0's rows are aligned, rank 1's are not (it starts at 120): rank
        # 1 says so to rank 0, whose call ends at once naming it (not at
        # update_timeout, 60 s here).
        parent.send((4, 120))
        t0 = time.monotonic()
        with pytest.raises(paramcast.UpdateError, match=r"trainer-1 cannot publish its part: shard of .* rows \[120, "
                                                        r"256\).*straddle two senders"):
            pub.weight_update_sharded(_rows(_sharded_weights(4), 0, 128))
        assert time.monotonic() - t0 < 30
        status, _, text = parent.recv()
        assert status == "error" and "rows [120, 256)" in text, text
        assert engine.call("digest") == before
        # And the next update goes through.
        parent.send((5, 128))
        r = pub.weight_update_sharded(_rows(_sharded_weights(5), 0, 128))
        assert parent.recv()[0] == "ok"
        want = sha256_of({n: t.contiguous() for n, t in _sharded_expected(_sharded_weights(5)).items()})
        assert engine.call("digest") == {**engine.call("digest"), **want}
    finally:
        parent.send(None)
        rank1.join(30)
        engine.close()
        pub.close()
