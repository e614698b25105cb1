"""Reading Hugging Face checkpoint folders: config, safetensors weights, name mapping.

The loaders of every model family (BERT encoders, GPT-2 and Llama decoders) go
through the same three steps, each written once here:

1. `read_config(folder)` reads `config.json`.
2. `read_safetensors(files)` reads the weights through safetensors' NumPy API
   (never pickle), one file or the shards listed in `model.safetensors.index.json`.
3. `map_names(...)` renames checkpoint keys into attnkit's names with a short
   table of regular expressions, and `check_shapes(...)` compares every tensor
   against the shapes the attnkit model expects.

Checkpoint names stop here: no attnkit class attribute takes a checkpoint's
spelling. Every problem raises `CheckpointError` (a `ValueError`) naming the
file and the tensor: a missing, unexpected or mis-shaped tensor, a truncated or
corrupt file, a folder with no weights.

The one rule every loader follows (docs/models.md, "Decoders: what loads"):

- every tensor in a file is consumed, or on the loader's short documented
  ignore list (rotary `inv_freq` buffers, GPT-2's causal-mask buffers);
  anything else is refused, naming the file and the unused tensors;
- every config key is understood: implemented, known to leave the math alone
  (dropouts, `initializer_range`, `transformers_version`, ...), or refused by
  name (`ConfigReader.check_keys`), so a key attnkit has never heard of cannot
  silently change what a model computes;
- the config is checked against the tensor shapes in the file header
  (`read_header`, which reads shapes without loading) before anything is
  allocated (`check_tensors`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from attnkit.models.checkpoint_files import (  # noqa: F401 - re-exported: the files' readers live there
    FLOAT_DTYPES,
    SAFETENSORS_FILE,
    SAFETENSORS_INDEX,
    CheckpointError,
    TensorInfo,
    check_folder,
    find_safetensors,
    is_model_file,
    read_config,
    read_header,
    read_json,
    read_model_bytes,
    read_model_text,
    read_safetensors,
)


# ----------------------------------------------------------------------------- tokenizers


def _post_processor_ids(node: Any) -> list[int]:
    """Token ids a tokenizer.json post-processor inserts (TemplateProcessing's `special_tokens`
    `ids`, BertProcessing's and RobertaProcessing's `cls`/`sep` pairs), wherever they nest."""
    found: list[int] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "ids" and isinstance(value, list):
                found += [v for v in value if isinstance(v, int)]
            elif key in ("cls", "sep") and isinstance(value, list):
                found += [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
            else:
                found += _post_processor_ids(value)
    elif isinstance(node, list):
        for value in node:
            found += _post_processor_ids(value)
    return found


def token_id_count(tokenizer: Any) -> int:
    """One more than the largest id a `tokenizers.Tokenizer` can produce: its vocabulary, its
    added tokens and the ids its post-processor inserts. Ids need not be dense, so this is
    what a model's embedding must cover, not the number of tokens."""
    ids = list(tokenizer.get_vocab(with_added_tokens=True).values())
    processor = json.loads(tokenizer.to_str()).get("post_processor")
    ids += _post_processor_ids(processor)
    return max(ids, default=-1) + 1


def check_token_ids(tokenizer: Any, vocab_size: int, *, source: str | Path, model: str | Path) -> None:
    """Refuse a tokenizer that can produce an id the model has no embedding row for.

    Arguments:
        tokenizer: a `tokenizers.Tokenizer`.
        vocab_size: rows of the model's token embedding.
        source, model: the tokenizer's file and the model's, for the message.

    Raises:
        CheckpointError: naming both files, the largest id and the vocabulary size.
    """
    count = token_id_count(tokenizer)
    if count > vocab_size:
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        worst = max(vocab, key=vocab.get) if vocab and max(vocab.values()) == count - 1 else None
        which = f" (token {worst!r})" if worst is not None else " (inserted by its post-processor)"
        raise CheckpointError(
            f"{source}: the tokenizer produces token id {count - 1}{which}, but the model in {model} has "
            f"a vocabulary of {vocab_size} (ids 0 to {vocab_size - 1}); expected every id below {vocab_size}"
        )


# ----------------------------------------------------------------------------- names


def map_names(
    tensors: Mapping[str, np.ndarray],
    table: Sequence[tuple[str, str]],
    *,
    ignore: Iterable[str] = (),
    source: str | Path = "checkpoint",
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Rename checkpoint tensors into attnkit's names.

    Arguments:
        tensors: checkpoint name -> array.
        table: (regex, replacement) pairs; the first regex that fully matches a
            name gives its attnkit name (`re.fullmatch`, `\\1` groups allowed).
        ignore: regexes of checkpoint names that are dropped on purpose (buffers
            such as `position_ids`, heads the model does not use).
        source: the file the tensors came from, for messages.

    Returns:
        (attnkit name -> array, attnkit name -> checkpoint name).

    Raises:
        CheckpointError: a tensor no rule maps (unexpected), or two checkpoint
            tensors that map onto the same attnkit name.
    """
    compiled = [(re.compile(pattern), replacement) for pattern, replacement in table]
    ignored = [re.compile(pattern) for pattern in ignore]
    mapped: dict[str, np.ndarray] = {}
    original: dict[str, str] = {}
    unexpected: list[str] = []
    for name, array in tensors.items():
        for pattern, replacement in compiled:
            match = pattern.fullmatch(name)
            if match is not None:
                new_name = match.expand(replacement)
                if new_name in mapped:
                    raise CheckpointError(
                        f"tensors {original[new_name]!r} and {name!r} in {source} both map "
                        f"to {new_name!r}"
                    )
                mapped[new_name] = array
                original[new_name] = name
                break
        else:
            if not any(pattern.fullmatch(name) for pattern in ignored):
                unexpected.append(name)
    if unexpected:
        shown = ", ".join(repr(name) for name in sorted(unexpected)[:8])
        more = f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else ""
        raise CheckpointError(f"unexpected tensor(s) in {source}: {shown}{more}")
    return mapped, original


def check_shapes(
    tensors: Mapping[str, np.ndarray],
    expected: Mapping[str, tuple[int, ...]],
    *,
    original: Mapping[str, str] | None = None,
    source: str | Path = "checkpoint",
) -> None:
    """Check that `tensors` holds exactly the names in `expected`, each with its shape.

    Arguments:
        tensors: attnkit name -> array (after `map_names`).
        expected: attnkit name -> shape the model needs.
        original: attnkit name -> checkpoint name, so messages show both.
        source: the file, for messages.

    Raises:
        CheckpointError: missing tensors, unexpected tensors, or a shape mismatch;
            all of them are listed.
    """
    original = original or {}

    def describe(name: str) -> str:
        checkpoint_name = original.get(name, name)
        return repr(name) if checkpoint_name == name else f"{checkpoint_name!r} (-> {name!r})"

    problems = []
    missing = [name for name in expected if name not in tensors]
    if missing:
        problems.append("missing tensor(s): " + ", ".join(repr(name) for name in missing))
    unexpected = [name for name in tensors if name not in expected]
    if unexpected:
        problems.append("unexpected tensor(s): " + ", ".join(describe(n) for n in unexpected))
    for name, shape in expected.items():
        if name in tensors and tuple(tensors[name].shape) != tuple(shape):
            problems.append(
                f"tensor {describe(name)} has shape {tuple(tensors[name].shape)}, "
                f"expected {tuple(shape)}"
            )
    if problems:
        raise CheckpointError(f"{source}: " + "; ".join(problems))


def load_state_dict(
    folder: str | Path,
    table: Sequence[tuple[str, str]],
    expected: Mapping[str, tuple[int, ...]],
    *,
    ignore: Iterable[str] = (),
    dtype: np.dtype | type = np.float32,
) -> dict[str, np.ndarray]:
    """Read a folder's safetensors weights, rename them, check them, cast them.

    Arguments:
        folder: a Hugging Face model folder.
        table, ignore: the name mapping (see `map_names`).
        expected: attnkit name -> shape (see `check_shapes`).
        dtype: floating dtype of the returned arrays (integer tensors are kept).

    Returns:
        attnkit name -> C-contiguous array of `dtype`, exactly the names in `expected`.
    """
    files = find_safetensors(folder)
    source = files[0] if len(files) == 1 else f"{files[0].parent} ({len(files)} shards)"
    tensors = read_safetensors(files)
    mapped, original = map_names(tensors, table, ignore=ignore, source=source)
    check_shapes(mapped, expected, original=original, source=source)
    out = {}
    for name, array in mapped.items():
        if np.issubdtype(array.dtype, np.floating):
            array = array.astype(dtype, copy=False)
        out[name] = np.ascontiguousarray(array)
    return out



# ----------------------------------------------------------------------------- the one rule



def _names(names: Iterable[str], limit: int = 8) -> str:
    names = sorted(names)
    shown = ", ".join(repr(name) for name in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_tensors(
    found: Mapping[str, TensorInfo],
    expected: Mapping[str, tuple[int, ...]],
    *,
    optional: Mapping[str, tuple[int, ...]] | None = None,
    ignore: Iterable[str] = (),
    dtypes: Sequence[str] | None = FLOAT_DTYPES,
    source: str | Path = "checkpoint",
    config: str = "",
) -> None:
    """The one rule, on header information only: every tensor of the file is expected (with
    the shape the config implies), optional and present with its shape, or on the `ignore`
    list; every expected tensor is there.

    Arguments:
        found: checkpoint name -> `TensorInfo` (`read_header`, or a GGUF file's tensor infos).
        expected: checkpoint name -> shape every loadable file has.
        optional: checkpoint name -> shape of tensors that may be absent (a tied head saved
            anyway, biases a GGUF may carry).
        ignore: regexes (full match) of tensors dropped on purpose; each loader documents its
            list (rotary `inv_freq` buffers, GPT-2's causal-mask buffers).
        dtypes: allowed dtypes of every used tensor (None: any).
        source: the file, for messages.
        config: the config values the shapes come from, for messages ("hidden_size=64, ...").

    Raises:
        CheckpointError: naming the file and every missing, unused or mis-shaped tensor.
    """
    optional = optional or {}
    ignored = [re.compile(pattern) for pattern in ignore]
    wanted = {**optional, **expected}
    problems = []
    missing = [name for name in expected if name not in found]
    if missing:
        problems.append(f"missing tensor(s) {_names(missing)}")
    unused = [
        name for name in found if name not in wanted and not any(pattern.fullmatch(name) for pattern in ignored)
    ]
    if unused:
        problems.append(
            f"tensor(s) {_names(unused)} that attnkit does not use (a tensor it would ignore means a "
            "feature it does not implement, so the file is refused rather than run without it)"
        )
    shapes = [
        f"tensor {name!r} has shape {tuple(found[name].shape)}, expected {tuple(shape)}"
        for name, shape in wanted.items()
        if name in found and tuple(found[name].shape) != tuple(shape)
    ]
    if shapes:
        more = f" and {len(shapes) - 3} more" if len(shapes) > 3 else ""
        because = f" from the config ({config})" if config else " from the config"
        problems.append("; ".join(shapes[:3]) + more + because)
    problems += [
        f"tensor {name!r} has dtype {found[name].dtype}, expected one of {', '.join(dtypes)}"
        for name in wanted
        if name in found and dtypes is not None and found[name].dtype not in dtypes
    ][:3]
    if problems:
        raise CheckpointError(f"{source}: " + "; ".join(problems))


def check_tied_copy(
    tensors: Mapping[str, np.ndarray], copy: str, original: str, *, source: str | Path = "checkpoint"
) -> None:
    """A tied head saved anyway must be the embedding again (else the file is untied and its
    config says otherwise)."""
    if copy in tensors and not np.array_equal(tensors[copy], tensors[original]):
        raise CheckpointError(
            f"{source}: the config ties the output head to the embedding (tie_word_embeddings), but "
            f"{copy!r} differs from {original!r}; expected equal tensors, or tie_word_embeddings: false"
        )


# ----------------------------------------------------------------------------- config keys

_MISSING: Any = object()

# Metadata: keys a Hugging Face config may carry that never change what a model computes at
# inference. Bookkeeping of the libraries that wrote the file (transformers, optimum's
# exporter, uniem/m3e, sentence-transformers), training-only settings (dropout,
# initialization), task heads attnkit does not run, and generation defaults (attnkit takes
# sampling settings as arguments, it never reads them from a config). Beside this list,
# `is_metadata_key`'s rule accepts every key that starts with "_", ends in "_token_id" or
# is a dropout; docs/models.md ("Config keys: computed and metadata") lists both.
METADATA_CONFIG_KEYS = frozenset(
    {
        # who wrote the file, and for which classes
        "architectures", "transformers_version", "torch_dtype", "dtype", "model_type", "tokenizer_class",
        "export_model_type",  # optimum's ONNX/OpenVINO exporter
        "uniem_embedding_strategy",  # m3e (uniem): read by uniem's own trainer; modules.json decides pooling
        "sentence_transformers", "name_or_path",
        # transformers' runtime switches
        "use_cache", "output_attentions", "output_hidden_states", "return_dict", "use_return_dict", "torchscript",
        "use_bfloat16", "tf_legacy_loss", "gradient_checkpointing", "output_past", "chunk_size_feed_forward",
        # training and initialization
        "initializer_range", "initializer_factor", "layer_norm_init",
        # task heads (classification, summarization) attnkit does not run
        "id2label", "label2id", "num_labels", "problem_type", "finetuning_task", "prefix", "task_specific_params",
        # generation defaults
        "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
        "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
        "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
        "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
        "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
        "suppress_tokens", "begin_suppress_tokens",
    }
)
HARMLESS_CONFIG_KEYS = METADATA_CONFIG_KEYS  # the former name


def is_metadata_key(key: str) -> bool:
    """Whether a config.json key is metadata: on `METADATA_CONFIG_KEYS`, or by the rule

    - `_` first (`_name_or_path`, `_model_name_or_path`, `_commit_hash`, `_attn_implementation`):
      a library's private bookkeeping;
    - `_token_id` last (`pad_token_id`, `unk_token_id`, `sep_token_id`, ...): which token the
      tokenizer uses for a role. The ids a model does read (a decoder's BOS/EOS) are in its
      family's computed table, which is consulted first;
    - a dropout (`*dropout`, `*_dropout_prob`, `*_pdrop`): training only.

    A family's table of computed keys always wins: a key it lists is read and checked there.
    """
    return (
        key in METADATA_CONFIG_KEYS
        or key.startswith("_")
        or key.endswith("_token_id")
        or key.endswith(("dropout", "_dropout_prob", "_pdrop"))
    )


# Keys that are harmless at these values only; any other value is refused by name.
NEUTRAL_CONFIG_VALUES: dict[str, tuple] = {
    "is_encoder_decoder": (False,),
    "add_cross_attention": (False,),
    "cross_attention_hidden_size": (None,),
    "tie_encoder_decoder": (False,),
    "pruned_heads": ({},),
    "use_mrope": (False,),  # Qwen2.5's configs: multimodal rotary sections, off
}


def _same(value: Any, allowed: Any) -> bool:
    """Equality that does not let True pass for 1 or 0 for False."""
    if allowed is None or value is None:
        return value is allowed
    return type(value) is type(allowed) and value == allowed


class ConfigReader:
    """Typed reads from a parsed config (`config.json`, GGUF metadata) whose every error names
    the file, the key, what was expected and what was found.

    Arguments:
        config: the parsed key -> value mapping.
        source: the file, for messages.
        prefix: prepended to every key (`"llama."` for GGUF metadata).
    """

    def __init__(self, config: Mapping[str, Any], source: str | Path, *, prefix: str = "") -> None:
        self.config = config
        self.source = source
        self.prefix = prefix

    def _value(self, key: str, default: Any) -> tuple[Any, bool]:
        value = self.config.get(self.prefix + key)
        if value is None:
            if default is _MISSING:
                raise CheckpointError(f"{self.source} lacks the key {self.prefix + key!r}, which this model needs")
            return default, False
        return value, True

    def _bad(self, key: str, expected: str, value: Any) -> CheckpointError:
        return CheckpointError(f"{self.source}: expected {self.prefix + key} to be {expected}, got {value!r}")

    def get(self, key: str, default: Any = None) -> Any:
        return self._value(key, default)[0]

    def has(self, key: str) -> bool:
        return self.config.get(self.prefix + key) is not None

    def integer(self, key: str, default: Any = _MISSING, *, minimum: int = 1) -> Any:
        """An integer >= `minimum` (sizes: 1; ids: 0). JSON floats and booleans are refused."""
        value, given = self._value(key, default)
        if not given:
            return value
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise self._bad(key, f"an integer >= {minimum}", value)
        if value < minimum:
            raise self._bad(key, f"an integer >= {minimum}", value)
        return int(value)

    def number(self, key: str, default: Any = _MISSING, *, positive: bool = False) -> Any:
        """A finite number (> 0 when `positive`)."""
        value, given = self._value(key, default)
        if not given:
            return value
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise self._bad(key, "a number", value)
        value = float(value)
        if not np.isfinite(value) or (positive and value <= 0):
            raise self._bad(key, "a finite number > 0" if positive else "a finite number", value)
        return value

    def flag(self, key: str, default: Any = _MISSING) -> Any:
        value, given = self._value(key, default)
        if not given:
            return value
        if not isinstance(value, (bool, np.bool_)):
            raise self._bad(key, "true or false", value)
        return bool(value)

    def text(self, key: str, default: Any = _MISSING) -> Any:
        value, given = self._value(key, default)
        if given and not isinstance(value, str):
            raise self._bad(key, "a string", value)
        return value

    def token_ids(self, key: str) -> tuple[int, ...]:
        """An id or a list of ids (Llama 3's `eos_token_id: [128001, 128008, 128009]`); () if absent."""
        value, given = self._value(key, None)
        if not given:
            return ()
        items = value if isinstance(value, (list, tuple)) else [value]
        for item in items:
            if isinstance(item, (bool, np.bool_)) or not isinstance(item, (int, np.integer)) or item < 0:
                raise self._bad(key, "a token id (an integer >= 0) or a list of them", value)
        return tuple(dict.fromkeys(int(item) for item in items))

    def check_keys(
        self,
        understood: Iterable[str],
        *,
        neutral: Mapping[str, tuple] | None = None,
        harmless: Iterable[str] = (),
        common: bool = True,
        what: str = "this model",
    ) -> None:
        """Refuse, by name, every key that is neither understood (implemented), harmless
        (changes nothing at inference) nor at a neutral value.

        Arguments:
            understood: keys the loader reads and implements.
            neutral: key -> the values at which it changes nothing (`"rope_interleaved": (False,)`).
            harmless: keys of this model that never change the math.
            common: also accept metadata (`is_metadata_key`) and `NEUTRAL_CONFIG_VALUES`, which any
                Hugging Face config may carry (False for GGUF metadata and nested objects).
            what: the model, for messages.
        """
        understood, harmless = set(understood), set(harmless)
        neutral = {**(NEUTRAL_CONFIG_VALUES if common else {}), **(neutral or {})}
        unknown = []
        for full_key, value in self.config.items():
            if not full_key.startswith(self.prefix):
                continue
            key = full_key[len(self.prefix) :]
            if key in understood or key in harmless:
                continue
            if key in neutral:
                if not any(_same(value, allowed) for allowed in neutral[key]):
                    allowed = " or ".join(json.dumps(a) for a in neutral[key])
                    raise CheckpointError(
                        f"{self.source}: {full_key}={json.dumps(value)} is not supported by {what} "
                        f"(expected {allowed}); it changes what the model computes"
                    )
                continue
            if common and is_metadata_key(key):
                continue
            unknown.append(full_key)
        if unknown:
            raise CheckpointError(
                f"{self.source}: {what} does not know the key(s) {_names(unknown)}; they may change what "
                "the model computes, so the file is refused rather than run without them "
                "(docs/models.md lists the keys each loader reads)"
            )


__all__ = [
    "CheckpointError",
    "ConfigReader",
    "FLOAT_DTYPES",
    "HARMLESS_CONFIG_KEYS",
    "METADATA_CONFIG_KEYS",
    "is_metadata_key",
    "NEUTRAL_CONFIG_VALUES",
    "TensorInfo",
    "check_tensors",
    "check_tied_copy",
    "check_token_ids",
    "token_id_count",
    "read_header",
    "check_folder",
    "check_shapes",
    "find_safetensors",
    "load_state_dict",
    "map_names",
    "read_config",
    "is_model_file",
    "read_json",
    "read_model_bytes",
    "read_model_text",
    "read_safetensors",
]
