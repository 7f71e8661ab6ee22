"""Liger-Kernel's block kernels, emulated in PyTorch ops so that the CPU smoke and the traced estimate
keep what the Triton kernels keep (train.block_kernels = "liger").

What each Function saves, allocates and writes in place is Liger's (linkedin/Liger-Kernel
src/liger_kernel/ops/rms_norm.py, rope.py, swiglu.py); its arithmetic is Liger's formulas. A Triton
kernel works on a row in registers; this emulation works on a sixteenth of the rows at a time, so its
temporaries stay a small fraction of a tensor. Writes that Liger's kernels make in place do not bump
autograd's version counter (Triton stores bypass it); the emulation writes through `.data` to do the
same, so a tensor some other node saved is not reported as modified, exactly as on the GPU.
"""

from __future__ import annotations

import torch

# Row slices per emulated kernel call: temporaries of 1/16 of a tensor, like a Triton kernel's registers.
SLICES = 16


def _up(t: torch.Tensor) -> torch.Tensor:
    """Liger's kernels compute in fp32 (fp64 stays fp64, for the gradient checks)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _slices(rows: int):
    step = max(1, -(-rows // SLICES))
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


class RMSNormFunction(torch.autograd.Function):
    """LigerRMSNormFunction, casting_mode "llama": Y = (X.float() * rstd).to(X.dtype) * W in X's dtype, an
    fp32 rstd per row, ctx.save_for_backward(X, W, RSTD); backward writes dX into dY's storage with
    in_place=True (LigerRMSNorm's and monkey_patch's default for Llama-style models), into a new
    zeros_like(dY) without (Gemma 2/3). `offset`: Y scaled by (offset + W), 1.0 for Gemma's norms (LigerRMSNorm
    offset=1.0, init_fn="zeros": liger_kernel/transformers/rms_norm.py LigerRMSNormForGemma*)."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, in_place: bool = True, offset: float = 0.0):
        ctx.in_place, ctx.offset = in_place, offset
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
            y = torch.empty_like(flat)
            rstd = torch.empty(flat.shape[0], dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
            for s in _slices(flat.shape[0]):
                xf = _up(flat[s])
                r = torch.rsqrt(xf.pow(2).mean(-1) + eps)
                rstd[s] = r
                y[s] = (xf * r[:, None]).to(x.dtype) * (weight + offset if offset else weight)
        ctx.save_for_backward(x, weight, rstd)
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        shape = dy.shape
        dy = dy.contiguous()  # Liger's @ensure_contiguous
        if not ctx.in_place:
            dy = dy.clone()  # Liger: dX = zeros_like(dY), filled by the kernel
        flat_dy, flat_x = dy.data.view(-1, shape[-1]), x.reshape(-1, shape[-1])
        n = shape[-1]
        dw = torch.zeros(n, dtype=rstd.dtype, device=dy.device) if ctx.needs_input_grad[1] else None
        with torch.no_grad(), torch.autocast(dy.device.type, enabled=False):
            for s in _slices(flat_dy.shape[0]):
                xf, r, g = _up(flat_x[s]), rstd[s][:, None], flat_dy[s]
                if dw is not None:
                    dw += _up(g * (xf * r).to(x.dtype)).sum(0)
                m = _up(g * (weight + ctx.offset if ctx.offset else weight))
                dx = r * m - (r.pow(3) / n) * (m * xf).sum(-1, keepdim=True) * xf
                flat_dy[s] = dx.to(dy.dtype)  # in place: dX is dY's storage
        return dy, (dw.to(weight.dtype) if dw is not None else None), None, None, None


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> None:
    """Rotate (b, heads, s, d) `t` in place by the HF-convention rotary tables; sign -1: the inverse
    (backward). Sliced along the sequence."""
    half = t.shape[-1] // 2
    data = t.data
    for s in _slices(t.shape[2]):
        part = data[:, :, s]
        x1, x2 = part[..., :half], part[..., half:]
        c, si = cos[s], sign * sin[s]
        new1 = x1 * c[..., :half] - x2 * si[..., :half]
        new2 = x2 * c[..., half:] + x1 * si[..., half:]
        x1.copy_(new1)
        x2.copy_(new2)


def _contiguous_by_token(t: torch.Tensor) -> torch.Tensor:
    """rope.py's `t.transpose(1, 2).contiguous()`, viewed back as (b, heads, s, d): a no-op for a
    projection's (b, s, heads, d) output, a copy otherwise."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


class RopeFunction(torch.autograd.Function):
    """LigerRopeFunction: q and k (b, heads, s, d) views of (b, s, heads, d) projections are made
    contiguous in that layout (a no-op for a linear's output), rotated in place and returned as views;
    ctx keeps cos and sin; backward rotates dq and dk back in place (after the same .contiguous())."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        q, k = _contiguous_by_token(q), _contiguous_by_token(k)
        with torch.no_grad(), torch.autocast(q.device.type, enabled=False):
            _rotate(q, cos, sin, 1.0)
            _rotate(k, cos, sin, 1.0)
        ctx.save_for_backward(cos, sin)
        return q, k

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq, dk = _contiguous_by_token(dq), _contiguous_by_token(dk)
        with torch.no_grad(), torch.autocast(dq.device.type, enabled=False):
            _rotate(dq, cos, sin, -1.0)
            _rotate(dk, cos, sin, -1.0)
        return dq, dk, None, None


class SiLUMulFunction(torch.autograd.Function):
    """LigerSiLUMulFunction: c = silu(a) * b into a new tensor, ctx.save_for_backward(a, b); backward
    recomputes silu and stores da and db into a and b, which it returns."""

    @staticmethod
    def forward(ctx, a, b):
        a, b = a.contiguous(), b.contiguous()
        n = a.shape[-1]
        fa, fb = a.view(-1, n), b.view(-1, n)
        with torch.no_grad(), torch.autocast(a.device.type, enabled=False):
            c = torch.empty_like(fa)
            for s in _slices(fa.shape[0]):
                c[s] = torch.nn.functional.silu(_up(fa[s])).to(fb.dtype) * fb[s]
        ctx.save_for_backward(a, b)
        return c.view(a.shape)

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        n = a.shape[-1]
        fa, fb, fc = a.data.view(-1, n), b.data.view(-1, n), dc.contiguous().view(-1, n)
        with torch.no_grad(), torch.autocast(dc.device.type, enabled=False):
            for s in _slices(fa.shape[0]):
                af, g = _up(fa[s]), fc[s]
                sig = torch.sigmoid(af)
                silu = af * sig
                db = g * silu
                da = g * (silu * (1 - sig) + sig) * fb[s]
                fa[s] = da.to(fa.dtype)
                fb[s] = db.to(fb.dtype)
        return a, b
