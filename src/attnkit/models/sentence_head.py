"""sentence-transformers' modules after the encoder, and the files that configure them.

A sentence-transformers folder lists its modules in `modules.json`: a
Transformer (the BERT encoder, usually at the folder's root), then a Pooling
module that turns the token vectors into one vector per sentence, then any
number of Dense and Normalize modules. This file implements those three and
reads every file sentence-transformers writes, from the 2.x layout to 6.x:

    h = the encoder's last hidden states over the real tokens      # (T, D) per sentence
    e = concat(pool(h) for each pooling mode)                      # (len(modes) * D,)
    for each module after Pooling, in modules.json order:
        Dense:     e = act(W e + b) [+ e or R e when use_residual]
        Normalize: e = e / max(|e|_2, 1e-12)
    e = e[:truncate_dim]                                           # config_sentence_transformers.json

Pooling modes (sentence-transformers' names), over the T real tokens only:
cls = h[0]; lasttoken = h[T-1]; mean = sum(h) / T; mean_sqrt_len_tokens =
sum(h) / sqrt(T); max = the element-wise max; weightedmean = sum(t h[t-1]) /
sum(t), t = 1..T.

Every setting that changes these numbers is implemented or refused by name;
each file's keys that do not change them are listed where the file is read.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from attnkit.models.checkpoint import CheckpointError, is_model_file, load_state_dict, read_json, read_model_text
from attnkit.nn.layers import gelu, relu

POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
# sentence-transformers < 6 wrote one boolean per mode; several true modes are
# concatenated in this order, and none true means mean.
LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
SIMILARITY_FUNCTIONS = ("cosine", "dot", "euclidean", "manhattan")
_NORM_EPS = np.float32(1e-12)  # torch.nn.functional.normalize's eps


# ----------------------------------------------------------------------------- modules


def _tanh(x: np.ndarray) -> np.ndarray:
    return np.tanh(x)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (np.tanh(0.5 * x) + 1.0)  # no overflow for large |x|; python floats keep float32


def _identity(x: np.ndarray) -> np.ndarray:
    return x


# Dense's activation_function (the torch class's full name) -> the function.
# sentence-transformers stores the class name only, so each is the class's default
# (GELU is the exact erf GELU).
DENSE_ACTIVATIONS = {
    "torch.nn.modules.linear.Identity": _identity,
    "torch.nn.modules.activation.Tanh": _tanh,
    "torch.nn.modules.activation.ReLU": relu,
    "torch.nn.modules.activation.GELU": gelu,
    "torch.nn.modules.activation.Sigmoid": _sigmoid,
}
DEFAULT_DENSE_ACTIVATION = "torch.nn.modules.activation.Tanh"  # sentence-transformers' default


@dataclass(frozen=True)
class Pooling:
    """One vector per sentence from packed token vectors.

    modes: sentence-transformers' pooling modes, concatenated in this order
    (output width len(modes) * D).
    """

    modes: tuple[str, ...] = ("mean",)

    def __post_init__(self) -> None:
        if isinstance(self.modes, str) or not self.modes:
            raise ValueError(f"expected pooling modes as a non-empty tuple of str, got {self.modes!r}")
        unknown = [mode for mode in self.modes if mode not in POOLING_MODES]
        if unknown:
            raise ValueError(f"unknown pooling mode(s) {unknown}; expected some of {POOLING_MODES}")

    @property
    def name(self) -> str:
        """The modes joined by '+': 'mean', or 'cls+mean' for a concatenation."""
        return "+".join(self.modes)

    def __call__(self, hidden: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Packed hidden states (N, D) of sentences with `lengths` (n,), each >= 1 -> (n, len(modes) * D)."""
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])  # (n,) first token of each sentence
        counts = lengths[:, None].astype(np.float32)  # (n, 1)
        pooled = []
        for mode in self.modes:
            if mode == "cls":
                pooled.append(hidden[starts])
            elif mode == "lasttoken":
                pooled.append(hidden[starts + lengths - 1])
            elif mode == "max":
                pooled.append(np.maximum.reduceat(hidden, starts, axis=0))
            elif mode == "mean":
                pooled.append(np.add.reduceat(hidden, starts, axis=0) / counts)
            elif mode == "mean_sqrt_len_tokens":
                pooled.append(np.add.reduceat(hidden, starts, axis=0) / np.sqrt(counts))
            else:  # weightedmean: token t (1-based) of a sentence weighs t
                weights = (np.arange(hidden.shape[0]) - np.repeat(starts, lengths) + 1).astype(np.float32)
                total = counts * (counts + 1) / 2  # (n, 1) = sum of 1..T
                pooled.append(np.add.reduceat(hidden * weights[:, None], starts, axis=0) / total)
        return pooled[0] if len(pooled) == 1 else np.concatenate(pooled, axis=1)


@dataclass(frozen=True, eq=False)
class Dense:
    """sentence-transformers' Dense: y = act(x W^T + b), plus x (or x R^T) with use_residual.

    weight: (out, in); bias: (out,) or None; residual: (out, in) when
    use_residual and out != in, else None; activation: a DENSE_ACTIVATIONS key.
    """

    weight: np.ndarray
    bias: np.ndarray | None = None
    activation: str = DEFAULT_DENSE_ACTIVATION
    use_residual: bool = False
    residual: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.activation not in DENSE_ACTIVATIONS:
            raise ValueError(
                f"unknown activation {self.activation!r}; expected one of {sorted(DENSE_ACTIVATIONS)}"
            )

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """(n, in) -> (n, out)."""
        y = x @ self.weight.T  # (n, out)
        if self.bias is not None:
            y += self.bias
        y = DENSE_ACTIVATIONS[self.activation](y)
        if self.use_residual:
            y = y + (x if self.residual is None else x @ self.residual.T)
        return y


@dataclass(frozen=True)
class Normalize:
    """sentence-transformers' Normalize: x / max(|x|_2, 1e-12), row by row."""

    def __call__(self, x: np.ndarray) -> np.ndarray:
        norms = np.sqrt(np.einsum("nd,nd->n", x, x))[:, None]  # (n, 1)
        return x / np.maximum(norms, _NORM_EPS)


@dataclass(frozen=True)
class SentenceHead:
    """Everything after the encoder: Pooling, then Dense / Normalize modules in order,
    then `truncate_dim`; `similarity` is the function `SentenceEncoder.similarity` uses.

    The default is attnkit's choice for a plain BERT folder: mean pooling, then Normalize.
    """

    pooling: Pooling = Pooling()
    modules: tuple[Dense | Normalize, ...] = (Normalize(),)
    truncate_dim: int | None = None
    similarity: str = "cosine"

    def __post_init__(self) -> None:
        if not isinstance(self.pooling, Pooling):
            raise TypeError(f"expected pooling to be a Pooling, got {type(self.pooling).__name__}")
        for module in self.modules:
            if not isinstance(module, (Dense, Normalize)):
                raise TypeError(f"expected Dense or Normalize modules, got {type(module).__name__}")
        if self.similarity not in SIMILARITY_FUNCTIONS:
            raise ValueError(f"expected similarity in {SIMILARITY_FUNCTIONS}, got {self.similarity!r}")
        if self.truncate_dim is not None and (
            isinstance(self.truncate_dim, bool) or not isinstance(self.truncate_dim, int) or self.truncate_dim < 1
        ):
            raise ValueError(f"expected truncate_dim to be a positive int or None, got {self.truncate_dim!r}")

    @property
    def normalized(self) -> bool:
        """Whether embeddings come out unit length (the last module is Normalize, no truncation)."""
        return bool(self.modules) and isinstance(self.modules[-1], Normalize) and self.truncate_dim is None

    def dim(self, hidden_size: int) -> int:
        """The embedding width for an encoder of width `hidden_size`."""
        width = len(self.pooling.modes) * hidden_size
        for module in self.modules:
            if isinstance(module, Dense):
                width = module.out_features
        return width if self.truncate_dim is None else min(width, self.truncate_dim)

    def __call__(self, hidden: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Packed float32 hidden states (N, D), sentence lengths (n,) -> embeddings (n, dim)."""
        x = self.pooling(hidden, lengths)
        for module in self.modules:
            x = module(x)
        if self.truncate_dim is not None:
            x = x[:, : self.truncate_dim]
        return x

    def similarity_matrix(self, embeddings: np.ndarray) -> np.ndarray:
        """(n, n) similarities of the rows, with sentence-transformers' similarity function:
        cosine, dot, or minus the euclidean / manhattan distance."""
        e = embeddings
        if self.similarity == "cosine":
            e = Normalize()(e)  # what sentence-transformers' cos_sim does
            return e @ e.T
        if self.similarity == "dot":
            return e @ e.T
        difference = e[:, None, :] - e[None, :, :]  # (n, n, D)
        if self.similarity == "manhattan":
            return -np.abs(difference).sum(axis=-1)
        return -np.sqrt(np.einsum("ijd,ijd->ij", difference, difference))


# ----------------------------------------------------------------------------- the files


def _type_error(path: Path, key: str, value: object, expected: str) -> CheckpointError:
    return CheckpointError(f"unexpected {key}={value!r} in {path}; expected {expected}")


def _positive_int(path: Path, key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _type_error(path, key, value, "a positive int")
    return value


def _boolean(path: Path, key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise _type_error(path, key, value, "true or false")
    return value


def _refuse_unknown(path: Path, settings: dict, known: Sequence[str], what: str) -> None:
    unknown = sorted(key for key in settings if key not in known)
    if unknown:
        raise CheckpointError(
            f"unsupported key(s) {unknown} in {path}: attnkit implements {what} with the keys "
            f"{sorted(known)} only, and refuses settings it cannot vouch for"
        )


@dataclass(frozen=True)
class ModuleEntry:
    """One line of modules.json: the class name, its folder, and the line as written."""

    kind: str  # Transformer, Pooling, Dense or Normalize
    folder: Path
    type: str


_MODULE_KINDS = ("Transformer", "Pooling", "Dense", "Normalize")


def read_modules(folder: Path) -> list[ModuleEntry] | None:
    """The modules of a sentence-transformers folder (None without modules.json).

    Accepted: a Transformer first, a Pooling second, then Dense and Normalize
    modules, all from the `sentence_transformers` package (any version's module
    path). Anything else is refused by its name and place.
    """
    path = folder / "modules.json"
    if not is_model_file(path):
        return None
    try:
        modules = json.loads(read_model_text(path))
    except json.JSONDecodeError as error:
        raise CheckpointError(f"cannot read {path}: {error}") from None
    if not isinstance(modules, list) or not modules or not all(isinstance(m, dict) for m in modules):
        raise CheckpointError(f"expected a non-empty JSON list of objects in {path}")
    entries = []
    for index, module in enumerate(modules):
        type_name, where = module.get("type"), module.get("path", "")
        if not isinstance(type_name, str) or not isinstance(where, str):
            raise CheckpointError(
                f"module {index} in {path} needs a string 'type' and 'path', got {module!r}"
            )
        kind = type_name.rsplit(".", 1)[-1]
        if not type_name.startswith("sentence_transformers.") or kind not in _MODULE_KINDS:
            raise CheckpointError(
                f"unsupported sentence-transformers module {type_name!r} (module {index}, path "
                f"{where!r}) in {path}; attnkit implements {', '.join(_MODULE_KINDS)}"
            )
        target = (folder / where).resolve()
        if folder.resolve() not in (target, *target.parents):
            raise CheckpointError(f"module {index} in {path} points outside the folder: {where!r}")
        entries.append(ModuleEntry(kind, target, type_name))
    kinds = [entry.kind for entry in entries]
    if kinds[0] != "Transformer" or kinds[1:2] != ["Pooling"] or "Transformer" in kinds[1:] or "Pooling" in kinds[2:]:
        raise CheckpointError(
            f"unsupported module order {kinds} in {path}; expected Transformer, Pooling, then "
            "Dense / Normalize modules"
        )
    return entries


# The sentence_bert_config.json keys attnkit reads: max_seq_length and do_lower_case are
# implemented; the task, modality, output name and backend must be the text-embedding
# defaults; config / processing overrides are refused; cache_dir and unpad_inputs
# (padding-free batching in torch) change nothing.
_TRANSFORMER_KEYS = (
    "max_seq_length", "do_lower_case", "transformer_task", "modality_config", "module_output_name",
    "model_args", "model_kwargs", "tokenizer_args", "processor_kwargs", "config_args", "config_kwargs",
    "backend", "cache_dir", "unpad_inputs", "processing_kwargs",
)
# model_kwargs that choose how torch runs the model, not what it computes (attnkit computes float32)
_IGNORED_MODEL_KWARGS = ("torch_dtype", "dtype", "attn_implementation", "trust_remote_code")


@dataclass(frozen=True)
class TransformerSettings:
    """What sentence_bert_config.json says about the encoder's inputs."""

    max_seq_length: int | None = None  # None: from the tokenizer config / the model
    lowercase: bool = False  # do_lower_case: lower-case before the tokenizer


def read_transformer_settings(folder: Path) -> TransformerSettings:
    """sentence_bert_config.json of the Transformer module's folder (defaults without it)."""
    path = folder / "sentence_bert_config.json"
    if not is_model_file(path):
        return TransformerSettings()
    settings = read_json(path)
    _refuse_unknown(path, settings, _TRANSFORMER_KEYS, "the Transformer module")
    task = settings.get("transformer_task", "feature-extraction")
    if task != "feature-extraction":
        raise CheckpointError(f"unsupported transformer_task {task!r} in {path}; expected 'feature-extraction'")
    output = settings.get("module_output_name", "token_embeddings")
    if output != "token_embeddings":
        raise CheckpointError(f"unsupported module_output_name {output!r} in {path}; expected 'token_embeddings'")
    modality = settings.get("modality_config", {})
    text = modality.get("text") if isinstance(modality, dict) else None
    if modality and text != {"method": "forward", "method_output_name": "last_hidden_state"}:
        raise CheckpointError(
            f"unsupported modality_config {modality!r} in {path}; expected text through the "
            "model's forward and its last_hidden_state"
        )
    backend = settings.get("backend", "torch")
    if backend != "torch":
        raise CheckpointError(f"unsupported backend {backend!r} in {path}; expected 'torch' (safetensors weights)")
    for key, what in (("config_args", "overrides"), ("config_kwargs", "overrides"), ("processing_kwargs", "changes")):
        if settings.get(key):
            raise CheckpointError(
                f"unsupported {key}={settings[key]!r} in {path}: it {what} the model's "
                "config or preprocessing, which attnkit does not implement"
            )
    for key in ("model_args", "model_kwargs", "tokenizer_args", "processor_kwargs"):
        if not isinstance(settings.get(key) or {}, dict):
            raise _type_error(path, key, settings[key], "an object")
    for key in ("model_args", "model_kwargs"):
        extra = sorted(set(settings.get(key) or {}) - set(_IGNORED_MODEL_KWARGS))
        if extra:
            raise CheckpointError(
                f"unsupported {key} {extra} in {path}; attnkit ignores only {list(_IGNORED_MODEL_KWARGS)}"
            )
    max_length = settings.get("max_seq_length")
    for key in ("tokenizer_args", "processor_kwargs"):  # these win over max_seq_length
        tokenizer_args = settings.get(key) or {}
        extra = sorted(set(tokenizer_args) - {"model_max_length", "trust_remote_code"})
        if extra:
            raise CheckpointError(f"unsupported {key} {extra} in {path}; attnkit reads only model_max_length")
        if tokenizer_args.get("model_max_length") is not None:
            max_length = tokenizer_args["model_max_length"]
    if max_length is not None:
        max_length = _positive_int(path, "max_seq_length", max_length)
    lowercase = _boolean(path, "do_lower_case", settings.get("do_lower_case", False))
    return TransformerSettings(max_length, lowercase)


def read_pooling(folder: Path, hidden_size: int) -> Pooling:
    """Pooling from `folder`/config.json: sentence-transformers >= 6's `pooling_mode`
    (a name or a list of names) or the older one-boolean-per-mode keys."""
    path = folder / "config.json"
    settings = read_json(path)
    known = ["pooling_mode", "embedding_dimension", "word_embedding_dimension", "include_prompt", *LEGACY_POOLING_KEYS]
    _refuse_unknown(path, settings, known, "Pooling")
    for key in ("embedding_dimension", "word_embedding_dimension"):
        if key in settings and settings[key] != hidden_size:
            raise CheckpointError(
                f"{key}={settings[key]!r} in {path} disagrees with the encoder: expected its "
                f"hidden_size {hidden_size}"
            )
    # include_prompt only matters with a prompt, and attnkit never adds one (a default
    # prompt is refused in read_model_settings).
    _boolean(path, "include_prompt", settings.get("include_prompt", True))
    if "pooling_mode" in settings:  # sentence-transformers >= 6; any legacy keys are ignored, as there
        mode = settings["pooling_mode"]
        modes = (mode,) if isinstance(mode, str) else mode
        if not isinstance(modes, (list, tuple)) or not modes or not all(isinstance(m, str) for m in modes):
            raise _type_error(path, "pooling_mode", mode, f"one of {POOLING_MODES} or a list of them")
    else:
        for key in LEGACY_POOLING_KEYS:
            _boolean(path, key, settings.get(key, False))
        modes = [mode for key, mode in LEGACY_POOLING_KEYS.items() if settings.get(key)] or ["mean"]
    unknown = [mode for mode in modes if mode not in POOLING_MODES]
    if unknown:
        raise CheckpointError(
            f"unsupported pooling_mode {unknown[0]!r} in {path}; expected one of {POOLING_MODES}"
        )
    return Pooling(tuple(modes))


_DENSE_KEYS = (
    "in_features", "out_features", "bias", "activation_function",
    "module_input_name", "module_output_name", "use_residual",
)


def read_dense(folder: Path, in_features: int) -> Dense:
    """Dense from `folder`/config.json and `folder`/model.safetensors (linear.weight,
    linear.bias, residual.weight: every tensor used, shapes checked)."""
    path = folder / "config.json"
    settings = read_json(path)
    _refuse_unknown(path, settings, _DENSE_KEYS, "Dense")
    for key in ("module_input_name", "module_output_name"):
        if settings.get(key) not in (None, "sentence_embedding"):
            raise CheckpointError(
                f"unsupported {key} {settings[key]!r} in {path}; expected 'sentence_embedding'"
            )
    n_in = _positive_int(path, "in_features", settings.get("in_features"))
    n_out = _positive_int(path, "out_features", settings.get("out_features"))
    if n_in != in_features:
        raise CheckpointError(
            f"in_features={n_in} in {path} disagrees with the module before it: expected {in_features}"
        )
    has_bias = _boolean(path, "bias", settings.get("bias", True))
    use_residual = _boolean(path, "use_residual", settings.get("use_residual", False))
    activation = settings.get("activation_function", DEFAULT_DENSE_ACTIVATION)
    if not isinstance(activation, str) or activation not in DENSE_ACTIVATIONS:
        raise CheckpointError(
            f"unsupported activation_function {activation!r} in {path}; expected one of "
            f"{sorted(DENSE_ACTIVATIONS)}"
        )
    expected = {"linear.weight": (n_out, n_in)}
    if has_bias:
        expected["linear.bias"] = (n_out,)
    if use_residual and n_in != n_out:
        expected["residual.weight"] = (n_out, n_in)
    table = [(name.replace(".", r"\."), name) for name in expected]
    state = load_state_dict(folder, table, expected)
    return Dense(
        weight=state["linear.weight"],
        bias=state.get("linear.bias"),
        activation=activation,
        use_residual=use_residual,
        residual=state.get("residual.weight"),
    )


def read_normalize(folder: Path) -> Normalize:
    """Normalize; its config.json (sentence-transformers >= 5) is optional."""
    path = folder / "config.json"
    if is_model_file(path):
        settings = read_json(path)
        _refuse_unknown(path, settings, ("module_input_name", "module_output_name"), "Normalize")
        for key in ("module_input_name", "module_output_name"):
            if settings.get(key) not in (None, "sentence_embedding"):
                raise CheckpointError(
                    f"unsupported {key} {settings[key]!r} in {path}; expected 'sentence_embedding'"
                )
    return Normalize()


def read_model_settings(folder: Path) -> tuple[str, int | None]:
    """(similarity function, truncate_dim) from config_sentence_transformers.json.

    A default prompt (prepended to every text by sentence-transformers) is refused;
    the versions and the prompts themselves change nothing.
    """
    path = folder / "config_sentence_transformers.json"
    if not is_model_file(path):
        return "cosine", None
    settings = read_json(path)
    model_type = settings.get("model_type", "SentenceTransformer")
    if model_type != "SentenceTransformer":
        raise CheckpointError(
            f"unsupported model_type {model_type!r} in {path}; expected 'SentenceTransformer' "
            "(dense sentence embeddings)"
        )
    name = settings.get("default_prompt_name")
    prompts = settings.get("prompts") or {}
    if name is not None:
        prompt = prompts.get(name) if isinstance(name, str) and isinstance(prompts, dict) else None
        if prompt != "":
            raise CheckpointError(
                f"unsupported default_prompt_name {name!r} in {path}: sentence-transformers prepends "
                f"its prompt ({prompt!r}) to every text, which attnkit does not implement"
            )
    similarity = settings.get("similarity_fn_name") or "cosine"
    if similarity not in SIMILARITY_FUNCTIONS:
        raise CheckpointError(
            f"unsupported similarity_fn_name {similarity!r} in {path}; expected one of {SIMILARITY_FUNCTIONS}"
        )
    truncate_dim = settings.get("truncate_dim")
    if truncate_dim is not None:
        truncate_dim = _positive_int(path, "truncate_dim", truncate_dim)
    return similarity, truncate_dim


def read_head(folder: Path, modules: list[ModuleEntry] | None, hidden_size: int) -> SentenceHead:
    """The SentenceHead a folder describes (attnkit's default without modules.json)."""
    similarity, truncate_dim = read_model_settings(folder)
    if modules is None:
        return SentenceHead(similarity=similarity, truncate_dim=truncate_dim)
    pooling = read_pooling(modules[1].folder, hidden_size)
    width = len(pooling.modes) * hidden_size
    after: list[Dense | Normalize] = []
    for entry in modules[2:]:
        if entry.kind == "Dense":
            dense = read_dense(entry.folder, width)
            after.append(dense)
            width = dense.out_features
        else:
            after.append(read_normalize(entry.folder))
    return SentenceHead(pooling, tuple(after), truncate_dim, similarity)


def read_max_seq_length(folder: Path, settings: TransformerSettings, max_position_embeddings: int) -> int:
    """The longest input in tokens, wherever the folder's sentence-transformers version keeps it.

    sentence_bert_config.json's max_seq_length (or its tokenizer args'
    model_max_length) when given, and it must fit the position table; else
    tokenizer_config.json's model_max_length, capped at max_position_embeddings
    (sentence-transformers >= 6 keeps it there); else max_position_embeddings.
    """
    if settings.max_seq_length is not None:
        if settings.max_seq_length > max_position_embeddings:
            raise CheckpointError(
                f"max_seq_length={settings.max_seq_length} in {folder / 'sentence_bert_config.json'} "
                f"exceeds the model's max_position_embeddings={max_position_embeddings}: inputs that "
                "long have no position embedding"
            )
        return settings.max_seq_length
    path = folder / "tokenizer_config.json"
    if is_model_file(path):
        value = read_json(path).get("model_max_length")
        # transformers writes a huge number (1e30) for "no limit"
        if isinstance(value, float) and value.is_integer() and value > 0:
            value = int(value)
        if value is not None:
            return min(_positive_int(path, "model_max_length", value), max_position_embeddings)
    return max_position_embeddings


__all__ = [
    "DENSE_ACTIVATIONS",
    "POOLING_MODES",
    "SIMILARITY_FUNCTIONS",
    "Dense",
    "ModuleEntry",
    "Normalize",
    "Pooling",
    "SentenceHead",
    "TransformerSettings",
    "read_head",
    "read_max_seq_length",
    "read_modules",
    "read_transformer_settings",
]
