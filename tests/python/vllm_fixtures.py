"""What the vLLM backend's tests share: the small Llama most of them train and send (``LLAMA``,
``make_model``, ``train_step``), its state as the trainer holds it (``hf_state``), a source that sends a
tensor under another name (``renamed``), and one publisher with one subscriber that collects what it
receives (``one_engine``, for the static ``trainer_send_weights`` form)."""

import contextlib
import dataclasses

import torch

import paramcast
from cluster import config_dict
from vllm_contract import ModuleSource

# The small Llama of the backend's tests: two layers, grouped-query attention, TP=2 divides everything.
LLAMA = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=64)


def make_model(llama=LLAMA, dtype=None):
    """A Hugging Face Llama of config ``llama``, seeded: every process makes the same one."""
    import transformers
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama))
    return model if dtype is None else model.to(dtype)


def train_step(model):
    """One SGD step on fixed tokens: every parameter changes, the same way in every process."""
    torch.manual_seed(1)
    tokens = torch.randint(0, model.config.vocab_size, (2, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(tokens, labels=tokens).loss.backward()
    opt.step()
    opt.zero_grad()


def hf_state(model):
    """{name: a copy of the parameter}, the trainer's checkpoint names."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def renamed(module, old="lm_head", new="output"):
    """``module``'s ModuleSource with ``old`` in its names sent as ``new`` (in the metadata and the tensors)."""

    class Renamed(ModuleSource):
        def __init__(self):
            super().__init__(module)
            self.metadata = [dataclasses.replace(m, name=m.name.replace(old, new)) for m in self.metadata]

        def iter_full(self):
            for name, t in super().iter_full():
                yield name.replace(old, new), t

    return Renamed()


@contextlib.contextmanager
def one_engine():
    """``(publisher, subscriber, got)``: a started publisher of one subscriber, ``engine-1``, whose received
    tensors land in ``got`` ({name: a copy}), a dict the caller may clear. Both are closed on exit."""
    pub = paramcast.Publisher(config_dict(subscribers=1))
    sub_cfg = dict(config_dict(), control={**config_dict()["control"], "endpoint": pub.endpoint})
    sub = paramcast.Subscriber(sub_cfg, "engine-1")
    got = {}
    sub.on_weights(lambda ws: got.update({n: t.clone() for n, t in ws}))
    sub.start()
    pub.start()
    try:
        yield pub, sub, got
    finally:
        sub.stop()
        pub.close()
