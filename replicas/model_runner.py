"""One rank's model: loads its shard, owns its KV cache, runs a step's forward.

Rank 0 sends each step's `StepInput` to the other ranks over the gloo control group (one
broadcast per step, never a Ray call); every rank runs the same forward, the TP layers all-reduce,
and rank 0 gets the full-vocabulary logits of the sampling rows.
"""
from __future__ import annotations

import gc
import logging
import time
from dataclasses import replace
from typing import Iterable

import numpy as np
import torch
import torch.distributed as dist

from replicas.attention.context import ForwardContext, forward_context
from replicas.attention.spec import AttentionBatch
from replicas.config import EngineConfig, ModelConfig
from replicas.device import resolve_device, resolve_dtype
from replicas.distributed.communicator import GlooCommunicator, NcclCommunicator, SingleCommunicator
from replicas.distributed.parallel_state import get_tp_group, set_tp_group
from replicas.models import model_class
from replicas.step_input import DraftRows, StepInput, probe_step
from replicas.transfer import to_device

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, rank: int = 0, world_size: int = 1, init_method: str | None = None,
                 device_index: int | None = None, checkpoint=None):
        from replicas.loaders import load_checkpoint

        self.config, self.rank, self.world_size = config, rank, world_size
        self.device = resolve_device(config.device, device_index if device_index is not None
                                     else (rank if world_size > 1 else None))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        cuda = self.device.type == "cuda"
        fp8_tensor_cores = cuda and torch.cuda.get_device_capability(self.device) >= (8, 9)
        if config.quantization == "fp8" and cuda:
            if not fp8_tensor_cores:
                raise ValueError("quantization=fp8 needs FP8 tensor cores (compute capability 8.9 or newer: Ada, "
                                 "Hopper)")
            if self.dtype != torch.bfloat16:
                raise ValueError(f"quantization=fp8 runs with dtype bfloat16 on a GPU (torch._scaled_mm's row-wise "
                                 f"scales write bf16), not {self.dtype}")
        self._init_distributed(init_method)
        checkpoint = checkpoint or load_checkpoint(config.model, config.load_format)
        # a checkpoint's own quantized format stays where a kernel runs it: GGUF blocks on the CPU, FP8 on a GPU
        # with FP8 tensor cores in bf16 (and wherever fp8 is asked for); otherwise its weights load dequantized
        stored = checkpoint.source.quantized_format
        fp8_runs = fp8_tensor_cores and self.dtype == torch.bfloat16
        keep_quantized = (stored == "gguf" and config.quantization == "auto" and not cuda) or (
            stored == "fp8" and (config.quantization == "fp8" or (config.quantization == "auto" and fp8_runs)))
        self.model_config: ModelConfig = checkpoint.model_config
        torch.manual_seed(config.seed)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = model_class(self.model_config.architecture)(self.model_config)
        finally:
            torch.set_default_dtype(default_dtype)
        if config.load_format == "dummy":
            self._init_random_weights()
        else:
            self.model.load_weights(checkpoint.weights(keep_quantized))
        if config.quantization == "fp8":
            self._weights_to_fp8()
        self.model.eval()
        mc = self.model_config
        self.max_model_len = min(config.scheduling.max_model_len or mc.max_position_embeddings,
                                 mc.max_position_embeddings)
        self.block_size = config.cache.block_size
        self.kv_caches: list[torch.Tensor] = []       # one view per attention layer
        self.kv_storages: list[torch.Tensor] = []     # the range tensors under them
        self.kv = None                       # memory.rank_kv.RankKV when elastic KV is on
        self.num_kv_blocks = 0
        self.graphs = None
        self.gemm_table = None               # decode GEMM choice per (N, K) and bucket (replicas/layers/gemm_select.py)
        self.step_activation_bytes = None    # a full step's activation peak, once profiled (sizes the mixed graphs)
        self.graph_aux_layers: tuple[int, ...] = ()     # the drafter's target layers, once a speculator asks
        self.last_aux_hidden: list[torch.Tensor] = []
        self.backend = self._make_backend()
        for layer in self._attention_layers():
            layer.backend = self.backend

    # ---- set-up -----------------------------------------------------------------------------
    @torch.no_grad()
    def _weights_to_fp8(self) -> None:
        from replicas.layers.fp8_linear import Fp8Weight
        from replicas.layers.linear import LinearBase
        layers = [m for m in self.model.modules() if isinstance(m, LinearBase)]
        converted = sum(layer.to_fp8() for layer in layers)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()          # the float weights' memory back to the device, for the KV pool
        in_fp8 = sum(isinstance(layer.weight, Fp8Weight) for layer in layers)
        log.info("quantization=fp8: %d of %d linear layers in FP8 (%d quantized here, %d loaded in FP8; the "
                 "others' shapes do not fit FP8 GEMMs)", in_fp8, len(layers), converted, in_fp8 - converted)

    @torch.no_grad()
    def _init_random_weights(self) -> None:
        gen = torch.Generator(self.device).manual_seed(self.config.seed + self.rank)
        for name, p in self.model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)

    def _init_distributed(self, init_method: str | None) -> None:
        if self.world_size == 1:
            set_tp_group(SingleCommunicator())
            return
        dist.init_process_group("gloo", init_method=init_method, rank=self.rank, world_size=self.world_size)
        backend = self.config.distributed_backend
        if backend == "auto":
            backend = "nccl" if self.device.type == "cuda" else "gloo"
        comm = NcclCommunicator(self.device) if backend == "nccl" else GlooCommunicator()
        set_tp_group(comm)

    def _make_backend(self):
        from replicas.attention.torch_backend import TorchAttentionBackend

        choice = self.config.attention_backend
        if choice == "auto":
            choice = "triton" if self.device.type == "cuda" else "torch"
        if choice == "triton":
            from replicas.attention.triton_backend import TritonAttentionBackend
            return TritonAttentionBackend(self.block_size)
        return TorchAttentionBackend(self.block_size)

    def _attention_layers(self):
        return [layer.self_attn.attn for layer in self.model.model.layers]

    def kv_block_bytes(self) -> int:
        mc = self.model_config
        kv_heads = mc.num_key_value_heads // self.world_size
        per_layer = 2 * self.block_size * kv_heads * mc.head_dim * torch.tensor([], dtype=self.dtype).element_size()
        return per_layer * mc.num_hidden_layers

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Per layer a view [num_blocks, 2, block_size, Hkv, D] (a block's K and V adjacent) into range tensors
        of a few layers each, block-major (memory/kv_layout.py): the reserve region (the tail blocks) of a
        range is one contiguous tail."""
        from memory.kv_layout import allocate_ranges
        mc = self.model_config
        shape = (2, self.block_size, mc.num_key_value_heads // self.world_size, mc.head_dim)
        self.bind_kv_caches(allocate_ranges(len(self._attention_layers()), num_blocks, shape, self.dtype,
                                            self.device))

    def release_kv_caches(self) -> None:
        """Drop every reference to the KV memory (layers included) so it can be freed."""
        for layer in self._attention_layers():
            layer.kv_cache = None
        self.kv_storages, self.kv_caches = [], []

    def bind_kv_caches(self, storages: list[torch.Tensor]) -> None:
        """Use range tensors [num_blocks, g, *block_shape] (allocated here or by the elastic VMM pool)."""
        from memory.kv_layout import layer_views
        self.kv_storages = storages
        self.kv_caches = layer_views(storages)
        for layer, cache in zip(self._attention_layers(), self.kv_caches):
            layer.kv_cache = cache

    def init_kv(self) -> None:
        """Size and create the KV cache (plain tensors, or VMM ranges with a reserve for elastic KV), then
        capture the decode graphs over it. Collective: every rank calls it at start-up."""
        cfg = self.config
        if cfg.elastic.mode == "off":
            self.num_kv_blocks = self.num_kv_blocks_for_budget()
            self.allocate_kv_cache(self.num_kv_blocks)
        else:
            from memory.rank_kv import build_rank_kv
            counts = {}
            explicit = cfg.cache.num_kv_blocks is not None and cfg.elastic.reserve_blocks > 0
            if self.device.type != "cuda" or explicit:
                n = self.num_kv_blocks_for_budget()
                reserve = min(cfg.elastic.reserve_blocks, n - 1)
                counts = dict(num_base_blocks=n - reserve, num_reserve_blocks=reserve)
            self.kv = build_rank_kv(self, cfg.elastic.mode, lend_step_tokens=cfg.elastic.lend_step_tokens, **counts)
            self.num_kv_blocks = self.kv.num_base + self.kv.num_reserve
        self.capture_graphs()

    def apply_kv_action(self, action) -> bool:
        """Lend or reclaim the elastic reserve on this rank (rank 0 sends it to all ranks with call_all)."""
        return self.kv.apply(action)

    def capture_graphs(self, verify_shapes: Iterable[tuple[int, int]] = ()) -> None:
        """After the KV tensors exist (their addresses never change afterwards); again after `release_graphs`
        when they were rebuilt, with the verify graphs the released ones had."""
        if not self._graphs_enabled():
            return
        from replicas.cuda_graphs import StepGraphs, graph_batch_sizes, mixed_graph_limit
        from replicas.layers.gemm_select import tune_linear_layers

        if self.gemm_table is None:          # once, before the first capture: the graphs bake the choice in
            self.gemm_table = tune_linear_layers(
                self.model, graph_batch_sizes(self.config.scheduling.max_num_seqs), self.device) or {}
        sched = self.config.scheduling
        start, reserved = time.perf_counter(), torch.cuda.memory_reserved(self.device)
        self.graphs = StepGraphs(self.model, self.device, sched.max_num_seqs, -(-self.max_model_len // self.block_size),
                                 self.max_model_len,
                                 mixed_graph_limit(self.config, self.step_activation_bytes,
                                                   torch.cuda.get_device_properties(self.device).total_memory))
        self.graphs.capture()
        if self.graph_aux_layers:
            self.graphs.capture(self.graph_aux_layers)
            if verify_shapes:
                self.graphs.capture_verify(self.graph_aux_layers, verify_shapes)
        log.info("CUDA graphs: %d decode/verify, %d mixed (up to %d tokens) in %.1f s, pool %.0f MiB",
                 sum(map(len, self.graphs.graphs.values())), sum(map(len, self.graphs.mixed.values())),
                 self.graphs.mixed_sizes[-1] if self.graphs.mixed_sizes else 0, time.perf_counter() - start,
                 (torch.cuda.memory_reserved(self.device) - reserved) / 2 ** 20)

    def _graphs_enabled(self) -> bool:
        return self.device.type == "cuda" and not self.config.graphs.enforce_eager and self.backend.name == "triton"

    def release_graphs(self) -> set[tuple[int, int]]:
        """Drop the graphs (before the KV tensors they read are rebuilt); returns their verify shapes."""
        aux = self.graph_aux_layers
        shapes = self.graphs.verify_shapes(aux) if self.graphs is not None and aux else set()
        self.graphs = None
        return shapes

    def capture_aux_graphs(self, aux_layers: tuple[int, ...]) -> None:
        """Decode graphs that also output the residual stream after `aux_layers` (kept across recaptures)."""
        self.graph_aux_layers = tuple(aux_layers)
        if self.graphs is not None:
            self.graphs.capture(self.graph_aux_layers)

    def keep_verify_graphs(self, keep: set[tuple[int, int]]) -> None:
        """Verify graphs over the aux layers for exactly the (bucket, draft nodes) shapes in `keep`: the missing
        ones captured, the others released. Rank 0 calls it with `call_all` (a capture runs the collectives)."""
        if self.graphs is not None:
            self.graphs.drop_verify(self.graph_aux_layers, keep)
            self.add_verify_graphs(keep)

    def add_verify_graphs(self, shapes: set[tuple[int, int]]) -> None:
        """Verify graphs for these shapes too (rank 0 calls it with `call_all`)."""
        if self.graphs is not None:
            self.graphs.capture_verify(self.graph_aux_layers, shapes)

    def full_vocab_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole embedding and LM head matrices [V, H], gathered from the vocabulary shards when TP > 1 (every
        rank calls it: rank 0 with `call_all`): what a drafter that reads the target's embedding and head needs."""
        model, vocab = self.model, self.model_config.vocab_size
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        if self.world_size == 1:
            return embed, head
        tp = get_tp_group()
        full_embed = tp.all_gather(embed, dim=0)[:vocab]
        return full_embed, full_embed if head is embed else tp.all_gather(head, dim=0)[:vocab]

    def num_kv_blocks_for_budget(self) -> int:
        """Blocks that fit: the configured count, the CPU byte budget, or GPU memory after a profiled peak."""
        if self.config.cache.num_kv_blocks is not None:
            n = self.config.cache.num_kv_blocks
        elif self.device.type == "cpu":
            n = self.config.cache.kv_cache_bytes // self.kv_block_bytes()
        else:
            peak = self.profile_peak_activation_bytes()
            free, total = torch.cuda.mem_get_info(self.device)
            budget = total * self.config.cache.gpu_memory_utilization - (total - free) - peak
            n = int(budget // self.kv_block_bytes())
        if self.world_size > 1:
            t = torch.tensor([n])
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            n = int(t.item())
        if n < 2:
            raise RuntimeError(f"not enough memory for the KV cache ({n} blocks); lower max_num_batched_tokens "
                               "or raise gpu_memory_utilization")
        return n

    @torch.inference_mode()
    def profile_peak_activation_bytes(self) -> int:
        """Peak bytes of one full `max_num_batched_tokens` prefill step, logits and sampling included."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        self.allocate_kv_cache(1)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.run_probe_step(self.config.scheduling.max_num_batched_tokens, self.config.scheduling.max_num_seqs)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        self.release_kv_caches()
        torch.cuda.empty_cache()
        self.step_activation_bytes = int(peak)
        return int(peak)

    @torch.inference_mode()
    def measure_graph_pool_bytes(self) -> int:
        """Capture the step graphs over a one-block KV cache, measure the memory their pool holds, release them
        (the kernels they compiled and the GEMM choice stay). The elastic KV plan leaves this out of the base."""
        if not self._graphs_enabled():
            return 0
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        self.allocate_kv_cache(1)
        before = torch.cuda.memory_reserved(self.device)
        try:
            self.capture_graphs()
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()             # the warm-ups' and the GEMM tuning's cached blocks are not the pool
            held = torch.cuda.memory_reserved(self.device) - before
        finally:
            self.release_graphs()
            self.release_kv_caches()
            gc.collect()                         # the graphs' memory goes back once nothing holds them
            torch.cuda.empty_cache()
        return max(0, int(held))

    @torch.inference_mode()
    def run_probe_step(self, num_tokens: int, num_rows: int) -> None:
        """One prefill-shaped step (step_input.probe_step: no K/V written, block 0 read), logits and the
        sampler's worst case (a sort, for top-p) included: what memory profiling measures."""
        logits = self.forward(probe_step(num_tokens, num_rows, self.block_size))
        if logits is not None:
            torch.softmax(logits.float(), -1).sort(-1)

    # ---- steps ------------------------------------------------------------------------------
    def _context(self, step: StepInput) -> ForwardContext:
        dev = self.device
        qsl = torch.from_numpy(step.query_start_loc).to(dev, non_blocking=True)
        lens = torch.from_numpy(step.seq_lens).to(dev, non_blocking=True)
        qlens = np.diff(step.query_start_loc)
        q = int(qlens.max())
        batch = AttentionBatch(
            query_start_loc=qsl, seq_lens=lens,
            block_tables=torch.from_numpy(step.block_tables).to(dev, non_blocking=True),
            max_query_len=q, max_seq_len=int(step.seq_lens.max()),
            tree_mask=None if step.trees is None else torch.empty(len(qlens), q, q, dtype=torch.bool, device=dev))
        return ForwardContext(batch, torch.from_numpy(step.slot_mapping).to(dev, non_blocking=True),
                              query_lens_host=qlens.tolist(), seq_lens_host=step.seq_lens.tolist())

    @torch.inference_mode()
    def forward(self, step: StepInput) -> torch.Tensor | None:
        """Runs the model on every rank; returns float32 logits [S, V] on rank 0, None elsewhere."""
        if self.graphs is not None and self.graphs.can_run(step):
            hidden, aux = self.graphs.run(step)
            self.last_aux_hidden = [a.clone() for a in aux]       # the next replay overwrites the static outputs
        else:
            ctx = self._context(step)
            own = step.trees is not None            # the trees are written in: never into the host arrays (CPU)
            ahead = step.device_input_ids
            input_ids = torch.from_numpy(step.input_ids).to(self.device, non_blocking=True,
                                                            copy=own or ahead is not None)
            if ahead is not None:
                input_ids[:ahead.shape[0]].copy_(ahead)
            positions = torch.from_numpy(step.positions).to(self.device, non_blocking=True, copy=own)
            if own:                                 # before the plan, which may read the tree mask
                step.trees.write(step.query_start_loc, input_ids, positions, ctx.batch.tree_mask)
            self.backend.plan(ctx)
            with forward_context(ctx):
                hidden, self.last_aux_hidden = self.model(input_ids, positions, step.aux_layers)
        rows = step.sample_indices
        if len(rows) == hidden.shape[0]:        # every token samples (a decode step): rows 0..T-1, no gather
            picked = hidden
        else:
            # From pinned memory: a copy from pageable memory may wait for the forward just enqueued, and the host
            # work meant to overlap it (the grammar's fill, the sampler's launches) would follow it instead.
            picked = hidden.index_select(0, to_device(rows, self.device))
        return self.model.compute_logits(picked)             # float32 (ParallelLMHead), None off rank 0

    @torch.inference_mode()
    def compact_kv(self, src_slots, dst_slots) -> None:
        """Copy the K/V of slots `src_slots` to `dst_slots` in every layer (a round's accepted nodes), one gather
        and one scatter per range tensor [num_blocks, g, 2, block, Hkv, D]; all sources are read first."""
        if len(src_slots) == 0:
            return
        slots = to_device(np.stack([np.asarray(src_slots, np.int64), np.asarray(dst_slots, np.int64)]), self.device)
        blocks, offsets = slots // self.block_size, slots % self.block_size
        for storage in self.kv_storages:
            storage[blocks[1], :, :, offsets[1]] = storage[blocks[0], :, :, offsets[0]]

    def execute(self, step: StepInput) -> torch.Tensor | None:
        """Rank 0: send the step to the other ranks, then run it here. Its draft trees (device tensors) follow
        over the TP group, so no rank waits for the drafter on the host."""
        if self.world_size > 1:
            trees = step.trees
            dist.broadcast_object_list([step if trees is None else replace(step, trees=replace(trees, rows=None))],
                                       src=0)
            if trees is not None:
                get_tp_group().broadcast_from_first(trees.rows.packed())
        return self.forward(step)

    def _receive_trees(self, step: StepInput) -> None:
        """Ranks 1..N-1: the draft trees of a step rank 0 sent (the matching broadcast in `execute`)."""
        w = step.trees.width(step.query_start_loc)
        packed = torch.empty(len(step.trees.index), DraftRows.packed_size(w), dtype=torch.long, device=self.device)
        step.trees.rows = DraftRows.unpacked(get_tp_group().broadcast_from_first(packed), w)

    def serve_forever(self) -> None:
        """Ranks 1..N-1: run whatever rank 0 broadcasts until it sends None."""
        assert self.rank > 0
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            msg = box[0]
            if msg is None:
                break
            if isinstance(msg, tuple):            # a control call: (method name, args)
                getattr(self, msg[0])(*msg[1])
                continue
            if msg.trees is not None:
                self._receive_trees(msg)
            self.forward(msg)
        dist.destroy_process_group()
        self.close_kv()

    def call_all(self, method: str, *args):
        """Rank 0: run a method on every rank (set-up calls, not per step)."""
        if self.world_size > 1:
            dist.broadcast_object_list([(method, args)], src=0)
        return getattr(self, method)(*args)

    def shutdown(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            dist.broadcast_object_list([None], src=0)
            dist.destroy_process_group()
        self.close_kv()

    def release_memory(self) -> None:
        """After shutdown, from the thread that stepped the engine (nothing may step it again): the KV, the
        graphs and the weights go back to the device now, not when the owner is collected."""
        self.graphs = None
        if self.model is not None:
            self.release_kv_caches()
            self.model = None
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()

    def close_kv(self) -> None:
        if self.kv is not None:
            self.graphs = None
            self.kv.close()
            self.kv = None
