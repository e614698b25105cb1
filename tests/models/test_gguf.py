"""GGUF reading against transformers' own GGUF loader.

A tiny random Llama is written as a GGUF file with llama.cpp's conventions (query/key
rows permuted for its rotary layout; F32, F16, Q8_0, Q4_1 and Q5_0 tensors; a byte-level
BPE tokenizer and a chat template in the metadata). transformers loads that file with
`from_pretrained(folder, gguf_file=...)`, and attnkit must agree with it: logits, greedy
tokens, tokenizer, chat template. Bad files are rejected with clear errors.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from conftest import assert_within_budget, optional

from attnkit.models.chat import render_chat_template
from attnkit.models.auto import AutoCausalLM
from attnkit.models.gguf import GGUFFile, supported_tensor_types
from attnkit.models.llama import unpermute_rotary_rows

gguf = optional("gguf")  # tests that use gguf, torch or transformers ask for their fixtures
torch = optional("torch")
transformers = optional("transformers")

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n"]


def _byte_alphabet() -> list[str]:
    from tokenizers import pre_tokenizers

    return sorted(pre_tokenizers.ByteLevel.alphabet())


def _vocab() -> list[str]:
    tokens = SPECIAL + _byte_alphabet()
    for merge in MERGES:
        tokens.append(merge.replace(" ", ""))
    return tokens


def _llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q_proj/k_proj rows."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape
    )


TYPES = {  # which GGML type each kind of tensor is stored in
    "attn_q": "Q8_0",
    "attn_k": "F16",
    "attn_v": "Q4_1",
    "attn_output": "Q5_0",
    "ffn_gate": "Q4_1",
    "ffn_up": "Q8_0",
    "ffn_down": "F32",
}


def write_llama_gguf(path, hf_model, *, arch: str = "llama", bad_type_for: str | None = None) -> None:
    """Write `hf_model` (a transformers LlamaForCausalLM) as a GGUF file like llama.cpp would."""
    Q = gguf.GGMLQuantizationType
    config = hf_model.config
    tokens = _vocab()
    assert config.vocab_size == len(tokens)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    state = {k: v.detach().numpy().astype(np.float32) for k, v in hf_model.state_dict().items()}

    def put(name: str, array: np.ndarray, kind) -> None:
        if kind in (Q.F32,):
            writer.add_tensor(name, array.astype(np.float32))
        elif kind == Q.F16:
            writer.add_tensor(name, array.astype(np.float16))
        elif kind == Q.I32:
            writer.add_tensor(name, np.round(array * 100).astype(np.int32))
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)

    put("token_embd.weight", state["model.embed_tokens.weight"], Q.Q8_0)
    put("output_norm.weight", state["model.norm.weight"], Q.F32)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", state[p + "input_layernorm.weight"], Q.F32)
        put(f"blk.{i}.ffn_norm.weight", state[p + "post_attention_layernorm.weight"], Q.F32)
        weights = {
            "attn_q": _llama_cpp_permute(state[p + "self_attn.q_proj.weight"], config.num_attention_heads),
            "attn_k": _llama_cpp_permute(state[p + "self_attn.k_proj.weight"], config.num_key_value_heads),
            "attn_v": state[p + "self_attn.v_proj.weight"],
            "attn_output": state[p + "self_attn.o_proj.weight"],
            "ffn_gate": state[p + "mlp.gate_proj.weight"],
            "ffn_up": state[p + "mlp.up_proj.weight"],
            "ffn_down": state[p + "mlp.down_proj.weight"],
        }
        for short, array in weights.items():
            kind = Q.I32 if (bad_type_for == short and i == 0) else Q[TYPES[short]]
            put(f"blk.{i}.{short}.weight", array, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _tiny_hf_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(_vocab()),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    return model.eval()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, gguf, torch, transformers):
    """(path, transformers model loaded from the GGUF, transformers tokenizer, attnkit model)."""
    folder = tmp_path_factory.mktemp("gguf")
    path = folder / "tiny.gguf"
    write_llama_gguf(path, _tiny_hf_llama())
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=path.name, dtype=torch.float32)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file=path.name)
    ours = AutoCausalLM.from_pretrained(path)
    return path, hf.eval(), hf_tokenizer, ours


def test_metadata_and_config(tiny_gguf):
    path, _, _, ours = tiny_gguf
    assert AutoCausalLM.from_pretrained(path.parent).config == ours.config  # a folder with one .gguf
    file = GGUFFile(path)
    assert file.architecture == "llama"
    assert file.tensor_type("blk.0.attn_v.weight") == "Q4_1"
    assert file.tensor("blk.0.attn_q.weight").shape == (64, 64)  # (out, in) in NumPy order
    assert file.tensor("blk.0.ffn_gate.weight").shape == (96, 64)
    c = ours.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (2, 64, 4, 2, 16)
    assert c.tie_word_embeddings and c.rope_theta == 10000.0


def test_logits_match_transformers_gguf_loader(tiny_gguf, torch):
    _, hf, _, ours = tiny_gguf
    ids = np.random.default_rng(0).integers(0, ours.config.vocab_size, size=(2, 30))
    with torch.no_grad():
        ref = hf(torch.from_numpy(ids)).logits.numpy()
        truth = copy.deepcopy(hf).double()(torch.from_numpy(ids)).logits.numpy()  # same weights, float64
    logits = ours(ids)
    assert logits.dtype == np.float32
    # weights x4 make large logits: transformers float32 is ~1.1e-4 from its float64, attnkit ~1e-4
    assert_within_budget(logits, ref, truth, what="tiny GGUF llama logits")


def test_greedy_tokens_match_transformers_gguf_loader(tiny_gguf, torch):
    _, hf, _, ours = tiny_gguf
    ids = np.array([[40, 50, 60, 70, 80]])
    with torch.no_grad():
        ref = hf.generate(torch.from_numpy(ids), max_new_tokens=24, do_sample=False, eos_token_id=None,
                          pad_token_id=2).numpy()
    np.testing.assert_array_equal(ours.generate(ids, 24, stop=()), ref)


TEXTS = [
    "the theater is in the north",
    " hello  there\n\nnew line\tand tab",
    "<|im_start|>user\nthe<|im_end|>",
    "café naïve 日本語 🙂",
    "",
]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers(tiny_gguf, text):
    _, _, hf_tokenizer, ours = tiny_gguf
    expected = hf_tokenizer(text, add_special_tokens=True)["input_ids"]
    assert ours.tokenizer.encode(text) == expected
    assert ours.tokenizer.decode(expected) == hf_tokenizer.decode(expected)


def test_special_tokens_stay_whole(tiny_gguf):
    _, _, _, ours = tiny_gguf
    ids = ours.tokenizer.encode("<|im_start|>the<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert ours.tokenizer.eos_token_id == 2 and ours.tokenizer.bos_token_id == 1


def test_chat_template_matches_transformers(tiny_gguf):
    _, _, hf_tokenizer, ours = tiny_gguf
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "the north?"},
        {"role": "assistant", "content": "in"},
        {"role": "user", "content": "ok"},
    ]
    for add in (True, False):
        expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
        assert ours.tokenizer.apply_chat_template(messages, add_generation_prompt=add) == expected


def test_unpermute_inverts_llama_cpp_permutation():
    rng = np.random.default_rng(0)
    for heads in (1, 3, 9):
        weight = rng.standard_normal((heads * 8, 5))
        np.testing.assert_array_equal(unpermute_rotary_rows(_llama_cpp_permute(weight, heads), heads), weight)


def test_supported_types_include_the_common_ones(gguf):
    names = supported_tensor_types()
    for name in ("F32", "F16", "Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"):
        assert name in names
    assert "I32" not in names


# ----------------------------------------------------------------------------- bad files


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip, not a gguf")
    with pytest.raises(ValueError, match="magic bytes b'GGUF'"):
        AutoCausalLM.from_pretrained(path)
    with pytest.raises(ValueError, match="GGUF"):
        GGUFFile(tmp_path / "missing.gguf")


def test_truncated_gguf_file(tmp_path, gguf):
    path = tmp_path / "cut.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(ValueError, match="could not read GGUF"):
        GGUFFile(path)


def test_unsupported_architecture(tmp_path, gguf, torch, transformers):
    path = tmp_path / "other.gguf"
    write_llama_gguf(path, _tiny_hf_llama(), arch="falcon")
    with pytest.raises(ValueError, match="architecture 'llama' or 'qwen2' or 'gemma3', got 'falcon'"):
        AutoCausalLM.from_pretrained(path)


def test_unsupported_tensor_type(tmp_path, gguf, torch, transformers):
    path = tmp_path / "int.gguf"
    write_llama_gguf(path, _tiny_hf_llama(), bad_type_for="ffn_up")
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight.*I32.*expected one of"):
        AutoCausalLM.from_pretrained(path)


def test_render_chat_template_rejects_bad_messages():
    with pytest.raises(ValueError, match="role"):
        render_chat_template(CHAT_TEMPLATE, [{"content": "no role"}])
