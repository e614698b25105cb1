"""Decoders against transformers: small random Llama and GPT-2 configs saved with
save_pretrained (safetensors) load in attnkit with the same logits and the same
greedy generations; cache decoding equals full recomputation; left-padded batches
generate what each prompt generates alone; attention maps are causal distributions."""

from __future__ import annotations

import copy
from typing import Any, NamedTuple

import numpy as np
import pytest
from conftest import F32_EPS, assert_within_budget, max_abs_err, optional

from attnkit.models.auto import AutoCausalLM
from attnkit.models.causal_lm import CausalLM
from attnkit.models.gpt2 import GPT2LMHeadModel
from attnkit.models.llama import LlamaForCausalLM
from attnkit.nn import KVCache

transformers = optional("transformers")  # for the config helpers; tests ask for the fixtures

VOCAB = 97


def _llama_config(tied: bool):
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,  # GQA: 3 query heads per key/value head
        max_position_embeddings=128,
        rope_theta=5000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
    )


def _gpt2_config():
    return transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=48, n_layer=3, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0
    )


def _save(model, folder):
    model.save_pretrained(folder, safe_serialization=True)
    return folder


class Pair(NamedTuple):
    name: str
    hf: Any  # transformers, float32
    ours: Any  # attnkit, float32
    hf64: Any  # transformers cast to float64: the truth for comparisons with transformers
    ours64: Any  # attnkit in float64: the truth for attnkit's own float32 paths


@pytest.fixture(scope="module", params=["llama-tied", "llama-untied", "gpt2"])
def pair(request, tmp_path_factory, torch, transformers):
    """transformers and attnkit models with the same random weights, in float32 and float64."""
    torch.manual_seed(0)
    if request.param == "gpt2":
        hf = transformers.GPT2LMHeadModel(_gpt2_config())
    else:
        hf = transformers.LlamaForCausalLM(_llama_config(tied=request.param == "llama-tied"))
    with torch.no_grad():  # larger-than-init weights so differences would show
        for p in hf.parameters():
            p.mul_(3.0)
    hf.eval()
    folder = _save(hf, tmp_path_factory.mktemp(request.param))
    ours = AutoCausalLM.from_pretrained(folder)
    ours64 = AutoCausalLM.from_pretrained(folder).astype(np.float64)
    return Pair(request.param, hf, ours, copy.deepcopy(hf).double(), ours64)


def test_loads_the_right_class(pair):
    name, _, ours = pair[:3]
    assert isinstance(ours, GPT2LMHeadModel if name == "gpt2" else LlamaForCausalLM)


def test_logits_match_transformers(pair, torch):
    name, hf, ours, hf64, _ = pair
    rng = np.random.default_rng(1)
    ids = rng.integers(0, VOCAB, size=(2, 23))
    with torch.no_grad():
        ref = hf(torch.from_numpy(ids)).logits.numpy()
        truth = hf64(torch.from_numpy(ids)).logits.numpy()
    logits = ours(ids)
    assert logits.shape == (2, 23, VOCAB) and logits.dtype == np.float32
    # transformers float32 is 3e-6..6e-6 from its float64 logits (up to ~4.5; the 8-ulp
    # epsilon is ~4e-6). Its float64 Llama keeps RMSNorm in float32, which leaves ~3e-6 of
    # float32 rounding in that truth: the budget absorbs it, and a wrong model is off by far more.
    assert_within_budget(logits, ref, truth, what=f"{name} logits")


def test_greedy_generation_matches_transformers(pair, torch):
    name, hf, ours = pair[:3]
    rng = np.random.default_rng(2)
    for length in (1, 7):
        ids = rng.integers(3, VOCAB, size=(1, length))
        with torch.no_grad():
            ref = hf.generate(
                torch.from_numpy(ids), max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0
            ).numpy()
        out = ours.generate(ids, 20, stop=())
        np.testing.assert_array_equal(out, ref)


def test_batched_left_padded_generation_matches_transformers(pair, torch):
    name, hf, ours = pair[:3]
    prompts = [[5, 9, 11, 40, 3, 7], [8, 60], [13, 14, 15]]
    width = max(map(len, prompts))
    ids = np.zeros((3, width), np.int64)
    mask = np.zeros((3, width), np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = 1
    with torch.no_grad():
        ref = hf.generate(
            torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), max_new_tokens=12, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        ).numpy()
    out = ours.generate(ids, 12, attention_mask=mask, stop=())
    np.testing.assert_array_equal(out[:, width:], ref[:, width:])
    # the ragged list form pads the same way, and each row equals its prompt alone
    ragged = ours.generate(prompts, 12, stop=())
    np.testing.assert_array_equal(ragged[:, width:], out[:, width:])
    for row, prompt in enumerate(prompts):
        alone = ours.generate(np.array(prompt), 12, stop=())
        np.testing.assert_array_equal(alone[len(prompt) :], out[row, width:])


def test_cache_decoding_equals_full_recomputation(pair):
    name, _, ours, _, ours64 = pair
    ids = np.random.default_rng(3).integers(0, VOCAB, size=(2, 19))
    full = ours(ids)
    truth = ours64(ids)  # the same full recomputation in float64
    # cached decoding is as accurate as full recomputation in float32 (both ~2e-6..5e-6 here)
    cache = ours.new_cache(2, 19)
    steps = [ours(ids[:, :6], cache=cache)]  # a prompt, then token by token
    for t in range(6, 19):
        steps.append(ours(ids[:, t : t + 1], cache=cache))
    assert_within_budget(np.concatenate(steps, axis=1), full, truth, what=f"{name} token-by-token decoding")
    # chunked prefill: 4 + 4 + ... tokens at a time
    cache = ours.new_cache(2, 19)
    chunks = [ours(ids[:, s : s + 4], cache=cache) for s in range(0, 19, 4)]
    assert_within_budget(np.concatenate(chunks, axis=1), full, truth, what=f"{name} chunked prefill")
    assert cache.length == 19
    # the float64 cache path is the float64 full recomputation up to float64 rounding
    cache = ours64.new_cache(2, 19)
    steps = [ours64(ids[:, s : s + 5], cache=cache) for s in range(0, 19, 5)]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), truth, atol=1e-10, rtol=0)


def test_generate_with_chunked_prefill_is_the_same(pair):
    _, _, ours = pair[:3]
    ids = np.random.default_rng(4).integers(3, VOCAB, size=17)
    np.testing.assert_array_equal(ours.generate(ids, 8, stop=(), prefill_chunk=5), ours.generate(ids, 8, stop=()))


def test_attention_map_is_causal_distribution(pair):
    _, _, ours = pair[:3]
    ids = np.arange(3, 15)
    result = ours.attention(ids)
    layers = ours.config.num_layers
    heads = ours.config.num_heads
    assert result.weights.shape == (layers, heads, 12, 12)
    # A row of T float32 probabilities sums to 1 within ~T eps (the float32 sum of the
    # softmax denominator, one rounding per division); summed here in float64, 4x that.
    np.testing.assert_allclose(result.weights.sum(-1, dtype=np.float64), 1.0, rtol=0, atol=4 * 12 * F32_EPS)
    assert np.all(np.triu(result.weights, k=1) == 0)
    assert len(result.tokens) == 12


def test_float64_model_is_closer_to_float64_transformers(pair, torch):
    name, hf, _, hf64, ours64 = pair
    ids = np.random.default_rng(5).integers(0, VOCAB, size=(1, 15))
    with torch.no_grad():
        ref = hf64(torch.from_numpy(ids)).logits.numpy()
        ref32 = hf(torch.from_numpy(ids)).logits.numpy()
    logits = ours64(ids)
    assert logits.dtype == np.float64
    ours_err, theirs_err = max_abs_err(logits, ref), max_abs_err(ref32, ref)
    print(f"{name} float64: attnkit {ours_err:.2e} from transformers float64 (transformers float32: {theirs_err:.2e})")
    if name == "gpt2":  # transformers' GPT-2 is float64 throughout
        assert ours_err < 1e-10
    else:
        # transformers' Llama normalizes (RMSNorm) in float32 even in a float64 model (~1e-6
        # here), so attnkit in float64 can only be closer to it than transformers in float32 is
        assert ours_err < theirs_err


def test_missing_tensor_is_a_clear_error(tmp_path, torch, transformers):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(_llama_config(tied=True))
    _save(hf, tmp_path)
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="up_proj"):
        AutoCausalLM.from_pretrained(tmp_path)


def test_unknown_model_type_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(ValueError, match="llama' or 'qwen2' or 'mistral' or 'gpt2'.*'bert'"):
        AutoCausalLM.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        AutoCausalLM.from_pretrained(tmp_path / "nowhere")


# ----------------------------------------------------------------------------- KVCache


def test_kv_cache_appends_in_place_and_masks_bottom_right():
    cache = KVCache(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=4, max_length=8)
    buffer = cache.keys[0]
    rng = np.random.default_rng(0)
    k = rng.standard_normal((1, 1, 3, 4), dtype=np.float32)
    keys, _ = cache.update(0, k, k)
    assert keys.shape == (1, 1, 3, 4) and np.shares_memory(keys, buffer)
    np.testing.assert_array_equal(keys, k)
    assert cache.length == 3
    mask = cache.mask(2, 5)  # 2 new queries over 5 keys: the last two positions
    np.testing.assert_array_equal(mask, [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    assert cache.mask(1, 5) is None  # a decode step sees every key
    with pytest.raises(ValueError, match="at most 8"):
        cache.update(0, np.zeros((1, 1, 6, 4), np.float32), np.zeros((1, 1, 6, 4), np.float32))
    with pytest.raises(ValueError, match="expected key"):
        cache.update(0, np.zeros((1, 2, 1, 4), np.float32), np.zeros((1, 2, 1, 4), np.float32))
    cache.crop(1)
    assert cache.length == 1
    with pytest.raises(ValueError, match="positive int"):
        KVCache(0, 1, 1, 4, 8)


def test_kv_cache_attend_matches_full_causal_attention():
    from attnkit.functional import scaled_dot_product_attention

    rng = np.random.default_rng(1)
    B, Hq, Hkv, T, E = 2, 4, 2, 9, 8
    q = rng.standard_normal((B, Hq, T, E))
    k = rng.standard_normal((B, Hkv, T, E))
    v = rng.standard_normal((B, Hkv, T, E))
    full = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    cache = KVCache(1, B, Hkv, E, T, dtype=np.float64)
    parts = [cache.attend(0, q[:, :, :4], k[:, :, :4], v[:, :, :4])]
    for t in range(4, T):
        parts.append(cache.attend(0, q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1]))
    np.testing.assert_allclose(np.concatenate(parts, axis=2), full, atol=1e-12)


def test_decode_steps_time_their_threads_and_short_prompts_run_on_one(monkeypatch):
    """Decode steps time one BLAS thread against all the caller allows and run the faster,
    re-timing the other every DECODE_RETIME_EVERY steps (issue 15: a second thread reads
    the weights faster on an idle CPU and made decoding 2-5x slower on a busy one); short
    prompts run on one thread (a second made a 50-token prefill 7-20x slower on a busy
    2-core machine); long prompts keep the caller's threads; `single_thread_decode`
    True / False fixes the choice."""
    import contextlib

    import attnkit.models.causal_lm as causal_lm
    from attnkit.models.llama import LlamaConfig

    used: list[int] = []  # the BLAS thread count each forward ran with; 0: left as it was

    @contextlib.contextmanager
    def threads(n):
        used.append(n)
        yield

    monkeypatch.setattr(causal_lm, "blas_threads", threads)
    monkeypatch.setattr(causal_lm, "blas_thread_count", lambda: 4)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_layers=1,
                                         num_heads=4, num_kv_heads=2, head_dim=4, max_position_embeddings=256),
                             seed=0)
    ids = np.arange(3, 3 + 70) % VOCAB

    def ran_with(input_ids, **options) -> int:
        used.clear()
        model(input_ids, **options)
        assert len(used) <= 1
        return used[0] if used else 0

    assert ran_with(ids[:50]) == 1 and ran_with(np.stack([ids[:32], ids[1:33]])) == 1  # 50, 2 x 32 rows
    assert ran_with(ids[:65]) == 0 and ran_with(np.stack([ids[:33], ids[1:34]])) == 0  # 65, 66 rows
    model.single_thread_rows = 100
    assert ran_with(ids[:65]) == 1

    # decode steps right after a pass on BLAS threads (its threads still spin) run but are
    # not timed: the first schedule stays untimed
    monkeypatch.setattr(CausalLM, "BLAS_SPIN_SECONDS", 3600.0)
    assert [ran_with(ids[:1]) for _ in range(3)] == [1, 1, 1]
    assert model._decode_choices[(1, 4)].seconds == {}
    monkeypatch.setattr(CausalLM, "BLAS_SPIN_SECONDS", 0.0)

    # decode steps: each schedule timed (the first step of all and the first after a switch
    # are warm-ups, run again), then the faster; the other re-timed after DECODE_RETIME_EVERY
    # steps, then (still slower) after twice as many
    assert [ran_with(ids[:1]) for _ in range(4)] == [1, 1, 4, 4]
    choice = model._decode_choices[(1, 4)]
    assert set(choice.seconds) == set(CausalLM.DECODE_SCHEDULES)
    for name, seconds in (("one thread", 2.0), ("BLAS threads", 1.0)):  # each estimate, through its runs
        for _ in range(choice.ESTIMATE_RUNS + 1):  # (the first after a switch is a warm-up)
            choice.timed(name, seconds)
    assert choice.seconds == {"one thread": 2.0, "BLAS threads": 1.0}
    runs = [ran_with(ids[:1]) for _ in range(2 * CausalLM.DECODE_RETIME_EVERY + 4)]
    assert runs.count(1) == 2 and runs.count(4) == len(runs) - 2  # one re-timing of two steps
    assert runs[CausalLM.DECODE_RETIME_EVERY - 1 : CausalLM.DECODE_RETIME_EVERY + 1] == [1, 1]
    two_rows = np.stack([ids[:1], ids[1:2]])
    assert [ran_with(two_rows) for _ in range(4)] == [1, 1, 4, 4]  # another batch size is timed on its own
    assert set(model._decode_choices) == {(1, 4), (2, 4)}

    monkeypatch.setattr(causal_lm, "blas_thread_count", lambda: 1)
    assert ran_with(ids[:1]) == 1  # one thread allowed: nothing to time
    monkeypatch.setattr(causal_lm, "blas_thread_count", lambda: 4)
    model.single_thread_decode = True
    assert ran_with(ids[:1]) == 1
    model.single_thread_decode = False
    assert ran_with(ids[:1]) == 0 and ran_with(ids[:50]) == 0
