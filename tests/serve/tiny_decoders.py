"""Decoders for the server's tests: tiny random Llama folders with a byte-level BPE
tokenizer.json and a chat template (attnkit's own weights, no torch), as `attnkit serve
--model PATH` serves them."""

from __future__ import annotations

import json

import pytest

TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_tiny_folder(folder, model):
    """`model` (a tiny_checkpoints.tiny_llama) as a folder with a tokenizer and chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from tiny_checkpoints import MERGES, SPECIAL, tiny_vocab, write_tiny_llama_folder

    write_tiny_llama_folder(folder, model)
    vocab = tiny_vocab()
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocab)},
                                     merges=[tuple(m.split(" ")) for m in MERGES]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "bos_token": "<|im_start|>", "pad_token": "<|endoftext|>", "chat_template": TEMPLATE,
    }))
    return folder


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny random Llama folder; its greedy text: "hehe..." (SmolLM2's is real)."""
    from tiny_checkpoints import tiny_llama

    return write_tiny_folder(tmp_path_factory.mktemp("tiny-llama"), tiny_llama(seed=3))


@pytest.fixture(scope="module")
def flat_folder(tmp_path_factory):
    """A tiny random Llama with flat logits (its embeddings scaled by 0.1: sampled answers differ
    by seed) and a context of 512 tokens."""
    import numpy as np

    from tiny_checkpoints import tiny_llama

    model = tiny_llama(seed=5, max_position_embeddings=512)
    model.embed.weight = model.embed.weight * np.float32(0.1)
    return write_tiny_folder(tmp_path_factory.mktemp("flat-llama"), model)


@pytest.fixture(scope="module")
def flat_gguf(tmp_path_factory):
    """The flat tiny Llama as a quantized GGUF file with the chat template: the decoder the
    compiled batched step runs (its invariance is bit for bit there)."""
    import numpy as np

    from tiny_checkpoints import tiny_llama, write_tiny_llama_gguf

    model = tiny_llama(seed=5, max_position_embeddings=512)
    model.embed.weight = model.embed.weight * np.float32(0.1)
    path = tmp_path_factory.mktemp("flat-gguf") / "flat.gguf"
    write_tiny_llama_gguf(path, model, extra=lambda writer, state: writer.add_chat_template(TEMPLATE))
    return path
