"""FP8 linear weights (quantization=fp8, replicas/layers/fp8_linear.py) on the CPU, which runs the same
torch._scaled_mm arithmetic as the GPU: row quantization within E4M3's rounding, the product equal to the float
product of the quantized operands, the layers that convert and those that keep their float weight, and a tiny
model end to end against its float self."""
import pytest
import torch

from replicas import LLM, SamplingParams
from replicas.distributed.communicator import SingleCommunicator
from replicas.distributed.parallel_state import get_tp_group, set_tp_group
from replicas.layers.fp8_linear import FP8, FP8_MAX, Fp8Weight, quantize_rows
from replicas.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from tests.support.checkpoints import make_fp8_checkpoint, make_tiny_llama

E4M3_REL = 2.0 ** -4            # half a unit in the last place of a 3-bit mantissa
E4M3_SUBNORMAL = 2.0 ** -9      # spacing of E4M3's subnormals (in units of the row scale)
# The tiny model's first-token logprobs in FP8 against float: two E4M3 roundings per product through two layers
# move them by up to about 0.12 nats (its logits are nearly flat: about -3.8 for the top tokens).
FIRST_TOKEN_NATS = 0.25


def test_rows_quantize_within_e4m3_rounding():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 80, generator=gen) * torch.logspace(-3, 2, 48).unsqueeze(1)   # rows of every magnitude
    w[5] = 0.0
    q, scale = quantize_rows(w)
    assert q.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (48,)
    assert torch.equal(q.float().abs().amax(dim=1)[torch.arange(48) != 5], torch.full((47,), FP8_MAX))
    back = q.float() * scale.unsqueeze(1)
    assert torch.all((back - w).abs() <= E4M3_REL * w.abs() + E4M3_SUBNORMAL * scale.unsqueeze(1))
    assert torch.equal(back[5], torch.zeros(80))


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_product_equals_the_float_product_of_the_quantized_operands(rows):
    gen = torch.Generator().manual_seed(rows)
    w, x, bias = torch.randn(96, 160, generator=gen), torch.randn(rows, 160, generator=gen), torch.randn(96)
    weight = Fp8Weight.from_float(w)
    y = weight.linear(x, bias)
    xq, xs = quantize_rows(x)
    want = (xq.float() * xs.unsqueeze(1)) @ weight.dequantize().T + bias
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    exact = x @ w.T + bias
    assert ((y - exact).norm() / exact.norm()).item() < 0.05      # two E4M3 roundings per product
    assert weight.linear(x.view(1, rows, 160), None).shape == (1, rows, 96)


@pytest.fixture
def single_rank():
    """Layers built here run on one rank, whatever TP group an earlier test of the process left set."""
    previous = get_tp_group()
    set_tp_group(SingleCommunicator())
    yield
    set_tp_group(previous)


def test_layers_convert_where_the_shape_fits_and_keep_their_bias(single_rank):
    gen = torch.Generator().manual_seed(3)
    fused = MergedColumnParallelLinear(64, [32, 32])
    fused.weight.data = torch.randn(64, 64, generator=gen)
    down = RowParallelLinear(64, 48, bias=True)
    down.weight.data, down.bias.data = torch.randn(48, 64, generator=gen), torch.randn(48, generator=gen)
    odd = RowParallelLinear(64, 40)                                   # 40 outputs: not a multiple of 16
    x = torch.randn(5, 64, generator=gen)
    want = down(x)
    assert fused.to_fp8() and down.to_fp8() and not odd.to_fp8()
    assert isinstance(fused.weight, Fp8Weight) and isinstance(odd.weight, torch.nn.Parameter)
    assert ((down(x) - want).norm() / want.norm()).item() < 0.05
    assert not down.to_fp8()                                          # already converted


@pytest.fixture(scope="module")
def tiny_float(tmp_path_factory) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny") / "m"))


def assert_first_token_logprobs_close(fp8, ref) -> set[int]:
    """The first token's top logprobs that both outputs report differ by less than FIRST_TOKEN_NATS; returns
    those tokens."""
    want, got = ref.logprobs[0], fp8.logprobs[0]
    common = set(want) & set(got)
    for t in common:
        assert abs(got[t].logprob - want[t].logprob) < FIRST_TOKEN_NATS, (t, got[t], want[t])
    return common


def test_tiny_model_decodes_in_fp8_close_to_its_float_self(tiny_float):
    """Every linear layer of a tiny Llama converts; its first token's top logprobs stay within FP8's error of
    the float engine's (the LM head is float in both)."""
    model = tiny_float
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    prompts = ["The cat", "Once upon a time", "1 2 3", "Hello there"]
    outs = {}
    for quantization in ("none", "fp8"):
        llm = LLM(model=model, device="cpu", quantization=quantization)
        try:
            if quantization == "fp8":
                layers = [m for m in llm.engine.runner.model.modules() if hasattr(m, "to_fp8")]
                assert layers and all(isinstance(m.weight, Fp8Weight) for m in layers)
            outs[quantization] = [o.outputs[0] for o in llm.generate(prompts, params)]
        finally:
            llm.shutdown()
    for fp8, ref in zip(outs["fp8"], outs["none"]):
        assert len(fp8.token_ids) == 8
        assert len(assert_first_token_logprobs_close(fp8, ref)) >= 3
        top = sorted(ref.logprobs[0].values(), key=lambda lp: -lp.logprob)
        if top[0].logprob - top[1].logprob > 2 * FIRST_TOKEN_NATS:          # not a near-tie: the same token
            assert fp8.token_ids[0] == ref.token_ids[0]


# ---- checkpoints published in FP8 ----------------------------------------------------------------------------

def _linear_layers(llm):
    return {name: m for name, m in llm.engine.runner.model.named_modules() if hasattr(m, "to_fp8")}


@pytest.mark.parametrize("scheme", ["channel", "tensor"])
def test_an_fp8_checkpoint_loads_its_own_values_and_scales(tiny_float, tmp_path, scheme):
    """fp8 keeps the file's E4M3 values and scales as they are (a per-tensor scale repeated over its rows, the
    fused qkv and gate_up taking each part's own); none dequantizes them exactly; both decode the same text
    within FP8's activation rounding."""
    from safetensors.torch import load_file
    folder = make_fp8_checkpoint(tiny_float, str(tmp_path / scheme), scheme)
    stored = load_file(f"{folder}/model.safetensors")
    prompts, params = ["The cat", "Once upon a time"], SamplingParams(temperature=0.0, max_tokens=4, logprobs=5,
                                                                      ignore_eos=True)
    outs = {}
    for quantization in ("fp8", "none"):
        llm = LLM(model=folder, device="cpu", quantization=quantization)
        try:
            layers = _linear_layers(llm)
            qkv = layers["model.layers.1.self_attn.qkv_proj"].weight
            parts = [stored[f"model.layers.1.self_attn.{p}_proj.{t}"] for p in "qkv" for t in ("weight",)]
            scales = [stored[f"model.layers.1.self_attn.{p}_proj.weight_scale"].float().reshape(-1) for p in "qkv"]
            rows = torch.cat([s.expand(len(w)) if s.numel() == 1 else s for s, w in zip(scales, parts)])
            if quantization == "fp8":
                assert all(isinstance(m.weight, Fp8Weight) for m in layers.values())
                assert torch.equal(qkv.q.view(torch.uint8), torch.cat(parts).view(torch.uint8))
                assert torch.equal(qkv.scale, rows)
            else:
                assert not any(isinstance(m.weight, Fp8Weight) for m in layers.values())
                assert torch.equal(qkv, torch.cat(parts).float() * rows.unsqueeze(1))
            outs[quantization] = [o.outputs[0] for o in llm.generate(prompts, params)]
        finally:
            llm.shutdown()
    for fp8, ref in zip(outs["fp8"], outs["none"]):
        assert_first_token_logprobs_close(fp8, ref)


def test_a_block_scaled_fp8_checkpoint_loads_dequantized(tiny_float, tmp_path):
    """weight_scale_inv per 32 x 32 block: the float weight is each block's values times its scale; fp8 then
    quantizes it per row like any float weight."""
    from safetensors.torch import load_file
    folder = make_fp8_checkpoint(tiny_float, str(tmp_path / "block"), "block")
    stored = load_file(f"{folder}/model.safetensors")
    q, inv = stored["model.layers.0.mlp.down_proj.weight"], stored["model.layers.0.mlp.down_proj.weight_scale_inv"]
    want = q.float() * inv.repeat_interleave(32, 0).repeat_interleave(32, 1)
    llm = LLM(model=folder, device="cpu", quantization="none")
    try:
        assert torch.equal(_linear_layers(llm)["model.layers.0.mlp.down_proj"].weight, want)
    finally:
        llm.shutdown()
    llm = LLM(model=folder, device="cpu", quantization="fp8")
    try:
        down = _linear_layers(llm)["model.layers.0.mlp.down_proj"].weight
        assert isinstance(down, Fp8Weight) and torch.equal(down.scale, want.abs().amax(dim=1) / FP8_MAX)
    finally:
        llm.shutdown()
