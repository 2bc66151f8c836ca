"""FP8 linear weights on a CUDA GPU (quantization=fp8): torch._scaled_mm with row scales equals the float product
of the quantized operands at decode and prefill sizes, and the default model in FP8 (CUDA graphs) keeps its
perplexity within 2% of bf16's."""
import pytest
import torch

from replicas import LLM, SamplingParams
from replicas.layers.fp8_linear import Fp8Weight, quantize_rows

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
    torch.testing.assert_close(y.float(), want, rtol=1e-2, atol=1e-2)      # bf16 output rounding


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
