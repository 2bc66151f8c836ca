"""The CPU elementwise kernels (replicas/kernels/elementwise_cpu.py) against the torch reference, on the shapes and
views the model hands them (odd widths with a scalar tail, strided per-head views, in-place rotary), and the layers
taking them."""
import pytest
import torch

from replicas.attention import reference as ref
from replicas.kernels import elementwise_cpu
from replicas.layers.activation import SiluAndMul
from replicas.layers.norm import RMSNorm
from replicas.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(not elementwise_cpu.supports(torch.zeros(1)), reason="the CPU kernels cannot be built")
TOL = dict(atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("rows,width", [(7, 96), (1, 576), (3, 101), (600, 128)])   # 600 x 128: the threaded loop
def test_rms_norm_with_and_without_residual(rows, width):
    gen = torch.Generator().manual_seed(width)
    x, res = torch.randn(rows, width, generator=gen), torch.randn(rows, width, generator=gen)
    w = 1 + 0.1 * torch.randn(width, generator=gen)
    x_before, res_before = x.clone(), res.clone()
    out, new_res = elementwise_cpu.rms_norm(x, w, 1e-6, res)
    want_out, want_res = ref.rms_norm_reference(x, w, 1e-6, res)
    assert torch.equal(new_res, want_res)                       # the add is exact
    torch.testing.assert_close(out, want_out, **TOL)
    assert torch.equal(x, x_before) and torch.equal(res, res_before)
    out, same = elementwise_cpu.rms_norm(x, w, 1e-6)
    assert same is x
    torch.testing.assert_close(out, ref.rms_norm_reference(x, w, 1e-6)[0], **TOL)


def test_rms_norm_per_head_on_a_strided_qkv_view():
    gen = torch.Generator().manual_seed(21)
    qkv = torch.randn(5, (4 + 2 + 2) * 16, generator=gen)
    q = qkv[:, : 4 * 16].view(5, 4, 16)
    w = torch.rand(16, generator=gen)
    out, _ = elementwise_cpu.rms_norm(q, w, 1e-5)
    torch.testing.assert_close(out, ref.rms_norm_reference(q.contiguous(), w, 1e-5)[0], **TOL)


@pytest.mark.parametrize("rot_dim,head_dim", [(64, 64), (32, 64), (12, 12)])    # 12: the scalar tail alone
def test_rotary_in_place_on_strided_views_touches_nothing_else(rot_dim, head_dim):
    gen = torch.Generator().manual_seed(rot_dim)
    qkv = torch.randn(6, (4 + 1 + 1) * head_dim, generator=gen)
    q, k = qkv[:, : 4 * head_dim].view(6, 4, head_dim), qkv[:, 4 * head_dim: 5 * head_dim].view(6, 1, head_dim)
    positions = torch.tensor([0, 1, 5, 5, 63, 17], dtype=torch.int32)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim))
    cache = ref.rotary_cos_sin_cache(inv_freq, 64)
    want_q, want_k, v = q.clone(), k.clone(), qkv[:, 5 * head_dim:].clone()
    ref.apply_rotary_reference(want_q, want_k, positions, cache)
    elementwise_cpu.apply_rotary(q, k, positions, cache)
    torch.testing.assert_close(q, want_q, **TOL)
    torch.testing.assert_close(k, want_k, **TOL)
    assert torch.equal(qkv[:, 5 * head_dim:], v)


@pytest.mark.parametrize("rows", [1, 5])
def test_silu_and_mul_on_a_strided_view(rows):
    gen = torch.Generator().manual_seed(30)
    x = (3 * torch.randn(rows, 2 * 1537 + 4, generator=gen))[:, 4:]               # a row stride beyond the width
    torch.testing.assert_close(elementwise_cpu.silu_and_mul(x), ref.silu_and_mul_reference(x), **TOL)


def test_the_layers_take_the_kernels_and_keep_their_torch_path_for_autograd():
    """The C path of each layer equals its torch path (the one a tensor that needs gradients takes)."""
    gen = torch.Generator().manual_seed(1)
    norm = RMSNorm(64, 1e-5)
    norm.weight.data = 1 + 0.1 * torch.randn(64, generator=gen)
    x, res = torch.randn(3, 64, generator=gen), torch.randn(3, 64, generator=gen)
    out, new_res = norm(x, res)
    grad_x = x.clone().requires_grad_()
    want_out, want_res = norm(grad_x, res)
    assert want_out.grad_fn is not None
    torch.testing.assert_close(out, want_out.detach(), **TOL)
    assert torch.equal(new_res, want_res.detach())

    rope = RotaryEmbedding(16, 32, 10000.0)
    q, k = torch.randn(3, 4, 16, generator=gen), torch.randn(3, 2, 16, generator=gen)
    positions = torch.tensor([0, 7, 31])
    want_q, want_k = rope(positions, q.clone().requires_grad_(), k.clone().requires_grad_())
    got_q, got_k = rope(positions, q, k)
    assert got_q is q and got_k is k                                              # in place
    torch.testing.assert_close(got_q, want_q.detach(), **TOL)
    torch.testing.assert_close(got_k, want_k.detach(), **TOL)

    act = SiluAndMul()
    x = torch.randn(2, 96, generator=gen)
    torch.testing.assert_close(act(x), act(x.clone().requires_grad_()).detach(), **TOL)
