"""Drafter training's loss on the GPU: the Triton cross-entropy kernel at the real vocabulary in bfloat16, the
chunked vocabulary loss against full logits, and the loss through the FlexAttention block mask against
the dense mask (values and gradients)."""
import pytest
import torch

from speculative.vocab_loss import _ce_grad_torch, full_vocab_losses, vocab_losses
from tests.speculative.test_vocab_loss import small_problem

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_kernel_at_the_real_vocabulary_in_bfloat16():
    from speculative.kernels.vocab_ce import cross_entropy_grad
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, v = 512, 49152
    logits = (3 * torch.randn(n, v, device="cuda", generator=gen)).bfloat16()
    labels = torch.randint(0, v, (n,), device="cuda", generator=gen)
    weights = torch.rand(n, device="cuda", generator=gen)
    acc = torch.randn(n, v, device="cuda", generator=gen).bfloat16()
    mine, ref = logits.clone(), logits.clone()
    ce, argmax = cross_entropy_grad(mine, labels, weights, True, acc)
    ce_ref, argmax_ref = _ce_grad_torch(ref, labels, weights, True, acc)
    assert torch.allclose(ce, ce_ref, rtol=1e-4, atol=1e-4) and torch.equal(argmax, argmax_ref)
    assert torch.allclose(mine.float(), ref.float(), rtol=1e-2, atol=1e-2)


def test_chunked_loss_equals_full_logits_in_bfloat16():
    gen = torch.Generator(device="cuda").manual_seed(1)
    n, v, h, r, lam = 6000, 49152, 576, 64, 0.3
    hidden = torch.randn(n, h, device="cuda", generator=gen).bfloat16().requires_grad_()
    z = torch.randn(n, r, device="cuda", generator=gen).bfloat16().requires_grad_()
    lm = (0.05 * torch.randn(v, h, device="cuda", generator=gen)).bfloat16()
    w2 = (0.05 * torch.randn(v, r, device="cuda", generator=gen)).requires_grad_()
    labels = torch.randint(0, v, (n,), device="cuda", generator=gen)
    weight = torch.rand(n, device="cuda", generator=gen)
    weight /= weight.sum()
    grads = []
    for losses in (full_vocab_losses, vocab_losses):
        loss = losses(hidden, z, lm, w2, labels, weight, lam)[0]
        grads.append([loss.detach()] + list(torch.autograd.grad(loss, (hidden, z, w2))))
    for full, mine in zip(*grads):
        full, mine = full.float(), mine.float()
        assert ((full - mine).norm() / full.norm()).item() < 2e-2


def test_block_mask_loss_and_gradients_equal_the_dense_mask_on_the_gpu():
    from speculative.train_loop import block_losses
    drafter, batch, hidden, embed, lm = small_problem(2)
    drafter, hidden, embed, lm = drafter.cuda(), hidden.cuda(), embed.cuda(), lm.cuda()
    batch = batch.to("cuda")
    results = []
    for sparse in (False, True):
        drafter.zero_grad(set_to_none=True)
        out = block_losses(drafter, batch, hidden, embed, lm, 7.0, 0.5, block_mask=sparse)
        out["loss"].backward()
        results.append((out["loss"].item(), {n: p.grad.clone() for n, p in drafter.named_parameters()
                                              if p.grad is not None}))
    (dense_loss, dense_grads), (sparse_loss, sparse_grads) = results
    assert sparse_loss == pytest.approx(dense_loss, rel=1e-4)
    for name, g in dense_grads.items():
        assert torch.allclose(sparse_grads[name], g, rtol=1e-3, atol=1e-5), name
