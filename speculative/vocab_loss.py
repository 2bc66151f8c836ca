"""The drafter's two training cross-entropies over the vocabulary, without the batch's logits in memory.

    base  = hidden @ lm_head.T                  the frozen target head over the block's hidden states
    final = base + z @ W2.T                     the Domino head's low-rank correction (z = 0 at uncorrected slots)
    loss  = sum_rows weight * ((1 - lam) CE(final) + lam CE(base))

Rows go in chunks (`chunk_rows`, ~2^28 logits a chunk): a chunk's two logit matrices are made by two GEMMs,
turned in place into their gradients (speculative/kernels/vocab_ce.py on the GPU, torch ops on the CPU), and
multiplied back into the gradients of hidden, z and W2 at once, so the loss's backward only scales what the
forward kept by the incoming gradient. The GEMMs are those of the plain formulation (forward, input gradient,
W2's gradient); what goes away is the float32 logits of the whole batch and the passes over them.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

CHUNK_ELEMENTS = 1 << 28          # logits per chunk and matrix (512 MiB in bfloat16)


def _ce_grad_torch(logits: Tensor, labels: Tensor, weights: Tensor, grad: bool,
                   acc: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """speculative.kernels.vocab_ce.cross_entropy_grad in torch ops (the CPU)."""
    x = logits.float()
    lse = torch.logsumexp(x, -1)
    ce = lse - x.gather(1, labels[:, None]).squeeze(1)
    argmax = x.argmax(-1)
    if grad:
        g = torch.exp(x - lse[:, None]).mul_(weights[:, None])
        g.scatter_add_(1, labels[:, None], -weights[:, None])
        if acc is not None:
            g += acc.float()
        logits.copy_(g)
    return ce, argmax


def cross_entropy_grad(logits: Tensor, labels: Tensor, weights: Tensor, grad: bool,
                       acc: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    if logits.is_cuda:
        from speculative.kernels.vocab_ce import cross_entropy_grad as on_gpu
        return on_gpu(logits, labels, weights, grad, acc)
    return _ce_grad_torch(logits, labels, weights, grad, acc)


class _ChunkedVocabLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, z: Tensor, lm_w: Tensor, w2: Tensor, labels: Tensor, w_final: Tensor,
                w_base: Tensor, grad: bool, chunk_rows: int):
        dt, n = hidden.dtype, hidden.shape[0]
        lm, proj = lm_w.to(dt), w2.to(dt)
        ce_final = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ce_base, argmax = torch.empty_like(ce_final), torch.empty(n, dtype=torch.int64, device=hidden.device)
        g_hidden = torch.empty_like(hidden) if grad else None
        g_z = torch.empty_like(z) if grad else None
        g_w2 = torch.zeros(w2.shape, dtype=torch.float32, device=w2.device) if grad else None
        for lo in range(0, n, chunk_rows):
            rows = slice(lo, min(n, lo + chunk_rows))
            base = hidden[rows] @ lm.t()
            final = torch.addmm(base, z[rows], proj.t())
            ce_final[rows], argmax[rows] = cross_entropy_grad(final, labels[rows], w_final[rows], grad)
            # base's gradient plus final's: both sets of logits were made from `hidden` through the head
            ce_base[rows], _ = cross_entropy_grad(base, labels[rows], w_base[rows], grad, acc=final)
            if grad:
                torch.mm(base, lm, out=g_hidden[rows])
                torch.mm(final, proj, out=g_z[rows])
                g_w2 += (final.t() @ z[rows]).float()
        ctx.save_for_backward(g_hidden, g_z, g_w2)
        ctx.w2_dtype = w2.dtype
        ctx.mark_non_differentiable(ce_final, ce_base, argmax)
        loss = (ce_final * w_final).sum() + (ce_base * w_base).sum()
        return loss, ce_final, ce_base, argmax

    @staticmethod
    def backward(ctx, g_loss: Tensor, *_):
        g_hidden, g_z, g_w2 = ctx.saved_tensors
        return (g_hidden * g_loss.to(g_hidden.dtype), g_z * g_loss.to(g_z.dtype), None,
                (g_w2 * g_loss).to(ctx.w2_dtype), None, None, None, None, None)


def full_vocab_losses(hidden: Tensor, z: Tensor, lm_w: Tensor, w2: Tensor, labels: Tensor, weight: Tensor,
                      lam) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`vocab_losses` on the batch's whole logits, float32 cross-entropies and autograd: the plain formulation,
    kept as the baseline the chunked one is measured against (`--vocab-loss full`)."""
    base = hidden @ lm_w.to(hidden.dtype).t()
    final = base + (z @ w2.to(z.dtype).t()).to(base.dtype)
    ce_final, ce_base = (torch.nn.functional.cross_entropy(x.float(), labels, reduction="none") for x in (final, base))
    weight = weight.float()
    loss = ((1 - lam) * ce_final * weight).sum() + (lam * ce_base * weight).sum()
    return loss, ce_final.detach(), ce_base.detach(), final.detach().argmax(-1)


@torch.compiler.disable
def vocab_losses(hidden: Tensor, z: Tensor, lm_w: Tensor, w2: Tensor, labels: Tensor, weight: Tensor,
                 lam, chunk_rows: Optional[int] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """hidden [N, H], z [N, r], lm_w [V, H] (frozen), w2 [V, r], labels [N], weight [N] (each row's share of
    the loss), lam (a float or a 0-dim tensor, on any device: the base CE's share) -> (loss, CE(final) [N],
    CE(base) [N], argmax(final) [N]); only `loss` carries a gradient (to hidden, z and w2). The logits are made
    in the autocast dtype where autocast is on (else hidden's)."""
    kind = hidden.device.type
    dt = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else hidden.dtype
    weight = weight.float()
    lam = torch.as_tensor(lam, dtype=torch.float32)          # a 0-dim tensor mixes with any device's: no sync
    grad = torch.is_grad_enabled() and (hidden.requires_grad or z.requires_grad or w2.requires_grad)
    rows = chunk_rows or max(1, CHUNK_ELEMENTS // lm_w.shape[0])
    hidden, z = hidden.to(dt).contiguous(), z.to(dt).contiguous()
    with torch.autocast(kind, enabled=False):
        return _ChunkedVocabLoss.apply(hidden, z, lm_w, w2, labels.contiguous(), weight * (1 - lam), weight * lam,
                                       grad, rows)
