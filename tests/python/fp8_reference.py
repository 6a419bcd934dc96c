"""The reference for ParamCast's transforms on send, in plain PyTorch
(docs/transforms.md): what an engine must hold, bit for bit, after an update
whose rules quantize or cast a tensor. The tests compare the engines' bytes
with this, never with ParamCast's own code."""

import torch

FP8_MAX = 448.0
BLOCK = 128


TINY = FP8_MAX * 2.0 ** -149  # below this amax, amax / 448 is 0 or the smallest subnormal in float32


def _scale(amax):
    """scale = amax / 448 in float32; 1 where amax is below 448 x 2^-149 (amax 0 included: amax / 448
    would be 0, or 2^-149 at most): such a block is scaled as a zero block."""
    amax = amax.to(torch.float32)
    return torch.where(amax < TINY, torch.ones_like(amax), amax / FP8_MAX)


def _q(x, scale):
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def quantize(x, scaling):
    """(fp8 tensor, float32 scale_inv) of a 2-D float tensor `x`, as ParamCast
    sends `<name>` and `<name>_scale_inv` for `fp8: block|channel|tensor`."""
    x = x.detach().to(torch.float32)
    rows, cols = x.shape
    if scaling == "tensor":
        s = _scale(x.abs().max()).reshape(1)
        return _q(x, s), s
    if scaling == "channel":
        s = _scale(x.abs().amax(dim=1, keepdim=True))
        return _q(x, s), s
    br, bc = -(-rows // BLOCK), -(-cols // BLOCK)
    s = torch.empty(br, bc, dtype=torch.float32)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(br):
        for j in range(bc):
            block = x[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            s[i, j] = _scale(block.abs().max())
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = _q(block, s[i, j])
    return q, s


def dequantize(q, s, scaling):
    """x ~ q * scale_inv (for checks of the error bound, not of bytes)."""
    x = q.to(torch.float32)
    if scaling == "block":
        s = s.repeat_interleave(BLOCK, 0)[:x.shape[0]].repeat_interleave(BLOCK, 1)[:, :x.shape[1]]
    return x * s
