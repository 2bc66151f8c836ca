"""DominoTree on CUDA: the fused Triton frontier build (build_frontier) against the reference heap on 1,200
random cases from four kernel-shape families (ties, DDTree mode, budgets beyond the tree, batches 1-8), the torch
frontier on the same Triton row math, SmolLM2-sized rounds in bf16, CUDA-graph replay per batch bucket and in
slices above the largest bucket against the reference on the unpadded batch, the kernels per replayed round, and
no host synchronisation in the eager round path (prepare, build, mask, accept)."""
import random
from dataclasses import dataclass

import pytest
import torch

from speculative.acceptance import accept
from speculative.drafter import DominoHead, DrafterConfig
from speculative.draft_tree import DraftTree, TreeConfig
from speculative.tree import prepare_round
from speculative.tree_gpu import GraphTreeBuilder, build_frontier, build_frontier_torch
from speculative.tree_reference import build_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEV = "cuda"


def head_for(v, h, gru, rank, seed, scale=1.0, dtype=torch.float32) -> DominoHead:
    cfg = DrafterConfig(vocab_size=v, hidden_size=h, intermediate_size=32, num_layers=1, num_heads=2,
                        num_kv_heads=1, head_dim=8, target_layer_ids=(0,), gru_hidden=gru, correction_rank=rank)
    head = DominoHead(cfg)
    g = torch.Generator().manual_seed(seed)
    for p in head.parameters():
        p.data = torch.randn(p.shape, generator=g) * scale / p.shape[-1] ** 0.5 * 4
    return head.to(DEV, dtype)


@dataclass(frozen=True)
class ShapeFamily:
    """Sizes a random case draws from. Triton compiles a kernel once per key: its constexprs (sizes padded to
    powers of two and the block sizes derived from them), whether each integer argument is 1 or divisible by 16,
    and whether each pointer is 16-byte aligned. A cold compile costs ~0.3-1 s, so every value in a field of a
    family lands on the family's key: same next power of two, same == 1 and % 16 classes, also for the derived
    sizes (depths = min(max_depth, steps), lanes = min(budget, node_topk ** max_depth), lanes x node_topk,
    depths x lanes, steps x vocab and steps x hidden strides). The four families below compile 40 keys over
    all kernels (Triton 3.9; one per kernel, family and mode, corrected or DDTree), while the values, seeds,
    ties, scales, roots and batches vary per case."""
    vocab: tuple[int, ...]
    hidden: tuple[int, ...]
    gru: tuple[int, ...]                 # multiples of 4: a request's root-state row stays 16-byte aligned
    rank: tuple[int, ...]
    steps: int
    candidates: tuple[int, ...]
    node_topk: tuple[int, ...]
    max_depth: tuple[int, ...]
    budget: tuple[int, ...]
    uncorrected_depths: tuple[int, ...]


# For every batch 1-8, batch x depths x vocab chunks (of 1024) is a multiple of 4: the round preparation's
# per-chunk buffers keep one alignment.
FAMILIES = (
    # a chain (one child per node): one node or a budget beyond the tree, depth below the block, a 4-chunk
    # odd vocabulary
    ShapeFamily(vocab=(3089, 3517, 3999), hidden=(16, 48), gru=(20, 24, 28), rank=(5, 6, 7), steps=8,
                candidates=(10, 12, 15), node_topk=(1,), max_depth=(5, 6, 7), budget=(1, 9, 11, 13, 15),
                uncorrected_depths=(2, 3, 4)),
    # two depths of a 16-step block, two children each: budgets far beyond the 6-node tree, all depths corrected
    ShapeFamily(vocab=(1100, 1500, 2001), hidden=(16, 32, 64), gru=(48, 64), rank=(16,), steps=16,
                candidates=(64,), node_topk=(2,), max_depth=(2,), budget=(16, 32, 48),
                uncorrected_depths=(0,)),
    # the serving default's shape: the whole vocabulary as candidates, full depth, budget 16
    ShapeFamily(vocab=(64,), hidden=(32,), gru=(48, 64), rank=(16,), steps=16, candidates=(64,),
                node_topk=(5, 6, 7, 8), max_depth=(16,), budget=(16,), uncorrected_depths=(1,)),
    # a bushy tree cut by the budget, two, three or all four depths uncorrected
    ShapeFamily(vocab=(301, 397, 509), hidden=(16, 32), gru=(24, 28), rank=(4,), steps=8, candidates=(20, 24, 30),
                node_topk=(3, 4), max_depth=(4,), budget=(6, 7, 8), uncorrected_depths=(2, 3, 5)),
)


def random_case(seed: int):
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    ties = seed % 4 == 0
    fam = rng.choice(FAMILIES)
    v, h, gru, rank, s = (rng.choice(fam.vocab), rng.choice(fam.hidden), rng.choice(fam.gru),
                          rng.choice(fam.rank), fam.steps)
    head = head_for(v, h, gru, rank, seed, rng.choice([0.3, 1.0, 3.0]))
    if ties:
        for p in head.parameters():
            p.data = p.data.round() * rng.choice([0.0, 0.5])
    b = rng.randint(1, 8)
    hidden = torch.randn(b, s, h, generator=g).to(DEV)
    base = (torch.randn(b, s, v, generator=g) * rng.choice([1.0, 3.0])).to(DEV)
    if ties:
        base = base.round() + 0.0
    embed = torch.randn(v, h, generator=g).to(DEV)
    roots = torch.randint(0, v, (b,), generator=g).to(DEV)
    tc = TreeConfig(budget=rng.choice(fam.budget), node_topk=rng.choice(fam.node_topk),
                    candidates=rng.choice(fam.candidates), max_depth=rng.choice(fam.max_depth),
                    uncorrected_depths=rng.choice(fam.uncorrected_depths), corrected=seed % 6 != 0)
    return head, hidden, base, roots, embed, tc


def assert_rows_of(tree: DraftTree):
    assert tree.rows is not None
    fresh = DraftTree(tree.tokens, tree.parents, tree.depths, tree.scores, tree.valid).verify_rows()
    for field in ("tokens", "offsets", "mask"):
        assert torch.equal(getattr(tree.rows, field), getattr(fresh, field)), field


def assert_same(a: DraftTree, b: DraftTree, msg):
    for field in ("tokens", "parents", "depths", "valid", "scores"):
        assert torch.equal(getattr(a, field), getattr(b, field)), (msg, field)


@pytest.mark.parametrize("chunk", range(4))
def test_fused_frontier_is_bit_identical_to_reference_on_cuda(chunk):
    for seed in range(300 * chunk, 300 * chunk + 300):
        head, hidden, base, roots, embed, tc = random_case(seed)
        rnd = prepare_round(head, hidden, base, roots, embed, tc)
        ref = build_reference(rnd, tc)
        assert_same(ref, build_frontier(rnd, tc), (seed, tc))
        if seed % 10 == 0:
            assert_same(ref, build_frontier_torch(rnd, tc), ("torch frontier", seed, tc))


def smollm_round(seed: int, b: int):
    """SmolLM2-sized round: V 49152, H 576, GRU 192, rank 64, bf16 drafter outputs."""
    g = torch.Generator().manual_seed(seed)
    head = head_for(49152, 576, 192, 64, seed)
    hidden = torch.randn(b, 16, 576, generator=g).to(DEV, torch.bfloat16)
    base = (torch.randn(b, 16, 49152, generator=g) * 4).to(DEV, torch.bfloat16)   # bf16: many exact ties
    embed = (torch.randn(49152, 576, generator=g) * 0.05).to(DEV)
    roots = torch.randint(0, 49152, (b,), generator=g).to(DEV)
    return head, hidden, base, roots, embed


def test_smollm_sized_rounds_match_reference():
    tc = TreeConfig()
    for seed in range(12):
        head, hidden, base, roots, embed = smollm_round(seed, 8)
        rnd = prepare_round(head, hidden, base, roots, embed, tc)
        tree = build_frontier(rnd, tc)
        assert_same(build_reference(rnd, tc), tree, seed)
        assert tree.num_nodes.tolist() == [16] * 8


def test_graph_replay_per_bucket_matches_reference_on_the_unpadded_batch():
    tc = TreeConfig()
    head, _, _, _, embed = smollm_round(0, 1)
    builder = GraphTreeBuilder(head, embed, tc, block_size=16, vocab_size=49152, hidden_size=576,
                               dtype=torch.bfloat16, batch_sizes=(1, 4, 8))
    assert builder.use_graphs and sorted(builder.graphs) == [1, 4, 8]
    for seed, b in enumerate([1, 3, 8, 2, 8, 5]):
        _, hidden, base, roots, _ = smollm_round(100 + seed, b)
        head_round = prepare_round(head, hidden, base, roots, embed, tc)
        tree = builder.build(hidden, base, roots)
        assert_same(build_reference(head_round, tc), tree, (seed, b))
        assert_rows_of(tree)                                          # the rows replayed with the tree
    _, hidden, base, roots, _ = smollm_round(999, 19)                 # above the largest bucket: slices of 8
    tree = builder.build(hidden, base, roots)
    assert_same(build_reference(prepare_round(head, hidden, base, roots, embed, tc), tc), tree, "slices")
    assert_rows_of(tree)


def test_a_replayed_round_is_a_few_dozen_kernels():
    """Budget 16, batch 1: 3 prepare launches + 16 depth launches + 1 ledger launch, then ~21 small kernels of the
    verify rows (offsets; the mask's closure: 4 squarings) in the graph (the input copies and the output clone are
    memcpys), against ~700 kernels before the fused build."""
    from bench.tree_builder import kernels_per_call
    tc = TreeConfig()
    head, hidden, base, roots, embed = smollm_round(3, 1)
    builder = GraphTreeBuilder(head, embed, tc, block_size=16, vocab_size=49152, hidden_size=576,
                               dtype=torch.bfloat16, batch_sizes=(1,))
    n = kernels_per_call(lambda: builder.build(hidden, base, roots))
    if n is None:
        pytest.skip("the profiler sees no kernels inside graph replays here")
    assert n <= 48, n


def test_round_path_never_synchronises_with_the_host():
    tc = TreeConfig()
    head, hidden, base, roots, embed = smollm_round(7, 8)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rnd = prepare_round(head, hidden, base, roots, embed, tc)
        tree = build_frontier(rnd, tc)
        mask = tree.tree_attention_mask()
        offsets = tree.position_offsets()
        logits = torch.randn(8, 17, 49152, device=DEV)
        out = accept(tree, logits)
        gumbel = lambda x: (x - torch.log(-torch.log(torch.rand_like(x).clamp(min=1e-10)))).argmax(-1)
        sampled = accept(tree, logits, gumbel)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert mask.shape == (8, 17, 17) and offsets.shape == (8, 17)
    assert (out.num_emitted >= 1).all() and (sampled.num_emitted >= 1).all()
