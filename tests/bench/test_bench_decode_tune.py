"""bench.decode_tune's GEMM section without a GPU: a fake timer in place of the CUDA-graph one, so what is checked
is what the benchmark times and how it reports (FP8 rows count one byte a weight, the selector's pick must beat
the library call by 1%, per-step sums over the layer GEMMs)."""
import pytest

from bench.decode_tune import FP8_BATCHES, GEMM_SHAPES, gemm_rows, summarize


def fake_timer(m, n, k, cfg):
    """The library call 10 us; FP8 tensor cores on per-token scales 5 us at M >= 16; CUDA-core products with the
    long K tiles 6 us at M <= 4; every other config 20 us."""
    if cfg is None:
        return 10e-6
    if cfg.token_scales and m >= 16:
        return 5e-6
    if cfg.gemv and cfg.block_k == 2 * min(1024, 8192 // (cfg.block_m * cfg.block_n)):
        return 6e-6
    return 20e-6


def test_fp8_rows_time_every_candidate_and_the_selector_picks_the_fastest():
    shapes = {k: v for k, v in GEMM_SHAPES.items() if k != "lm_head"}
    rows = []
    gemm_rows(rows, fake_timer, 132, None, shapes, FP8_BATCHES, 1)
    out = summarize(rows, copy_bw=4e12, batches=FP8_BATCHES)
    assert {(r["shape"], r["m"]) for r in out["rows"]} == {(s, m) for s in shapes for m in FP8_BATCHES}
    for r in out["rows"]:
        n, k, m = r["n"], r["k"], r["m"]
        assert r["bytes"] == n * k + 2 * (m * k + m * n)
        assert all(t["s"] is not None and t["candidate"] for t in r["trials"])
        pick = r["selector"]["pick"]
        if m >= 16:
            assert pick.endswith("d8t") and r["selector"]["s"] == 5e-6
        elif m <= 4:
            assert "v" in pick and r["selector"]["s"] == 6e-6
    assert set(out["per_step"]) == set(FP8_BATCHES)
    assert out["per_step"][64]["cublas_ms"] == pytest.approx(32 * 4 * 10e-3)
    assert out["per_step"][64]["selector_ms"] == pytest.approx(32 * 4 * 5e-3)


def test_a_pick_within_one_percent_of_the_library_call_is_not_taken():
    rows = []
    gemm_rows(rows, lambda m, n, k, cfg: 10e-6 if cfg is None else 9.95e-6, 132, None, {"o_proj": (4096, 4096)},
              (64,), 2)
    (row,) = summarize(rows, copy_bw=4e12, batches=(64,))["rows"]
    assert row["selector"]["pick"] == "cublas" and row["bytes"] == 2 * (4096 * 4096 + 2 * 64 * 4096)
