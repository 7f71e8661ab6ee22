"""The next-token loss as each training stack computes it; what differs is what stays alive.

- fp32-upcast (podkit): cross_entropy(logits.float()); the logits die with the model's frame and
  only log-softmax's fp32 output is saved for backward.
- fp32-logits-kept (HF transformers 4.3x-4.4x LlamaForCausalLM.forward: `logits = logits.float()`,
  returned in CausalLMOutputWithPast): the fp32 logits stay referenced by the output until the
  caller drops it after backward.
- fp32-upcast-shifted (transformers 4.46-4.48 loss/loss_utils.py ForCausalLMLoss): the loss upcasts
  the 16-bit logits, then cross-entropies a shifted .contiguous() copy of the fp32 ones.
- compute-shifted (transformers < 4.49 GPT2LMHeadModel.forward): the shifted .contiguous() copy of
  the compute-dtype logits and CrossEntropyLoss on it, as CUDA runs it: nll_loss(log_softmax(x, dim,
  x.dtype)), so under autocast only nll_loss upcasts (a CPU's autocast would upcast cross_entropy whole).
- chunked (torchtune CEWithChunkedOutputLoss, torchtune/modules/loss/ce_chunked_output_loss.py:
  the model returns the head's output in `num_output_chunks` = 8 chunks along the sequence and
  each chunk is upcast and cross-entropied with reduction="sum"; litgpt's chunked_cross_entropy in
  litgpt/utils.py does the same per lm_head_chunk_size = 128 tokens).
- fused: a linear + cross-entropy in one autograd Function that keeps the head's input and weight
  (their autocast casts) and a logsumexp per row, and recomputes the logits block by block in
  backward, as Cut Cross-Entropy does (apple ml-cross-entropy, Wijmans et al. 2024, "Cut Your Losses
  in Large-Vocabulary Language Models").
- liger: Liger's LigerFusedLinearCrossEntropyFunction (linkedin/Liger-Kernel
  src/liger_kernel/ops/fused_linear_cross_entropy.py), which the HF Trainer runs with
  use_liger_kernel: the gradients are computed in forward, chunk by chunk, and held on the ctx until
  backward returns them (the input's gradient, and the head weight's when it trains).
Both fused losses never hold the full logits. Written here so the CPU smoke run needs no Triton.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from podkit.checks.activations import liger_chunk_rows


# Vocabulary blocks of the fused (Cut Cross-Entropy) emulation: CCE tiles the vocabulary too, so no
# chunk of full-vocabulary logits ever exists.
VOCAB_BLOCKS = 8


def _autocast_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def plain(logits: torch.Tensor, targets: torch.Tensor, upcast: bool = True) -> torch.Tensor:
    """cross_entropy over every position; upcast: on an fp32 copy of the logits (else their own dtype, as
    cuda_cross_entropy runs it)."""
    flat = logits.view(-1, logits.shape[-1])
    return F.cross_entropy(flat.float(), targets.reshape(-1)) if upcast else cuda_cross_entropy(flat, targets)


def cuda_cross_entropy(flat: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """cross_entropy as aten's cross_entropy_loss decomposes it on CUDA (LossNLL.cpp): log_softmax in the input's
    dtype, then nll_loss, which autocast runs in fp32 (autocast_mode.h AT_FORALL_FP32), saving an fp32 cast of
    16-bit log-probabilities. Written out so a CPU run does the same: CPU autocast puts cross_entropy itself on
    its fp32 list."""
    return F.nll_loss(F.log_softmax(flat, -1, dtype=flat.dtype), targets.reshape(-1), reduction=reduction)


def shifted_copy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """transformers <= 4.48's `shift_logits = logits[..., :-1, :].contiguous()` then cross_entropy: a copy
    of the logits as given (fp32 ones for ForCausalLMLoss, GPT-2's compute-dtype ones). The targets here are already the next tokens, so the copy is taken at full
    length (transformers' is one position per sequence shorter). Of one sequence the slice is already
    contiguous and transformers copies nothing (checks/activations.py shifted_copy_bytes): nor does this."""
    copy = logits if logits.shape[0] == 1 else logits.clone(memory_format=torch.contiguous_format)
    return F.cross_entropy(copy.view(-1, copy.shape[-1]), targets.reshape(-1))


def compute_shifted(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """GPT-2's loss before transformers 4.49: a shifted copy of the compute-dtype logits (none of one sequence),
    cross-entropied as aten's cross_entropy_loss decomposes on CUDA (LossNLL.cpp): log_softmax in the input's
    dtype, then nll_loss, which autocast runs in fp32 (autocast_mode.h AT_FORALL_FP32)."""
    copy = logits if logits.shape[0] == 1 else logits.clone(memory_format=torch.contiguous_format)
    return cuda_cross_entropy(copy.view(-1, copy.shape[-1]), targets)


def chunked(x: torch.Tensor, head, targets: torch.Tensor, chunks: int, upcast: bool = True,
            keep: list | None = None, to_fp32: bool = False) -> torch.Tensor:
    """torchtune's chunked output + loss: head per chunk of the sequence (all chunks kept until the
    loss is done), fp32 upcast (litgpt: none) and cross-entropy per chunk, summed and divided by the
    tokens; `keep` receives the chunks when the caller holds them through backward (litgpt's fit).
    `to_fp32`: every chunk cast to fp32 once all are made, the 16-bit ones dropped, as Fabric's wrapper
    converts the model's outputs (checks/stacks.py Stack.outputs_fp32)."""
    logits = [head(c) for c in x.chunk(chunks, dim=1)]
    if to_fp32:
        logits = [lc.float() for lc in logits]
    if keep is not None:
        keep.extend(logits)
    labels = targets.chunk(chunks, dim=1)
    total = 0.0
    for lc, tc in zip(logits, labels):
        flat = lc.reshape(-1, lc.shape[-1])
        total = total + (F.cross_entropy(flat.float(), tc.reshape(-1), reduction="sum") if upcast
                         else cuda_cross_entropy(flat, tc, reduction="sum"))
    return total / targets.numel()


class FusedLinearCrossEntropy(torch.autograd.Function):
    """mean cross_entropy(x @ weight.T) without logits in memory, as Cut Cross-Entropy computes it
    (apple/ml-cross-entropy cut_cross_entropy/cce.py LinearCrossEntropyFunction): under autocast the
    input and the weight are cast to the autocast dtype first, and ctx.save_for_backward keeps those
    casts (e and c, trained or not: backward recomputes the logits from them) and an fp32 logsumexp per
    row. CCE's kernels work on blocks of rows x vocab in on-chip memory; this emulation takes an
    eighth of the rows (`chunks`) by an eighth of the vocabulary at a time, so its logits blocks stay a
    small fraction of the full logits. Backward makes only the gradients that are needed."""

    @staticmethod
    def forward(ctx, x, weight, targets, chunks: int, dtype: torch.dtype):
        n, vocab = x.shape[0], weight.shape[0]
        size, vsize = -(-n // chunks), -(-vocab // VOCAB_BLOCKS)
        acc = torch.promote_types(dtype, torch.float32)  # fp32 logits, as the plain path's upcast
        with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
            e, c = x.to(dtype), weight.to(dtype)
            lse = torch.empty(n, dtype=acc, device=x.device)
            picked = torch.empty(n, dtype=acc, device=x.device)
            for r in range(0, n, size):
                xs, ts = e[r:r + size], targets[r:r + size]
                parts = [torch.logsumexp((xs @ c[v:v + vsize].t()).to(acc), -1) for v in range(0, vocab, vsize)]
                lse[r:r + size] = torch.logsumexp(torch.stack(parts), 0)
                picked[r:r + size] = (xs.to(acc) * c[ts].to(acc)).sum(-1)  # CCE's indexed dot
        ctx.save_for_backward(e, c, targets, lse)
        ctx.size, ctx.vsize, ctx.x_dtype, ctx.w_dtype = size, vsize, x.dtype, weight.dtype
        return (lse - picked).sum() / n

    @staticmethod
    def backward(ctx, grad):
        e, c, targets, lse = ctx.saved_tensors
        size, vsize, n, vocab = ctx.size, ctx.vsize, e.shape[0], c.shape[0]
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc = lse.dtype
        with torch.no_grad(), torch.autocast(e.device.type, enabled=False):
            # cce_backward_kernel: de = zeros_like(e), dc = zeros_like(c) when needed, in the saved casts'
            # dtypes (accum_e_fp32 / accum_c_fp32 default False), cast to the inputs' dtypes at the end.
            grad_x = torch.zeros_like(e) if want_x else None
            grad_w = torch.zeros_like(c) if want_w else None
            for r in range(0, n, size):
                xs, ts = e[r:r + size], targets[r:r + size]
                for v in range(0, vocab, vsize):
                    cv = c[v:v + vsize]
                    probs = ((xs @ cv.t()).to(acc) - lse[r:r + size, None]).exp_()  # softmax, this block
                    hit = ((ts >= v) & (ts < v + len(cv))).to(acc)  # d loss / d logits: -1 at the target
                    probs.scatter_add_(1, (ts - v).clamp(0, len(cv) - 1)[:, None], -hit[:, None])
                    g = probs.mul_(grad / n).to(e.dtype)
                    del probs
                    if want_x:
                        grad_x[r:r + size].add_(g @ cv)
                    if want_w:
                        grad_w[v:v + vsize].add_(g.t() @ xs)
        return (grad_x.to(ctx.x_dtype) if want_x else None), (grad_w.to(ctx.w_dtype) if want_w else None), \
            None, None, None


def fused(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunks: int) -> torch.Tensor:
    dtype = _autocast_dtype(x)
    flat = x.reshape(-1, x.shape[-1])
    return FusedLinearCrossEntropy.apply(flat, weight, targets.reshape(-1), chunks, dtype)


class LigerFusedLinearCrossEntropy(torch.autograd.Function):
    """mean cross_entropy(x @ weight.T), gradients made in forward as Liger makes them.

    Liger's forward allocates grad_input = zeros_like(x), grad_weight = zeros_like(weight) when the
    weight trains (accum_dtype None: the parameter's dtype) and an fp32 loss per row; per chunk it
    computes the logits in the matmul dtype, turns them into their own gradient in place (its Triton
    cross-entropy kernel), writes grad_input's rows and adds into grad_weight; ctx keeps only the two
    gradients. Backward scales them by grad_output in place (element_mul_kernel) and returns them.
    Liger's kernel works on a row in registers; this emulation upcasts an eighth of a chunk at a time.
    (Liger's accumulation into an fp32 grad_weight casts the 16-bit factors per chunk; here per eighth.)"""

    @staticmethod
    def forward(ctx, x, weight, targets):
        rows, hidden = x.shape
        size = liger_chunk_rows(rows, hidden, weight.shape[0])
        dtype = _autocast_dtype(x)
        acc = torch.promote_types(dtype, torch.float32)  # Liger's kernel works in fp32 (fp64 here for a check)
        with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
            grad_x = torch.zeros_like(x)
            grad_w = torch.zeros_like(weight) if weight.requires_grad else None
            loss_rows = torch.zeros(rows, dtype=acc, device=x.device)
            w = weight.to(dtype)
            for start in range(0, rows, size):
                xs, ts = x[start:start + size].to(dtype), targets[start:start + size]
                logits = xs @ w.t()
                step = max(1, -(-len(ts) // 8))
                for r in range(0, len(ts), step):
                    lf = logits[r:r + step].to(acc)
                    lse = torch.logsumexp(lf, -1)
                    t = ts[r:r + step]
                    loss_rows[start + r:start + r + len(t)] = lse - lf.gather(1, t[:, None]).squeeze(1)
                    lf.sub_(lse[:, None]).exp_()
                    lf[torch.arange(len(t), device=t.device), t] -= 1.0
                    logits[r:r + step] = lf.div_(rows)
                    del lf
                grad_x[start:start + size].copy_(logits @ w)
                if grad_w is not None:  # in place, as Liger's addmm(out=grad_weight): no weight-sized temporary
                    for r in range(0, len(ts), step):
                        grad_w.addmm_(logits[r:r + step].t().to(grad_w.dtype), xs[r:r + step].to(grad_w.dtype))
                del logits, xs
            w = None
        ctx.save_for_backward(grad_x, grad_w)
        return loss_rows.sum() / rows

    @staticmethod
    def backward(ctx, grad):
        grad_x, grad_w = ctx.saved_tensors
        grad_x.mul_(grad)
        if grad_w is not None:
            grad_w.mul_(grad)
        return grad_x, grad_w, None


def liger(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return LigerFusedLinearCrossEntropy.apply(x.reshape(-1, x.shape[-1]), weight, targets.reshape(-1))
