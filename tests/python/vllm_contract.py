"""What vLLM (0.33.0) puts around a weight-transfer backend, for driving ParamCast's without vLLM or a GPU.

- ``VllmStyleLlama``: a Llama with vLLM's parameter layout on one tensor-parallel rank (fused
  ``qkv_proj`` and ``gate_up_proj``, column- and row-parallel shards, vocabulary-parallel embeddings)
  and vLLM's ``load_weights(Iterable[(checkpoint name, tensor)]) -> set[str]`` (stacked_params_mapping,
  each shard narrowed from the full checkpoint tensor). Like vLLM's layerwise reload it keeps the
  tensors it was given until the round finishes, so a backend that reused them would be caught.
- ``worker_main``: one vLLM GPU worker process (``vllm/v1/worker/gpu_worker.py``): the engine is
  created after the model as ``engine_cls(config, vllm_config, device, model)`` and each RPC does what
  the worker's method of the same name does, in the same order, with the same checks.
- ``Client``: the trainer's VLLMWeightSyncClient: each call is a collective RPC to every worker.

The parts the other imitated-vLLM tests share (test_vllm_tp_slices.py, test_vllm_moe_slices.py,
test_vllm_fp8.py; their models vllm_tp_model.py, vllm_moe_model.py, vllm_fp8_model.py):

- ``serve_worker``: the worker process main with the model as a parameter (``make_model``), and the
  test's own RPCs (``make_checks``); ``make_engine``, ``gpu_worker_rpcs`` and ``serve`` (the RPC loop)
  are its steps. ``worker_main`` is ``serve_worker`` with a ``VllmStyleLlama``.
- ``start_cluster``: the trainer's engine (rank 0 of 1) over ``tp`` worker processes, a ``Client``.
- ``ModuleSource``: vLLM's WeightSource over a module.
- ``load_stacked``: vLLM's ``load_weights`` loop over a model's parallel layers (``stacked_params_mapping``,
  then each layer's ``weight_loader``); ``slice_report``: what a worker holds against its slices.
"""

import dataclasses
import threading
import types

import torch

import spawning


def expected_shard(name, full, rank, tp, cfg):
    """The slice of checkpoint tensor ``full`` that TP rank ``rank`` holds under vLLM parameter ``name``."""
    def rows(t):
        n = t.shape[0] // tp
        return t[rank * n:(rank + 1) * n]

    def cols(t):
        n = t.shape[1] // tp
        return t[:, rank * n:(rank + 1) * n]

    if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight",
                      "embed_tokens.weight")) or name == "lm_head.weight":
        return rows(full)
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return cols(full)
    return full  # norms: replicated


class VllmStyleLlama(torch.nn.Module):
    def __init__(self, cfg, rank, tp):
        super().__init__()
        self.cfg, self.rank, self.tp = cfg, rank, tp
        h, inter, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
        hd = h // cfg.num_attention_heads
        self.q_size = cfg.num_attention_heads * hd // tp
        self.kv_size = cfg.num_key_value_heads * hd // tp
        p = {"model.embed_tokens.weight": (v // tp, h), "model.norm.weight": (h,), "lm_head.weight": (v // tp, h)}
        for i in range(cfg.num_hidden_layers):
            pre = f"model.layers.{i}."
            p[pre + "self_attn.qkv_proj.weight"] = (self.q_size + 2 * self.kv_size, h)
            p[pre + "self_attn.o_proj.weight"] = (h, cfg.num_attention_heads * hd // tp)
            p[pre + "mlp.gate_up_proj.weight"] = (2 * inter // tp, h)
            p[pre + "mlp.down_proj.weight"] = (h, inter // tp)
            p[pre + "input_layernorm.weight"] = (h,)
            p[pre + "post_attention_layernorm.weight"] = (h,)
        self.params = torch.nn.ParameterDict()
        self._names = {}
        for name, shape in p.items():
            key = name.replace(".", "__")
            self._names[name] = key
            self.params[key] = torch.nn.Parameter(torch.full(shape, float("nan")), requires_grad=False)
        self.kept = []  # (tensor given to load_weights, its bytes when given): vLLM's loaders keep them
        self.threads = set()  # where load_weights ran: vLLM runs it on the worker's own thread

    def param(self, name):
        return self.params[self._names[name]]

    def load_weights(self, weights):
        stacked = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
                   (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]
        loaded = set()
        self.threads.add(threading.get_ident())
        for name, full in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            self.kept.append((full, full.clone()))
            shard = expected_shard(name, full, self.rank, self.tp, self.cfg)
            for fused, part, which in stacked:
                if part in name:
                    target = name.replace(part, fused)
                    dst = self.param(target)
                    if which == "q":
                        start = 0
                    elif which == "k":
                        start = self.q_size
                    elif which == "v":
                        start = self.q_size + self.kv_size
                    else:
                        start = which * dst.shape[0] // 2
                    dst.data[start:start + shard.shape[0]].copy_(shard)
                    loaded.add(target)
                    break
            else:
                dst = self.param(name)  # KeyError for a name this model does not have, as vLLM's
                if dst.shape != shard.shape:
                    raise ValueError(f"{name}: shard shape {tuple(shard.shape)} != parameter {tuple(dst.shape)}")
                dst.data.copy_(shard)
                loaded.add(name)
        return loaded

    def expected(self, hf_state):
        """Every parameter as it must be after loading checkpoint ``hf_state`` ({name: tensor})."""
        out = {}
        for name, full in hf_state.items():
            shard = expected_shard(name, full, self.rank, self.tp, self.cfg)
            out.setdefault(name.replace(".q_proj", ".qkv_proj").replace(".k_proj", ".qkv_proj")
                           .replace(".v_proj", ".qkv_proj").replace(".gate_proj", ".gate_up_proj")
                           .replace(".up_proj", ".gate_up_proj"), []).append(shard)
        return {n: torch.cat(parts) if len(parts) > 1 else parts[0] for n, parts in out.items()}


def make_engine(engine_cls_path, rank, tp, hf_config, model, device="cpu"):
    """The worker's weight-transfer engine, made after its model as vLLM makes it:
    ``engine_cls(config, vllm_config, device, model)`` (``device``: the worker's, as vLLM passes it).
    Returns (engine, its parallel config)."""
    import importlib

    module, cls = engine_cls_path.rsplit(".", 1)
    engine_cls = getattr(importlib.import_module(module), cls)
    parallel = types.SimpleNamespace(rank=rank, world_size=tp, data_parallel_index=0, data_parallel_rank=0)
    vllm_config = types.SimpleNamespace(parallel_config=parallel,
                                        model_config=types.SimpleNamespace(hf_config=hf_config))
    engine = engine_cls(types.SimpleNamespace(backend="paramcast"), vllm_config, torch.device(device), model)
    return engine, parallel


def gpu_worker_rpcs(engine, parallel, rank):
    """gpu_worker.py's weight-transfer RPC methods over ``engine``, in the same order, with the same
    checks: {method name: function}."""
    active = False

    def init_weight_transfer_engine(init_info):
        engine.init_transfer_engine(engine.parse_init_info(init_info))

    def start_weight_update():
        nonlocal active
        if active:
            raise RuntimeError("weight update already active")
        try:
            engine.start_weight_update()
        except Exception:
            engine.reset_weight_update_target()
            raise
        active = True

    def update_weights(update_info):
        nonlocal active
        if not active:
            raise RuntimeError("start_weight_update must be called first")
        local = update_info[parallel.data_parallel_index * parallel.world_size + rank] \
            if isinstance(update_info, list) else update_info
        try:
            engine.update_weights(local)
        except Exception:
            active = False
            engine.reset_weight_update_target()
            raise

    def finish_weight_update():
        nonlocal active
        if not active:
            raise RuntimeError("no active weight update")
        engine.finish_weight_update()
        engine.reset_weight_update_target()
        active = False

    def shutdown_weight_transfer_engine():
        if active:
            raise RuntimeError("cannot shut down during a weight update")
        engine.shutdown()

    return {f.__name__: f for f in (init_weight_transfer_engine, start_weight_update, update_weights,
                                    finish_weight_update, shutdown_weight_transfer_engine)}


def serve(conn, engine, calls):
    """The worker's RPC loop: says "ready", then answers each (name, kwargs) with ("ok", what
    ``calls[name](**kwargs)`` returned) or ("error", exception class name, message), until "exit"."""
    conn.send("ready")
    while True:
        name, kwargs = conn.recv()
        if name == "exit":
            engine.shutdown()  # vLLM's worker shutdown calls it again: it must be idempotent
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", calls[name](**kwargs)))
        except Exception as e:  # noqa: BLE001 - sent back as vLLM's collective_rpc raises it
            conn.send(("error", type(e).__name__, str(e)))


def serve_worker(conn, rank, tp, engine_cls_path, make_model, make_checks=None, device="cpu"):
    """One vLLM worker process (gpu_worker.py): ``make_model()`` -> (hf_config, model) builds its model,
    then its weight-transfer engine is made (``make_engine``, on ``device``), then it serves gpu_worker's
    RPCs and the test's own, ``make_checks(hf_config, model, engine)``'s functions under their names, until
    "exit"."""
    torch.set_num_threads(1)
    cfg, model = make_model()
    engine, parallel = make_engine(engine_cls_path, rank, tp, cfg, model, device)
    calls = gpu_worker_rpcs(engine, parallel, rank)
    if make_checks is not None:
        calls.update({f.__name__: f for f in make_checks(cfg, model, engine)})
    serve(conn, engine, calls)


def llama_check(model, hf_state):
    """What a test asks of a VllmStyleLlama worker after a round: parameters that differ from the
    trainer's (``bad``), ones never loaded, tensors handed to load_weights that changed after it
    returned (``clobbered``), and loads from threads other than this one; the last two reset."""
    want = model.expected(hf_state)
    bad = [n for n, t in want.items() if not torch.equal(model.param(n).data, t)]
    untouched = [n for n in model._names if n not in want]
    clobbered = sum(1 for given, then in model.kept if not torch.equal(given, then))
    model.kept.clear()
    other_threads = len(model.threads - {threading.get_ident()})
    model.threads.clear()
    return {"bad": bad, "untouched": untouched, "clobbered": clobbered, "other_threads": other_threads}


def worker_main(conn, rank, tp, llama_config_dict, engine_cls_path):
    """One vLLM worker: builds its model, then its weight-transfer engine, then serves RPCs."""
    def make_model():
        import transformers
        cfg = transformers.LlamaConfig(**llama_config_dict)
        return cfg, VllmStyleLlama(cfg, rank, tp)

    def make_checks(cfg, model, engine):
        # what the test asks of the worker
        def check(hf_state):
            return llama_check(model, hf_state)

        def parse(kind, info):
            getattr(engine, f"parse_{kind}_info")(info)

        return check, parse

    serve_worker(conn, rank, tp, engine_cls_path, make_model, make_checks)


def load_stacked(model, weights, stacked, route=None):
    """vLLM's ``load_weights`` over ``model``'s parallel layers: each (checkpoint name, full tensor) of
    ``weights`` counted in ``model.load_calls``/``load_bytes``; taken by ``route(name, tensor)`` where it
    returns true (a MoE block's experts); else renamed by the first (fused, part, shard id) of ``stacked``
    (vLLM's stacked_params_mapping) whose part it contains and given to its layer's ``weight_loader``
    (with the shard id where one matched), or copied whole where the layer has none (vLLM's
    default_weight_loader: norms). Returns the names of the parameters loaded."""
    params = dict(model.named_parameters())
    loaded = set()
    for name, full in weights:
        model.load_calls += 1
        model.load_bytes += full.numel() * full.element_size()
        if route is not None and route(name, full):
            continue
        for fused, part, shard_id in stacked:
            if part in name:
                name = name.replace(part, fused)
                break
        else:
            shard_id = None
        param = params[name]  # KeyError for a name this model does not have, as vLLM's
        module = model.get_submodule(name.rpartition(".")[0])
        if not hasattr(module, "weight_loader"):  # vLLM's default_weight_loader (norms)
            param.data.copy_(full)
        elif shard_id is None:
            module.weight_loader(param, full)
        else:
            module.weight_loader(param, full, shard_id)
        loaded.add(name)
    return loaded


def _nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def slice_report(model, want, cuts, ckpt):
    """What a worker serving slices holds, against ``want`` ({parameter name: its first rows as they must
    be}; rows past them, the vocabulary's padding, must be untouched NaN), and what its slices ``cuts``
    ({checkpoint name: slice}) and the whole checkpoint ``ckpt`` weigh; resets the model's load counters."""
    bad, padding_written = [], []
    for name, param in model.named_parameters():
        loaded = want.get(name)
        if loaded is None or not torch.equal(param.data[:loaded.shape[0]], loaded):
            bad.append(name)
        elif not torch.isnan(param.data[loaded.shape[0]:].float()).all():
            padding_written.append(name)
    report = {"bad": bad, "padding_written": padding_written, "load_calls": model.load_calls,
              "load_bytes": model.load_bytes, "slice_bytes": _nbytes(cuts.values()),
              "layer0_slice_bytes": _nbytes(t for n, t in cuts.items() if n.startswith("model.layers.0.")),
              "whole_bytes": _nbytes(ckpt.values())}
    model.load_calls = model.load_bytes = 0
    return report


class WorkerError(RuntimeError):
    pass


class Client:
    """The trainer's VLLMWeightSyncClient over ``tp`` worker processes (collective_rpc semantics)."""

    def __init__(self, tp, llama_config_dict, engine_cls_path="paramcast.integrations.vllm.ParamCastWeightTransferEngine",
                 target=worker_main):
        ctx = spawning.context(spawning.LLAMA)
        self.conns, self.procs = [], []
        for rank in range(tp):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=target, args=(child, rank, tp, llama_config_dict, engine_cls_path),
                               daemon=True, name=f"vllm-worker-{rank}")
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        for rank, c in enumerate(self.conns):
            assert c.poll(120), f"worker {rank} did not start within 120 s"
            assert c.recv() == "ready"

    def rpc(self, name, timeout=120, **kwargs):
        for c in self.conns:
            c.send((name, kwargs))
        results, errors = [], []
        for rank, c in enumerate(self.conns):
            assert c.poll(timeout), f"worker {rank}: no answer to {name} within {timeout} s"
            answer = c.recv()
            if answer[0] == "ok":
                results.append(answer[1])
            else:
                errors.append(f"worker {rank}: {answer[1]}: {answer[2]}")
        if errors:
            raise WorkerError(f"{name}: " + "; ".join(errors))
        return results

    # VLLMWeightSyncClient
    def init_weight_transfer_engine(self, init_info):
        self.rpc("init_weight_transfer_engine", init_info=init_info)

    def start_weight_update(self):
        self.rpc("start_weight_update")

    def update_weights(self, update_info):
        self.rpc("update_weights", update_info=update_info)

    def finish_weight_update(self, weight_version=None):
        self.rpc("finish_weight_update")

    def close(self):
        for c, p in zip(self.conns, self.procs):
            try:
                c.send(("exit", {}))
                c.poll(20)
            except (BrokenPipeError, OSError):
                pass
            p.join(20)
            if p.is_alive():
                p.kill()


@dataclasses.dataclass(frozen=True)
class ParamMeta:  # vLLM's ParamMeta(name, dtype, shape)
    name: str
    dtype: torch.dtype
    shape: tuple


class ModuleSource:
    """vLLM's WeightSource over a module: ``metadata`` and ``iter_full()`` of (checkpoint name, tensor)."""

    def __init__(self, module):
        self.module = module
        self.metadata = [ParamMeta(n, p.dtype, tuple(p.shape)) for n, p in module.named_parameters()]

    def iter_full(self):
        for name, p in self.module.named_parameters():
            yield name, p.detach()


def start_cluster(tp, spec, worker, trainer_model, source=ModuleSource, **init_info):
    """The trainer's weight-transfer engine (paramcast.integrations.vllm's, rank 0 of 1) over ``tp`` worker
    processes (a ``Client``: ``worker(conn, rank, tp, spec, engine_cls_path)`` each): returns (client,
    trainer engine, trainer model). ``trainer_model()`` makes the trainer's model, ``source(model)`` its
    WeightSource; ``init_info``: further ParamCastTrainerInitInfo fields (engine_init, transforms).
    A failed start closes the workers."""
    from paramcast.integrations import vllm as backend

    from cluster import config_dict
    client = Client(tp, spec, target=worker)
    try:
        info = backend.ParamCastTrainerInitInfo(
            config=config_dict(subscribers=tp), rank=0, **init_info,
            engine_config={k: v for k, v in config_dict().items() if k != "publisher"})
        model = trainer_model()
        trainer = backend.ParamCastTrainerWeightTransferEngine.trainer_init(info, client=client, source=source(model))
    except BaseException:
        client.close()
        raise
    return client, trainer, model
