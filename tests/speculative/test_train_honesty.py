"""What the training log's accept length measures: the teacher-forced chain stops at the response's end, looping
regenerations are trimmed before training, and held-out pairs give a held-out accept length in the log."""
import json
import random
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from speculative.drafter import DominoDrafter, DrafterConfig
from speculative.train_data import TrainBatch, trim_loop, trim_loops, write_pairs
from speculative.train_loop import block_losses
from tests.support.threads import one_thread  # noqa: F401  (autouse)

V, BLOCK = 64, 8


def counting_drafter(wrong_label=None) -> DominoDrafter:
    """A drafter whose corrected logits put the token after each path token (token i + 1) first: with an
    identity embedding and W2 the correction is 100 at that token (-100 at `wrong_label`), far above the base
    logits of the normed hidden states; so it predicts a counting sequence exactly, except where the label is
    `wrong_label`."""
    cfg = DrafterConfig(vocab_size=V, hidden_size=V, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                        head_dim=16, target_layer_ids=(0,), block_size=BLOCK, gru_hidden=8, correction_rank=V,
                        uncorrected_positions=0)
    torch.manual_seed(0)
    drafter = DominoDrafter(cfg)
    drafter.head.w2.weight.data = torch.eye(V)

    def correction_inputs(hidden, path_embeds):
        z = 100.0 * path_embeds.roll(1, dims=-1)
        if wrong_label is not None:
            z[..., wrong_label] = -100.0
        return z
    drafter.head.correction_inputs = correction_inputs
    return drafter


def counting_batch() -> TrainBatch:
    """Token i at position i; prompt 0..9. Row 0: response 10..29, padded to 40 columns; row 1: response 10..39,
    cut at the batch's 40 columns."""
    ids = torch.arange(40).repeat(2, 1)
    ids[0, 30:] = 0
    mask = torch.zeros(2, 40, dtype=torch.bool)
    mask[0, 10:30] = mask[1, 10:40] = True
    anchors = torch.tensor([[27, 20, 9, 0], [36, 38, 12, 30]])
    valid = torch.tensor([[True, True, True, False], [True] * 4])
    return TrainBatch(ids, mask, anchors, valid)


def test_a_perfect_drafters_accept_length_stops_at_the_response_end():
    """Every anchor's chain counts only the response tokens left after it: 2, 8, 8 in row 0 (its end at 29, the
    invalid anchor not counted), 3, 1, 8, 8 in row 1 (cut at 39), not the block size everywhere; a miss ends the
    chain too."""
    embed = torch.eye(V)
    out = block_losses(counting_drafter(), counting_batch(), torch.zeros(2, 40, V), embed, embed, 7.0)
    assert out["accept_len"].item() == pytest.approx((2 + 8 + 8 + 3 + 1 + 8 + 8) / 7)
    assert out["accuracy"].item() == 1.0
    missed = block_losses(counting_drafter(wrong_label=24), counting_batch(), torch.zeros(2, 40, V), embed, embed,
                          7.0)
    assert missed["accept_len"].item() == pytest.approx((2 + 3 + 8 + 3 + 1 + 8 + 8) / 7)
    slots = 2 + 8 + 8 + 3 + 1 + 8 + 8
    assert missed["accuracy"].item() == pytest.approx((slots - 1) / slots)        # 24: a label of one block


def test_trim_loop_keeps_two_periods_of_a_looping_tail():
    head = [11, 12, 13, 14, 15]
    assert trim_loop(head + [5, 6, 7] * 20 + [5]) == head + [5, 6, 7] * 2
    assert trim_loop(head + [8] * 40) == head + [8, 8]
    assert trim_loop(head + [5, 6, 7] * 20 + [5], keep_repeats=3) == head + [5, 6, 7] * 3
    sentence = list(range(100, 140))
    assert trim_loop(head + sentence * 4) == head + sentence * 2
    assert trim_loop(head + sentence * 4, max_period=32) == head + sentence * 4
    rng = random.Random(0)
    plain = [rng.randrange(1000) for _ in range(500)]
    assert trim_loop(plain) == plain
    assert trim_loop(head + [5, 6, 7] * 20 + [2]) == head + [5, 6, 7] * 20 + [2]       # it ended: not a loop
    assert trim_loop(head + [8] * 20) == head + [8] * 20                                # shorter than a loop
    pairs, trimmed, removed = trim_loops([([1], plain), ([2], head + [8] * 40)])
    assert pairs == [([1], plain), ([2], head + [8, 8])] and (trimmed, removed) == (1, 38)


@st.composite
def responses(draw):
    """Few-token alphabets, often ending in a block repeated `repeats` times (then part of it): (ids, block
    length, repeats)."""
    ids = draw(st.lists(st.integers(0, 3), max_size=80))
    block = draw(st.lists(st.integers(0, 3), min_size=1, max_size=12))
    repeats = draw(st.integers(0, 30))
    return ids + block * repeats + block[:draw(st.integers(0, len(block) - 1))], len(block), repeats


@settings(max_examples=300, deadline=None)
@given(responses(), st.integers(1, 3))
def test_trim_loop_returns_a_prefix_and_is_idempotent(case, keep):
    ids, period, repeats = case
    out = trim_loop(ids, keep_repeats=keep)
    assert out == ids[:len(out)] and (len(out) > 0 or not ids)
    assert trim_loop(out, keep_repeats=keep) == out
    if repeats > keep and period * repeats >= 32:
        assert len(out) < len(ids)


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    from tests.support.checkpoints import make_tiny_llama
    root = tmp_path_factory.mktemp("honesty")
    target = make_tiny_llama(root / "target")
    rng = random.Random(0)

    def pairs(n):
        return [([rng.randrange(5, 300) for _ in range(rng.randint(4, 10))],
                 [rng.randrange(5, 300) for _ in range(rng.randint(12, 30))]) for _ in range(n)]
    write_pairs(str(root / "pairs.jsonl"), pairs(15) + [([5, 6, 7], [40, 41, 42] * 15)])
    write_pairs(str(root / "heldout.jsonl"), pairs(6))
    return root, target


def run_tiny(root, target, out, *extra):
    from speculative.train import main
    main(["--target", str(target), "--pairs", str(root / "pairs.jsonl"), "--out", str(root / out), "--layers", "1",
          "--block-size", "4", "--launcher", "local", "--workers", "1", "--device", "cpu", "--steps", "4",
          "--batch-size", "2", "--seq-len", "32", "--anchors-per-seq", "4", "--warmup-steps", "1", "--log-every", "2",
          "--checkpoint-every", "1000", *extra])
    with open(root / out / "train_log.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.timeout(60)
def test_held_out_accept_length_is_logged_and_looping_pairs_are_trimmed(tiny_data, capsys):
    root, target = tiny_data
    records = run_tiny(root, target, "heldout", "--heldout-pairs", str(root / "heldout.jsonl"),
                       "--heldout-batches", "2")
    printed = capsys.readouterr().out
    assert "training pairs: 16, looping tails trimmed from 1 of them (39 response tokens removed)" in printed
    assert "held-out pairs: 6" in printed
    assert [r["step"] for r in records] == [2, 4]
    for r in records:
        assert 0 <= r["heldout_accept_len"] <= 4 and 0 <= r["heldout_accuracy"] <= 1
        assert 0 <= r["accept_len"] <= 4
    plain = run_tiny(root, target, "plain", "--no-trim-loops")
    assert "looping tails kept" in capsys.readouterr().out
    assert all("heldout_accept_len" not in r and "heldout_accuracy" not in r for r in plain)


@pytest.mark.timeout(60)
def test_both_feature_modes_train_on_trimmed_pairs_and_evaluate_fixed_heldout_batches(tiny_data):
    from speculative.train_distributed import TrainJob, train_worker
    from speculative.train_loop import TrainConfig
    root, target = tiny_data
    cfg = TrainConfig(steps=2, batch_size=2, seq_len=32, anchors_per_seq=4, warmup_steps=1, checkpoint_every=1000,
                      heldout_pairs=str(root / "heldout.jsonl"), heldout_batches=3)
    for mode in ("cached", "online"):
        job = TrainJob(pairs=str(root / "pairs.jsonl"), out=str(root / f"modes-{mode}"),
                       cfg=replace(cfg, target_features=mode), target=target, layers=1, block_size=4)
        trainer = train_worker(job, 0, 1, torch.device("cpu"))
        assert trainer.batcher.pairs[-1] == ([5, 6, 7], [40, 41, 42] * 2)
        assert len(trainer.heldout) == 3 and all(b.input_ids.shape[0] == 2 for b, _ in trainer.heldout)
        first = trainer.heldout_metrics()
        assert set(first) == {"heldout_accept_len", "heldout_accuracy"}
        assert {k: v.item() for k, v in trainer.heldout_metrics().items()} == {k: v.item() for k, v in first.items()}


@pytest.mark.timeout(120)
def test_held_out_pairs_are_regenerated_by_the_target_once_and_recorded(tiny_data, capsys):
    root, target = tiny_data
    prompts = root / "heldout_prompts.json"
    prompts.write_text(json.dumps(["name a colour", "count to three", "say hi", "one more"]))
    path = root / "regen" / "heldout.jsonl"
    flags = ["--heldout-pairs", str(path), "--regenerate-heldout", "3", "--heldout-prompts-file", str(prompts),
             "--max-response", "8"]
    records = run_tiny(root, target, "regen-heldout", *flags)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 3 and all(0 < len(p["response_ids"]) <= 8 for p in lines)
    assert "held-out pairs: 3" in capsys.readouterr().out
    assert all("heldout_accept_len" in r for r in records)
    run = json.loads((root / "regen-heldout" / "run.json").read_text())
    assert run["data"]["heldout"]["regeneration_calls"][0]["pairs_written"] == 3
    run_tiny(root, target, "regen-heldout-again", *flags)                  # complete: not answered again
    assert path.read_text().count("\n") == 3
    again = json.loads((root / "regen-heldout-again" / "run.json").read_text())
    assert again["data"]["heldout"]["regeneration_calls"] == []
    run_tiny(root, target, "regen-heldout", *flags)                        # a later run in the same folder
    kept = json.loads((root / "regen-heldout" / "run.json").read_text())["data"]["heldout"]["regeneration_calls"]
    assert [c["pairs_written"] for c in kept] == [3]                        # keeps the calls recorded before
    with pytest.raises(SystemExit):
        run_tiny(root, target, "no-file", "--regenerate-heldout", "3")
    narrow = root / "regen" / "heldout-narrow.jsonl"                     # an engine of 2 sequences a step
    run_tiny(root, target, "regen-narrow", *flags[:1], str(narrow), *flags[2:], "--regenerate-max-seqs", "2")
    assert narrow.read_text() == path.read_text()                          # greedy: the same answers
    call = json.loads((root / "regen-narrow" / "run.json").read_text())["data"]["heldout"]["regeneration_calls"][0]
    assert call["engine_args"] == {"max_num_seqs": 2}


@pytest.mark.timeout(120)
def test_regenerate_only_makes_the_pairs_that_a_later_run_trains_on(tiny_data, capsys):
    from speculative.train import main
    root, target = tiny_data
    prompts = root / "turn_prompts.json"
    prompts.write_text(json.dumps(["name a colour", [{"role": "user", "content": "hi"},
                                                     {"role": "assistant", "content": "hello"},
                                                     {"role": "user", "content": "count to three"}]]))
    pairs, out = root / "only" / "pairs.jsonl", root / "only-run"
    flags = ["--target", str(target), "--pairs", str(pairs), "--out", str(out), "--regenerate", "2",
             "--prompts-file", str(prompts), "--max-response", "8", "--launcher", "local", "--device", "cpu"]
    main([*flags, "--regenerate-only"])
    assert "no training (--regenerate-only)" in capsys.readouterr().out
    assert pairs.read_text().count("\n") == 2 and not (out / "train_log.jsonl").exists()
    run = json.loads((out / "run.json").read_text())
    assert [c["pairs_written"] for c in run["data"]["regeneration_calls"]] == [2] and "result" not in run
    main([*flags, "--layers", "1", "--block-size", "4", "--steps", "2", "--batch-size", "2", "--seq-len", "32",
          "--anchors-per-seq", "4", "--warmup-steps", "1", "--log-every", "1", "--checkpoint-every", "1000"])
    assert pairs.read_text().count("\n") == 2                                # complete: not answered again
    run = json.loads((out / "run.json").read_text())
    assert [c["pairs_written"] for c in run["data"]["regeneration_calls"]] == [2] and run["result"]["finished"]
    assert (out / "train_log.jsonl").read_text().count("\n") == 2
