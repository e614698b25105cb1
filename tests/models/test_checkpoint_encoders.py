"""Encoder checkpoints as users have them, against sentence-transformers and transformers.

Small random BERTs saved by transformers (`save_pretrained`) and wrapped by the
installed sentence-transformers (`SentenceTransformer(modules=[...]).save`) in
every layout it writes: the >= 6 pooling file (`{"pooling_mode": "cls"}`) and
the older one-boolean-per-mode file, every pooling mode, Dense and Normalize
modules, `max_seq_length` in sentence_bert_config.json or as tokenizer_config.json's
`model_max_length`. Each is compared with sentence-transformers reading the same
folder, within FlashAttention's budget: attnkit's float32 error against the float64
truth (the same SentenceTransformer `.double()`) at most 2x sentence-transformers'
float32 error plus 8 ulps. Broken and unsupported folders must be refused with a
CheckpointError (a ValueError) that names the file and the key or tensor, and a
config that disagrees with the weights must be refused before anything is allocated.
"""

from __future__ import annotations

import copy
import json
import shutil
import tracemalloc
import warnings

import numpy as np
import pytest
from conftest import assert_within_budget
from safetensors.numpy import load_file, save_file

from attnkit.models import CheckpointError, SentenceEncoder
from attnkit.models.bert import BertConfig, BertModel, bert_shapes, load_bert
from attnkit.models.sentence import POOLING_MODES, Dense, Normalize, Pooling, SentenceHead

WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "##s", "big", ".", ",", "!", "?", "red", "The", "CAT"]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS + [f"w{i}" for i in range(40)]
HIDDEN, MAX_POSITIONS = 32, 64
LONG = "cats? dogs, the big red dog ran on the mat! " * 8  # ~100 word pieces: truncated
TEXTS = ["the cat sat on the mat.", "a big red dog ran!", "", LONG, "w1 w2 w3 w4 w5 w6 w7 w8 w9", "dog"]
LEGACY_POOLING_KEYS = {
    "cls": "pooling_mode_cls_token",
    "max": "pooling_mode_max_tokens",
    "mean": "pooling_mode_mean_tokens",
    "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens",
    "weightedmean": "pooling_mode_weightedmean_tokens",
    "lasttoken": "pooling_mode_lasttoken",
}


# ----------------------------------------------------------------------------- folders


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory, torch, transformers):
    """A random 2-layer BertModel saved by transformers, with a vocab.txt."""
    folder = tmp_path_factory.mktemp("bert")
    config = transformers.BertConfig(
        vocab_size=len(VOCAB), hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=37, max_position_embeddings=MAX_POSITIONS, layer_norm_eps=1e-7,
    )
    torch.manual_seed(0)
    transformers.BertModel(config).eval().save_pretrained(folder)
    (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    return folder


@pytest.fixture(scope="module")
def st_modules(sentence_transformers):
    """sentence-transformers' module classes, wherever the installed version keeps them."""
    try:
        from sentence_transformers.sentence_transformer import modules
    except ImportError:  # sentence-transformers < 6
        modules = sentence_transformers.models
    return modules


@pytest.fixture(scope="module")
def save_st(bert_folder, st_modules, sentence_transformers, torch, tmp_path_factory):
    """save_st(pooling="mean", after=(), max_seq_length=24) -> a fresh copy of a folder written by
    SentenceTransformer.save; `after` lists ("dense", kwargs) and ("normalize",) modules. Each
    distinct folder is saved once and copied (tests edit their copy)."""
    saved = {}

    def save(pooling="mean", after=(), max_seq_length=24, seed=0):
        key = repr((pooling, after, max_seq_length, seed))
        if key not in saved:
            saved[key] = build(pooling, after, max_seq_length, seed)
        target = tmp_path_factory.mktemp("st_copy")
        shutil.copytree(saved[key], target, dirs_exist_ok=True)
        return target

    def build(pooling, after, max_seq_length, seed):
        torch.manual_seed(seed)
        modules = [
            st_modules.Transformer(str(bert_folder), max_seq_length=max_seq_length),
            st_modules.Pooling(HIDDEN, pooling_mode=pooling),
        ]
        width = HIDDEN
        for kind, *kwargs in after:
            if kind == "dense":
                kwargs = dict(kwargs[0])
                if isinstance(kwargs.get("activation_function"), str):
                    kwargs["activation_function"] = getattr(torch.nn, kwargs["activation_function"])()
                modules.append(st_modules.Dense(width, **kwargs))
                width = kwargs["out_features"]
            else:
                modules.append(st_modules.Normalize())
        folder = tmp_path_factory.mktemp("st")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sentence_transformers.SentenceTransformer(modules=modules, device="cpu").save(str(folder))
        return folder

    return save


def st_embeddings(sentence_transformers, folder, texts=TEXTS):
    """(sentence-transformers' float32 embeddings, its float64 embeddings, the float32 model)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = sentence_transformers.SentenceTransformer(str(folder), device="cpu")
        model64 = copy.deepcopy(model).double()  # the same model read from the same files, in float64
        theirs = model.encode(texts, convert_to_numpy=True, batch_size=4)
        truth = model64.encode(texts, convert_to_numpy=True, batch_size=4)
    assert truth.dtype == np.float64
    return theirs, truth, model


def assert_matches_st(sentence_transformers, folder, what, texts=TEXTS):
    """Load `folder` with attnkit and sentence-transformers; embeddings within budget."""
    encoder = SentenceEncoder.from_pretrained(folder, num_threads=2)
    theirs, truth, model = st_embeddings(sentence_transformers, folder, texts)
    ours = encoder.encode(texts, batch_size=4)
    assert ours.dtype == np.float32 and ours.shape == theirs.shape == (len(texts), encoder.dim)
    assert encoder.max_seq_length == model.max_seq_length
    assert_within_budget(ours, theirs, truth, what=what)
    return encoder, model


def edit_json(path, change=None, **values):
    settings = json.loads(path.read_text()) if path.is_file() else {}
    if change is not None:
        change(settings)
    settings.update(values)
    path.write_text(json.dumps(settings))


def copy_folder(folder, tmp_path, name="copy"):
    target = tmp_path / name
    shutil.copytree(folder, target)
    return target


def legacy_pooling(modes):
    """The one-boolean-per-mode Pooling config of sentence-transformers < 6."""
    return {"word_embedding_dimension": HIDDEN, **{key: mode in modes for mode, key in LEGACY_POOLING_KEYS.items()}}


# ----------------------------------------------------------------------------- case 7: pooling


@pytest.mark.parametrize("mode", POOLING_MODES)
def test_every_pooling_mode_in_both_formats(mode, save_st, sentence_transformers, tmp_path):
    folder = save_st(pooling=mode)
    settings = json.loads((folder / "1_Pooling" / "config.json").read_text())
    assert settings["pooling_mode"] == mode  # the installed (>= 6) format
    encoder, _ = assert_matches_st(sentence_transformers, folder, f"{mode} pooling, pooling_mode format")
    assert encoder.pooling == mode and not encoder.normalize
    # the same folder with the older format, as sentence-transformers < 6 wrote it
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(legacy_pooling({mode})))
    encoder, _ = assert_matches_st(sentence_transformers, folder, f"{mode} pooling, boolean format")
    assert encoder.pooling == mode


def test_concatenated_pooling_modes(save_st, sentence_transformers):
    folder = save_st(pooling="mean")
    # several true booleans concatenate in sentence-transformers' fixed order: cls, max, mean, ...
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(legacy_pooling({"mean", "cls", "max"})))
    encoder, _ = assert_matches_st(sentence_transformers, folder, "cls+max+mean pooling, boolean format")
    assert encoder.pooling == "cls+max+mean" and encoder.dim == 3 * HIDDEN
    # a list in the >= 6 format keeps its own order
    edit_json(folder / "1_Pooling" / "config.json", change=lambda s: s.clear(),
              embedding_dimension=HIDDEN, pooling_mode=["lasttoken", "weightedmean"])
    encoder, _ = assert_matches_st(sentence_transformers, folder, "lasttoken+weightedmean pooling")
    assert encoder.pooling == "lasttoken+weightedmean"


def test_no_true_boolean_means_mean(save_st, sentence_transformers):
    folder = save_st(pooling="cls")
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(legacy_pooling(set())))
    encoder, _ = assert_matches_st(sentence_transformers, folder, "no mode set: mean")
    assert encoder.pooling == "mean"


# ----------------------------------------------------------------------------- case 7: Dense, Normalize


DENSE_CASES = {
    "tanh (default)": [("dense", {"out_features": 16}), ("normalize",)],
    "identity, no bias": [("dense", {"out_features": 24, "bias": False, "activation_function": "Identity"})],
    "relu, residual": [("dense", {"out_features": HIDDEN, "activation_function": "ReLU", "use_residual": True})],
    "gelu, projected residual": [
        ("dense", {"out_features": 20, "activation_function": "GELU", "use_residual": True}), ("normalize",)
    ],
    "sigmoid then tanh": [
        ("dense", {"out_features": 8, "activation_function": "Sigmoid"}), ("dense", {"out_features": 5}),
    ],
    "normalize before dense": [("normalize",), ("dense", {"out_features": 12})],
}


@pytest.mark.parametrize("case", DENSE_CASES)
def test_dense_and_normalize_modules(case, save_st, sentence_transformers):
    after = DENSE_CASES[case]
    folder = save_st(pooling="mean", after=after, seed=1)
    assert (folder / "modules.json").is_file()
    dense_files = sorted(folder.glob("*_Dense/model.safetensors"))
    assert len(dense_files) == sum(kind == "dense" for kind, *_ in after)
    encoder, _ = assert_matches_st(sentence_transformers, folder, f"Dense: {case}")
    assert encoder.normalize == (after[-1] == ("normalize",))
    assert len(encoder.head.modules) == len(after)


def test_mean_then_normalize_with_cls_dense(save_st, sentence_transformers):
    """The issue's own layout: {"pooling_mode": "cls"} plus Dense and Normalize, written by >= 6."""
    folder = save_st(pooling="cls", after=[("dense", {"out_features": 16}), ("normalize",)], seed=2)
    assert json.loads((folder / "1_Pooling" / "config.json").read_text())["pooling_mode"] == "cls"
    encoder, _ = assert_matches_st(sentence_transformers, folder, "cls + Dense + Normalize")
    assert encoder.normalize and encoder.dim == 16
    assert np.allclose(np.linalg.norm(encoder.encode(TEXTS), axis=1), 1.0, atol=1e-6)


# ----------------------------------------------------------------------------- case 7: max_seq_length


def test_max_seq_length_as_model_max_length(save_st, sentence_transformers):
    """sentence-transformers >= 6 keeps max_seq_length only as tokenizer_config.json's model_max_length."""
    folder = save_st(max_seq_length=24)
    assert "max_seq_length" not in json.loads((folder / "sentence_bert_config.json").read_text())
    assert json.loads((folder / "tokenizer_config.json").read_text())["model_max_length"] == 24
    encoder, model = assert_matches_st(sentence_transformers, folder, "max_seq_length from tokenizer_config.json")
    assert encoder.max_seq_length == model.max_seq_length == 24
    assert len(encoder.tokens(LONG)) == 24 < MAX_POSITIONS


def test_max_seq_length_in_sentence_bert_config(save_st, sentence_transformers):
    """Older folders keep it in sentence_bert_config.json, which wins over the tokenizer's."""
    folder = save_st(max_seq_length=24)
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 12, "do_lower_case": False}))
    encoder, model = assert_matches_st(sentence_transformers, folder, "max_seq_length from sentence_bert_config.json")
    assert encoder.max_seq_length == model.max_seq_length == 12
    # a tokenizer limit beyond the position table is capped at it, as sentence-transformers does
    (folder / "sentence_bert_config.json").write_text(json.dumps({}))
    edit_json(folder / "tokenizer_config.json", model_max_length=512)
    encoder, model = assert_matches_st(sentence_transformers, folder, "model_max_length capped")
    assert encoder.max_seq_length == model.max_seq_length == MAX_POSITIONS


def test_max_seq_length_beyond_positions_is_refused(save_st, tmp_path):
    folder = save_st()
    edit_json(folder / "sentence_bert_config.json", max_seq_length=MAX_POSITIONS + 1)
    with pytest.raises(CheckpointError, match=f"max_seq_length={MAX_POSITIONS + 1} in .*sentence_bert_config.json "
                       f"exceeds the model's max_position_embeddings={MAX_POSITIONS}"):
        SentenceEncoder.from_pretrained(folder)


def test_plain_folder_reads_model_max_length(bert_folder, tmp_path):
    folder = copy_folder(bert_folder, tmp_path)
    assert SentenceEncoder.from_pretrained(folder).max_seq_length == MAX_POSITIONS
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 10}))
    encoder = SentenceEncoder.from_pretrained(folder)
    assert encoder.max_seq_length == 10 and len(encoder.tokens(LONG)) == 10
    assert (encoder.pooling, encoder.normalize) == ("mean", True)  # attnkit's documented default


def test_truncation_side_left(save_st, sentence_transformers):
    folder = save_st(max_seq_length=16)
    edit_json(folder / "tokenizer_config.json", truncation_side="left")
    encoder, _ = assert_matches_st(sentence_transformers, folder, "truncation_side left")
    tokens = encoder.tokens(LONG)
    assert len(tokens) == 16 and tokens[0] == "[CLS]" and tokens[-1] == "[SEP]"


def test_lowercasing_as_transformers_and_sentence_transformers(save_st, sentence_transformers, transformers):
    folder = save_st(max_seq_length=24)
    texts = ["The CAT sat", "THE cat", "the Cat"]
    # tokenizer_config.json's do_lower_case wins over tokenizer.json's normalizer (transformers' BertTokenizer)
    edit_json(folder / "tokenizer_config.json", do_lower_case=False)
    encoder = SentenceEncoder.from_pretrained(folder)
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    for text in texts:
        assert encoder.tokens(text) == reference.convert_ids_to_tokens(reference(text)["input_ids"])
    assert encoder.tokens("The CAT") == ["[CLS]", "The", "CAT", "[SEP]"]
    assert_matches_st(sentence_transformers, folder, "cased tokenizer", texts)
    # sentence_bert_config.json's do_lower_case lower-cases on top of a cased tokenizer
    edit_json(folder / "sentence_bert_config.json", do_lower_case=True)
    encoder, _ = assert_matches_st(sentence_transformers, folder, "do_lower_case in sentence_bert_config", texts)
    assert encoder.tokens("The CAT") == ["[CLS]", "the", "cat", "[SEP]"]


# ----------------------------------------------------------------------------- config_sentence_transformers.json


@pytest.mark.parametrize("function", ["cosine", "dot", "euclidean", "manhattan"])
def test_similarity_function(function, save_st, sentence_transformers, torch):
    folder = save_st(after=[("dense", {"out_features": 16})], seed=3)
    edit_json(folder / "config_sentence_transformers.json", similarity_fn_name=function)
    theirs, truth, model = st_embeddings(sentence_transformers, folder)
    assert model.similarity_fn_name == function
    encoder = SentenceEncoder.from_pretrained(folder)
    ours = encoder.similarity(TEXTS)
    with torch.no_grad():
        their_matrix = model.similarity(torch.from_numpy(theirs), torch.from_numpy(theirs)).numpy()
        true_matrix = model.similarity(torch.from_numpy(truth), torch.from_numpy(truth)).numpy()
    assert_within_budget(ours, their_matrix, true_matrix, what=f"{function} similarity")


def test_truncate_dim(save_st, sentence_transformers):
    folder = save_st(after=[("normalize",)], seed=4)
    edit_json(folder / "config_sentence_transformers.json", truncate_dim=10)
    encoder, _ = assert_matches_st(sentence_transformers, folder, "truncate_dim 10")
    assert encoder.dim == 10 and not encoder.normalize


def test_default_prompt_is_refused(save_st):
    folder = save_st()
    path = folder / "config_sentence_transformers.json"
    assert json.loads(path.read_text())["default_prompt_name"] is None
    edit_json(path, prompts={"query": "query: ", "document": ""}, default_prompt_name="document")
    SentenceEncoder.from_pretrained(folder)  # an empty prompt changes nothing
    edit_json(path, default_prompt_name="query")
    with pytest.raises(CheckpointError, match="unsupported default_prompt_name 'query' in .*config_sentence_transformers"):
        SentenceEncoder.from_pretrained(folder)


# ----------------------------------------------------------------------------- refusals: modules


def _module(kind, path):
    return {"idx": 0, "name": path, "path": path, "type": kind}


@pytest.mark.parametrize(
    "module",
    [
        "sentence_transformers.sentence_transformer.modules.layer_norm.LayerNorm",
        "sentence_transformers.models.WeightedLayerPooling",
        "sentence_transformers.models.Dropout",
        "my_package.modules.Dense",  # a Dense that is not sentence-transformers'
    ],
)
def test_unknown_module_is_refused_by_name(module, save_st):
    folder = save_st(after=[("normalize",)])
    modules = json.loads((folder / "modules.json").read_text())
    modules.insert(2, _module(module, "2_Extra"))
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(CheckpointError) as info:
        SentenceEncoder.from_pretrained(folder)
    message = str(info.value)
    assert f"unsupported sentence-transformers module {module!r}" in message
    assert "modules.json" in message and "'2_Extra'" in message


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda m: m.pop(1), "unsupported module order ['Transformer', 'Normalize']"),
        (lambda m: m.reverse(), "unsupported module order"),
        (lambda m: m[1].update(path="../../elsewhere"), "points outside the folder"),
        (lambda m: m[1].pop("type"), "needs a string 'type'"),
        (lambda m: m.clear(), "expected a non-empty JSON list"),
    ],
)
def test_broken_modules_json(change, words, save_st):
    folder = save_st(after=[("normalize",)])
    modules = json.loads((folder / "modules.json").read_text())
    change(modules)
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(CheckpointError, match="modules.json") as info:
        SentenceEncoder.from_pretrained(folder)
    assert words in str(info.value)


@pytest.mark.parametrize(
    "settings, words",
    [
        ({"pooling_mode": "median"}, "unsupported pooling_mode 'median'"),
        ({"pooling_mode": ["mean", "sum"]}, "unsupported pooling_mode 'sum'"),
        ({"pooling_mode": 3}, "unexpected pooling_mode=3"),
        ({"pooling_mode_median_tokens": True}, "unsupported key(s) ['pooling_mode_median_tokens']"),
        ({"pooling_mode": "mean", "embedding_dimension": 48}, "embedding_dimension=48"),
        ({"pooling_mode_mean_tokens": "yes"}, "unexpected pooling_mode_mean_tokens='yes'"),
        ({"pooling_mode": "mean", "include_prompt": "no"}, "unexpected include_prompt='no'"),
    ],
)
def test_bad_pooling_config(settings, words, save_st):
    folder = save_st()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(settings))
    with pytest.raises(CheckpointError, match=r"1_Pooling/config.json") as info:
        SentenceEncoder.from_pretrained(folder)
    assert words in str(info.value)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"activation_function": "torch.nn.modules.activation.Softplus"}, "unsupported activation_function"),
        ({"activation_function": "my_package.Swish"}, "unsupported activation_function 'my_package.Swish'"),
        ({"in_features": 31}, "in_features=31"),
        ({"out_features": 0}, "unexpected out_features=0"),
        ({"module_input_name": "token_embeddings"}, "unsupported module_input_name 'token_embeddings'"),
        ({"scale": 2.0}, "unsupported key(s) ['scale']"),
    ],
)
def test_bad_dense_config(change, words, save_st):
    folder = save_st(after=[("dense", {"out_features": 16})])
    edit_json(folder / "2_Dense" / "config.json", **change)
    with pytest.raises(CheckpointError, match="2_Dense/config.json") as info:
        SentenceEncoder.from_pretrained(folder)
    assert words in str(info.value)


def test_dense_weights_follow_the_one_rule(save_st):
    folder = save_st(after=[("dense", {"out_features": 16})])
    path = folder / "2_Dense" / "model.safetensors"
    tensors = load_file(str(path))
    save_file({**tensors, "linear.scale": np.ones(16, np.float32)}, str(path))
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) in .*2_Dense/model.safetensors: 'linear.scale'"):
        SentenceEncoder.from_pretrained(folder)
    save_file({"linear.weight": tensors["linear.weight"][:, :8].copy()}, str(path))
    with pytest.raises(CheckpointError, match=r"2_Dense/model.safetensors: missing tensor\(s\): 'linear.bias'; .*"
                       r"'linear.weight' has shape \(16, 8\), expected \(16, 32\)"):
        SentenceEncoder.from_pretrained(folder)
    path.unlink()
    (folder / "2_Dense" / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(CheckpointError, match="no weights in .*2_Dense.*pickle weights"):
        SentenceEncoder.from_pretrained(folder)


@pytest.mark.parametrize(
    "settings, words",
    [
        ({"transformer_task": "fill-mask"}, "unsupported transformer_task 'fill-mask'"),
        ({"module_output_name": "sentence_embedding"}, "unsupported module_output_name"),
        ({"config_kwargs": {"num_hidden_layers": 1}}, "unsupported config_kwargs"),
        ({"model_kwargs": {"add_pooling_layer": True}}, "unsupported model_kwargs ['add_pooling_layer']"),
        ({"tokenizer_args": {"do_basic_tokenize": False}}, "unsupported tokenizer_args ['do_basic_tokenize']"),
        ({"backend": "onnx"}, "unsupported backend 'onnx'"),
        ({"max_seq_length": 0}, "unexpected max_seq_length=0"),
        ({"do_lower_case": 1}, "unexpected do_lower_case=1"),
        ({"modality_config": {"text": {"method": "forward", "method_output_name": "pooler_output"}}},
         "unsupported modality_config"),
        ({"pooling": "first"}, "unsupported key(s) ['pooling']"),
    ],
)
def test_bad_sentence_bert_config(settings, words, save_st):
    folder = save_st()
    edit_json(folder / "sentence_bert_config.json", **settings)
    with pytest.raises(CheckpointError, match="sentence_bert_config.json") as info:
        SentenceEncoder.from_pretrained(folder)
    assert words in str(info.value)


@pytest.mark.parametrize(
    "settings, file, words",
    [
        ({"model_type": "SparseEncoder"}, "config_sentence_transformers.json",
         "unsupported model_type 'SparseEncoder'"),
        ({"similarity_fn_name": "maxsim"}, "config_sentence_transformers.json", "unsupported similarity_fn_name"),
        ({"truncate_dim": -3}, "config_sentence_transformers.json", "unexpected truncate_dim=-3"),
        ({"padding_side": "left"}, "tokenizer_config.json", "unsupported padding_side 'left'"),
        ({"truncation_side": "middle"}, "tokenizer_config.json", "unsupported truncation_side 'middle'"),
        ({"tokenizer_class": "XLMRobertaTokenizer"}, "tokenizer_config.json", "unsupported tokenizer_class"),
        ({"model_max_length": "long"}, "tokenizer_config.json", "unexpected model_max_length='long'"),
    ],
)
def test_bad_settings_elsewhere(settings, file, words, save_st):
    folder = save_st()
    edit_json(folder / file, **settings)
    with pytest.raises(CheckpointError, match=file) as info:
        SentenceEncoder.from_pretrained(folder)
    assert words in str(info.value)


def test_old_layout_with_the_transformer_in_a_subfolder(save_st, sentence_transformers, tmp_path):
    """sentence-transformers < 2 kept the encoder in 0_Transformer/ (modules.json says where)."""
    folder = save_st(pooling="max", after=[("normalize",)])
    sub = folder / "0_Transformer"
    sub.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "sentence_bert_config.json"):
        (folder / name).rename(sub / name)
    modules = json.loads((folder / "modules.json").read_text())
    modules[0]["path"] = "0_Transformer"
    (folder / "modules.json").write_text(json.dumps(modules))
    assert_matches_st(sentence_transformers, folder, "encoder in 0_Transformer/")


# ----------------------------------------------------------------------------- BERT config validation


def _with_config(folder, tmp_path, **change):
    target = copy_folder(folder, tmp_path)
    config = json.loads((target / "config.json").read_text())
    for key, value in change.items():
        if value is _DROP:
            config.pop(key)
        else:
            config[key] = value
    (target / "config.json").write_text(json.dumps(config))
    return target


_DROP = object()


@pytest.mark.parametrize(
    "change, words",
    [
        ({"num_attention_heads": 0}, "unexpected num_attention_heads=0 in .*config.json; expected a positive int"),
        ({"num_attention_heads": 5}, "hidden_size=32 is not divisible by num_attention_heads=5 in .*config.json"),
        ({"num_attention_heads": -4}, "unexpected num_attention_heads=-4"),
        ({"num_attention_heads": 4.0}, "unexpected num_attention_heads=4.0"),
        ({"num_attention_heads": True}, "unexpected num_attention_heads=True"),
        ({"num_attention_heads": _DROP}, r"missing key\(s\) \['num_attention_heads'\] in .*config.json"),
        ({"hidden_size": _DROP}, r"missing key\(s\) \['hidden_size'\]"),
        ({"vocab_size": _DROP, "intermediate_size": _DROP}, r"missing key\(s\) \['vocab_size', 'intermediate_size'\]"),
        ({"max_position_embeddings": _DROP}, r"missing key\(s\) \['max_position_embeddings'\]"),
        ({"num_hidden_layers": _DROP}, r"missing key\(s\) \['num_hidden_layers'\]"),
        ({"layer_norm_eps": "1e-12"}, "unexpected layer_norm_eps='1e-12'"),
        ({"model_type": _DROP}, "unsupported architecture in .*config.json"),
        ({"model_type": "roberta"}, "expected model_type 'bert'"),
        ({"position_embedding_type": "relative_key"}, "unsupported position_embedding_type 'relative_key'"),
        ({"position_embedding_type": "rotary"}, "unsupported position_embedding_type 'rotary'"),
        ({"hidden_act": "gelu_new"}, "unsupported hidden_act 'gelu_new'"),
        ({"hidden_act": "relu"}, "unsupported hidden_act 'relu'"),
        ({"is_decoder": True}, "unsupported is_decoder True"),
        ({"add_cross_attention": True}, "unsupported add_cross_attention True"),
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, "unsupported quantization_config"),
        ({"rope_theta": 10000.0}, r"does not know the key\(s\) 'rope_theta'"),
        ({"embedding_size": 16}, r"does not know the key\(s\) 'embedding_size'"),
    ],
)
def test_bad_bert_config_is_refused_by_name(change, words, bert_folder, tmp_path):
    folder = _with_config(bert_folder, tmp_path, **change)
    with pytest.raises(CheckpointError, match=words) as info:
        load_bert(folder)
    assert str(folder / "config.json") in str(info.value)
    with pytest.raises(ValueError):
        SentenceEncoder.from_pretrained(folder)


@pytest.mark.parametrize(
    "key, value, tensor",
    [
        ("hidden_size", 12_000_000, "embeddings.word_embeddings.weight"),
        ("vocab_size", 10**9, "embeddings.word_embeddings.weight"),
        ("intermediate_size", 36, "encoder.layer.0.intermediate.dense.weight"),
        ("max_position_embeddings", 128, "embeddings.position_embeddings.weight"),
        ("type_vocab_size", 3, "embeddings.token_type_embeddings.weight"),
        ("hidden_size", 64, "embeddings.word_embeddings.weight"),
    ],
)
def test_sizes_that_disagree_with_the_tensors(key, value, tensor, bert_folder, tmp_path):
    """Refused from the safetensors header, naming the key and the tensor, before anything is allocated."""
    folder = _with_config(bert_folder, tmp_path, **{key: value})
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError) as info:
            SentenceEncoder.from_pretrained(folder)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    message = str(info.value)
    config, weights = folder / "config.json", folder / "model.safetensors"
    assert f"{key}={value} in {config} disagrees with the weights in {weights}" in message
    assert f"tensor {tensor!r}" in message and "has shape" in message and "expected" in message
    assert peak < 4 * 2**20, f"{peak / 2**20:.1f} MiB allocated before the config was refused"


def test_layer_count_that_disagrees(bert_folder, tmp_path):
    folder = _with_config(bert_folder, tmp_path, num_hidden_layers=1)
    with pytest.raises(CheckpointError, match=r"num_hidden_layers=1 in .*config.json disagrees with the weights in "
                       r".*model.safetensors: they hold layers up to encoder.layer.1, so expected num_hidden_layers=2; "
                       r"unexpected tensor\(s\) 'encoder.layer.1"):
        load_bert(folder)
    folder = _with_config(bert_folder, tmp_path / "more", num_hidden_layers=3)
    with pytest.raises(CheckpointError, match=r"num_hidden_layers=3 .* expected num_hidden_layers=2"):
        load_bert(folder)


# ----------------------------------------------------------------------------- the one rule


def _with_tensors(folder, tmp_path, change):
    target = copy_folder(folder, tmp_path)
    path = target / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))
    return target, path


def test_ignore_list_is_short_and_documented(bert_folder, tmp_path):
    """Buffers (position_ids, token_type_ids), the pooler and pre-training heads (cls.*) are the
    only tensors a BERT file may hold that the encoder does not use."""
    from attnkit.models.bert import BERT_IGNORED

    assert len(BERT_IGNORED) == 4

    def add_ignored(tensors):
        tensors["embeddings.position_ids"] = np.arange(MAX_POSITIONS, dtype=np.int64)[None]
        tensors["embeddings.token_type_ids"] = np.zeros((1, MAX_POSITIONS), np.int64)
        tensors["cls.predictions.bias"] = np.zeros(len(VOCAB), np.float32)

    folder, _ = _with_tensors(bert_folder, tmp_path, add_ignored)
    load_bert(folder)


@pytest.mark.parametrize(
    "name, array",
    [
        ("encoder.layer.0.attention.self.rotary.inv_freq", np.ones(4, np.float32)),
        ("encoder.layer.0.attention.self.distance_embedding.weight", np.ones((127, 8), np.float32)),
        ("classifier.weight", np.ones((2, HIDDEN), np.float32)),
        ("embeddings.LayerNorm.scale", np.ones(HIDDEN, np.float32)),
    ],
)
def test_unused_tensor_is_refused_naming_file_and_tensor(name, array, bert_folder, tmp_path):
    folder, path = _with_tensors(bert_folder, tmp_path, lambda t: t.update({name: array}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) in ") as info:
        SentenceEncoder.from_pretrained(folder)
    assert str(path) in str(info.value) and repr(name) in str(info.value)


def test_unknown_key_and_unknown_tensor_together(bert_folder, tmp_path):
    """The walk the issue asks for: an unknown tensor and an unknown math-changing key, each refused."""
    folder, _ = _with_tensors(bert_folder, tmp_path, lambda t: t.update({"extra.weight": np.ones(3, np.float32)}))
    with pytest.raises(CheckpointError, match="'extra.weight'"):
        load_bert(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attention_scale": 0.5}))
    with pytest.raises(CheckpointError, match=r"does not know the key\(s\) 'attention_scale'"):
        load_bert(folder)


def test_integer_weights_are_refused(bert_folder, tmp_path):
    name = "encoder.layer.1.output.dense.weight"
    folder, path = _with_tensors(bert_folder, tmp_path, lambda t: t.update({name: t[name].astype(np.int8)}))
    with pytest.raises(CheckpointError, match=f"tensor '{name}' in {path} has dtype I8; expected floating point"):
        load_bert(folder)


def test_shapes_from_the_config_are_the_model_shapes():
    config = BertConfig(vocab_size=11, hidden_size=12, num_hidden_layers=3, num_attention_heads=3,
                        intermediate_size=7, max_position_embeddings=9, type_vocab_size=1)
    model = {name: array.shape for name, array in BertModel(config).state_dict().items()}
    shapes = {name: tuple(size for _, size in dims) for name, dims in bert_shapes(config).items()}
    assert shapes == model


def test_head_modules_directly():
    """SentenceHead on a hand-made packed batch, against the formulas in float64."""
    rng = np.random.default_rng(0)
    lengths = np.array([1, 4, 2])
    hidden = rng.standard_normal((lengths.sum(), 5)).astype(np.float32)
    rows = np.split(hidden.astype(np.float64), np.cumsum(lengths)[:-1])
    expected = {
        "cls": [r[0] for r in rows],
        "lasttoken": [r[-1] for r in rows],
        "mean": [r.mean(0) for r in rows],
        "max": [r.max(0) for r in rows],
        "mean_sqrt_len_tokens": [r.sum(0) / np.sqrt(len(r)) for r in rows],
        "weightedmean": [(np.arange(1, len(r) + 1)[:, None] * r).sum(0) / (len(r) * (len(r) + 1) / 2) for r in rows],
    }
    for mode, want in expected.items():
        got = Pooling((mode,))(hidden, lengths)
        assert got.dtype == np.float32
        assert np.abs(got - np.array(want)).max() < 1e-6, mode  # a few float32 roundings of O(1) values
    weight = rng.standard_normal((3, 10)).astype(np.float32)
    dense = Dense(weight, activation="torch.nn.modules.linear.Identity")
    head = SentenceHead(Pooling(("cls", "mean")), (dense, Normalize()))
    out = head(hidden, lengths)
    assert out.shape == (3, 3) and head.dim(5) == 3 and head.normalized
    want = np.concatenate([expected["cls"], expected["mean"]], axis=1) @ weight.T.astype(np.float64)
    want /= np.linalg.norm(want, axis=1, keepdims=True)
    assert np.abs(out - want).max() < 1e-5
    with pytest.raises(ValueError, match="unknown pooling mode"):
        Pooling(("median",))
    with pytest.raises(TypeError, match="expected head to be a SentenceHead"):
        SentenceEncoder(None, None, head="mean")


# ----------------------------------------------------------------------------- the real model


@pytest.mark.slow
def test_minilm_saved_by_installed_sentence_transformers(minilm_folder, sentence_transformers, tmp_path):
    """all-MiniLM-L6-v2 re-saved by the installed sentence-transformers (>= 6: no max_seq_length in
    sentence_bert_config.json, model_max_length 256, tokenizer.json truncating at 128): a long text
    must be cut at 256 word pieces, not 128, and embed as sentence-transformers embeds it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sentence_transformers.SentenceTransformer(str(minilm_folder), device="cpu").save(str(tmp_path / "mini"))
    folder = tmp_path / "mini"
    text = " ".join(f"word{i} and, in the year {1900 + i}, a café opened." for i in range(30))
    texts = [text, "A man is eating food.", ""]
    encoder, model = assert_matches_st(sentence_transformers, folder, "MiniLM re-saved", texts)
    assert encoder.max_seq_length == model.max_seq_length == 256
    assert len(encoder.tokens(text)) == 256


# ----------------------------------------------------------------------------- no crash from any file

ODD_VALUES = [None, -1, 0, 1e30, "x", [], [1], {}, {"a": 1}, True]


@pytest.mark.slow
def test_every_odd_value_in_every_file_is_loaded_or_refused(save_st, tmp_path):
    """Each key of each JSON file of a sentence-transformers folder set to odd values: the folder
    loads or raises a CheckpointError (a ValueError) naming that file, never another error."""
    pristine = save_st(after=[("dense", {"out_features": 16}), ("normalize",)])
    files = ["config.json", "modules.json", "1_Pooling/config.json", "2_Dense/config.json", "3_Normalize/config.json",
             "sentence_bert_config.json", "tokenizer_config.json", "config_sentence_transformers.json"]
    outcomes = {"loaded": 0, "refused": 0}
    for name in files:
        settings = json.loads((pristine / name).read_text())
        keys = range(len(settings)) if isinstance(settings, list) else list(settings)
        for key in keys:
            for value in ODD_VALUES:
                changed = copy.deepcopy(settings)
                changed[key] = value
                (pristine / name).write_text(json.dumps(changed))
                try:
                    SentenceEncoder.from_pretrained(pristine, num_threads=1)
                    outcomes["loaded"] += 1
                except CheckpointError as error:
                    assert str(pristine / name) in str(error), (name, key, value, str(error))
                    outcomes["refused"] += 1
                except Exception as error:  # noqa: BLE001 - the point of the test
                    pytest.fail(f"{name}[{key!r}] = {value!r}: {type(error).__name__}: {error}")
            (pristine / name).write_text(json.dumps(settings))
    assert outcomes["refused"] > outcomes["loaded"] > 0
