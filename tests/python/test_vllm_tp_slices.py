"""The vLLM backend on tensor-parallel workers: each worker registers only the slices it serves, read from its
model's parallel layers, written in place into its fused parameters; no full tensor reaches it.

A Hugging Face Llama trainer (one rank, bf16, GQA: fewer kv heads than q heads, q/k/v and o_proj biases as
Qwen's, a vocabulary vLLM pads) publishes whole tensors under their Hugging Face names through the backend's
trainer engine; two TP=2 worker processes, each made and driven as vLLM 0.33.0's worker does
(vllm_contract.py's RPC sequence), hold vLLM's LlamaForCausalLM layout on their rank (vllm_tp_model.py:
vLLM's layer classes and attributes imitated on the CPU; vLLM's real layers need a GPU). Real: the processes,
ZeroMQ, Gloo, ParamCast's plan and its point-to-point sends, the backend. Checked per worker: every parameter
bit for bit the trainer's slices (q, k, v rows back to back in qkv_proj; gate, up in gate_up_proj; the
vocabulary's padding rows untouched), load_weights never called, and the bytes ParamCast delivered to it (the
UpdateResult's per-worker count) exactly its slices' bytes. A layer that cannot be mapped fails the worker's
init naming the parameter, or, with whole_fallback, goes through load_weights."""

import time

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import paramcast  # noqa: E402
from paramcast.integrations import vllm as backend  # noqa: E402,F401  (the trainer engine start_cluster makes)

from vllm_contract import ModuleSource, WorkerError, serve_worker, slice_report, start_cluster  # noqa: E402
from vllm_fixtures import hf_state, renamed  # noqa: E402

TP = 2
LLAMA = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, attention_bias=True, tie_word_embeddings=False, max_position_embeddings=64)


def worker_main(conn, rank, tp, spec, engine_cls_path):
    """One vLLM worker (vllm_contract.serve_worker: gpu_worker.py's RPCs), its model vllm_tp_model's
    LlamaForCausalLM."""
    import vllm_tp_model
    spec = dict(spec)
    quantized = spec.pop("quantized_mlp", False)

    def make_model():
        cfg = transformers.LlamaConfig(**spec)
        model = vllm_tp_model.LlamaForCausalLM(cfg, rank, tp)
        if quantized:  # a layer whose parameters are not the checkpoint's bytes
            model.model.layers[0].mlp.gate_up_proj.quant_method = vllm_tp_model.Fp8LinearMethod()
        return cfg, model

    def make_checks(cfg, model, engine):
        def check(hf_state):
            """What this worker holds against the trainer's tensors, and what its slices weigh."""
            return slice_report(model, vllm_tp_model.expected_params(cfg, hf_state, rank, tp),
                                vllm_tp_model.expected_slices(cfg, hf_state, rank, tp), hf_state)

        return (check,)

    serve_worker(conn, rank, tp, engine_cls_path, make_model, make_checks)


def _trainer_model(spec):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**spec)).to(torch.bfloat16)


def _cluster(spec, engine_init=None):
    return start_cluster(TP, spec, worker_main,
                         lambda: _trainer_model({k: v for k, v in spec.items() if k != "quantized_mlp"}),
                         engine_init=engine_init)


_state = hf_state  # the trainer's checkpoint, as the workers check it


def _assert_slices_equal(client, hf_state):
    """Every worker holds its slices of ``hf_state`` bit for bit, and no full tensor went through load_weights."""
    for rank, report in enumerate(client.rpc("check", hf_state=hf_state)):
        assert report["bad"] == [] and report["load_calls"] == 0, (rank, report)


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["kv-heads-split", "kv-heads-replicated"])
def test_each_tp_worker_receives_only_its_slices_into_its_fused_parameters(kv_heads):
    spec = dict(LLAMA, num_key_value_heads=kv_heads)
    client, trainer, model = _cluster(spec)
    try:
        for step in range(3):
            if step == 1:  # an optimizer step: every weight changes
                opt = torch.optim.SGD(model.parameters(), lr=0.5)
                tokens = torch.randint(0, spec["vocab_size"], (2, 8))
                model(tokens, labels=tokens).loss.backward()
                opt.step()
            elif step == 2:  # only the first layer changes: a delta of each worker's slices
                with torch.no_grad():
                    for name, p in model.named_parameters():
                        if name.startswith("model.layers.0."):
                            p.mul_(1.5)
            result = trainer.send_weights()
            assert result.ok and result.tensors == len(list(model.parameters()))
            delivered = {o.worker_id: o.bytes for o in result.subscribers}
            for rank, report in enumerate(client.rpc("check", hf_state=_state(model))):
                who = f"vllm-dp0-r{rank}"
                assert report["bad"] == [], f"{who}: parameters differ from the trainer's slices: {report['bad']}"
                assert report["padding_written"] == [], f"{who}: rows past the vocabulary written: " \
                                                        f"{report['padding_written']}"
                assert report["load_calls"] == 0, f"{who}: {report['load_calls']} full tensors " \
                                                  f"({report['load_bytes']} bytes) went through load_weights"
                if step == 0:  # dense: exactly its slices' bytes, about half of the parallel ones
                    assert delivered[who] == report["slice_bytes"], (who, delivered, report)
                    assert delivered[who] < 0.75 * report["whole_bytes"], (who, delivered, report)
                if step == 2:  # the delta: at most its slices of the first layer (plus framing)
                    assert result.delta, result.dense_because
                    assert 0 < delivered[who] <= 1.1 * report["layer0_slice_bytes"], (who, delivered, report)
        assert trainer.send == "whole"  # learned from the publisher: the workers serve slices
    finally:
        trainer.shutdown()
        client.close()


def test_a_layer_that_cannot_be_mapped_fails_the_workers_init_naming_it():
    spec = dict(LLAMA, quantized_mlp=True)
    with pytest.raises(WorkerError, match=r"vllm-dp0-r0: cannot state the slice .* parameter "
                                          r"'model\.layers\.0\.mlp\.gate_up_proj\.weight' "
                                          r"\(MergedColumnParallelLinear\): its layer is quantized \(Fp8LinearMethod\)"
                                          r".*whole_fallback"):
        _cluster(spec)


def test_whole_fallback_loads_whole_tensors_through_load_weights():
    spec = dict(LLAMA, quantized_mlp=True)
    client, trainer, model = _cluster(spec, engine_init={"whole_fallback": True})
    try:
        result = trainer.send_weights()
        assert result.ok and trainer.send == "auto"  # streamed: no worker serves slices
        for rank, report in enumerate(client.rpc("check", hf_state=_state(model))):
            assert report["bad"] == [] and report["padding_written"] == [], (rank, report)
            assert report["load_calls"] == result.tensors and report["load_bytes"] == report["whole_bytes"], report
    finally:
        trainer.shutdown()
        client.close()


def test_slices_arriving_outside_a_round_fail_the_update_naming_the_worker():
    """Registered slices are written in place as they arrive (ParamCast has no staging copy to hold them
    back): an update sent without start_weight_update fails naming each worker, which is dirty until the
    next round makes it whole again."""
    client, trainer, model = _cluster(dict(LLAMA))
    try:
        trainer.send_weights()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1)
        with pytest.raises(paramcast.UpdateError, match=r"vllm-dp0-r[01].*outside start/finish_weight_update"):
            trainer.publisher.weight_update(ModuleSource(model).iter_full())
        result = trainer.send_weights()
        assert result.ok
        _assert_slices_equal(client, _state(model))
    finally:
        trainer.shutdown()
        client.close()


def test_a_round_naming_a_tensor_no_worker_serves_fails_at_once_naming_it():
    client, trainer, model = _cluster(dict(LLAMA))

    try:
        trainer.send_weights()
        trainer.source = renamed(model)
        with pytest.raises(WorkerError, match=r"worker 0: ValueError: vllm-dp0-r0: update v\d+ carries "
                                              r"'output.weight', which this worker does not serve; "
                                              r"does not carry 'lm_head.weight'"):
            trainer.send_weights()
        trainer.source = ModuleSource(model)
        assert trainer.send_weights().ok  # the failed round was closed
        _assert_slices_equal(client, _state(model))
    finally:
        trainer.shutdown()
        client.close()


def test_a_round_whose_plan_paramcast_refuses_ends_at_once_naming_the_tensor():
    # The trainer holds the final norm in float32, the workers serve it in bf16: ParamCast refuses the
    # plan before any byte moves. The workers, inside their round for that version, hear of it from the
    # publisher (an Abandon of the version) and end at once naming the reason, not after timeout_s.
    client, trainer, model = _cluster(dict(LLAMA))
    try:
        trainer.send_weights()
        good = _state(model)
        trainer.update_timeout_s = 120.0
        norm = model.model.norm
        norm.weight = torch.nn.Parameter(norm.weight.detach().float() + 1)
        trainer.source = ModuleSource(model)
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=r"publisher abandoned update v\d+ before any byte reached this "
                                              r"engine: .*model\.norm\.weight"):
            trainer.send_weights()
        took = time.monotonic() - t0
        assert took < 30, f"the refused round took {took:.1f} s (timeout_s 120)"
        _assert_slices_equal(client, good)  # nothing of it applied
        norm.weight = torch.nn.Parameter(norm.weight.detach().to(torch.bfloat16))
        trainer.source = ModuleSource(model)
        assert trainer.send_weights().ok  # the refused round was closed
        _assert_slices_equal(client, _state(model))
    finally:
        trainer.shutdown()
        client.close()
