"""A CPU stand-in for the runner's CUDA graphs: the real buffer logic of `StepGraphs` (static inputs, padded
buckets and lanes, aux-layer variants, tree masks, mixed steps' empty lanes) with a replay that reruns the model
eagerly on the static buffers, as a CUDA graph would."""
from replicas.cuda_graphs import GraphEntry, StepGraphs, mixed_graph_limit


class EagerReplayGraphs(StepGraphs):
    """A 'graph' that reruns the model on the static buffers and writes the static outputs (the torch backend
    plans from host copies of the buffers; a CUDA graph needs none). Counts replays per query length (decode,
    verify) or ("mixed", tokens)."""

    def __init__(self, backend, *args):
        super().__init__(*args)
        self.backend = backend
        self.replays: dict = {}

    def _planned(self, ctx):
        """Host lengths of the lanes holding tokens (a mixed graph's empty lanes come last: the torch backend
        plans the others only)."""
        b = ctx.batch
        q_lens = (b.query_start_loc[1:] - b.query_start_loc[:-1]).tolist()
        real = sum(1 for q in q_lens if q > 0)
        ctx.query_lens_host, ctx.seq_lens_host, ctx.backend_state = q_lens[:real], b.seq_lens[:real].tolist(), {}
        self.backend.plan(ctx)
        return ctx

    def _context(self, b, q=1):
        return self._planned(super()._context(b, q))

    def _mixed_context(self, tokens):
        return self._planned(super()._mixed_context(tokens))

    def _record(self, forward, label):
        hidden, aux = forward()

        def replay():
            h, a = forward()
            hidden.copy_(h)
            for out, new in zip(aux, a):
                out.copy_(new)
            self.replays[label] = self.replays.get(label, 0) + 1
        return GraphEntry(replay, hidden, list(aux))


def install_graphs(llm):
    runner = llm.engine.runner
    cfg = llm.engine.config
    runner.graphs = EagerReplayGraphs(runner.backend, runner.model, runner.device, cfg.scheduling.max_num_seqs,
                                      -(-runner.max_model_len // runner.block_size), runner.max_model_len,
                                      mixed_graph_limit(cfg, None, None))
    runner.graphs.capture()
    if llm.engine.speculator is not None:
        runner.capture_aux_graphs(llm.engine.speculator.aux_layers)
    return runner.graphs
