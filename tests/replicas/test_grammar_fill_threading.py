"""Which way a step's grammar bitmask is filled (xgrammar's thread pool or the calling thread): chosen per batch
size by timing, the same bitmask either way."""
import torch

from replicas.structured.bitmask import bitmask_words
from replicas.structured.spec import GrammarSpec
from replicas.structured.xgrammar_backend import FILL_TRIALS, FillThreading, create
from replicas.tokenizer import Tokenizer
from tests.support.checkpoints import make_tiny_llama


def test_each_bucket_alternates_then_keeps_the_faster_way():
    choice = FillThreading(threads=4)
    for rows, pool_s, alone_s in ((64, 1.0, 2.0), (8, 3.0, 2.0)):       # 64 rows: the pool wins; 8: the caller
        ways = []
        for _ in range(2 * FILL_TRIALS):
            threaded, trial = choice.next(rows)
            assert trial
            ways.append(threaded)
            choice.record(rows, threaded, pool_s if threaded else alone_s)
        assert ways.count(True) == ways.count(False) == FILL_TRIALS
        assert all(choice.next(rows) == (pool_s < alone_s, False) for _ in range(3))    # settled: no more timing
    assert choice.chosen == {7: True, 4: False}
    assert choice.next(100) == (True, False) and choice.next(12) == (False, False)    # same buckets: 64-127, 8-15
    assert choice.next(2) == (False, True) and 2 not in choice.chosen    # a new bucket starts on the caller
    single = FillThreading(threads=1)
    for _ in range(3 * FILL_TRIALS):
        assert single.next(64) == (False, False)                         # nothing to choose, nothing timed
    assert single.chosen == {}


def test_the_pool_and_the_calling_thread_fill_the_same_bitmask(tmp_path):
    tok = Tokenizer.from_hf_folder(make_tiny_llama(tmp_path))
    vocab = tok.vocab_size
    backend = create(tok, vocab, tok.eos_token_ids, threads=2)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}},
              "required": ["n", "s"]}
    compiled = backend.compile(GrammarSpec.json_schema(schema))
    text = '{"n": 12, "s": "abc'
    ids = tok.encode(text, add_special_tokens=False)
    matchers = [backend.new_matcher(compiled) for _ in range(len(ids))]
    for depth, m in enumerate(matchers):                 # each matcher somewhere else in the same output
        assert all(backend.accept([m], [t])[0] for t in ids[:depth])
    alone = torch.zeros(len(matchers), bitmask_words(vocab), dtype=torch.int32)
    pooled = torch.full_like(alone, -1)
    backend.batch_one.batch_fill_next_token_bitmask(matchers, alone)
    backend.batch.batch_fill_next_token_bitmask(matchers, pooled)
    assert torch.equal(alone, pooled) and len(set(map(tuple, alone.tolist()))) > 2
    for _ in range(2 * FILL_TRIALS):                      # the engine's path times both ways, then keeps one
        backend.fill_bitmask(matchers, torch.zeros_like(alone))
    assert len(matchers).bit_length() in backend.fill_threading.chosen
