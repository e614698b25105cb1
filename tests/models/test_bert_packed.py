"""BertModel's one forward on packed input (cu_seqlens) against its padded input and
transformers, recording on packed input, and SentenceEncoder's thread schedules.

A tiny random BERT (3 layers, width 32) keeps these fast; test_bert.py holds the
MiniLM checks."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from conftest import F32_EPS, assert_within_budget

import attnkit
from attnkit.functional import ATTENTION_BACKENDS, scaled_dot_product_attention
from attnkit.models.bert import BertModel, SentenceEncoder, load_bert
from attnkit.runtime import FastestSchedule

WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "##s", "big", ".", ",", "!", "?", "red"]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS + [f"w{i}" for i in range(40)]
LAYERS, HEADS = 3, 4
LENGTHS = [5, 11, 1, 8]  # a one-token sequence too


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, torch, transformers):
    """(folder, attnkit float32, attnkit float64, transformers eager float32, transformers float64)."""
    folder = tmp_path_factory.mktemp("tiny_bert_packed")
    config = transformers.BertConfig(
        vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=37, max_position_embeddings=40, type_vocab_size=2, layer_norm_eps=1e-7,
    )
    torch.manual_seed(1)
    hf = transformers.BertModel(config).eval()
    with torch.no_grad():  # larger-than-init weights so that differences would show
        for p in hf.parameters():
            p.mul_(2.0)
    hf.save_pretrained(folder, safe_serialization=True)
    (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    hf = transformers.BertModel.from_pretrained(folder, attn_implementation="eager").eval()
    return folder, load_bert(folder), load_bert(folder).astype(np.float64), hf, copy.deepcopy(hf).double()


def _batch(seed=0):
    """Padded ids, types and mask (B, T), and the same sequences packed with cu_seqlens."""
    rng = np.random.default_rng(seed)
    B, T = len(LENGTHS), max(LENGTHS)
    ids = rng.integers(5, len(VOCAB), size=(B, T))
    types = rng.integers(0, 2, size=(B, T))
    mask = np.arange(T)[None, :] < np.array(LENGTHS)[:, None]
    ids[~mask], types[~mask] = 0, 0
    cu_seqlens = np.concatenate([[0], np.cumsum(LENGTHS)])
    return ids, types, mask, ids[mask], types[mask], cu_seqlens


def _hf(model, torch, ids, types, mask, **options):
    with torch.no_grad():
        return model(
            input_ids=torch.from_numpy(ids), token_type_ids=torch.from_numpy(types),
            attention_mask=torch.from_numpy(mask.astype(np.int64)), **options,
        )


def test_packed_and_padded_forwards_agree_and_match_transformers(tiny, torch):
    _, model, model64, hf, hf64 = tiny
    ids, types, mask, packed_ids, packed_types, cu = _batch()
    theirs = _hf(hf, torch, ids, types, mask, output_hidden_states=True)
    truth = _hf(hf64, torch, ids, types, mask, output_hidden_states=True)
    padded = model(ids, mask, types, output_hidden_states=True)
    packed = model(packed_ids, token_type_ids=packed_types, cu_seqlens=cu, output_hidden_states=True)
    assert packed.last_hidden_state.shape == (sum(LENGTHS), 32) and packed.last_hidden_state.dtype == np.float32
    assert len(packed.hidden_states) == len(padded.hidden_states) == LAYERS + 1
    for layer in range(LAYERS + 1):
        oracle = theirs.hidden_states[layer].numpy()[mask]
        exact = truth.hidden_states[layer].numpy()[mask]
        assert_within_budget(padded.hidden_states[layer][mask], oracle, exact, what=f"padded, hidden state {layer}")
        assert_within_budget(packed.hidden_states[layer], oracle, exact, what=f"packed, hidden state {layer}")
    # float64: packed is the padded forward to float64 rounding
    packed64 = model64(packed_ids, token_type_ids=packed_types, cu_seqlens=cu).last_hidden_state
    assert packed64.dtype == np.float64
    np.testing.assert_allclose(packed64, truth.last_hidden_state.numpy()[mask], rtol=0, atol=1e-11)


def test_packed_input_is_recorded_per_group(tiny, torch):
    _, model, _, hf, hf64 = tiny
    ids, types, mask, packed_ids, packed_types, cu = _batch(1)
    theirs = _hf(hf, torch, ids, types, mask, output_attentions=True).attentions
    truth = _hf(hf64, torch, ids, types, mask, output_attentions=True).attentions
    with attnkit.record_attention(model) as recording:
        out = model(packed_ids, token_type_ids=packed_types, cu_seqlens=cu, output_attentions=True)
    # 4 sequences: one group per layer, padded to the longest, padded keys weigh exactly 0
    assert len(recording) == LAYERS and len(out.attentions) == LAYERS
    real_rows = mask[:, None, :, None] & np.ones((1, HEADS, 1, max(LENGTHS)), bool)
    for layer, (w, a) in enumerate(zip(recording, out.attentions)):
        np.testing.assert_array_equal(w, a)
        assert w.shape == (len(LENGTHS), HEADS, max(LENGTHS), max(LENGTHS))
        assert np.all(w[np.broadcast_to(~mask[:, None, None, :], w.shape)] == 0)
        assert_within_budget(w[real_rows], theirs[layer].numpy()[real_rows], truth[layer].numpy()[real_rows],
                             what=f"packed layer {layer} attention")
    # more sequences than ATTENTION_GROUP: one recorded map per group per layer
    many = np.concatenate([packed_ids] * 5)
    cu_many = np.concatenate([[0], np.cumsum(LENGTHS * 5)])
    with attnkit.record_attention(model) as recording:
        model(many, cu_seqlens=cu_many)
    assert [w.shape[0] for w in recording] == [BertModel.ATTENTION_GROUP, 20 - BertModel.ATTENTION_GROUP] * LAYERS


@pytest.fixture
def counting(monkeypatch):
    calls = []

    def counting_attention(query, key, value, *args, **kwargs):
        calls.append(query.shape)
        return scaled_dot_product_attention(query, key, value, *args, **kwargs)

    monkeypatch.setitem(ATTENTION_BACKENDS, "counting", counting_attention)
    return calls


def test_packed_input_takes_every_backend(tiny, counting):
    _, model, model64, _, _ = tiny
    _, _, _, packed_ids, packed_types, cu = _batch(2)
    try:
        naive = model.set_attention_backend("naive")(packed_ids, token_type_ids=packed_types, cu_seqlens=cu)
        truth = model64(packed_ids, token_type_ids=packed_types, cu_seqlens=cu).last_hidden_state
        for name in ("flash", "counting"):
            got = model.set_attention_backend(name)(packed_ids, token_type_ids=packed_types, cu_seqlens=cu)
            assert_within_budget(got.last_hidden_state, naive.last_hidden_state, truth, what=f"packed, {name}")
        # a backend varlen_attention does not know runs through `attend`, one padded group per layer
        assert counting == [(len(LENGTHS), HEADS, max(LENGTHS), 8)] * LAYERS
    finally:
        model.set_attention_backend("naive")


def test_packed_input_is_checked(tiny):
    _, model, _, _, _ = tiny
    ids, _, mask, packed_ids, _, cu = _batch()
    with pytest.raises(ValueError, match="attention_mask=None with cu_seqlens"):
        model(packed_ids, mask.ravel(), cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"packed input_ids of shape \(total,\)"):
        model(ids, cu_seqlens=cu)
    for bad in ([1, 25], [0, 20], [0, 5, 5, 25], [0, 30, 25]):
        with pytest.raises(ValueError, match="expected cu_seqlens to rise from 0"):
            model(packed_ids, cu_seqlens=np.array(bad))
    with pytest.raises(TypeError, match="cu_seqlens to be an integer array"):
        model(packed_ids, cu_seqlens=np.array([0.0, 25.0]))
    long = np.ones(41, dtype=np.int64) * 7
    with pytest.raises(ValueError, match="max_position_embeddings=40 tokens per sequence, got 41"):
        model(long, cu_seqlens=np.array([0, 41]))
    with pytest.raises(ValueError, match="token_type_ids of shape"):
        model(packed_ids, token_type_ids=np.zeros(3, np.int64), cu_seqlens=cu)


def test_encode_times_each_schedule_and_agrees(tiny):
    folder = tiny[0]
    rng = np.random.default_rng(3)
    texts = [" ".join(rng.choice(WORDS[:8], size=rng.integers(16, 31))) for _ in range(48)]
    one = SentenceEncoder.from_pretrained(folder, num_threads=1)
    two = SentenceEncoder(one.model, one.tokenizer, head=one.head, num_threads=2)
    expected = one.encode(texts, batch_size=8)
    assert one._choice.seconds == {}  # one thread: nothing to choose
    got = two.encode(texts, batch_size=8)  # 6 batches of >= 128 tokens: every schedule is timed
    assert set(two._choice.seconds) == set(SentenceEncoder.SCHEDULES)
    np.testing.assert_allclose(got, expected, rtol=0, atol=64 * F32_EPS)
    assert two._schedule(2 * SentenceEncoder.MIN_TOKENS_PER_THREAD - 1) == "one thread"
    # the fastest runs; every RETIME_EVERY-th batch re-times another
    two._choice = FastestSchedule(SentenceEncoder.SCHEDULES, SentenceEncoder.RETIME_EVERY)
    two._choice.seconds = {"one thread": 3.0, "BLAS threads": 1.0, "worker threads": 2.0}
    chosen = [two._schedule(1000) for _ in range(2 * SentenceEncoder.RETIME_EVERY)]
    assert chosen.count("BLAS threads") == len(chosen) - 2
    assert {c for c in chosen if c != "BLAS threads"} == {"one thread", "worker threads"}
