"""Step inputs the speculative graph tests feed the model runner directly."""
import numpy as np
import torch

from replicas.step_input import DraftRows, StepInput, StepTrees


def random_verify_step(aux_layers, b: int, n: int, seed: int = 0, max_prefix: int = 40,
                       device="cpu") -> StepInput:
    """b requests verifying random trees of n nodes after prefixes of 3..max_prefix tokens, in their own blocks
    (the trees on `device`, the runner's)."""
    rng = np.random.default_rng(seed)
    q = 1 + n
    prefix = rng.integers(3, max_prefix, b)
    width = -(-int((prefix + q).max()) // 16)
    tables = (1 + np.arange(b * width, dtype=np.int32)).reshape(b, width)
    masks = np.zeros((b, q, q), dtype=bool)
    offsets = np.zeros((b, q), dtype=np.int64)
    masks[:, :, 0] = True
    for r in range(b):
        for i in range(n):
            p = int(rng.integers(-1, i)) if i else -1
            masks[r, 1 + i, 1 + i] = True
            if p >= 0:
                masks[r, 1 + i] |= masks[r, 1 + p]
            offsets[r, 1 + i] = masks[r, 1 + i].sum() - 1
    slots = prefix[:, None] + np.arange(q)
    tokens = rng.integers(3, 300, (b, q))
    rows = DraftRows(torch.from_numpy(tokens[:, 1:]).to(device), torch.from_numpy(offsets).to(device),
                     torch.from_numpy(masks).to(device))
    return StepInput(input_ids=np.repeat(tokens[:, 0], q), positions=np.repeat(prefix, q).astype(np.int64),
                     slot_mapping=(np.take_along_axis(tables, slots // 16, 1) * 16 + slots % 16).ravel(),
                     query_start_loc=np.arange(0, b * q + 1, q, dtype=np.int32),
                     seq_lens=(prefix + q).astype(np.int32), block_tables=tables,
                     sample_indices=np.arange(b * q, dtype=np.int64),
                     trees=StepTrees(np.arange(b, dtype=np.int64), rows), aux_layers=aux_layers)


def decode_step(aux_layers, b: int, first_len: int = 20) -> StepInput:
    """b requests of first_len .. first_len+b-1 tokens decoding one token each, every request in its own
    ceil(len / 16) blocks (every block its table reads)."""
    lens = np.arange(first_len, first_len + b, dtype=np.int32)
    width = -(-int(lens.max()) // 16)
    blocks = np.arange(1, b * width + 1, dtype=np.int32).reshape(b, width)
    last = lens - 1
    return StepInput(input_ids=np.arange(5, 5 + b, dtype=np.int64), positions=last.astype(np.int64),
                     slot_mapping=(blocks[np.arange(b), last // 16] * 16 + last % 16).astype(np.int64),
                     query_start_loc=np.arange(b + 1, dtype=np.int32), seq_lens=lens, block_tables=blocks,
                     sample_indices=np.arange(b, dtype=np.int64), aux_layers=aux_layers)


def mixed_step(aux_layers, chunks: list[int], prefixes: list[int]) -> StepInput:
    """Requests with `prefixes[i]` tokens cached computing `chunks[i]` new ones (1: a decode), each in its own
    blocks, every request sampling its last new token."""
    q = np.asarray(chunks)
    lens = (np.asarray(prefixes) + q).astype(np.int32)
    width = -(-int(lens.max()) // 16)
    tables = np.arange(1, len(q) * width + 1, dtype=np.int32).reshape(len(q), width)
    pos = np.concatenate([np.arange(p, p + n) for p, n in zip(prefixes, chunks)]).astype(np.int64)
    rows = np.repeat(np.arange(len(q)), q)
    qsl = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
    return StepInput(input_ids=(7 + np.arange(len(pos)) % 200).astype(np.int64), positions=pos,
                     slot_mapping=(tables[rows, pos // 16] * 16 + pos % 16).astype(np.int64), query_start_loc=qsl,
                     seq_lens=lens, block_tables=tables, sample_indices=(qsl[1:] - 1).astype(np.int64),
                     aux_layers=aux_layers)
