"""Quantized linear weights on CPU (quantization=auto): the weight-only kernels against the float product of the
dequantized weight for each GGUF block type, the loader keeping the default model's linear weights quantized, and
the default model's greedy outputs against the dequantized path."""
import gguf
import numpy as np
import pytest
import torch

from replicas import LLM, SamplingParams
from replicas.config import EngineConfig
from replicas.kernels import quant_cpu
from replicas.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from replicas.layers.quantized_linear import QuantizedWeight
from replicas.loaders.gguf_loader import quantized_weight
from replicas.sequence import Sequence
from replicas.scheduler import ScheduledBatch
from replicas.step_input import StepInput
from tests.support.greedy import compare_greedy

TYPES = ("Q4_0", "Q4_1", "Q8_0")
# The kernel keeps activations in float: the dequantized weight's product up to summation order.
KERNEL_RTOL = 1e-5


def _blocks(type_name: str, n: int, k: int, seed: int = 0):
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    qt = gguf.GGMLQuantizationType[type_name]
    raw = gguf.quants.quantize(w, qt)
    return quantized_weight(raw, type_name), torch.from_numpy(gguf.quants.dequantize(raw, qt).copy())


@pytest.mark.parametrize("type_name", TYPES)
def test_blocks_dequantize_exactly_as_gguf(type_name):
    weight, ref = _blocks(type_name, 48, 96)
    assert weight.bits == (8 if type_name == "Q8_0" else 4)
    assert torch.equal(weight.dequantize(), ref)


@pytest.mark.skipif(not quant_cpu.available(), reason="the CPU kernel cannot be built here (no cc or no AVX2)")
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 32, 40])    # 40: above MAX_ROWS, the dequantized float GEMM
def test_linear_matches_float_product(type_name, rows):
    weight, ref = _blocks(type_name, 72, 160, seed=rows)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(72)
    want = x @ ref.t() + bias
    got = weight.linear(x, bias)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < KERNEL_RTOL, rel


def test_tp_loaders_slice_quantized_weights():
    """The fused and row-parallel weight loaders copy quantized parts like float ones (TP=1 here; a rank's slice
    of input columns must cover whole groups)."""
    gate, gate_ref = _blocks("Q4_1", 64, 96, seed=1)
    up, up_ref = _blocks("Q4_0", 64, 96, seed=2)
    fused = MergedColumnParallelLinear(96, [64, 64])
    w = fused.quantize_weight(4)
    fused.weight_loader(w, gate, 0)
    fused.weight_loader(w, up, 1)
    assert torch.equal(w.dequantize(), torch.cat([gate_ref, up_ref]))
    down = RowParallelLinear(96, 64)
    d = down.quantize_weight(4)
    down.weight_loader(d, gate)
    assert torch.equal(d.dequantize(), gate_ref)
    with pytest.raises(ValueError, match="multiples of 32"):
        gate.narrow(1, 16, 48)
    with pytest.raises(ValueError, match="cannot take"):
        fused.weight_loader(w, _blocks("Q8_0", 64, 96)[0], 0)


def test_loader_keeps_linear_weights_quantized():
    from replicas.model_runner import ModelRunner
    quant, plain = (ModelRunner(EngineConfig.from_flat(device="cpu", quantization=q)).model for q in ("auto", "none"))
    linears = [n for n, m in quant.named_modules() if hasattr(m, "quantize_weight")]
    assert len(linears) == 4 * 30
    for name in linears:
        qw, fw = quant.get_submodule(name).weight, plain.get_submodule(name).weight
        assert isinstance(qw, QuantizedWeight) and qw.bits == 4       # the file's Q4_1
        assert isinstance(fw, torch.nn.Parameter) and fw.dtype == torch.float32
        assert torch.equal(qw.dequantize(), fw)
    assert quant.lm_head.weight.dtype == torch.float32 and quant.model.embed_tokens.weight.dtype == torch.float32


def test_an_unknown_quantization_is_refused():
    with pytest.raises(ValueError):
        EngineConfig.from_flat(quantization="int3")


QUESTIONS = ["What is the capital of France?", "Who wrote Hamlet?", "What is 12 times 7?",
             "Name a famous painting."]
# The kernel and the dequantized float GEMM differ in summation order only: outputs may part where the dequantized
# path's top-2 logits are that close, nowhere else.
QUANT_TIE = 1e-2


def test_default_model_greedy_matches_dequantized():
    params = SamplingParams(temperature=0.0, max_tokens=24)
    quant = LLM(quantization="auto")          # one engine at a time: two idle engines slow each other down
    try:
        prompts = [quant.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
        got = [o.outputs[0].token_ids for o in quant.generate(prompts, params)]
        paris = "Paris" in quant.tokenizer.decode(got[0])
    finally:
        quant.shutdown()
    plain = LLM(quantization="none")

    @torch.no_grad()
    def last_logits(ids):
        engine = plain.engine
        seq = Sequence("logits", 0, ids, params, 0, 0.0)
        engine.block_manager.allocate(seq, len(ids))
        batch = ScheduledBatch([seq], [len(ids)])
        step = StepInput.from_batch(batch, engine.config.cache.block_size)
        step.sample_indices = np.array([len(ids) - 1])
        try:
            return engine.runner.execute(step)[0]
        finally:
            engine.block_manager.free(seq)

    try:
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
        flips = compare_greedy(prompts, got, want, last_logits, tie=QUANT_TIE)
    finally:
        plain.shutdown()
    assert len(flips) <= len(prompts) // 2, flips
    assert paris
