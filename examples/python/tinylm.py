"""A small decoder-only transformer for the Python examples and tests.

TinyLM keeps q, k and v as separate projections, like a trainer's model;
FusedTinyLM stores them fused in one ``qkv_proj`` per layer, like an
inference engine, and loads a trainer's weights through ``load_weights``.
Both compute the same thing with the same operations, so their logits are
bit-identical when their weights are.
"""

import math
import re

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, LAYERS, FFN = 1000, 64, 4, 2, 128


def _attend(q, k, v):
    b, n, _ = q.shape
    def split(x):
        return x.view(b, n, HEADS, DIM // HEADS).transpose(1, 2)
    q, k, v = split(q), split(k), split(v)
    scores = q @ k.transpose(-1, -2) / math.sqrt(DIM // HEADS)
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    out = scores.softmax(-1) @ v
    return out.transpose(1, 2).reshape(b, n, DIM)


class Block(nn.Module):
    def __init__(self, fused):
        super().__init__()
        self.ln1 = nn.LayerNorm(DIM)
        if fused:
            self.qkv_proj = nn.Linear(DIM, 3 * DIM)
        else:
            self.q_proj, self.k_proj, self.v_proj = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.o_proj = nn.Linear(DIM, DIM)
        self.ln2 = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, FFN)
        self.down = nn.Linear(FFN, DIM)

    def qkv(self, h):
        if hasattr(self, "qkv_proj"):
            w, b = self.qkv_proj.weight, self.qkv_proj.bias
            return [F.linear(h, w[i * DIM:(i + 1) * DIM], b[i * DIM:(i + 1) * DIM]) for i in range(3)]
        return self.q_proj(h), self.k_proj(h), self.v_proj(h)

    def forward(self, x):
        x = x + self.o_proj(_attend(*self.qkv(self.ln1(x))))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyLM(nn.Module):
    fused = False

    def __init__(self, seed, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(self.fused) for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.to(dtype)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


_QKV = re.compile(r"blocks\.(\d+)\.([qkv])_proj\.(weight|bias)")


class FusedTinyLM(TinyLM):
    """The engine's layout: q/k/v fused; load_weights takes the trainer's names."""

    fused = True

    @torch.no_grad()
    def load_weights(self, weights):
        """vLLM-shaped: copies each (name, tensor) into place; returns the fused shards loaded."""
        params = dict(self.named_parameters())
        shards = []
        for name, tensor in weights:
            m = _QKV.fullmatch(name)
            if m:
                layer, which, kind = int(m.group(1)), "qkv".index(m.group(2)), m.group(3)
                fused = getattr(self.blocks[layer].qkv_proj, kind)
                dest = fused[which * DIM:(which + 1) * DIM]
                shards.append(name)
            else:
                if name not in params:
                    raise KeyError(f"no parameter {name}")
                dest = params[name]
            if dest.shape != tensor.shape or dest.dtype != tensor.dtype:
                raise ValueError(f"{name}: expected {tuple(dest.shape)} {dest.dtype}, got "
                                 f"{tuple(tensor.shape)} {tensor.dtype}")
            dest.copy_(tensor)
        return shards


PROMPT = torch.tensor([[1, 17, 256, 999, 42, 7, 512, 3]])


def _device(model):
    return next(model.parameters()).device


def digest(tensor):
    """A short sha256 of a tensor's bytes, without numpy (PyTorch from PyPI does not bring it)."""
    import hashlib

    raw = tensor.detach().cpu().contiguous().view(torch.uint8).flatten().tolist()
    return hashlib.sha256(bytes(raw)).hexdigest()[:16]


def logits(model):
    """The model's logits for PROMPT, on the host."""
    with torch.no_grad():
        return model(PROMPT.to(_device(model))).cpu()


@torch.no_grad()
def unfused_state(model):
    """Every parameter under the trainer's (TinyLM's) names, copied to the host: a FusedTinyLM's
    qkv_proj comes back as q_proj, k_proj and v_proj. Always copies (``.cpu()`` of a host tensor
    is the tensor itself): a tensor sent through a multiprocessing pipe moves its storage to
    shared memory, which would free the buffer an engine registered with ParamCast."""
    out = {}
    for name, p in model.named_parameters():
        m = re.fullmatch(r"blocks\.(\d+)\.qkv_proj\.(weight|bias)", name)
        if not m:
            out[name] = p.detach().to("cpu", copy=True)
            continue
        for i, which in enumerate("qkv"):
            out[f"blocks.{m.group(1)}.{which}_proj.{m.group(2)}"] = p[i * DIM:(i + 1) * DIM].detach().to("cpu", copy=True)
    return out


def train_step(model, optimizer, seed):
    """One optimizer step on a fixed random batch."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 9), generator=g).to(_device(model))
    out = model(ids[:, :-1])
    loss = F.cross_entropy(out.float().reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()
