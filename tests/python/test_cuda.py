"""CUDA tensors end to end: a PyTorch trainer on cuda:0 and engine processes on cuda:0 over NCCL.

Every process here shares one GPU: each claims a host of its own (NCCL_HOSTID) and the ranks
talk over loopback sockets, the arrangement tests/gpu/run.sh uses (never a real node's). On a
machine without a CUDA device the whole file skips, saying so.
"""

import time

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device: the CUDA path is built but not run here "
                                       "(tests/gpu/run.sh runs it)")

import paramcast  # noqa: E402

import tinylm as tinymodel  # noqa: E402
from cluster import Engine, config_dict, cuda_config, kill_and_expect_named, share_one_gpu  # noqa: E402

DEVICE = "cuda:0"


def assert_same_weights(model, engine):
    want = tinymodel.unfused_state(model)
    got = engine.call("params")
    assert sorted(got) == sorted(want), engine.worker_id
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), f"{engine.worker_id}: {name} differs from the trainer's"


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def cluster(request):
    torch.set_num_threads(1)
    share_one_gpu("trainer")  # this process is the publisher's rank
    model = tinymodel.TinyLM(0, getattr(torch, request.param)).to(DEVICE)
    pub = paramcast.Publisher(cuda_config(config_dict(subscribers=2), DEVICE, side="publisher"))
    engines = []
    try:
        for worker, mode, seed in (("engine-1", "inplace", 1), ("engine-2", "fused", 2)):
            engines.append(Engine(pub.endpoint, worker, mode, request.param, seed, DEVICE))
        for e in engines:
            e.wait_ready()
        pub.start()
        yield model, pub, engines
    finally:
        for e in engines:
            e.close()
        pub.close()


def test_cuda_engines_match_the_trainer_bit_for_bit(cluster):
    model, pub, engines = cluster
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(3):
        result = pub.weight_update(model.named_parameters())
        assert result.ok and result.bytes == sum(p.numel() * p.element_size() for p in model.parameters())
        for e in engines:
            assert e.call("state") == ("consistent", result.version), e.worker_id
            assert_same_weights(model, e)
        # The fused engine loaded q, k and v through load_weights, as CUDA tensors.
        shards = engines[1].call("shards", result.version)
        assert len(shards) == 3 * 2 * tinymodel.LAYERS
        tinymodel.train_step(model, optimizer, seed=step)
    # One optimizer step on the GPU since the last update: the engines now differ.
    assert not torch.equal(engines[0].call("params")["lm_head.weight"], model.lm_head.weight.cpu())


def test_weights_written_on_a_side_stream_are_never_sent_stale(cluster):
    model, pub, engines = cluster
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.no_grad():
        # The writes below land about half a second after weight_update is called (a whole
        # update takes 15-40 ms here): it must order its reads after the caller's current
        # stream, not read what the tensors hold at the call.
        torch.cuda._sleep(1_000_000_000)
        for p in model.parameters():
            p.add_(1.0)
        result = pub.weight_update(model.named_parameters())
    torch.cuda.synchronize()
    assert result.ok
    for e in engines:
        assert_same_weights(model, e)


def test_a_lost_cuda_engine_is_named_within_seconds_and_a_new_one_heals_the_group(cluster):
    model, pub, engines = cluster
    kill_and_expect_named(pub, model, engines[1], "lost CUDA engine")
    # A new engine process takes the id; the next update forms a new NCCL group with it.
    dtype = str(model.lm_head.weight.dtype).removeprefix("torch.")
    engines[1] = Engine(pub.endpoint, "engine-2", "fused", dtype, 7, DEVICE)
    engines[1].wait_ready()
    deadline = time.monotonic() + 10
    while pub.status()["members"].get("engine-2") not in ("joined", "rejoined") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pub.status()["members"].get("engine-2") in ("joined", "rejoined"), pub.status()["members"]
    epoch = pub.status()["epoch"]
    result = pub.weight_update(model.named_parameters())
    assert pub.status()["epoch"] > epoch, "the group must re-form with the new engine-2"
    for e in engines:
        assert e.call("state") == ("consistent", result.version), e.worker_id
        assert_same_weights(model, e)


def test_cuda_deltas_are_encoded_and_applied_on_the_device_bit_exact():
    """A CUDA trainer and an in-place CUDA engine: after a small change the update goes as a
    delta (CUB compaction on the trainer's GPU, applied and verified on the engine's), bit-exact;
    an update with nothing changed moves almost nothing. With a callback engine in the group
    (the module's cluster) updates stay dense, saying why."""
    share_one_gpu("trainer")
    model = tinymodel.TinyLM(0, torch.bfloat16).to(DEVICE)
    cfg = cuda_config(config_dict(subscribers=1), DEVICE, side="publisher")
    cfg["publisher"]["delta"] = {"mode": "auto", "baseline": "device"}
    pub = paramcast.Publisher(cfg)
    engine = Engine(pub.endpoint, "engine-9", "inplace", "bfloat16", 9, DEVICE)
    try:
        engine.wait_ready()
        pub.start()
        first = pub.weight_update(model.named_parameters())
        assert first.ok and not first.delta, "the first update has no baseline to go against"
        with torch.no_grad():
            for p in model.parameters():
                p.view(-1)[::101] += 1.0  # about 1% of the elements
        second = pub.weight_update(model.named_parameters())
        assert second.ok and second.delta, second.dense_because
        assert second.wire_bytes < second.bytes // 4, (second.wire_bytes, second.bytes)
        assert_same_weights(model, engine)
        third = pub.weight_update(model.named_parameters())
        assert third.ok and third.delta and third.wire_bytes < 4096, third.wire_bytes
        assert engine.call("state") == ("consistent", third.version)
        assert_same_weights(model, engine)
    finally:
        engine.close()
        pub.close()


def test_a_cuda_callback_engine_keeps_updates_dense_and_says_why(cluster):
    model, pub, engines = cluster
    result = pub.weight_update(model.named_parameters())
    assert result.ok and not result.delta
    assert "engine-2 cannot apply deltas" in result.dense_because, result.dense_because


def test_engines_on_the_trainers_gpu_get_the_bytes_through_cuda_ipc():
    """backend shm on CUDA devices: the trainer's two slots are its GPU memory, opened by each
    engine through CUDA IPC; an in-place and a fused engine on the same GPU are bit-exact."""
    share_one_gpu("trainer")
    model = tinymodel.TinyLM(0, torch.float32).to(DEVICE)
    cfg = cuda_config(cuda_config(config_dict(subscribers=2), DEVICE, side="publisher"), DEVICE)
    cfg["data_plane"]["backend"] = "shm"  # every device cuda (a mixed shm plane is refused)
    pub = paramcast.Publisher(cfg)
    engines = []
    try:
        for worker, mode, seed in (("ipc-1", "inplace", 1), ("ipc-2", "fused", 2)):
            engines.append(Engine(pub.endpoint, worker, mode, "float32", seed, DEVICE))
        for e in engines:
            e.wait_ready()
        pub.start()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        for step in range(2):
            result = pub.weight_update(model.named_parameters())
            assert result.ok, result
            for e in engines:
                assert e.call("state") == ("consistent", result.version), e.worker_id
                assert_same_weights(model, e)
            tinymodel.train_step(model, optimizer, seed=step)
    finally:
        for e in engines:
            e.close()
        pub.close()


def _cuda_rank_main(endpoint, dtype, steps, out):
    """Trainer rank 1 of 2 on the shared GPU: the same model as rank 0, the same steps, and it
    publishes only its rows (the second half of dim 0 of every parameter)."""
    share_one_gpu("trainer-1")
    import paramcast
    import tinylm
    from paramcast.reshard import Shard

    torch.set_num_threads(1)
    model = tinylm.TinyLM(0, getattr(torch, dtype)).to(DEVICE)
    cfg = cuda_config(config_dict(endpoint=endpoint, subscribers=2), DEVICE, side="publisher")
    cfg["publisher"]["ranks"] = 2
    try:
        with paramcast.PublisherRank(cfg, 1) as rank:
            rank.start()
            for step in range(1, steps + 1):
                _cuda_step(model, step)
                r = rank.weight_update(_rows(model, 1, Shard), version=step)
                out.put(("ok", r.version))
    except Exception as e:  # the test reads it
        out.put(("error", repr(e)))


def _cuda_step(model, step):
    """The optimizer step both ranks take: a write on a side stream the update must wait for."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side), torch.no_grad():
        torch.cuda._sleep(20_000_000)  # the write lands well after the call is made
        for p in model.parameters():
            p.view(-1)[::7] += float(step)
    torch.cuda.current_stream().wait_stream(side)


def _rows(model, rank, Shard):
    """Rank `rank` of 2's rows (dim 0) of every parameter, as views of the model's own tensors."""
    out = []
    for name, p in model.named_parameters():
        half = p.shape[0] // 2
        first, count = (0, half) if rank == 0 else (half, p.shape[0] - half)
        offsets = [first] + [0] * (p.dim() - 1)
        out.append((name, Shard(p.detach().narrow(0, first, count), list(p.shape), offsets)))
    return out


def test_two_cuda_trainer_ranks_publish_their_rows_to_cuda_engines_bit_exact():
    """Many senders on the GPU: rank 0 (this process) and rank 1 (a process) each publish their
    rows of every parameter straight from the GPU (PublisherRank / weight_update_sharded, over
    NCCL point to point); two in-place CUDA engines hold the whole model, bit-exact, after each
    step. Each step's write runs on a side stream the update is ordered after."""
    import spawning
    from paramcast.reshard import Shard

    share_one_gpu("trainer")
    torch.set_num_threads(1)
    model = tinymodel.TinyLM(0, torch.bfloat16).to(DEVICE)
    cfg = cuda_config(cuda_config(config_dict(subscribers=2), DEVICE, side="publisher"), DEVICE)
    cfg["publisher"]["ranks"] = 2
    pub = paramcast.Publisher(cfg)
    ctx = spawning.context()
    out = ctx.Queue()
    rank1 = ctx.Process(target=_cuda_rank_main, args=(pub.endpoint, "bfloat16", 2, out), daemon=True)
    engines = []
    try:
        rank1.start()
        for worker, seed in (("engine-1", 1), ("engine-2", 2)):
            engines.append(Engine(pub.endpoint, worker, "inplace", "bfloat16", seed, DEVICE))
        for e in engines:
            e.wait_ready()
        pub.start()
        for step in (1, 2):
            _cuda_step(model, step)
            result = pub.weight_update_sharded(_rows(model, 0, Shard), version=step)
            assert result.ok and result.version == step, result
            assert "moves dense" in result.dense_because, result.dense_because
            assert out.get(timeout=60) == ("ok", step)
            for e in engines:
                assert e.call("state") == ("consistent", step), e.worker_id
                assert_same_weights(model, e)
    finally:
        for e in engines:
            e.close()
        pub.close()
        rank1.join(30)
        if rank1.is_alive():
            rank1.kill()
