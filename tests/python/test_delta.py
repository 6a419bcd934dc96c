"""Delta updates from a real training loop, with real processes: fp32 master
weights trained with AdamW at lr 1e-6, published in bf16; after the first
(dense) update only the elements that changed cross the wire, and every
engine (one applying deltas in place, one keeping its own copy for its
on_weights callback) holds the trainer's bytes exactly, update after
update; an engine that restarts gets one dense update, then deltas."""

import pytest

torch = pytest.importorskip("torch")
import paramcast  # noqa: E402

from cluster import BulkEngine, config_dict, sha256_of  # noqa: E402


def model_specs():
    """A small LLaMA-shaped stack (Hugging Face names), fp32 master weights of std 0.02."""
    h, ffn, vocab, layers = 256, 704, 1024, 4
    shapes = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}"
        for m in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"{p}.self_attn.{m}.weight"] = (h, h)
        shapes[f"{p}.mlp.gate_proj.weight"] = (ffn, h)
        shapes[f"{p}.mlp.up_proj.weight"] = (ffn, h)
        shapes[f"{p}.mlp.down_proj.weight"] = (h, ffn)
        shapes[f"{p}.input_layernorm.weight"] = (h,)
    shapes["lm_head.weight"] = (vocab, h)
    return shapes


def zeros_bf16(specs):
    return {name: torch.zeros(shape, dtype=torch.bfloat16) for name, _, shape in specs}


class Trainer:
    def __init__(self):
        torch.manual_seed(0)
        self.master = {n: torch.nn.Parameter(torch.randn(s) * 0.02) for n, s in model_specs().items()}
        self.opt = torch.optim.AdamW(self.master.values(), lr=1e-6, weight_decay=0.0)

    def step(self):
        loss = sum((p.float() ** 2).sum() * 1e-3 + p.sum() for p in self.master.values())
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()

    def published(self):
        return {n: p.detach().to(torch.bfloat16) for n, p in self.master.items()}


def test_ten_real_optimizer_steps_go_as_verified_deltas_and_a_restarted_engine_gets_dense_first():
    cfg = config_dict(subscribers=2)
    cfg["data_plane"].update({"bucket_size": "1MiB", "direct_min_size": "256KiB", "checksum": "none"})
    cfg["publisher"]["delta"] = "auto"
    cfg["subscriber"] = {"delta_baseline": "host"}
    trainer = Trainer()
    weights = trainer.published()
    specs = paramcast.manifest(weights.items())
    pub = paramcast.Publisher(cfg)
    engines = [BulkEngine(pub.endpoint, "engine-1", "inplace", cfg, specs, zeros_bf16),
               BulkEngine(pub.endpoint, "engine-2", "callback", cfg, specs, zeros_bf16)]
    try:
        for e in engines:
            e.wait_ready()
        pub.start()

        def publish_and_check(expect_delta):
            w = trainer.published()
            r = pub.weight_update(w.items())
            want = sha256_of(w)
            for e in engines:
                assert e.call("state") == ("consistent", r.version), e.worker_id
                got = e.call("digest")
                bad = [n for n in want if got.get(n) != want[n]]
                assert not bad, f"{e.worker_id} differs from the trainer at v{r.version}: {bad[:3]}"
            assert r.delta == expect_delta, f"v{r.version}: delta {r.delta}, dense because '{r.dense_because}'"
            return r

        first = publish_and_check(False)
        assert first.dense_because == "no baseline yet"
        ratios = []
        for _ in range(10):
            trainer.step()
            r = publish_and_check(True)
            ratios.append(r.wire_bytes / r.bytes)
        print("wire/dense per step:", " ".join(f"{x:.3f}" for x in ratios))
        assert max(ratios) < 0.10, f"a delta of lr 1e-6 steps took {max(ratios):.1%} of the dense bytes"
        assert pub.status()["baseline_bytes"] >= first.bytes

        # A streamed update (a sharded trainer's) keeps the same baseline: a delta too.
        trainer.step()
        w = trainer.published()
        with pub.stream(w.items()) as u:
            for name in reversed(list(w)):
                u.send(name, w[name].clone())
        assert u.result.delta and u.result.wire_bytes < u.result.bytes / 10, u.result.dense_because
        want = sha256_of(w)
        for e in engines:
            assert e.call("digest") == {**e.call("digest"), **want}, f"{e.worker_id} after the streamed delta"

        # engine-2 restarts: the group's next update is dense (it holds nothing), then deltas again.
        engines[1].close()
        engines[1] = BulkEngine(pub.endpoint, "engine-2", "callback", cfg, specs, zeros_bf16)
        engines[1].wait_ready()
        trainer.step()
        r = pub.weight_update(trainer.published().items())  # may re-form the group first
        assert not r.delta and "engine-2" in r.dense_because, r.dense_because
        trainer.step()
        publish_and_check(True)
    finally:
        for e in engines:
            e.close()
        pub.close()
