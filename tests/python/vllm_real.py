"""vLLM's own weight-transfer code, from the pinned wheel (fetch_vllm.py), around ParamCast's backend.

What runs is vLLM's, unmodified: ``vllm/distributed/weight_transfer/{base,factory,clients}.py`` and
``vllm/config/weight_transfer.py`` imported as modules; the worker's weight-transfer RPC methods
(``Worker`` in ``vllm/v1/worker/gpu_worker.py``) and the ``LLM``'s RL methods (``RLOfflineMixin`` in
``vllm/entrypoints/rl/offline.py``) compiled from the wheel's source, method by method, into classes
without their heavy bases (their modules import CUDA-bound parts of vLLM). Stubbed at the edges only
(``vllm_stubs/``, and here): vLLM's logger and config package, its layerwise reload (needs vLLM's
model layers), ``torch.accelerator.synchronize`` where there is no accelerator, the worker's model
runner (the model is ``vllm_contract.VllmStyleLlama``), the engine core's version store, and Ray's
``remote``/``get`` (a direct call) under vLLM's ``RayVLLMWeightSyncClient``.
"""

import ast
import contextlib
import importlib
import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
STUBS = os.path.join(HERE, "vllm_stubs")

WORKER_METHODS = ("_check_weight_transfer_engine", "init_weight_transfer_engine", "shutdown_weight_transfer_engine",
                  "start_weight_update", "_start_weight_update", "update_weights", "finish_weight_update")
LLM_METHODS = ("init_weight_transfer_engine", "shutdown_weight_transfer_engine", "start_weight_update",
               "update_weights", "finish_weight_update", "update_weight_version", "get_weight_version")


def use(src):
    """Puts vLLM's sources (``src``, from fetch_vllm.py) and the stubs on sys.path."""
    for path in (STUBS, src):
        if path not in sys.path:
            sys.path.insert(0, path)
    if not hasattr(__import__("torch"), "accelerator") or not __import__("torch").accelerator.is_available():
        import torch
        if hasattr(torch, "accelerator"):  # base.update_weights syncs the device: nothing to sync without one
            torch.accelerator.synchronize = lambda *a, **k: None


def compile_methods(path, class_name, names, globals_):
    """Class ``class_name`` of source file ``path`` with only the methods ``names``, as vLLM wrote them."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    methods = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in names]
    missing = set(names) - {m.name for m in methods}
    assert not missing, f"{path}: {class_name} has no {sorted(missing)}: not the vLLM this test pins"
    cls.body, cls.bases, cls.keywords, cls.decorator_list = methods, [], [], []
    module = ast.Module(body=[cls], type_ignores=[])
    exec(compile(module, path, "exec"), globals_)  # noqa: S102 - vLLM's own source from the pinned wheel
    return globals_[class_name]


def worker_main(conn, rank, tp, llama_config_dict, src):
    """One vLLM GPU worker: the model, then vLLM's factory makes the engine, then vLLM's RPC methods."""
    use(src)
    import tomllib

    import torch
    import transformers

    from vllm_contract import VllmStyleLlama, llama_check
    torch.set_num_threads(1)
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer import base as vbase
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.model_executor.model_loader import reload

    # vLLM's load_general_plugins runs each vllm.general_plugins entry point: the package declares one.
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        target = tomllib.load(f)["project"]["entry-points"]["vllm.general_plugins"]["paramcast"]
    module, func = target.split(":")
    getattr(importlib.import_module(module), func)()

    cfg = transformers.LlamaConfig(**llama_config_dict)
    model = VllmStyleLlama(cfg, rank, tp)
    parallel = types.SimpleNamespace(rank=rank, world_size=tp, data_parallel_index=0, data_parallel_rank=0)
    vllm_config = types.SimpleNamespace(parallel_config=parallel, model_config=types.SimpleNamespace(hf_config=cfg),
                                        weight_transfer_config=WeightTransferConfig(backend="paramcast"))
    in_config = []

    @contextlib.contextmanager
    def set_current_vllm_config(c):
        in_config.append(c)
        try:
            yield
        finally:
            in_config.pop()

    def draft_only(*_a, **_k):
        raise AssertionError("draft-model path: this worker has no draft model")

    Worker = compile_methods(os.path.join(src, "vllm/v1/worker/gpu_worker.py"), "Worker", WORKER_METHODS,
                             {"set_current_vllm_config": set_current_vllm_config, "torch": torch,
                              "restore_quantized_lm_heads": draft_only, "share_source_lm_heads": draft_only,
                              "__name__": "vllm.v1.worker.gpu_worker"})
    worker = Worker()
    worker.vllm_config, worker.rank = vllm_config, rank
    worker._weight_update_active = worker._weight_update_is_draft = False
    worker.get_draft_model = lambda: None
    worker.model_runner = types.SimpleNamespace(reset_lora_state=lambda: None)
    # Worker.load_model, after the model is loaded:
    worker.weight_transfer_engine = WeightTransferEngineFactory.create_engine(
        vllm_config.weight_transfer_config, vllm_config, torch.device("cpu"), model)

    def check(hf_state):
        return llama_check(model, hf_state)

    def state():
        engine = worker.weight_transfer_engine
        return {"reload": dict(reload.STATE), "active": worker._weight_update_active,
                "engine": type(engine).__module__ + "." + type(engine).__name__,
                "real_base": isinstance(engine, vbase.WeightTransferEngine), "base_file": vbase.__file__}

    calls = {name: getattr(worker, name) for name in WORKER_METHODS if not name.startswith("_")}
    calls.update(check=check, state=state)
    conn.send("ready")
    while True:
        name, kwargs = conn.recv()
        if name == "exit":
            worker.weight_transfer_engine.shutdown()  # Worker.shutdown calls it again: idempotent
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", calls[name](**kwargs)))
        except Exception as e:  # noqa: BLE001 - sent back as vLLM's collective_rpc raises it
            conn.send(("error", type(e).__name__, str(e)))


class EngineCore:
    """What LLM.llm_engine gives RLOfflineMixin: collective_rpc to the workers, the weight version."""

    def __init__(self, workers):
        self.workers = workers
        self.weight_version = "default"  # EngineCore._weight_version's initial value

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return self.workers.rpc(method, **(kwargs or {}))

    def set_weight_version(self, weight_version):
        self.weight_version = weight_version

    def get_weight_version(self):
        return self.weight_version


def llm_class(src):
    """vLLM's RLOfflineMixin (the LLM's RL methods), compiled from the wheel's source."""
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest
    return compile_methods(os.path.join(src, "vllm/entrypoints/rl/offline.py"), "RLOfflineMixin", LLM_METHODS,
                           {"WeightTransferInitRequest": WeightTransferInitRequest,
                            "WeightTransferUpdateRequest": WeightTransferUpdateRequest,
                            "__name__": "vllm.entrypoints.rl.offline"})


def fake_ray():
    """Ray's ``handle.method.remote(...)`` and ``ray.get`` as direct calls, for vLLM's RayVLLMWeightSyncClient."""
    ray = types.ModuleType("ray")
    ray.get = lambda refs: [r() for r in refs] if isinstance(refs, list) else refs()

    class Handle:
        def __init__(self, actor):
            self._actor = actor

        def __getattr__(self, name):
            method = getattr(self._actor, name)
            return types.SimpleNamespace(remote=lambda *a, **k: (lambda: method(*a, **k)))

    ray.Handle = Handle
    return ray
