"""The vLLM backend's tensor-parallel workers on a GPU: each worker's model lives on cuda:0 (vLLM's
layout, vllm_tp_model.py), it registers only the slices it serves straight into its fused parameters
there, and the trainer's engine publishes a bf16 Llama checkpoint from cuda:0 over NCCL.

test_vllm_tp_slices.py drives the same backend with the workers on the CPU (Gloo); this file is its GPU
half: the CUDA slices registered in place, the trainer's CUDA tensors sent point to point, each worker
receiving exactly its slices' bytes, bit for bit the trainer's. The checkpoint is built by hand under
Hugging Face's Llama names and shapes (no transformers needed on the GPU machine). Every process shares
one GPU, each claiming a host of its own (cluster.share_one_gpu), as tests/gpu/run.sh arranges; on a
machine without a CUDA device the file skips, saying so.
"""

import types

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device: the CUDA path is built but not run here "
                                       "(tests/gpu/run.sh runs it)")

import paramcast  # noqa: E402
from paramcast.integrations import vllm as backend  # noqa: E402

import vllm_contract  # noqa: E402
from cluster import config_dict, cuda_config, share_one_gpu  # noqa: E402

DEVICE = "cuda:0"
TP = 2
LLAMA = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, attention_bias=True)


def checkpoint(spec, seed):
    """{Hugging Face Llama name: bf16 tensor on the CPU}, the shapes LlamaForCausalLM has."""
    c = types.SimpleNamespace(**spec)
    hd = c.hidden_size // c.num_attention_heads
    g = torch.Generator().manual_seed(seed)
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for part, rows in (("q", c.num_attention_heads), ("k", c.num_key_value_heads), ("v", c.num_key_value_heads)):
            shapes[f"{p}self_attn.{part}_proj.weight"] = (rows * hd, c.hidden_size)
            shapes[f"{p}self_attn.{part}_proj.bias"] = (rows * hd,)
        shapes[f"{p}self_attn.o_proj.weight"] = (c.hidden_size, c.num_attention_heads * hd)
        shapes[f"{p}self_attn.o_proj.bias"] = (c.hidden_size,)
        shapes[f"{p}mlp.gate_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[f"{p}mlp.up_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[f"{p}mlp.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
        shapes[f"{p}input_layernorm.weight"] = (c.hidden_size,)
        shapes[f"{p}post_attention_layernorm.weight"] = (c.hidden_size,)
    shapes["model.norm.weight"] = (c.hidden_size,)
    shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}


def worker_main(conn, rank, tp, spec, engine_cls_path):
    """One vLLM worker on cuda:0 (vllm_contract.serve_worker: gpu_worker.py's RPCs)."""
    share_one_gpu(f"vllm-worker-{rank}")  # before NCCL reads its environment
    import vllm_tp_model

    def make_model():
        cfg = types.SimpleNamespace(**spec)
        return cfg, vllm_tp_model.LlamaForCausalLM(cfg, rank, tp).to(DEVICE)

    def make_checks(cfg, model, engine):
        def check(hf_state):
            """slice_report on the GPU: every parameter against its slices, the padding rows untouched."""
            want = {n: t.to(DEVICE) for n, t in vllm_tp_model.expected_params(cfg, hf_state, rank, tp).items()}
            report = vllm_contract.slice_report(model, want, vllm_tp_model.expected_slices(cfg, hf_state, rank, tp),
                                                hf_state)
            report["devices"] = sorted({str(p.device) for p in model.parameters()})
            return report

        return (check,)

    vllm_contract.serve_worker(conn, rank, tp, engine_cls_path, make_model, make_checks, device=DEVICE)


class CheckpointSource:
    """vLLM's WeightSource over {name: CUDA tensor}."""

    def __init__(self, state):
        self.state = state
        self.metadata = [vllm_contract.ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in state.items()]

    def iter_full(self):
        yield from self.state.items()


def test_tp_workers_on_the_gpu_receive_only_their_slices_into_their_fused_parameters():
    torch.set_num_threads(1)
    share_one_gpu("trainer")  # this process is the publisher's rank
    client = vllm_contract.Client(TP, LLAMA, target=worker_main)
    trainer = None
    try:
        cfg = cuda_config(config_dict(subscribers=TP), DEVICE, side="publisher")
        engine_cfg = {k: v for k, v in cfg.items() if k != "publisher"}  # the workers' own device: their engine's
        info = backend.ParamCastTrainerInitInfo(config=cfg, rank=0, engine_config=engine_cfg)
        state = {n: t.to(DEVICE) for n, t in checkpoint(LLAMA, 0).items()}
        trainer = backend.ParamCastTrainerWeightTransferEngine.trainer_init(info, client=client,
                                                                            source=CheckpointSource(state))
        for step in range(3):
            if step == 1:  # every weight changes
                for t in state.values():
                    t.add_(torch.randn(t.shape, device=DEVICE).to(t.dtype))
            elif step == 2:  # only the first layer changes
                for name, t in state.items():
                    if name.startswith("model.layers.0."):
                        t.mul_(1.5)
            result = trainer.send_weights()
            assert result.ok and result.tensors == len(state), result
            # On a GPU a sharded update moves dense, and says so.
            assert not result.delta and "moves dense" in result.dense_because, result.dense_because
            delivered = {o.worker_id: o.bytes for o in result.subscribers}
            host = {n: t.cpu() for n, t in state.items()}
            for rank, report in enumerate(client.rpc("check", hf_state=host)):
                who = f"vllm-dp0-r{rank}"
                assert report["devices"] == [DEVICE], (who, report["devices"])
                assert report["bad"] == [], f"{who} step {step}: parameters differ from the trainer's slices: " \
                                            f"{report['bad']}"
                assert report["padding_written"] == [], (who, report["padding_written"])
                assert report["load_calls"] == 0, f"{who}: {report['load_calls']} full tensors went through " \
                                                  f"load_weights"
                assert delivered[who] == report["slice_bytes"], (who, step, delivered, report)
                assert delivered[who] < 0.75 * report["whole_bytes"], (who, delivered, report)
        assert trainer.send == "whole"  # learned from the publisher: the workers serve slices
    finally:
        if trainer is not None:
            trainer.shutdown()
        client.close()
