"""Tiny random checkpoints written with the format libraries themselves (gguf's writer,
safetensors' NumPy API), no torch: for the robustness and fuzz tests of the readers.

    write_tiny_llama_gguf(path)        # a Llama GGUF (Q8_0, Q4_1, F16, F32 tensors, BPE tokenizer)
    write_tiny_llama_folder(folder)    # the same kind of model as config.json + model.safetensors
    tensor_entry_offsets(path)         # where each tensor-info entry's type and offset fields are
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from attnkit.models.llama import LlamaConfig, LlamaForCausalLM

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]


def tiny_vocab() -> list[str]:
    from tokenizers import pre_tokenizers

    return SPECIAL + sorted(pre_tokenizers.ByteLevel.alphabet()) + [m.replace(" ", "") for m in MERGES]


def tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A random attnkit Llama whose sizes suit every GGUF block type (multiples of 32)."""
    config = LlamaConfig(**{
        "vocab_size": len(tiny_vocab()), "hidden_size": 64, "intermediate_size": 96, "num_layers": 2,
        "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "rope_theta": 10000.0, "max_position_embeddings": 128,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": (2,), **overrides,
    })
    return LlamaForCausalLM(config, seed=seed)


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's row order for q/k (the inverse of `unpermute_rotary_rows`)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape
    )


GGUF_TYPES = {"attn_q": "Q8_0", "attn_k": "F16", "attn_v": "Q4_1", "attn_output": "Q8_0",
              "ffn_gate": "Q4_1", "ffn_up": "Q8_0", "ffn_down": "F32"}


def write_tiny_llama_gguf(path, model: LlamaForCausalLM | None = None, *, arch: str = "llama",
                          extra=None, types: dict | None = None, big_endian: bool = False) -> LlamaForCausalLM:
    """Write `model` (default `tiny_llama()`) as a llama.cpp-style GGUF; returns the model.

    `extra(writer, state)` may add keys or tensors before the file is written; `types` maps
    "token_embd" and the matrices' short names to GGML types (default Q8_0 and `GGUF_TYPES`);
    `big_endian` writes the file with the gguf package's `GGUFEndian.BIG`."""
    import gguf

    model = model or tiny_llama()
    c = model.config
    Q = gguf.GGMLQuantizationType
    state = {k: np.asarray(v, np.float32) for k, v in model.state_dict().items()}
    tokens = tiny_vocab()
    types = {"token_embd": "Q8_0", **GGUF_TYPES, **(types or {})}
    endianess = gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE
    writer = gguf.GGUFWriter(str(path), arch, endianess=endianess)
    writer.add_block_count(c.num_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_heads)
    writer.add_head_count_kv(c.num_kv_heads)
    writer.add_rope_freq_base(float(c.rope_theta))
    writer.add_layer_norm_rms_eps(float(c.rms_norm_eps))
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def put(name, array, kind):
        if kind == Q.F32:
            writer.add_tensor(name, array.astype(np.float32))
        elif kind == Q.F16:
            writer.add_tensor(name, array.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)

    put("token_embd.weight", state["embed.weight"], Q[types["token_embd"]])
    for i in range(c.num_layers):
        p = f"layers.{i}."
        put(f"blk.{i}.attn_norm.weight", state[p + "attn_norm.weight"], Q.F32)
        weights = {
            "attn_q": _permute(state[p + "attn.q_proj.weight"], c.num_heads),
            "attn_k": _permute(state[p + "attn.k_proj.weight"], c.num_kv_heads),
            "attn_v": state[p + "attn.v_proj.weight"],
            "attn_output": state[p + "attn.out_proj.weight"],
            "ffn_gate": state[p + "mlp.gate_proj.weight"],
            "ffn_up": state[p + "mlp.up_proj.weight"],
            "ffn_down": state[p + "mlp.down_proj.weight"],
        }
        for short, array in weights.items():
            put(f"blk.{i}.{short}.weight", array, Q[types[short]])
        put(f"blk.{i}.ffn_norm.weight", state[p + "mlp_norm.weight"], Q.F32)
    put("output_norm.weight", state["norm.weight"], Q.F32)
    if extra is not None:
        extra(writer, state)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


def write_tiny_llama_folder(folder, model: LlamaForCausalLM | None = None) -> LlamaForCausalLM:
    """Write `model` as a Hugging Face Llama folder (config.json + model.safetensors)."""
    from safetensors.numpy import save_file

    model = model or tiny_llama()
    c = model.config
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "llama", "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "rope_theta": c.rope_theta, "rms_norm_eps": c.rms_norm_eps, "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
    }
    (folder / "config.json").write_text(json.dumps(config))
    names = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    state = {}
    for name, value in model.state_dict().items():
        hf = names.get(name)
        if hf is None:
            hf = "model." + (name.replace("attn_norm", "input_layernorm").replace("mlp_norm", "post_attention_layernorm")
                             .replace("attn.", "self_attn.").replace("out_proj", "o_proj"))
        state[hf] = np.ascontiguousarray(value, np.float32)
    save_file(state, str(folder / "model.safetensors"))
    return model


def tensor_entry_offsets(path) -> dict[str, dict[str, int]]:
    """tensor name -> byte positions in the file of its tensor-info fields ("dims", "type",
    "offset") and the reader's `data_start` and `alignment`."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    out = {}
    for tensor in reader.tensors:
        parts = tensor.field.parts  # name_len, name, n_dims, dims, type, offset
        start = tensor.field.offset
        sizes = [int(p.nbytes) for p in parts]
        out[tensor.name] = {
            "dims": start + sum(sizes[:3]),
            "type": start + sum(sizes[:4]),
            "offset": start + sum(sizes[:5]),
            "entry_end": start + sum(sizes),
        }
    out["_"] = {"data_start": int(reader.data_offset), "alignment": int(reader.alignment)}
    return out
