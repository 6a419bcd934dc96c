"""Streamed and partial updates from Python, with real processes:

- a sharded trainer: PyTorch FSDP2 (fully_shard) on CPU over Gloo, 2 ranks,
  a LLaMA model with Hugging Face names (transformers, random weights from a
  config); rank 0 gathers one parameter at a time (full_tensor()) and
  streams it; the engines must hold the trainer's bytes exactly;
- the publisher's peak RSS while streaming a ~1 GiB model with 64 MiB buckets;
- out-of-order sends, a bad send, an exception inside the block;
- LoRA-style partial updates (only *.lora_A/B).
"""

import os
import time

import pytest

torch = pytest.importorskip("torch")
import paramcast  # noqa: E402

from cluster import BulkEngine, config_dict, sha256_of  # noqa: E402

MiB = 1 << 20


def _fsdp2_available():
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    if (major, minor) < (2, 6):  # before FSDP2 (and 1.13's torch.distributed.fsdp fails to import on 3.11)
        return False
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def zeros_like_specs(specs):
    """Engine buffers for (name, dtype name, shape) specs, zeroed."""
    dtypes = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}
    return {name: torch.zeros(shape, dtype=dtypes[dtype]) for name, dtype, shape in specs}


def start_engines(pub, cfg, specs, modes):
    engines = [BulkEngine(pub.endpoint, f"engine-{i + 1}", mode, cfg, specs, zeros_like_specs)
               for i, mode in enumerate(modes)]
    for e in engines:
        e.wait_ready()
    return engines


def close_all(engines, pub=None):
    for e in engines:
        e.close()
    if pub is not None:
        pub.close()


# ------------------------------------------------------------ small streams
@pytest.fixture(scope="module")
def small():
    torch.manual_seed(0)
    model = {}
    for layer in range(3):
        p = f"model.layers.{layer}.self_attn.q_proj"
        model[f"{p}.weight"] = torch.randn(128, 128).to(torch.bfloat16)
        model[f"{p}.lora_A.weight"] = torch.randn(8, 128).to(torch.bfloat16)
        model[f"{p}.lora_B.weight"] = torch.randn(128, 8).to(torch.bfloat16)
    model["lm_head.weight"] = torch.randn(512, 128).to(torch.bfloat16)  # larger than direct_min: sent straight
    cfg = config_dict(subscribers=2)
    pub = paramcast.Publisher(cfg)
    specs = paramcast.manifest(model.items())
    engines = start_engines(pub, cfg, specs, ["inplace", "callback"])
    pub.start()
    yield pub, model, engines
    close_all(engines, pub)


def held_everywhere(engines, tensors, version):
    want = sha256_of(tensors)
    for e in engines:
        assert e.call("state") == ("consistent", version), e.worker_id
        got = e.call("digest")
        for name, h in want.items():
            assert got.get(name) == h, f"{e.worker_id}: '{name}' differs from the trainer's"


def test_an_update_inside_an_open_stream_fails_at_once_instead_of_waiting_for_itself(small):
    pub, model, engines = small
    with pub.stream(paramcast.manifest(model.items())) as u:
        for call in (lambda: pub.weight_update(model.items()), lambda: pub.stream(model.items()),
                     lambda: pub.weight_update_async(model.items())):
            with pytest.raises(RuntimeError, match="a streamed update is open on this thread"):
                call()
        for name, t in model.items():
            u.send(name, t)
    assert u.result.ok
    held_everywhere(engines, model, u.result.version)
    assert pub.weight_update(model.items()).ok  # the lock was released with the stream


def test_out_of_order_stream_is_bit_exact_and_frees_each_tensor(small):
    pub, model, engines = small
    for step in range(2):
        for t in model.values():
            t.add_(1.0)
        names = list(model)[::-1] if step == 0 else sorted(model)
        with pub.stream(paramcast.manifest(model.items())) as u:
            for name in names:
                scratch = model[name].clone()
                u.send(name, scratch)
                scratch.fill_(float("nan"))  # overwritten at once: send() staged or sent it
        assert u.result.ok and u.result.tensors == len(model)
        held_everywhere(engines, model, u.result.version)


def test_bad_send_names_it_and_an_exception_aborts_leaving_engines_dirty(small):
    pub, model, engines = small
    with pytest.raises(ValueError, match="tensor 'nope' is not in the update's manifest"):
        with pub.stream(model.items()) as u:
            u.send("nope", torch.zeros(3))
    with pytest.raises(ValueError, match=r"shape expected \[512, 128\], got \[128, 512\]"):
        with pub.stream(model.items()) as u:
            u.send("lm_head.weight", torch.zeros(128, 512, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="the trainer failed"):
        with pub.stream(model.items()) as u:
            version = u.version
            u.send("lm_head.weight", model["lm_head.weight"])
            raise RuntimeError("the trainer failed")
    deadline = time.monotonic() + 30
    for e in engines:
        while e.call("state")[0] != "dirty" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert e.call("state")[0] == "dirty", f"{e.worker_id} does not say it is dirty after v{version} was aborted"
    result = pub.weight_update(model.items())  # the next update heals every engine
    held_everywhere(engines, model, result.version)


def test_rejected_manifest_raises_before_the_block_and_moves_nothing(small):
    pub, model, engines = small
    result = pub.weight_update(model.items())
    wrong = [(n, d, s if n != "lm_head.weight" else [511, 128]) for n, d, s in paramcast.manifest(model.items())]
    with pytest.raises(paramcast.UpdateError) as err:
        with pub.stream(wrong):
            pytest.fail("the block ran although the plan was rejected")
    assert "'lm_head.weight': shape expected [512, 128], got [511, 128]" in str(err.value)
    held_everywhere(engines, model, result.version)


def test_lora_partial_updates_keep_every_other_tensor(small):
    pub, model, engines = small
    base = pub.weight_update(model.items())
    lora = {n: t for n, t in model.items() if ".lora_" in n}
    with pytest.raises(paramcast.UpdateError, match="registered by the subscriber but missing from the update"):
        pub.weight_update(lora.items())
    for step in range(2):
        for t in lora.values():
            t.mul_(0.5)
        if step == 0:
            result = pub.weight_update(lora.items(), partial=True)
        else:
            with pub.stream(lora.items(), partial=True) as u:
                for name, t in reversed(list(lora.items())):
                    u.send(name, t)
            result = u.result
        assert result.version > base.version and result.bytes == sum(t.numel() * 2 for t in lora.values())
        # The in-place engine holds the adapters' new bytes and every other tensor's old ones.
        inplace = engines[0]
        assert inplace.call("state") == ("consistent", result.version)
        got = inplace.call("digest")
        for name, h in sha256_of(model).items():
            assert got[name] == h, f"'{name}' differs after a partial update"


# --------------------------------------------------------- bounded memory
def _rss_trainer(conn, cfg, specs):
    """Streams `specs` (generated one at a time, freed after each send) and
    reports its resident set before and at its peak (VmHWM, reset first)."""
    import paramcast as pc

    torch.set_num_threads(1)

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    pub = pc.Publisher(cfg)
    conn.send(pub.endpoint)
    pub.start()
    dtypes = {"BF16": torch.bfloat16}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    idle = status("VmRSS:")
    with pub.stream(specs) as u:
        for i, (name, dtype, shape) in enumerate(specs):
            t = torch.full(shape, float(i % 7) - 3.0, dtype=dtypes[dtype])
            u.send(name, t)
            del t
    peak = status("VmHWM:")
    conn.send((idle, peak, u.result.bytes, u.result.ok))
    conn.recv()
    pub.close()


def test_publisher_memory_stays_within_three_buckets_of_idle_while_streaming_1gib():
    import multiprocessing

    bucket = 64 * MiB
    cfg = config_dict(subscribers=2)
    cfg["data_plane"].update({"bucket_size": "64MiB", "direct_min_size": "48MiB", "checksum": "none"})
    cfg["publisher"]["update_timeout"] = "300s"
    # The staging bound alone: a delta baseline (publisher.delta, on by
    # default) is a copy of the model in host memory by design.
    cfg["publisher"]["delta"] = "off"
    # LLaMA-shaped: 10 layers of 4 attention (8 MiB) and 3 MLP (22 MiB)
    # matrices, 32 MiB embeddings and head, the norms: ~1.03 GiB in bf16,
    # packed into 64 MiB buckets (none reaches direct_min_size).
    h, ffn, vocab = 2048, 5632, 8192
    specs = [("model.embed_tokens.weight", "BF16", [vocab, h])]
    for layer in range(10):
        p = f"model.layers.{layer}"
        specs += [(f"{p}.self_attn.{m}.weight", "BF16", [h, h]) for m in ("q_proj", "k_proj", "v_proj", "o_proj")]
        specs += [(f"{p}.mlp.gate_proj.weight", "BF16", [ffn, h]), (f"{p}.mlp.up_proj.weight", "BF16", [ffn, h]),
                  (f"{p}.mlp.down_proj.weight", "BF16", [h, ffn])]
        specs += [(f"{p}.input_layernorm.weight", "BF16", [h]), (f"{p}.post_attention_layernorm.weight", "BF16", [h])]
    specs += [("model.norm.weight", "BF16", [h]), ("lm_head.weight", "BF16", [vocab, h])]
    total = sum(2 * (s[0] * s[1] if len(s) == 2 else s[0]) for _, _, s in specs)
    assert total > 1 << 30

    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    trainer = ctx.Process(target=_rss_trainer, args=(child, cfg, specs), daemon=True)
    # What is measured is the publisher, not glibc's heuristics: with its
    # mmap threshold fixed, every freed tensor goes back to the system at
    # once (by default the threshold rises to the largest block freed, and
    # freed tensors linger in the heap).
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 * MiB)
    try:
        trainer.start()
    finally:
        del os.environ["MALLOC_MMAP_THRESHOLD_"]
    engines = []
    try:
        assert conn.poll(120), "the trainer did not start"
        endpoint = conn.recv()
        engines = [BulkEngine(endpoint, "engine-1", "inplace", cfg, specs, zeros_like_specs),
                   BulkEngine(endpoint, "engine-2", "callback", cfg, specs, zeros_like_specs)]
        for e in engines:
            e.wait_ready()
        assert conn.poll(280), "the streamed update did not finish"
        idle, peak, sent, ok = conn.recv()
        conn.send("done")
        assert ok and sent == total
        grew = peak - idle
        print(f"publisher RSS: idle {idle / MiB:.0f} MiB, peak {peak / MiB:.0f} MiB (+{grew / MiB:.0f} MiB) "
              f"streaming {total / MiB:.0f} MiB with {bucket // MiB} MiB buckets")
        # Staging is two buckets; the rest is one 32 MiB tensor at a time.
        assert grew < 3 * bucket, f"the publisher grew by {grew / MiB:.0f} MiB, above 3 buckets"
        for e in engines:
            assert e.call("state") == ("consistent", 1)
        # Every engine holds the generated bytes.
        dtypes = {"BF16": torch.bfloat16}
        for i, (name, dtype, shape) in enumerate(specs[:3] + specs[-2:]):
            j = specs.index((name, dtype, shape))
            want = sha256_of({name: torch.full(shape, float(j % 7) - 3.0, dtype=dtypes[dtype])})[name]
            for e in engines:
                assert e.call("digest")[name] == want, f"{e.worker_id}: '{name}'"
    finally:
        close_all(engines)
        trainer.join(30)
        if trainer.is_alive():
            trainer.kill()


# ------------------------------------------------------- a sharded trainer
def _llama(seed):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def llama_engine_buffers(specs):
    """An engine's own LLaMA (another seed): its parameters are the registered buffers."""
    model = _llama(seed=99).to(torch.bfloat16)
    params = dict(model.named_parameters())
    assert [n for n, _, _ in specs] == list(params), "engine and trainer disagree on the model"
    return {n: p.detach() for n, p in params.items()}


def _fsdp_rank(rank, world, store_port, conn, cfg, steps):
    """One FSDP2 rank: trains on its shard; rank 0 streams each parameter as it is gathered."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store_port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    model = _llama(seed=0)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pub = None
    if rank == 0:
        pub = paramcast.Publisher(cfg)
        conn.send(pub.endpoint)
        pub.start()
    manifest = [(n, "BF16", list(p.shape)) for n, p in model.named_parameters()]  # global shapes: metadata only
    g = torch.Generator().manual_seed(rank)
    for step in range(steps):
        ids = torch.randint(0, 512, (2, 16), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        sent = {}
        stream = pub.stream(manifest) if rank == 0 else None
        for name, p in model.named_parameters():
            full = p.full_tensor().detach().to(torch.bfloat16)  # a collective: every rank gathers
            if rank == 0:
                stream.send(name, full)
                sent[name] = sha256_of({name: full})[name]
            del full
        if rank == 0:
            result = stream.finish()
            conn.send((result.version, result.tensors, sent))
    if rank == 0:
        conn.recv()
        pub.close()
    dist.destroy_process_group()


@pytest.mark.skipif(not _fsdp2_available(), reason="needs PyTorch >= 2.6 (FSDP2 fully_shard) and transformers "
                    "(deploy/install-deps.sh installs torch 2.13 and transformers for the default python3)")
def test_fsdp2_sharded_trainer_streams_one_gathered_parameter_at_a_time():
    import spawning
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = config_dict(subscribers=2)
    cfg["data_plane"].update({"bucket_size": "256KiB", "direct_min_size": "64KiB"})
    steps = 3
    manifest = [(n, "BF16", list(p.shape)) for n, p in _llama(seed=0).named_parameters()]
    ctx = spawning.context(spawning.LLAMA)
    conn, child = ctx.Pipe()
    ranks = [ctx.Process(target=_fsdp_rank, args=(r, 2, port, child if r == 0 else None, cfg, steps), daemon=True)
             for r in range(2)]
    for p in ranks:
        p.start()
    engines = []
    try:
        assert conn.poll(120), "rank 0 did not start its publisher"
        endpoint = conn.recv()
        engines = [BulkEngine(endpoint, "engine-1", "inplace", cfg, manifest, llama_engine_buffers),
                   BulkEngine(endpoint, "engine-2", "callback", cfg, manifest, llama_engine_buffers)]
        for e in engines:
            e.wait_ready()
        for step in range(steps):
            assert conn.poll(240), f"step {step}: the streamed update did not finish"
            version, tensors, sent = conn.recv()
            assert tensors == len(manifest)
            for e in engines:
                assert e.call("state") == ("consistent", version), e.worker_id
                got = e.call("digest")
                bad = [n for n, h in sent.items() if got.get(n) != h]
                assert not bad, f"{e.worker_id} differs from the gathered parameters at v{version}: {bad[:3]}"
        conn.send("done")
    finally:
        close_all(engines)
        for p in ranks:
            p.join(30)
            if p.is_alive():
                p.kill()
