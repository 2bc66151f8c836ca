"""Triton kernels of the draft tree builder (CUDA tensors; CPU tensors under TRITON_INTERPRET=1 when
speculative.tree's `triton_on_cpu` asks for them), and one of drafter training.

    tree_ops     the shared @triton.jit device math and the launch constants
    tree_round   a round's preparation: candidates, base log-probs, z projections, root GRU states
    tree_rows    one node per program: what the reference heap and the torch frontier launch
    tree_fused   the fused frontier build: one launch per depth plus one for the ledger
    tree_walk    the verified round's tree walk: one launch, one program per request
    vocab_ce     training: a row's cross-entropy over the vocabulary and its gradient, in place
                 (speculative/vocab_loss.py)

Imports run one way: tree_ops <- tree_round, tree_rows, tree_fused; all of them (and tree_walk) read
speculative.draft_tree; vocab_ce reads nothing of the package.
"""
