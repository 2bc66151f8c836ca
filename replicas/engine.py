"""The engine loop: schedule a step, run it on every rank, sample, update sequences, detokenize.

engine -> scheduler -> block manager -> model runner -> model -> sampler: five hops, one step.

Failures: a request's own failure (admission, detokenization) ends that request only; a step that runs out of
device memory, or an elastic reclaim that fails, ends the requests of that step, frees their blocks and the engine
goes on. The errors of requests ended in a step wait in `take_failed()`. Anything else propagates: the engine's
state is unknown.
"""
from __future__ import annotations

import logging
import random
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field, replace
from functools import partial
import time
from typing import Optional, Union

import numpy as np
import torch

from memory.block_manager import BlockManager
from memory.rank_kv import RECLAIM, KVAction
from memory.vmm import VmmError
from replicas.config import EngineConfig
from replicas.distributed.launch import LaunchedRanks, ProcessLauncher, WorkerLauncher, free_port
from replicas.model_runner import ModelRunner
from replicas.outputs import Logprob, RequestOutput
from replicas.request import EngineStepError, Request, RequestError, check_logit_bias, check_params, check_prompt
from replicas.sampler import Sampler
from replicas.sampling_batch import SamplingBatch, SequenceTokens
from replicas.sampling_params import SamplingParams
from replicas.scheduler import ScheduledBatch, Scheduler
from replicas.sequence import Sequence
from replicas.speculation_api import Proposer, VerifiedRound, Verifier, load_speculation
from replicas.stats import EngineStats, RequestTimings
from replicas.step_input import StepInput, StepTrees
from replicas.stream_coalescer import StreamCoalescer
from replicas.structured.backend import GrammarError
from replicas.structured.guided import GuidedDecoding
from replicas.transfer import to_device

Prompt = Union[str, list[int]]
COMPILE_WAIT_S = 0.05       # an engine with nothing to run but grammars compiling waits this long per step

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, worker_launcher: Optional[WorkerLauncher] = None):
        from replicas.loaders import load_checkpoint
        from replicas.detokenizer import IncrementalDetokenizer

        self.config = config
        self._detokenizer_cls = IncrementalDetokenizer
        checkpoint = load_checkpoint(config.model, config.load_format)
        self.tokenizer = checkpoint.tokenizer
        self.model_config = checkpoint.model_config
        self.model_name = config.model or "SmolLM2-135M-Instruct"
        # the loader already merged generation_config's EOS ids into both
        self.eos_token_ids = tuple(sorted(set(self.tokenizer.eos_token_ids) | set(self.model_config.eos_token_ids)))

        tp = config.tensor_parallel_size
        self.launcher = worker_launcher or (ProcessLauncher() if tp > 1 else None)
        if isinstance(self.launcher, LaunchedRanks):
            init_method = self.launcher.init_method
        else:
            init_method = f"tcp://127.0.0.1:{free_port()}" if tp > 1 else None
            for rank in range(1, tp):
                self.launcher.launch(config, rank, tp, init_method)
        self.runner = ModelRunner(config, 0, tp, init_method, checkpoint=checkpoint)
        self.max_model_len = self.runner.max_model_len
        self.runner.init_kv()
        kv = self.runner.kv
        num_blocks = self.runner.num_kv_blocks
        reserve = kv.num_reserve if kv is not None else min(config.elastic.reserve_blocks, num_blocks - 1)
        self.block_manager = BlockManager(num_blocks - reserve, reserve, config.cache.block_size,
                                          config.cache.enable_prefix_caching)
        self.max_model_len = self.runner.max_model_len = self._fit_max_model_len()
        self.scheduler = Scheduler(self.block_manager, config.scheduling.max_num_batched_tokens,
                                   config.scheduling.max_num_seqs, self.max_model_len)
        self.elastic = None
        if kv is not None:
            from memory.elastic import ElasticKV, ElasticPolicy
            self.elastic = ElasticKV(config.elastic.mode, self.block_manager, self.scheduler,
                                     partial(self.runner.call_all, "apply_kv_action"),
                                     ElasticPolicy(kv.lend_step_tokens, config.elastic.lend_after_steps,
                                                   config.elastic.min_lend_steps),
                                     kv.reserve_bytes, self.max_model_len)
        self.sampler = Sampler()
        self.requests: dict[str, Request] = {}
        self.failed: list[tuple[str, BaseException]] = []
        self._in_forward = False          # a step's forward is under way (with TP: inside collectives)
        self.coalescer = StreamCoalescer((config.serving.stream_item_ms or 0.0) / 1e3)
        self.stats = EngineStats(kv_blocks_total=num_blocks - reserve)
        self.finished_timings: list[RequestTimings] = []
        self._rng = random.Random(config.seed)
        self.speculator: Optional[Proposer] = None
        self.verifier: Optional[Verifier] = None
        if config.speculative.method is not None:
            self.speculator, self.verifier = load_speculation(config, self.model_config, self.runner, self.sampler,
                                                              self.eos_token_ids)
        self.speculation = self.speculator is not None
        # ids valid in both the model and the tokenizer (what logit_bias may name)
        self.vocab_size = min(self.model_config.vocab_size, self.tokenizer.vocab_size)
        self.guided: Optional[GuidedDecoding] = None
        if config.structured.backend != "none":
            self.guided = GuidedDecoding(config.structured.backend, config.structured.cache_size, self.tokenizer,
                                         self.model_config.vocab_size, self.eos_token_ids,
                                         config.scheduling.max_num_seqs, self.runner.device)
        self._compiling: dict[str, Future] = {}     # request id -> its grammar's compile; it waits outside the queue
        self._pending: Optional[_Launched] = None     # async scheduling: a sampled step not yet read back
        self._finished_early: list[RequestOutput] = []  # its outputs, where `reconfigure` finished it
        chosen = config.scheduling.async_scheduling
        self.async_scheduling = self.runner.device.type == "cuda" if chosen is None else chosen
        self._readback = TokenReadback(self.runner.device, config.scheduling.max_num_seqs)

    def _fit_max_model_len(self) -> int:
        """One sequence of max_model_len tokens must fit the blocks a sequence can always have (the base region:
        an elastic reserve may be taken back before any step), or it would wait for room forever. The model's
        default is lowered to what fits; a max_model_len given explicitly that does not fit refuses to start."""
        bm, want = self.block_manager, self.runner.max_model_len
        capacity = bm.num_base * bm.block_size
        if want <= capacity:
            return want
        where = f"{bm.num_base} KV blocks of {bm.block_size} tokens" + (
            f" (not counting the {bm.num_reserve} reserve blocks)" if bm.num_reserve else "")
        if self.config.scheduling.max_model_len is not None:
            raise ValueError(f"max_model_len={want} does not fit the KV cache: its {where} hold {capacity} tokens; "
                             f"give --max-model-len {capacity} or less, or more KV blocks (--num-kv-blocks, "
                             "--gpu-memory-utilization, --kv-cache-bytes on CPU)")
        log.warning("max_model_len lowered from the model's %d to %d tokens: one sequence must fit the KV cache "
                    "(%s); more blocks through --num-kv-blocks or --gpu-memory-utilization", want, capacity, where)
        return capacity

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                    arrival_time: Optional[float] = None, stream: bool = True) -> None:
        """`prompt`: text (tokenized here) or token ids. `stream=False`: `step()` reports the request only when it
        finishes (offline use). A request the engine cannot take raises RequestError and leaves nothing behind."""
        if request_id in self.requests:
            raise RequestError("request_id", f"request id {request_id!r} is already running")
        check_params(params, self.config.limits)
        check_logit_bias(params, self.vocab_size)
        if params.grammar is not None and self.guided is None:
            raise RequestError(params.grammar.param, "structured outputs are off on this server (grammar_backend "
                               "none)", "unsupported_parameter")
        if isinstance(prompt, str) and not prompt:
            raise RequestError("prompt", "the prompt is empty", "empty_prompt")
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_prompt(ids, params, self.max_model_len, self.model_config.vocab_size)
        now = arrival_time if arrival_time is not None else time.monotonic()
        seqs = []
        for i in range(params.n):
            seed = (params.seed * 1_000_003 + i) & 0x7FFFFFFFFFFF if params.seed is not None \
                else self._rng.getrandbits(47)
            seqs.append(Sequence(request_id, i, ids, params, seed, now))
        req = Request(request_id, text, ids, params, seqs,
                      [self._detokenizer_cls(self.tokenizer, ids, params) for _ in seqs], stream)
        self.requests[request_id] = req
        if params.constrained:
            kind = params.grammar.kind if params.grammar is not None else "logit_bias"
            self.stats.constrained_requests[kind] = self.stats.constrained_requests.get(kind, 0) + 1
        if params.grammar is not None:
            self._compiling[request_id] = self.guided.compile(params.grammar)
            return
        for seq in seqs:
            self.scheduler.add(seq)

    def abort(self, request_id: str) -> Optional[RequestOutput]:
        req = self._drop(request_id)
        return req.make_output() if req is not None else None

    def _drop(self, request_id: str) -> Optional[Request]:
        """Forget the request and free its sequences' blocks."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self._compiling.pop(request_id, None)
        self.coalescer.forget(request_id)
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
            if self.speculator is not None:
                self.speculator.forget(seq)
        return req

    def _fail(self, request_id: str, error: BaseException) -> None:
        """End the request with `error` for its client (`take_failed`), its blocks freed."""
        if self._drop(request_id) is not None:
            self.failed.append((request_id, error))

    def take_failed(self) -> list[tuple[str, BaseException]]:
        """(request id, error) of the requests the engine ended with an error since the last call."""
        out, self.failed = self.failed, []
        return out

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests or self._finished_early)

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self._compiling:
            self._admit_compiled()
        outputs, self._finished_early = self._finished_early, []    # only where no step is pending (reconfigure)
        spec = self.speculator if self.speculation and self.speculator.enabled else None
        if self._pending is not None:
            ahead = self.scheduler.schedule_ahead({id(s) for s in self._pending.sampling_seqs}) \
                if self._overlap_allowed(spec) else None
            if ahead is not None:
                return self._step_ahead(ahead)
            pending, self._pending = self._pending, None
            outputs += self._finish(pending)
        if self.elastic is not None:
            self._elastic_guarded(self.elastic.before_schedule)   # reclaim before a prefill that needs the reserve
        start, emitted = time.perf_counter(), self.stats.generation_tokens
        self.scheduler.spec_budget = spec.budget(len(self.scheduler.running)) if spec is not None else 0
        batch = self.scheduler.schedule()
        if batch.is_empty:
            self._fail_unschedulable()
            if self._compiling:
                wait(list(self._compiling.values()), COMPILE_WAIT_S, FIRST_COMPLETED)
            return outputs
        self._in_forward = False
        try:
            launched = self._launch(batch, spec)
            self._sample(launched)
        except torch.OutOfMemoryError as e:
            if self._in_forward and self.runner.world_size > 1:
                raise                   # the other ranks are inside this step's collectives
            self._fail_step(batch, e)
            return outputs
        outputs += self._keep_or_finish(launched)
        if spec is not None and not batch.has_prefill:
            drafted = sum(1 for i in range(len(batch.seqs)) if batch.num_drafts(i))
            if drafted in (0, len(batch.seqs)):
                n = len(batch.seqs)
                spec.record_round(n, self.scheduler.spec_budget if drafted else 0, time.perf_counter() - start,
                                  (self.stats.generation_tokens - emitted) / n)
        return outputs

    # Async scheduling (`scheduling.async_scheduling`): a step that only samples (no draft rows) on one rank stays
    # pending after its sampler is launched; the next `step()` schedules the following step (`Scheduler.
    # schedule_ahead`: every running sequence decodes its pending token, waiting ones are admitted after them) and
    # launches it with the pending tokens as the first rows' device input (`StepInput.device_input_ids`), and only
    # then reads the pending tokens back and emits them, fills the grammar masks and launches that step's sampler.
    # The host's work between two forwards thus runs while the device computes. Where the next step needs the
    # tokens on the host (a sequence still prefilling, preemption, a draft round, elastic lending), the pending step
    # is finished first and the step runs as a synchronous one. A sequence that finished with the pending token
    # has a row in the step launched ahead: that row's token is dropped, and its KV write lands in a block no step
    # reads (freed blocks are handed out again only to steps that run after it on the stream).
    def _overlap_allowed(self, spec) -> bool:
        return (self.async_scheduling and spec is None and self.runner.world_size == 1
                and (self.elastic is None or self.elastic.mode != "elastic"))

    def _step_ahead(self, batch) -> list[RequestOutput]:
        pending, self._pending = self._pending, None
        self.stats.steps_ahead += 1
        rows = {id(s): r for r, s in enumerate(pending.sampling_seqs)}
        index = [rows[id(s)] for s in batch.seqs[:batch.ahead]]
        tokens = pending.out.token_ids if index else None
        if index and index != list(range(len(tokens))):
            tokens = tokens.index_select(0, to_device(np.asarray(index, dtype=np.int64), tokens.device))
        try:
            launched = self._launch(batch, None, StepInput.from_batch(batch, self.config.cache.block_size,
                                                                      ahead_tokens=tokens))
        except torch.OutOfMemoryError as e:
            outputs = self._finish(pending)
            self._fail_step(batch, e)
            return outputs
        outputs = self._finish(pending)
        try:
            self._sample(launched)
        except torch.OutOfMemoryError as e:
            self._fail_step(batch, e)
            return outputs
        return outputs + self._keep_or_finish(launched)

    def _keep_or_finish(self, launched: "_Launched") -> list[RequestOutput]:
        """A step that may overlap stays pending (read back at the next step, after the one that follows is
        launched); any other is finished now."""
        if launched.sampling_seqs and self._overlap_allowed(launched.spec):
            self._pending = launched
            return []
        return self._finish(launched)

    def _launch(self, batch, spec, step: Optional[StepInput] = None) -> "_Launched":
        """Propose (speculative rows), build the step's input (unless given) and launch its forward."""
        drafted = [i for i in range(len(batch.seqs)) if batch.num_drafts(i)]
        proposal = spec.propose([batch.seqs[i] for i in drafted], batch.num_drafts(drafted[0])) if drafted else None
        trees = StepTrees(np.asarray(drafted, dtype=np.int64), proposal.rows) if drafted else None
        if step is None:
            step = StepInput.from_batch(batch, self.config.cache.block_size, trees,
                                        spec.aux_layers if spec is not None else ())
        sampling = batch.sampling_rows()
        self._in_forward = True
        logits = self.runner.execute(step)
        self._in_forward = False
        launched = _Launched(batch, spec, step, logits, [batch.seqs[i] for i in sampling], drafted, proposal)
        if drafted:
            launched.plain_rows, launched.spec_rows = self._logit_rows(batch, sampling, drafted)
        return launched

    def _sample(self, launched: "_Launched") -> None:
        """Fill the grammar masks (while the forward runs, on CUDA) and launch the sampler; on CUDA the sampled
        tokens start their copy to pinned host memory."""
        logits = launched.logits
        if not launched.sampling_seqs:
            return
        seqs = launched.sampling_seqs
        # rows of `sampling_seqs`; a sequence that ended with the step before (async) has a row whose token is dropped
        guided = [row for row, seq in enumerate(seqs) if seq.grammar is not None and not seq.is_finished]
        guided_seqs = [seqs[r] for r in guided]
        mask = self.guided.token_mask(guided_seqs, guided, launched.broken) if guided else None
        sb = SamplingBatch.build(
            [s.params for s in seqs], [s.seed for s in seqs], [s.num_tokens for s in seqs],
            SequenceTokens(seqs, prompt=False), SequenceTokens(seqs, prompt=True),
            self.eos_token_ids, self.model_config.vocab_size, logits.device, token_mask=mask)
        launched.out = self.sampler(_take_rows(logits, launched.plain_rows) if launched.drafted else logits, sb)
        launched.guided, launched.guided_seqs = guided, guided_seqs
        launched.readback = self._readback.start(launched.out.token_ids)

    def _finish(self, launched: "_Launched") -> list[RequestOutput]:
        """Read the sampled tokens back, verify the draft rows, emit the tokens and the outputs due."""
        batch, spec, step, out = launched.batch, launched.spec, launched.step, launched.out
        num_failed = len(self.failed)
        tokens, refused, broken = [], [], launched.broken
        if launched.sampling_seqs:
            tokens = self._readback.finish(launched.readback)
            if launched.guided:
                refused = self.guided.refused(launched.guided_seqs, [tokens[r] for r in launched.guided])
        now = time.monotonic()
        touched: dict[str, Request] = {}
        aux = self.runner.last_aux_hidden if spec is not None else None
        if aux:
            spec.observe_step(batch, step, aux)
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if batch.num_drafts(i) or seq.is_finished:     # finished: ended with the step before (async)
                continue
            before = seq.num_computed_tokens
            seq.num_computed_tokens += n
            self.block_manager.commit_full_blocks(seq, before)
        for seq, error in broken:
            self._fail_own(seq.request_id, error)
        if launched.drafted:
            seqs = [batch.seqs[i] for i in launched.drafted]
            first_rows = [int(step.query_start_loc[i]) for i in launched.drafted]
            verified = self.verifier.verify(seqs, launched.proposal, _take_rows(launched.logits, launched.spec_rows))
            self._apply_verified(seqs, verified, aux, first_rows, step.block_tables[launched.drafted], now)
            touched.update((s.request_id, self.requests[s.request_id]) for s in seqs if s.request_id in self.requests)
        for row, seq in enumerate(launched.sampling_seqs):
            req = self.requests.get(seq.request_id)
            if req is None or seq.is_finished:
                continue                # failed earlier in this step, or (async) ended with the step before
            try:
                self._append_token(req, seq, tokens[row], out, row, now)
            except Exception as e:  # noqa: BLE001 - this request's own failure (detokenizer, stop check)
                self._fail_own(seq.request_id, e)
                continue
            touched[seq.request_id] = req
        for seq, token in refused:
            if seq.request_id in self.requests:     # its refused token never reaches the client
                self._fail_own(seq.request_id, GrammarError(f"the sampled token {token} does not match the grammar"))
        if len(self.failed) > num_failed:   # a request that failed after another of its sequences was touched
            touched = {rid: req for rid, req in touched.items() if rid in self.requests}
        self.stats.num_steps += 1
        self.stats.prefill_steps += batch.has_prefill
        self.stats.iteration_tokens_total += batch.num_tokens
        outputs = []
        for req in self.coalescer.due(touched, now, len(touched)):
            outputs.append(req.make_output())
            if req.finished:
                self._retire(req)
        return outputs

    # ---- structured outputs -----------------------------------------------------------------
    def _admit_compiled(self) -> None:
        """Requests whose grammar finished compiling join the queue; those whose grammar failed end with a 400."""
        for rid, compiling in list(self._compiling.items()):
            if not compiling.done():
                continue
            del self._compiling[rid]
            req = self.requests[rid]
            try:
                compiled = compiling.result()
            except GrammarError as e:
                self._fail(rid, RequestError(req.params.grammar.param, f"the schema cannot be used: {e}",
                                             "invalid_value"))
                continue
            except Exception as e:  # noqa: BLE001 - the backend failed (not the request): this request ends
                self._fail_own(rid, e)
                continue
            self.guided.attach(req.seqs, compiled)
            for seq in req.seqs:
                self.scheduler.add(seq)

    # ---- failures ---------------------------------------------------------------------------
    def _fail_own(self, request_id: str, error: Exception) -> None:
        """A request whose own processing raised: its client gets the error (no traceback), the log the traceback."""
        log.error("request %s failed", request_id, exc_info=error)
        self._fail(request_id, RuntimeError(f"{type(error).__name__}: {error}"))

    def _fail_step(self, batch, error: BaseException) -> None:
        """The step ran out of device memory: its requests end, their blocks go back, the engine goes on."""
        ids = list(dict.fromkeys(s.request_id for s in batch.seqs))
        log.error("a step of %d tokens ran out of device memory; failing its requests %s", batch.num_tokens, ids,
                  exc_info=error)
        for rid in ids:
            self._fail(rid, EngineStepError("the engine ran out of device memory in the step running this request"))
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()

    def _fail_unschedulable(self) -> None:
        """Nothing runs and the head of the queue still does not fit: it never will (max_model_len is sized so that
        this cannot happen; a request must not wait for room forever if it does)."""
        sched = self.scheduler
        if sched.running or not sched.waiting:
            return
        seq = sched.waiting[0]
        self._fail(seq.request_id, RequestError(
            "prompt", f"the request needs {seq.num_tokens} tokens of KV cache at once, more than this engine's "
            f"{self.block_manager.num_free_blocks} free blocks of {self.block_manager.block_size} tokens hold",
            "context_length_exceeded"))

    def _elastic_guarded(self, action) -> None:
        """Run an elastic KV action (before_schedule, a mode change). A lend that raises changed nothing but the
        device mapping; a reclaim that raises (VmmError, out of memory) may have moved blocks whose K/V was
        never copied: the running requests end, the reserve is taken back on this rank, the engine goes on."""
        bm, kv = self.block_manager, self.runner.kv
        was_lent = bm.reserve_lent
        try:
            action()
            return
        except (VmmError, torch.OutOfMemoryError) as e:
            if not was_lent and self.runner.world_size > 1:
                raise                   # the other ranks wait for this rank in the lend's all-reduce
            error = e
        if was_lent:
            ids = list(dict.fromkeys(s.request_id for s in self.scheduler.running))
            log.error("taking the elastic reserve back failed; failing the running requests %s", ids, exc_info=error)
            for rid in ids:
                self._fail(rid, EngineStepError("the engine failed to take its KV reserve back while running this "
                                                "request"))
            if bm.reserve_lent:         # no live block left anywhere: nothing to migrate
                if not bm.reserve_draining:
                    bm.begin_reclaim()
                bm.reclaim_reserve()
            bm.drop_prefix_cache()      # blocks the reclaim moved carry their hashes, maybe not their K/V
        else:
            log.error("lending the elastic reserve failed; it stays in the reserve", exc_info=error)
            self.elastic.gate.refused()
            self.elastic.lend_refused += 1
        if kv.memory.mapped:
            kv.apply(KVAction(RECLAIM))   # this rank only: the others ran the action to its end
        bm.set_reserve_mapped(False)

    @staticmethod
    def _logit_rows(batch, sampling: list[int], drafted: list[int]) -> tuple[list[int], list[int]]:
        """Logit rows (batch order: one per sampling sequence, 1+N per speculative one) of each kind."""
        plain, spec, row = [], [], 0
        on, drafts = set(sampling), set(drafted)
        for i in range(len(batch.seqs)):
            if i in drafts:
                spec.extend(range(row, row + batch.num_new_tokens[i]))
                row += batch.num_new_tokens[i]
            elif i in on:
                plain.append(row)
                row += 1
        return plain, spec

    def _append_token(self, req: Request, seq: Sequence, token: int, out, row: int, now: float) -> None:
        seq.token_ids.append(token)
        stats = self.stats
        stats.generation_tokens += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
            if seq.index == 0:
                stats.prompt_tokens += seq.num_prompt_tokens
        else:
            seq.inter_token_latencies.append(now - seq.last_token_time)
        seq.last_token_time = now
        p = seq.params
        if p.logprobs is not None:
            seq.logprobs.append(self._logprob_entry(token, out, row, p.logprobs))
            seq.cumulative_logprob += seq.logprobs[-1][token].logprob
        idx = seq.index
        stop_reason, reason = None, None
        is_eos = token in self.eos_token_ids and not p.ignore_eos
        is_stop_id = token in p.stop_token_ids
        if (is_eos or is_stop_id) and seq.num_output_tokens > p.min_tokens - 1:
            reason, stop_reason = "stop", (token if is_stop_id and not is_eos else None)
            if p.include_stop_str_in_output and is_stop_id:
                req.text_parts[idx].append(req.detokenizers[idx].update([token])[0])
        elif p.detokenize:
            delta, matched = req.detokenizers[idx].update([token])
            req.text_parts[idx].append(delta)
            if matched is not None:
                reason, stop_reason = "stop", matched
        if reason is None and seq.ends_by_length(self.max_model_len):
            reason = "length"
        if reason is not None:
            if p.detokenize and not isinstance(stop_reason, str):
                req.text_parts[idx].append(req.detokenizers[idx].flush())
            self.scheduler.finish(seq, reason, stop_reason)

    def _apply_verified(self, seqs: list[Sequence], v: VerifiedRound, aux: list, first_rows: list[int],
                        tables: np.ndarray, now: float) -> None:
        """Emit each sequence's accepted tokens and bonus token, move the accepted nodes' K/V from their scratch
        slots (root + 1 + node index) to the contiguous slots root + 1 .. root + k, so the sequence has
        root + 1 + k computed tokens (the bonus token is the next round's root), and hand the root's and the
        accepted nodes' hidden states to the proposer. `tables`: the sequences' block tables as the verify step
        ran them (rows of StepInput.block_tables)."""
        stats = self.stats
        stats.spec_drafts += len(seqs)
        stats.spec_draft_tokens += v.num_draft_tokens
        stats.spec_accepted_tokens += int(v.num_emitted.sum()) - len(seqs)
        per_depth = (v.path_slots[:, 1:] >= 0).sum(0).tolist()
        by_pos = stats.spec_accepted_by_position
        by_pos.extend([0] * (len(per_depth) - len(by_pos)))
        for d, c in enumerate(per_depth):
            by_pos[d] += c

        bs = self.config.cache.block_size
        roots = np.fromiter((seq.num_computed_tokens for seq in seqs), dtype=np.int64, count=len(seqs))
        accepted = v.num_emitted - 1
        alive = np.fromiter((seq.request_id in self.requests for seq in seqs), dtype=bool, count=len(seqs))
        # The device work of the round's end is launched before the host emits the tokens, so the two overlap:
        # accepted node c (path column c, 0-based) moves its K/V from root + its slot to root + 1 + c, and the
        # root's and accepted nodes' hidden states enter the drafter context. A sequence that finishes below had
        # that work done for nothing: the blocks written are its own (positions past its committed prefix) and
        # its context is dropped when it retires.
        column = np.arange(v.width - 1)
        path = v.path_slots[:, 1:]
        moved_b, moved_c = np.nonzero(alive[:, None] & (column < accepted[:, None]) & (path != column + 1))
        if len(moved_b):
            src, dst = roots[moved_b] + path[moved_b, moved_c], roots[moved_b] + moved_c + 1
            self.runner.call_all("compact_kv", tables[moved_b, src // bs].astype(np.int64) * bs + src % bs,
                                 tables[moved_b, dst // bs].astype(np.int64) * bs + dst % bs)
        live = np.flatnonzero(alive)
        if len(live):
            on_path = np.arange(v.width) <= accepted[live, None]     # the root, then the accepted nodes
            rows = np.asarray(first_rows, dtype=np.int64)[live, None] + v.path_slots[live]
            self.speculator.observe(aux, rows[on_path],
                                    np.repeat([seqs[b].seq_id for b in live.tolist()], accepted[live] + 1),
                                    (roots[live, None] + np.arange(v.width))[on_path])
            self.speculator.flush()

        kept = np.zeros(len(seqs), dtype=bool)
        num_failed = len(self.failed)
        for b in live.tolist():
            seq = seqs[b]
            req = self.requests.get(seq.request_id)
            if req is None:
                continue                # failed earlier in this round, through another of its sequences
            slots = v.path_slots[b]
            try:
                for j, token in enumerate(v.tokens[b, :int(v.num_emitted[b])].tolist()):
                    self._append_token(req, seq, token, v.sampled, b * v.width + int(slots[j]), now)
                    if seq.is_finished:
                        break
            except Exception as e:  # noqa: BLE001 - this request's own failure (detokenizer, stop check)
                self._fail_own(seq.request_id, e)
                continue
            kept[b] = not seq.is_finished
        if len(self.failed) > num_failed:   # a request that failed after another of its sequences was kept
            kept &= np.fromiter((seq.request_id in self.requests for seq in seqs), dtype=bool, count=len(seqs))
        for b in np.flatnonzero(kept).tolist():
            seq, root = seqs[b], int(roots[b])
            seq.num_computed_tokens = root + 1 + int(accepted[b])
            self.block_manager.commit_full_blocks(seq, root)
            self.block_manager.truncate(seq, -(-seq.num_tokens // bs))

    def _logprob_entry(self, token: int, out, row: int, k: int) -> dict[int, Logprob]:
        """The sampled token's logprob and the top-k alternatives, decoded once."""
        lp = float(out.logprobs[row])
        pairs = {token: (lp, 0)}
        if out.top_ids is not None and k > 0:
            for rank, (tid, v) in enumerate(zip(out.top_ids[row, :k].tolist(), out.top_logprobs[row, :k].tolist()),
                                            start=1):
                if tid == token:
                    pairs[token] = (lp, rank)
                else:
                    pairs.setdefault(tid, (v, rank))
        decode = self.tokenizer.decode
        return {tid: Logprob(v, r, decode([tid], skip_special_tokens=False)) for tid, (v, r) in pairs.items()}

    def _retire(self, req: Request) -> None:
        del self.requests[req.request_id]           # the coalescer dropped it when it reported its last output
        self.stats.requests_finished += 1
        for seq in req.seqs:
            if self.speculator is not None:
                self.speculator.forget(seq)
            self.finished_timings.append(RequestTimings(
                request_id=req.request_id, arrival_time=seq.arrival_time,
                scheduled_time=seq.first_scheduled_time or seq.arrival_time,
                first_token_time=seq.first_token_time or seq.arrival_time,
                finish_time=seq.last_token_time or time.monotonic(),
                num_prompt_tokens=seq.num_prompt_tokens, num_generation_tokens=seq.num_output_tokens,
                finish_reason=seq.finish_reason or "abort", inter_token_latencies=seq.inter_token_latencies))
        del self.finished_timings[:-10000]

    # ---- knobs and stats --------------------------------------------------------------------
    def reconfigure(self, max_num_batched_tokens: Optional[int] = None, elastic: Optional[str] = None,
                    speculation: Optional[bool] = None) -> dict:
        """Runtime knobs, applied between steps. Returns the settings now in force."""
        if self._pending is not None:
            # A change may preempt (grants taken back, a reclaim) or remap the KV: the async-scheduled step must
            # have run and its tokens be the sequences' own first, or a preempted one would carry that step's
            # progress into its recompute. Its outputs go out with the next step's.
            pending, self._pending = self._pending, None
            self._finished_early += self._finish(pending)
        if max_num_batched_tokens is not None:
            n = int(max_num_batched_tokens)
            configured = self.config.scheduling.max_num_batched_tokens
            if self.runner.device.type == "cuda" and n > configured:
                raise ValueError(f"max_num_batched_tokens={n} is above the {configured} "
                                 "whose activation peak this engine reserved memory for")
            self.scheduler.set_budget(n)
            if self.elastic is not None and self.config.elastic.budget_grants:
                # A smaller budget's steps need less of the reserve: the rest is KV until the budget rises again.
                target = self.runner.kv.grant_target(n, configured)
                self._elastic_guarded(lambda: self.elastic.fit_reserve(target))
        if elastic is not None:
            if self.elastic is not None:
                self._elastic_guarded(lambda: self.elastic.set_mode(elastic))
                self.elastic.set_mode(elastic)      # again, if a failed reclaim stopped it half-way
            elif elastic != "off":
                raise ValueError("elastic KV needs an engine started with elastic='elastic'")
        if speculation is not None:
            if speculation and self.speculator is None:
                raise ValueError("speculative decoding needs an engine started with speculative=... and a drafter")
            self.speculation = bool(speculation)
        return {"max_num_batched_tokens": self.scheduler.max_num_batched_tokens,
                "elastic": self.elastic.mode if self.elastic is not None else "off",
                "speculation": self.speculation}

    def drain_finished_timings(self) -> list[RequestTimings]:
        """The timings of the requests finished since the last call (the metrics recorder's per-request samples)."""
        out, self.finished_timings = self.finished_timings, []
        return out

    def get_stats(self) -> EngineStats:
        """A snapshot: the engine's counters with the current gauges (readers never see it move)."""
        s = replace(self.stats, spec_accepted_by_position=list(self.stats.spec_accepted_by_position))
        s.preemptions = self.scheduler.num_preemptions      # recompute preemptions, elastic reclaims included
        s.kv_admission_waits = self.scheduler.num_kv_admission_waits
        s.num_running = len(self.scheduler.running)
        s.num_waiting = len(self.scheduler.waiting)
        s.kv_blocks_total = self.block_manager.num_usable_blocks
        s.kv_blocks_used = self.block_manager.num_used_blocks
        s.max_num_batched_tokens = self.scheduler.max_num_batched_tokens
        s.prefix_cache_queries = self.block_manager.queries
        s.prefix_cache_hits = self.block_manager.hits
        if self.elastic is not None:
            self.elastic.fill_stats(s)
        s.constrained_requests = dict(self.stats.constrained_requests)
        s.spec_constrained_plain = self.scheduler.num_constrained_plain
        if self.guided is not None:
            cache = self.guided.cache
            s.grammar_compiles, s.grammar_cache_hits = cache.compiles, cache.hits
            s.grammar_compile_latencies = list(cache.compile_seconds)
            s.grammar_mask_steps, s.grammar_mask_latencies = self.guided.mask_steps, list(self.guided.mask_seconds)
        s.bookkeeping = {"engine_requests": len(self.requests), "grammar_compiling": len(self._compiling),
                         "scheduled_sequences": s.num_running + s.num_waiting,
                         "stream_coalescer": self.coalescer.num_tracked,
                         "drafter_contexts": self.speculator.num_tracked if self.speculator is not None else 0}
        return s

    def shutdown(self) -> None:
        self._pending = None
        if self.guided is not None:
            self.guided.shutdown()
        self.runner.shutdown()
        if self.launcher is not None:
            self.launcher.shutdown()


@dataclass(eq=False)
class _Launched:
    """A step whose forward is launched: what sampling it and finishing it need."""
    batch: ScheduledBatch
    spec: Optional[Proposer]
    step: StepInput
    logits: Optional[torch.Tensor]
    sampling_seqs: list[Sequence]        # the sequences that sample one token, in batch order
    drafted: list[int]                   # batch rows that verify a draft tree
    proposal: object = None
    plain_rows: list[int] = field(default_factory=list)      # logit rows of `sampling_seqs` and of `drafted`
    spec_rows: list[int] = field(default_factory=list)
    broken: list = field(default_factory=list)               # (sequence, error): its grammar refused its tokens
    guided: list[int] = field(default_factory=list)          # rows of `sampling_seqs` that follow a grammar
    guided_seqs: list[Sequence] = field(default_factory=list)
    out: object = None                   # the SamplerOutput
    readback: object = None              # TokenReadback.start's handle


class TokenReadback:
    """The sampled token ids' copy to the host. On CUDA into one pinned buffer, asynchronously, with an event to
    wait for (not the whole stream, where an async-scheduled forward may already be queued behind the sampler);
    one copy is outstanding at a time (a step's tokens are read before the next step's sampler is launched)."""

    def __init__(self, device: torch.device, max_rows: int):
        self.cuda = torch.device(device).type == "cuda"
        if self.cuda:
            self.buffer = torch.empty(max_rows, dtype=torch.int64, pin_memory=True)
            self.event = torch.cuda.Event()

    def start(self, token_ids: torch.Tensor):
        if not self.cuda:
            return token_ids
        n = token_ids.shape[0]
        self.buffer[:n].copy_(token_ids, non_blocking=True)
        self.event.record()
        return n

    def finish(self, handle) -> list[int]:
        if not self.cuda:
            return handle.tolist()
        self.event.synchronize()            # the outstanding copy, the last work of its step
        return self.buffer[:handle].tolist()


def _take_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits[rows] without a host sync: all rows are the common case (a decode-only round), else the index
    travels pinned and asynchronously (indexing a device tensor with a list copies it synchronously, so the host
    would wait for the forward before it could prepare sampling)."""
    if len(rows) == logits.shape[0] and (not rows or rows[-1] == len(rows) - 1):
        return logits                               # rows are increasing and distinct: 0 .. S-1
    return logits.index_select(0, to_device(np.asarray(rows, dtype=np.int64), logits.device))
