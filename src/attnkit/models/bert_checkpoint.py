"""Hugging Face BERT checkpoints: tensor names, shapes from the config, the header check,
and the weights as an attnkit state dict.

Checkpoint names stop here: `BERT_NAME_TABLE` maps each Hugging Face name to
attnkit's (`BertModel`'s state-dict keys), `BERT_IGNORED` names the tensors
dropped on purpose, and `read_bert_weights(folder)` returns the config and the
mapped state dict that `attnkit.models.bert.load_bert` loads into a model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from attnkit.models.bert_config import BertConfig
from attnkit.models.checkpoint import (
    FLOAT_DTYPES,
    CheckpointError,
    check_folder,
    check_shapes,
    find_safetensors,
    load_state_dict,
    map_names,
    read_config,
    read_header,
)

_PREFIX = r"(?:bert\.)?"  # BertForMaskedLM & co. nest the encoder under "bert."
_LAYER = _PREFIX + r"encoder\.layer\.(\d+)\."


def _layer_norm_rules(checkpoint: str, ours: str, group: int) -> list[tuple[str, str]]:
    """A LayerNorm's weight/bias (regex group `group`), and the gamma/beta of
    TensorFlow-era checkpoints."""
    return [
        (checkpoint + r"\.(weight|bias)", f"{ours}.\\{group}"),
        (checkpoint + r"\.gamma", ours + ".weight"),
        (checkpoint + r"\.beta", ours + ".bias"),
    ]


def _bert_name_table() -> list[tuple[str, str]]:
    """Hugging Face BERT names -> attnkit names (see docs/models.md)."""
    table = [
        (_PREFIX + r"embeddings\.word_embeddings\.weight", "embeddings.word.weight"),
        (_PREFIX + r"embeddings\.position_embeddings\.weight", "embeddings.position.weight"),
        (_PREFIX + r"embeddings\.token_type_embeddings\.weight", "embeddings.token_type.weight"),
        *_layer_norm_rules(_PREFIX + r"embeddings\.LayerNorm", "embeddings.norm", 1),
    ]
    for checkpoint, ours in (
        (r"attention\.self\.query", "attn.q_proj"),
        (r"attention\.self\.key", "attn.k_proj"),
        (r"attention\.self\.value", "attn.v_proj"),
        (r"attention\.output\.dense", "attn.out_proj"),
        (r"intermediate\.dense", "ffn.fc1"),
        (r"output\.dense", "ffn.fc2"),
    ):
        table.append((_LAYER + checkpoint + r"\.(weight|bias)", r"blocks.\1." + ours + r".\2"))
    table += _layer_norm_rules(_LAYER + r"attention\.output\.LayerNorm", r"blocks.\1.norm1", 2)
    table += _layer_norm_rules(_LAYER + r"output\.LayerNorm", r"blocks.\1.norm2", 2)
    return table


BERT_NAME_TABLE = _bert_name_table()
# Checkpoint tensors dropped on purpose: buffers, the pooler, pre-training heads.
BERT_IGNORED = (
    _PREFIX + r"embeddings\.position_ids",
    _PREFIX + r"embeddings\.token_type_ids",
    _PREFIX + r"pooler\..*",
    r"cls\..*",
)


def bert_shapes(config: BertConfig) -> dict[str, tuple[tuple[str, int], ...]]:
    """Every attnkit tensor name of a BertModel -> its shape, each size with the
    config key that sets it, e.g. (("vocab_size", 30522), ("hidden_size", 384)).
    Computed from the config alone: nothing is allocated."""
    D = ("hidden_size", config.hidden_size)
    F = ("intermediate_size", config.intermediate_size)
    shapes = {
        "embeddings.word.weight": (("vocab_size", config.vocab_size), D),
        "embeddings.position.weight": (("max_position_embeddings", config.max_position_embeddings), D),
        "embeddings.token_type.weight": (("type_vocab_size", config.type_vocab_size), D),
        "embeddings.norm.weight": (D,),
        "embeddings.norm.bias": (D,),
    }
    for i in range(config.num_hidden_layers):
        block = f"blocks.{i}."
        for projection in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes[f"{block}attn.{projection}.weight"] = (D, D)
            shapes[f"{block}attn.{projection}.bias"] = (D,)
        shapes[f"{block}ffn.fc1.weight"] = (F, D)
        shapes[f"{block}ffn.fc1.bias"] = (F,)
        shapes[f"{block}ffn.fc2.weight"] = (D, F)
        shapes[f"{block}ffn.fc2.bias"] = (D,)
        for norm in ("norm1", "norm2"):
            shapes[f"{block}{norm}.weight"] = (D,)
            shapes[f"{block}{norm}.bias"] = (D,)
    return shapes


def check_bert_header(config: BertConfig, folder: Path) -> None:
    """Check a folder's weights against its config from the safetensors headers alone,
    before anything is allocated.

    Raises:
        CheckpointError: a tensor no rule maps and no ignore rule names, a layer
            count or size that disagrees with config.json (naming the key, what the
            config says and what the tensor has), a non-float weight, a missing tensor.
    """
    files = find_safetensors(folder)
    source = files[0] if len(files) == 1 else f"{folder} ({len(files)} shards)"
    infos = read_header(files)
    mapped, original = map_names(infos, BERT_NAME_TABLE, ignore=BERT_IGNORED, source=source)
    config_path = folder / "config.json"
    layers = {int(name.split(".")[1]) for name in mapped if name.startswith("blocks.")}
    if layers and max(layers) + 1 != config.num_hidden_layers:
        extra = sorted(
            f"{original[name]!r} (-> {name!r})" for name in mapped
            if name.startswith("blocks.") and int(name.split(".")[1]) >= config.num_hidden_layers
        )
        found = f"unexpected tensor(s) {', '.join(extra[:8])}" + (" and more" if len(extra) > 8 else "")
        raise CheckpointError(
            f"num_hidden_layers={config.num_hidden_layers} in {config_path} disagrees with the "
            f"weights in {source}: they hold layers up to encoder.layer.{max(layers)}, so "
            f"expected num_hidden_layers={max(layers) + 1}" + (f"; {found}" if extra else "")
        )
    for name, dims in bert_shapes(config).items():
        info = mapped.get(name)
        if info is None:
            continue  # missing: check_shapes names every missing tensor below
        expected = tuple(size for _, size in dims)
        if tuple(info.shape) != expected:
            keys = ", ".join(f"{key}={size}" for key, size in dims)
            if len(info.shape) == len(dims):  # name the sizes that disagree
                keys_off = ", ".join(f"{key}={size}" for (key, size), n in zip(dims, info.shape) if size != n)
            else:
                keys_off = keys
            described = repr(name) if original[name] == name else f"{original[name]!r} (-> {name!r})"
            raise CheckpointError(
                f"{keys_off} in {config_path} disagrees with the weights in {info.file}: "
                f"tensor {described} has shape {tuple(info.shape)}, expected {expected} from {keys}"
            )
        if info.dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                f"tensor {original[name]!r} in {info.file} has dtype {info.dtype}; expected "
                f"floating point weights ({', '.join(FLOAT_DTYPES)})"
            )
    shapes = {name: tuple(size for _, size in dims) for name, dims in bert_shapes(config).items()}
    check_shapes(mapped, shapes, original=original, source=source)



def read_bert_weights(folder: str | Path) -> tuple[BertConfig, dict[str, np.ndarray]]:
    """The config and the weights (attnkit names) of a Hugging Face BERT folder.

    The config is validated, then checked against the safetensors headers
    (`check_bert_header`), and only then are the weights read.

    Raises:
        CheckpointError: unsupported architecture or setting, a missing or
            malformed config key, no weights, a corrupt file, or a missing /
            unexpected / mis-shaped tensor (named, with the config key it disagrees with).
    """
    folder = check_folder(folder)
    config = BertConfig.from_dict(read_config(folder), folder / "config.json")
    check_bert_header(config, folder)
    expected = {name: tuple(size for _, size in dims) for name, dims in bert_shapes(config).items()}
    return config, load_state_dict(folder, BERT_NAME_TABLE, expected, ignore=BERT_IGNORED)


__all__ = ["BERT_IGNORED", "BERT_NAME_TABLE", "bert_shapes", "check_bert_header", "read_bert_weights"]
