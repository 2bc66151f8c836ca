"""The drafter's chunked vocabulary loss (speculative/vocab_loss.py) against the plain formulation: the logits of
the whole batch, float32 cross-entropies and autograd. The Triton kernel runs on the CPU under TRITON_INTERPRET=1
(tests/conftest.py) against the torch ops the CPU uses."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the first @triton.jit of the kernel modules

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import speculative.vocab_loss as vocab_loss  # noqa: E402
from speculative.drafter import DominoDrafter, DrafterConfig  # noqa: E402
from speculative.train_data import TrainBatch  # noqa: E402
from speculative.train_loop import attended_pairs, block_losses, training_mask  # noqa: E402
from tests.support.threads import one_thread  # noqa: F401,E402  (autouse)

V = 96


def plain_block_losses(drafter, batch, target_hidden, embed_w, lm_w, gamma, lam):
    """The objective written out on full logits (what block_losses computed before it went chunked)."""
    s = drafter.cfg.block_size
    ids, anchors = batch.input_ids, batch.anchors
    (b, t), a = ids.shape, anchors.shape[1]
    ctx = drafter.backbone.context(target_hidden, torch.arange(t).expand(b, t))
    embeds, pos = drafter.block_inputs(ids.gather(1, anchors).reshape(-1), anchors.reshape(-1), embed_w)
    hidden = drafter.backbone(embeds.view(b, a * s, -1), pos.view(b, a * s), ctx,
                              training_mask(anchors, batch.anchor_valid, t, s))
    base = hidden @ lm_w.t()
    offsets = torch.arange(s)
    label_pos = anchors[..., None] + 1 + offsets
    labels = ids.gather(1, label_pos.clamp(max=t - 1).view(b, -1)).view(b, a, s)
    valid = (label_pos < t) & batch.loss_mask.gather(1, label_pos.clamp(max=t - 1).view(b, -1)).view(b, a, s) \
        & batch.anchor_valid[..., None]
    path = ids.gather(1, (anchors[..., None] + offsets).clamp(max=t - 1).view(b, -1))
    head, u = drafter.head, drafter.cfg.uncorrected_positions
    h, base = hidden.view(b * a, s, -1), base.view(b * a, s, -1)
    states = head.gru(embed_w[path].view(b * a, s, -1))[0]
    corr = head.w2(F.silu(head.w1(torch.cat([h[:, u:], states[:, u:]], -1))))
    final = torch.cat([base[:, :u], base[:, u:] + corr], 1)
    weight = torch.exp(-offsets.float() / gamma) * valid
    norm = weight.sum()
    ce = [F.cross_entropy(x.reshape(-1, V), labels.reshape(-1), reduction="none").view(b, a, s) for x in (final, base)]
    final_ce, base_ce = ((c * weight).sum() / norm for c in ce)
    hit = (final.view(b, a, s, -1).argmax(-1) == labels) & valid
    return {"loss": (1 - lam) * final_ce + lam * base_ce, "final": final_ce, "base": base_ce,
            "accuracy": hit.sum() / valid.sum()}


def small_problem(seed=0):
    cfg = DrafterConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                        num_kv_heads=1, head_dim=16, target_layer_ids=(0,), block_size=4, gru_hidden=8,
                        correction_rank=4)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    drafter = DominoDrafter(cfg)
    for p in drafter.parameters():                       # away from the initialisation's zeros
        p.data.add_(0.05 * torch.randn(p.shape, generator=gen))
    b, t, a = 3, 24, 5
    ids = torch.randint(0, V, (b, t), generator=gen)
    mask = torch.zeros(b, t, dtype=torch.bool)
    mask[:, 6:] = True
    mask[2, 18:] = False
    anchors = torch.sort(torch.randint(5, t - 1, (b, a), generator=gen), dim=1).values
    valid = torch.ones(b, a, dtype=torch.bool)
    valid[1, -1] = False
    batch = TrainBatch(ids, mask, anchors, valid)
    embed = torch.randn(V, 32, generator=gen)
    return drafter, batch, torch.randn(b, t, 32, generator=gen), embed, torch.randn(V, 32, generator=gen)


@pytest.mark.parametrize("lam", [0.0, 0.3, 1.0])
def test_chunked_loss_and_gradients_equal_the_plain_formulation(monkeypatch, lam):
    """Values, accuracy and every drafter parameter's gradient, with chunks of 7 rows (the last one partial)."""
    monkeypatch.setattr(vocab_loss, "CHUNK_ELEMENTS", 7 * V)
    drafter, batch, hidden, embed, lm = small_problem()
    ref = plain_block_losses(drafter, batch, hidden, embed, lm, 7.0, lam)
    ref["loss"].backward()
    want = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
    drafter.zero_grad(set_to_none=True)
    out = block_losses(drafter, batch, hidden, embed, lm, 7.0, torch.tensor(lam))
    out["loss"].backward()
    for key in ("loss", "final", "base", "accuracy"):
        assert out[key].item() == pytest.approx(ref[key].item(), rel=1e-5, abs=1e-6), key
    assert not out["final"].requires_grad and not out["base"].requires_grad
    got = {n: p.grad for n, p in drafter.named_parameters() if p.grad is not None}
    assert set(got) == set(want)
    for name, g in want.items():
        assert torch.allclose(got[name], g, rtol=1e-4, atol=1e-6), name


def test_the_full_logits_baseline_equals_the_chunked_loss():
    """`vocab_loss="full"` (what bench.drafter_train measures the chunked loss against) trains the same objective."""
    drafter, batch, hidden, embed, lm = small_problem(3)
    grads, values = [], []
    for kind in ("chunked", "full"):
        drafter.zero_grad(set_to_none=True)
        out = block_losses(drafter, batch, hidden, embed, lm, 7.0, 0.4, vocab_loss=kind)
        out["loss"].backward()
        values.append({k: out[k].item() for k in ("loss", "final", "base", "accuracy", "accept_len")})
        grads.append({n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None})
    assert values[0] == pytest.approx(values[1], rel=1e-5)
    assert set(grads[0]) == set(grads[1])
    for name, g in grads[1].items():
        assert torch.allclose(grads[0][name], g, rtol=1e-4, atol=1e-6), name


def test_no_gradient_work_without_autograd():
    """Under no_grad (held-out evaluation) the same figures come out and the logits are left alone."""
    drafter, batch, hidden, embed, lm = small_problem(1)
    with torch.no_grad():
        out = block_losses(drafter, batch, hidden, embed, lm, 7.0)
        ref = plain_block_losses(drafter, batch, hidden, embed, lm, 7.0, 0.0)
    assert out["final"].item() == pytest.approx(ref["final"].item(), rel=1e-5)
    assert out["accuracy"].item() == pytest.approx(ref["accuracy"].item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_cross_entropy_grad_equals_the_torch_ops(monkeypatch, dtype):
    """The kernel (several column tiles, the last one partial; ties in a row go to the first index) against the
    CPU path: CE, argmax, and the in-place gradient with and without an accumulated row."""
    from speculative.kernels import vocab_ce
    gen = torch.Generator().manual_seed(3)
    n, v = 6, 300
    logits = (3 * torch.randn(n, v, generator=gen)).to(dtype)
    logits[2, 7] = logits[2, 250] = logits[2].max() + 1            # a tie: argmax is the first index
    labels = torch.randint(0, v, (n,), generator=gen)
    weights = torch.rand(n, generator=gen)
    weights[4] = 0.0
    acc = torch.randn(n, v, generator=gen).to(dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    monkeypatch.setattr(vocab_ce, "BLOCK", 128)
    for grad, with_acc in ((False, False), (True, False), (True, True)):
        mine, ref = logits.clone().to(device), logits.clone()
        ce, argmax = vocab_ce.cross_entropy_grad(mine, labels.to(device), weights.to(device), grad,
                                                 acc.to(device) if with_acc else None)
        ce_ref, argmax_ref = vocab_loss._ce_grad_torch(ref, labels, weights, grad, acc if with_acc else None)
        assert torch.allclose(ce.cpu(), ce_ref, **tol)
        assert torch.equal(argmax.cpu(), argmax_ref) and argmax_ref[2] == 7
        assert torch.allclose(mine.cpu().float(), ref.float(), **tol)


def test_block_mask_attention_equals_the_dense_mask():
    """The FlexAttention BlockMask (what a compiled loss uses) lets through what the dense mask does: the same
    losses (forward only: FlexAttention has no backward on the CPU); attended_pairs, what MFU counts, is the
    dense mask's count of True."""
    drafter, batch, hidden, embed, lm = small_problem(2)
    with torch.no_grad():
        dense, sparse = (block_losses(drafter, batch, hidden, embed, lm, 7.0, 0.5, block_mask=b) for b in (False, True))
    for key in ("loss", "final", "base", "accuracy", "accept_len"):
        assert sparse[key].item() == pytest.approx(dense[key].item(), rel=1e-5), key
    s, t = drafter.cfg.block_size, batch.input_ids.shape[1]
    assert attended_pairs(batch.anchors, batch.anchor_valid, s) == \
        int(training_mask(batch.anchors, batch.anchor_valid, t, s).sum())


def test_auto_vocab_loss_takes_the_full_logits_where_a_compiled_steps_logits_fit(monkeypatch):
    """`--vocab-loss auto`: the full logits for a compiled loss whose step's logits (batch x anchors x slots x
    vocabulary, bf16) fit four times in a quarter of the GPU's memory; chunked for a larger step, for an eager
    loss, and wherever the loss is named."""
    from types import SimpleNamespace

    from speculative.train_loop import TrainConfig, resolve_vocab_loss
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 << 30))
    drafter = DrafterConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2,
                            num_kv_heads=1, head_dim=32, target_layer_ids=(0,), block_size=16)
    gpu = torch.device("cuda", 0)
    step = dict(batch_size=16, anchors_per_seq=128)                    # 32,768 rows: 3 GiB of logits
    assert resolve_vocab_loss(TrainConfig(**step), True, drafter, gpu) == "full"
    assert resolve_vocab_loss(TrainConfig(**step), False, drafter, gpu) == "chunked"
    assert resolve_vocab_loss(TrainConfig(batch_size=32, anchors_per_seq=128), True, drafter, gpu) == "chunked"
    for named in ("chunked", "full"):
        assert resolve_vocab_loss(TrainConfig(vocab_loss=named, **step), False, drafter, gpu) == named
