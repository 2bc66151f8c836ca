"""A one-layer Llama MLP (hidden 1024, intermediate 4096) in bf16 on CUDA with small random weights, on a
single-rank TP group: the GPU tests of the start-up GEMM selection tune it."""
import torch


def cuda_llama_mlp(seed: int = 0):
    from replicas.config import ModelConfig
    from replicas.distributed.communicator import SingleCommunicator
    from replicas.distributed.parallel_state import set_tp_group
    from replicas.models.llama import LlamaMLP

    set_tp_group(SingleCommunicator())
    cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=1024, intermediate_size=4096,
                      num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=8, head_dim=128,
                      max_position_embeddings=128)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        mlp = LlamaMLP(cfg).bfloat16()
    for p in mlp.parameters():
        p.data.normal_(0, 0.02)
    return mlp
