"""Randomized GPU checks of the skinny GEMM (bf16) against an fp32 torch reference, CUDA-graph replay of a
split-K call, and the start-up selection on a tiny model with the real graph timer.

240 random cases: M in [1, 256], N in [1, 3000], K in [1, 5000], bias or not, drawn per case from its seed;
configs come from a fixed list (the selector's candidates for a few shapes) so compilations stay few.
"""
import random

import pytest
import torch
import torch.nn.functional as F

from replicas.layers.gemm_select import GraphTimer, candidate_configs, select_gemms
from replicas.kernels.skinny_gemm import SkinnyConfig, skinny_gemm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

N_CASES = 240
CONFIGS = sorted({c for m in (1, 8, 64, 128, 256) for c in candidate_configs(m, 4096, 4096, 132)}, key=str) + [
    SkinnyConfig(16, 16, 64, 3, 4, 2), SkinnyConfig(64, 256, 64, 1, 8, 3)]
TOL = dict(atol=2e-2, rtol=2e-2)


def draw(seed: int):
    rng = random.Random(seed)
    m = rng.choice([1, 2, 7, 16, 33, 64, 100, 128, 200, 256, rng.randint(1, 256)])
    n = rng.choice([rng.randint(1, 3000), 16 * rng.randint(1, 190)])
    k = rng.choice([rng.randint(1, 5000), 128 * rng.randint(1, 40)])
    return m, n, k, rng.random() < 0.3, CONFIGS[seed % len(CONFIGS)]


@pytest.mark.parametrize("seed", range(N_CASES))
def test_skinny_gemm_bf16_random_shapes(seed):
    m, n, k, bias, cfg = draw(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
    w = (torch.randn(n, k, generator=gen, device="cuda") / k ** 0.5).bfloat16()
    b = torch.randn(n, generator=gen, device="cuda").bfloat16() if bias else None
    y = skinny_gemm(x, w, b, cfg)
    expect = F.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(y.float(), expect, **TOL, msg=lambda s: f"m={m} n={n} k={k} {cfg}: {s}")


def test_split_k_call_replays_in_a_cuda_graph():
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(64, 4096, generator=gen, device="cuda").bfloat16()
    w = (torch.randn(1024, 4096, generator=gen, device="cuda") / 64).bfloat16()
    cfg = SkinnyConfig(64, 64, 128, 4, 4, 4)
    eager = skinny_gemm(x, w, None, cfg)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = skinny_gemm(x, w, None, cfg)
    x.copy_(torch.randn(64, 4096, generator=gen, device="cuda").bfloat16())
    graph.replay()
    torch.testing.assert_close(y, skinny_gemm(x, w, None, cfg), atol=0, rtol=0)   # split order is fixed
    assert not torch.equal(y, eager)


def test_selection_with_the_graph_timer_on_small_shapes():
    timer = GraphTimer(torch.device("cuda"), torch.bfloat16, calls_per_graph=4, reps=3)
    table, choices = select_gemms([(768, 512), (512, 1024)], [16, 64], timer, 132)
    assert set(table) == {(768, 512), (512, 1024)} and len(choices) == 4
    for c in choices:
        assert 0 < c.cublas_s < 1e-2 and (c.best is None or 0 < c.best_s < 1e-2)
        assert (c.m in table[(c.n, c.k)]) == c.use_skinny
    timer.release()


def test_tuned_mlp_in_a_cuda_graph_matches_cublas():
    from replicas.layers.gemm_select import apply_table, tune_linear_layers
    from tests.support.mlp import cuda_llama_mlp

    mlp = cuda_llama_mlp()
    table = tune_linear_layers(mlp, [16, 64, 300], torch.device("cuda"))
    assert table is not None and set(table) == {(8192, 1024, torch.bfloat16), (1024, 4096, torch.bfloat16)}
    assert all(set(per_m) <= {16, 64} for per_m in table.values())
    forced = {shape: {64: SkinnyConfig(64, 64, 128, 4, 4, 4)} for shape in table}
    apply_table(mlp, forced)
    x = torch.randn(64, 1024, device="cuda").bfloat16()
    with torch.inference_mode():
        mlp(x)                                  # compiles every kernel outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = mlp(x)
        graph.replay()
        apply_table(mlp, {})
        torch.testing.assert_close(y.float(), mlp(x).float(), atol=2e-3, rtol=3e-2)
