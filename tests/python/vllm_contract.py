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
"""

import multiprocessing
import threading
import types

import torch


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


def worker_main(conn, rank, tp, llama_config_dict, engine_cls_path):
    """One vLLM worker: builds its model, then its weight-transfer engine, then serves RPCs."""
    import importlib

    import transformers
    torch.set_num_threads(1)
    cfg = transformers.LlamaConfig(**llama_config_dict)
    model = VllmStyleLlama(cfg, rank, tp)
    module, cls = engine_cls_path.rsplit(".", 1)
    engine_cls = getattr(importlib.import_module(module), cls)
    parallel = types.SimpleNamespace(rank=rank, world_size=tp, data_parallel_index=0, data_parallel_rank=0)
    vllm_config = types.SimpleNamespace(parallel_config=parallel, model_config=types.SimpleNamespace(hf_config=cfg))
    engine = engine_cls(types.SimpleNamespace(backend="paramcast"), vllm_config, torch.device("cpu"), model)
    active = False

    # gpu_worker.py's RPC methods
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

    # what the test asks of the worker
    def check(hf_state):
        want = model.expected(hf_state)
        bad = [n for n, t in want.items() if not torch.equal(model.param(n).data, t)]
        untouched = [n for n in model._names if n not in want]
        clobbered = sum(1 for given, then in model.kept if not torch.equal(given, then))
        model.kept.clear()
        other_threads = len(model.threads - {threading.get_ident()})
        model.threads.clear()
        return {"bad": bad, "untouched": untouched, "clobbered": clobbered, "other_threads": other_threads}

    def parse(kind, info):
        getattr(engine, f"parse_{kind}_info")(info)

    calls = {f.__name__: f for f in (init_weight_transfer_engine, start_weight_update, update_weights,
                                      finish_weight_update, shutdown_weight_transfer_engine, check, parse)}
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


class WorkerError(RuntimeError):
    pass


class Client:
    """The trainer's VLLMWeightSyncClient over ``tp`` worker processes (collective_rpc semantics)."""

    def __init__(self, tp, llama_config_dict, engine_cls_path="paramcast.integrations.vllm.ParamCastWeightTransferEngine",
                 target=worker_main):
        ctx = multiprocessing.get_context("spawn")
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
