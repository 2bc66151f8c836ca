"""Decode graphs with aux outputs, on CPU: the graphs' buffer logic (static inputs, padded buckets, per aux-layer
variants, views handed out) with a replay that reruns the model eagerly on the static buffers, as a CUDA graph
would. A graphed step returns the eager step's logits and aux hidden states, and a speculative engine whose
plain decode steps replay these graphs still decodes exactly like plain greedy decoding."""
import numpy as np
import pytest
import torch

from checkpoints import make_tiny_llama
from replicas import LLM, SamplingParams
from replicas.attention.context import forward_context
from replicas.cuda_graphs import DecodeGraphs, GraphEntry
from replicas.step_input import StepInput
from speculative.cost_model import KneeBudgetPolicy
from support.greedy import compare_greedy

transformers = pytest.importorskip("transformers")
ENGINE = dict(block_size=16, max_num_seqs=8, max_num_batched_tokens=64)


class EagerReplayGraphs(DecodeGraphs):
    """A 'graph' that reruns the model on the static buffers and writes the static outputs (the torch backend
    plans from host copies of the buffers; a CUDA graph needs none)."""
    replays = 0

    def __init__(self, backend, *args):
        super().__init__(*args)
        self.backend = backend

    def _eager(self, b, aux_layers):
        ctx = self._context(b)
        ctx.query_lens_host, ctx.seq_lens_host, ctx.backend_state = [1] * b, self.seq_lens[:b].tolist(), {}
        self.backend.plan(ctx)
        with forward_context(ctx):
            return self.model(self.input_ids[:b], self.positions[:b], aux_layers)

    def _record(self, b, aux_layers):
        hidden, aux = self._eager(b, aux_layers)

        def replay():
            h, a = self._eager(b, aux_layers)
            hidden.copy_(h)
            for out, new in zip(aux, a):
                out.copy_(new)
            self.replays += 1
        return GraphEntry(replay, hidden, list(aux))


def install_graphs(llm):
    runner = llm.engine.runner
    runner.graphs = EagerReplayGraphs(runner.backend, runner.model, runner.device, llm.engine.config.max_num_seqs,
                                      -(-runner.max_model_len // runner.block_size), runner.max_model_len)
    runner.graphs.capture()
    runner.capture_aux_graphs(llm.engine.speculator.aux_layers)
    return runner.graphs


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_llama(str(tmp_path_factory.mktemp("graphs")), num_attention_heads=4, num_key_value_heads=2)


def decode_step(aux_layers, b=3):
    lens = np.arange(4, 4 + b, dtype=np.int32)
    blocks = np.arange(1, b + 1, dtype=np.int32)
    return StepInput(input_ids=np.arange(5, 5 + b, dtype=np.int64), positions=(lens - 1).astype(np.int64),
                     slot_mapping=(blocks * 16 + lens - 1).astype(np.int64),
                     query_start_loc=np.arange(b + 1, dtype=np.int32), seq_lens=lens, block_tables=blocks[:, None],
                     sample_indices=np.arange(b, dtype=np.int64), aux_layers=aux_layers)


def test_graphed_aux_step_equals_eager(folder):
    llm = LLM(model=folder, speculative="dominotree", allow_random_drafter=True, **ENGINE)
    try:
        runner, aux_layers = llm.engine.runner, llm.engine.speculator.aux_layers
        for b in (1, 3, 8):
            step = decode_step(aux_layers, b)
            eager = runner.forward(step)
            eager_aux = [a.clone() for a in runner.last_aux_hidden]
            graphs = install_graphs(llm)
            assert graphs.can_run(step) and not graphs.can_run(decode_step((0,), b))   # no variant for (0,)
            graphed = runner.forward(step)
            assert graphs.replays == 1
            torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-5)
            assert len(runner.last_aux_hidden) == len(aux_layers) == len(eager_aux)
            for g, e in zip(runner.last_aux_hidden, eager_aux):
                assert g.shape == e.shape == (b, llm.engine.model_config.hidden_size)
                torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
            kept = [a.clone() for a in runner.last_aux_hidden]
            runner.forward(decode_step(aux_layers, b))                 # a later replay leaves earlier outputs
            for g, e in zip(kept, eager_aux):
                torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
            runner.graphs = None
    finally:
        llm.shutdown()


def test_speculative_engine_with_graphed_plain_steps_matches_plain(folder):
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, hf.config.vocab_size, (k,), generator=g).tolist() for k in (5, 9, 14, 3, 21, 7, 11)]
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 4 * i, ignore_eos=True) for i in range(len(prompts))]
    plain = LLM(model=folder, **ENGINE)
    try:
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    finally:
        plain.shutdown()
    llm = LLM(model=folder, speculative="dominotree", allow_random_drafter=True, **ENGINE)
    try:
        graphs = install_graphs(llm)
        llm.engine.speculator.policy = KneeBudgetPolicy(8, knee_tokens=30)      # batch >= 7: plain, graphed
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert graphs.replays > 0 and llm.engine.get_stats().spec_drafts > 0
        assert llm.engine.block_manager.num_used_blocks == 0
    finally:
        llm.shutdown()

    @torch.no_grad()
    def last(ids):
        return hf(torch.tensor([ids])).logits[0, -1]
    compare_greedy(prompts, got, want, last)
