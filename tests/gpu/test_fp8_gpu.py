"""FP8 linear weights on a CUDA GPU (quantization=fp8): the activation quantizer kernel writes what the torch rule
writes, torch._scaled_mm with row scales equals the float product of the quantized operands at decode and prefill
sizes, the FP8 skinny GEMM equals the product with the dequantized weight (weight-only) or is as close to it as
the library path (FP8 tensor cores), the start-up selection
covers FP8 layers and its choice replays in a CUDA graph, and the default model in FP8 (CUDA graphs) keeps its
perplexity within 2% of bf16's."""
import pytest
import torch

from replicas import LLM, SamplingParams
from replicas.kernels.fp8_quant import quantize_rows_fp8
from replicas.kernels.skinny_gemm import SkinnyConfig
from replicas.layers.fp8_linear import FP8, FP8_MAX, MIN_SCALE, Fp8Weight, quantize_rows
from replicas.layers.gemm_select import candidate_configs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("rows", [1, 3, 64, 1000])
def test_scaled_mm_equals_the_float_product_of_the_quantized_operands(rows):
    gen = torch.Generator(device="cuda").manual_seed(rows)
    w = torch.randn(1536, 576, generator=gen, device="cuda").bfloat16()
    x = torch.randn(rows, 576, generator=gen, device="cuda").bfloat16()
    bias = torch.randn(1536, generator=gen, device="cuda").bfloat16()
    weight = Fp8Weight.from_float(w)
    y = weight.linear(x, bias)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 1536)
    xq, xs = quantize_rows(x)
    want = (xq.float() * xs.unsqueeze(1)) @ weight.dequantize().T + bias.float()
    # Hopper's FP8 tensor cores accumulate with fewer bits than float32: the error scales with the terms summed
    # (here |y| ~ 24), so the bound is absolute at that scale, plus the bf16 output's rounding.
    torch.testing.assert_close(y.float(), want, rtol=1e-2, atol=5e-2)


@pytest.mark.parametrize("rows,k", [(1, 576), (7, 300), (64, 4096), (8192, 14336)])
def test_activation_quantizer_kernel_writes_what_the_torch_rule_writes(rows, k):
    gen = torch.Generator(device="cuda").manual_seed(k)
    x = (torch.randn(rows, k, generator=gen, device="cuda") * 4).bfloat16()
    x[0, :] = 0                                          # an all-zero row takes MIN_SCALE
    q, scale = quantize_rows_fp8(x, FP8_MAX, MIN_SCALE, FP8)
    want_q, want_scale = quantize_rows(x)
    assert torch.equal(scale, want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


FP8_CONFIGS = sorted({c for m in (1, 64, 256) for c in candidate_configs(m, 4096, 4096, 132, weight_bytes=1)},
                     key=str)


@pytest.mark.parametrize("m,n,k", [(1, 6144, 4096), (16, 4096, 4096), (64, 28672, 4096), (200, 4096, 14336),
                                   (3, 1536, 576)])
def test_fp8_skinny_gemm_equals_the_product_with_the_dequantized_weight(m, n, k):
    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
    weight = Fp8Weight.from_float(torch.randn(n, k, generator=gen, device="cuda") / k ** 0.5)
    bias = torch.randn(n, generator=gen, device="cuda").bfloat16()
    want = x.float() @ weight.dequantize().T + bias.float()
    for cfg in FP8_CONFIGS:
        y = weight.skinny(x, bias, cfg)
        assert y.dtype == torch.bfloat16
        if cfg.fp8_dot:        # x tiles in E4M3 too: close to the product, as the library path is
            assert (y.float() - want).norm() / want.norm() < 0.05, cfg
        else:
            torch.testing.assert_close(y.float(), want, atol=2e-2, rtol=2e-2, msg=lambda s: f"{cfg}: {s}")


def test_selection_covers_fp8_layers_and_their_choice_replays_in_a_cuda_graph():
    from replicas.layers.gemm_select import apply_table, tune_linear_layers
    from tests.support.mlp import cuda_llama_mlp

    mlp = cuda_llama_mlp()
    assert mlp.gate_up_proj.to_fp8() and mlp.down_proj.to_fp8()
    table = tune_linear_layers(mlp, [1, 64, 300], torch.device("cuda"))
    assert table is not None and set(table) == {(8192, 1024, FP8), (1024, 4096, FP8)}
    assert all(set(per_m) <= {1, 64} for per_m in table.values())
    apply_table(mlp, {key: {64: SkinnyConfig(64, 64, 256, 2, 4, 3)} for key in table})
    x = torch.randn(64, 1024, device="cuda").bfloat16()
    with torch.inference_mode():
        eager = mlp(x)                           # compiles every kernel outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = mlp(x)
        graph.replay()
        torch.testing.assert_close(y, eager, atol=0, rtol=0)
        apply_table(mlp, {})                     # the library path quantizes activations too: close, not equal
        library = mlp(x).float()
        assert (y.float() - library).norm() / library.norm() < 0.05


def test_default_model_in_fp8_keeps_its_perplexity_within_2_percent_of_bf16():
    """SmolLM2 (every linear shape fits FP8) decodes through its CUDA graphs in FP8, and its teacher-forced
    perplexity on a fixed text (bench.engine.fp8_perplexity: Python's LICENSE.txt, 512 tokens) is within 2% of
    bf16's."""
    from bench.engine import fp8_perplexity
    llm = LLM(quantization="fp8", gpu_memory_utilization=0.3)
    try:
        assert llm.engine.runner.graphs is not None
        assert any(isinstance(m, Fp8Weight) for m in llm.engine.runner.model.modules())
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        assert all(len(o.outputs[0].token_ids) == 16 for o in llm.generate(["Once upon a time"] * 3, params))
    finally:
        llm.shutdown()
    ppl = fp8_perplexity(gpu_memory_utilization=0.3)
    assert ppl["ratio"] <= 1.02, ppl
