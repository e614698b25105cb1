"""Conformance of "attnkit", "attnkit_flash" and "attnkit_tiled" with transformers' "eager", per architecture.

One case per architecture: a tiny random config (2 layers, width 32-64, 16
tokens), built through `AutoConfig.for_model` and the Auto class of its task.
For each case and implementation, `run_case` builds the model with
`from_config(cfg, attn_implementation=name)` (same seed, so the same weights as
eager's), runs a training step on two batches (no padding: transformers hands
over no mask, the kernels' own is_causal; right padding: a mask) and returns:

- the logits (every position; for "attnkit_flash" the padded batch's real tokens only:
  transformers' flash route unpads, so a padding query gets output 0 there, as with
  FlashAttention, where eager attends from it), the loss and every parameter's gradient, in float32,
- eager's float32 values and the float64 truth (eager on the model cast to float64),
- or the refusal, when the implementation cannot compute a feature the
  architecture uses (the message names both); for "attnkit_flash" also when the
  architecture's class does not take the name (it lists its own flash kernels);
- the loss after one SGD step (the model trains).

The rule (docs/conventions.md, tests/conftest.py `assert_within_budget`):
attnkit's float32 error against the float64 truth <= 2x eager float32's for the
forward (logits, loss), 3x for gradients, + 8 float32 ulps of the largest truth
(for a gradient, the largest gradient of the step: `budget_scale`).
`tests/hf/test_hf.py` runs these cases under pytest; `scripts/hf_conformance.py`
writes the table in docs/hf.md from the same runs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from attnkit import runtime

__all__ = ["CASES", "Case", "CaseRun", "Check", "FLASH", "IMPLEMENTATIONS", "budget_scale", "checks", "compared",
           "run_case"]

IMPLEMENTATIONS = ("attnkit", "attnkit_flash", "attnkit_tiled")
FLASH = "attnkit_flash"
FORWARD_FACTOR, GRADIENT_FACTOR, ULPS = 2.0, 3.0, 8.0
F32_EPS = float(np.finfo(np.float32).eps)
BATCH, LENGTH, PADDED, VOCAB = 2, 16, 3, 96  # 3 pads: every query still sees a key, even in a window

# Llama's names, which most decoders share: 2 layers, width 32, 4 query heads over 2 key/value heads.
_DECODER = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=64, attention_dropout=0.0,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
)
_BERT = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0,
)


@dataclass(frozen=True)
class Case:
    """One architecture: its model_type, task ("causal", "masked" or "seq2seq"), config and what it exercises."""

    model_type: str
    task: str
    config: dict[str, Any]
    features: tuple[str, ...] = ()
    slow: bool = False

    @property
    def name(self) -> str:
        return self.model_type


def _decoder(model_type: str, features=("GQA",), slow=False, **overrides) -> Case:
    return Case(model_type, "causal", {**_DECODER, **overrides}, ("causal", *features), slow)


CASES: tuple[Case, ...] = (
    Case("bert", "masked", _BERT, ("bidirectional", "padding mask (B, 1, 1, S)")),
    Case("roberta", "masked", {**_BERT, "pad_token_id": 1}, ("bidirectional",)),
    Case("distilbert", "masked", dict(vocab_size=VOCAB, dim=32, hidden_dim=64, n_layers=2, n_heads=4,
                                      max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                                      pad_token_id=0), ("bidirectional",)),
    Case("electra", "masked", {**_BERT, "embedding_size": 32}, ("bidirectional",)),
    Case("modernbert", "masked", dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=64, local_attention=8,
                                      global_attn_every_n_layers=2, attention_dropout=0.0, mlp_dropout=0.0,
                                      embedding_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                      cls_token_id=1, sep_token_id=2),
         ("bidirectional", "local window")),
    Case("gpt2", "causal", dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                                embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2), ("causal",)),
    _decoder("llama"),
    _decoder("mistral", ("GQA", "sliding window"), sliding_window=6),
    _decoder("qwen2", ("GQA", "sliding window"), use_sliding_window=True, sliding_window=6, max_window_layers=1),
    _decoder("qwen3", ("GQA", "q/k norm")),
    _decoder("gemma2", ("GQA", "sliding window", "softcap"), sliding_window=6, attn_logit_softcapping=50.0,
             final_logit_softcapping=30.0, query_pre_attn_scalar=8),
    _decoder("phi3", ("GQA",), resid_pdrop=0.0, embd_pdrop=0.0, original_max_position_embeddings=64),
    _decoder("olmo2"),
    _decoder("gemma"),
    _decoder("gemma3_text", ("GQA", "sliding window"), sliding_window=6, query_pre_attn_scalar=8),
    _decoder("starcoder2", ("GQA", "sliding window"), sliding_window=6, residual_dropout=0.0, embedding_dropout=0.0),
    _decoder("olmo"),
    _decoder("granite"),
    _decoder("cohere"),
    _decoder("stablelm", ("GQA",), partial_rotary_factor=0.5),
    _decoder("phi", (), num_key_value_heads=4, resid_pdrop=0.0, embd_pdrop=0.0),
    _decoder("smollm3"),
    _decoder("helium"),
    _decoder("mixtral", ("GQA", "sliding window", "mixture of experts"), sliding_window=6, num_local_experts=2,
             num_experts_per_tok=1, experts_implementation="eager"),
    _decoder("qwen3_moe", ("GQA", "q/k norm", "mixture of experts"), num_experts=2, num_experts_per_tok=1,
             moe_intermediate_size=32, experts_implementation="eager"),
    _decoder("exaone4", ("GQA", "sliding window"), sliding_window=6, sliding_window_pattern=2),
    _decoder("ernie4_5"),
    _decoder("arcee"),
    _decoder("ministral", ("GQA", "sliding window"), sliding_window=6),
    _decoder("seed_oss"),
    _decoder("apertus"),
    _decoder("glm", ("GQA", "partial rotary")),
    _decoder("gpt_neox", (), num_key_value_heads=4, hidden_dropout=0.0, attention_dropout=0.0),
    _decoder("opt", (), ffn_dim=64, word_embed_proj_dim=32, dropout=0.0, enable_bias=True),
    Case("t5", "seq2seq", dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                               relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=0, eos_token_id=2,
                               decoder_start_token_id=0),
         ("bidirectional", "causal", "cross-attention", "position bias")),
    _decoder("gpt_oss", ("GQA", "sliding window", "attention sinks"), sliding_window=6, num_local_experts=2,
             num_experts_per_tok=1, experts_implementation="eager", slow=True),
)


@dataclass
class CaseRun:
    """What `run_case` measured: per implementation either `values` (name -> float32
    array, "logits/<batch>", "loss/<batch>", "grad/<batch>/<param>") or a `refused` message;
    `eager` and `truth` hold the same names for eager float32 and eager float64."""

    case: Case
    eager: dict[str, np.ndarray] = field(default_factory=dict)
    truth: dict[str, np.ndarray] = field(default_factory=dict)
    values: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    trained: dict[str, float] = field(default_factory=dict)  # the loss after one optimizer step


def _auto_class(task: str):
    transformers = runtime.require("transformers", "hf", "the attnkit.hf conformance cases")
    classes = {"causal": transformers.AutoModelForCausalLM, "masked": transformers.AutoModelForMaskedLM,
               "seq2seq": transformers.AutoModelForSeq2SeqLM}
    return classes[task]


def _build(case: Case, implementation: str, seed: int = 0):
    transformers = runtime.require("transformers", "hf", "the attnkit.hf conformance cases")
    config = transformers.AutoConfig.for_model(case.model_type, **case.config)
    for name, value in config.to_dict().items():  # every dropout off: the runs must be deterministic
        if isinstance(value, float) and ("dropout" in name or "pdrop" in name or name == "dropout_rate"):
            setattr(config, name, 0.0)
    torch.manual_seed(seed)
    return _auto_class(case.task).from_config(config, attn_implementation=implementation)


def _flash_refusal(case: Case) -> str | None:
    """Why `case`'s model class cannot take "attnkit_flash", or None: it lists its own flash
    kernels (`_compatible_flash_implementations`, gpt-oss), and transformers swaps any other
    flash name for one of them at init. (A class without flash support, `_supports_flash_attn`
    False, is built all the same; T5's position bias is then refused at the first call.)"""
    transformers = runtime.require("transformers", "hf", "the attnkit.hf conformance cases")
    config = transformers.AutoConfig.for_model(case.model_type, **case.config)
    cls = _auto_class(case.task)._model_mapping[type(config)]
    head = f"attn_implementation={FLASH!r} cannot compute"
    kernels = getattr(cls, "_compatible_flash_implementations", None)
    if kernels:
        return (f"{head} the flash route ({cls.__name__} takes only its own flash kernels), which {case.model_type} "
                f"needs: transformers swaps any other flash name for one of {', '.join(kernels)}; "
                "use attn_implementation='attnkit_tiled'")
    return None


def _batches() -> dict[str, dict[str, torch.Tensor]]:
    """Two batches of 2 x 16 tokens: "full" (no padding) and "padded" (the second right-padded)."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (BATCH, LENGTH), generator=generator)
    mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
    mask[1, LENGTH - PADDED :] = 0
    labels = ids.masked_fill(mask == 0, -100)
    padded_ids = ids.masked_fill(mask == 0, 0)
    return {
        "full": {"input_ids": ids, "labels": ids},
        "padded": {"input_ids": padded_ids, "attention_mask": mask, "labels": labels},
    }


def _step(model, batches) -> dict[str, np.ndarray]:
    """One training step's logits, loss and parameter gradients on each batch, as float64 arrays
    (the gradients of the last batch stay on the parameters)."""
    model.train()  # every dropout of the cases is 0: train mode changes nothing but transformers' dropout argument
    values = {}
    for name, batch in batches.items():
        model.zero_grad(set_to_none=True)
        out = model(**batch)
        out.loss.backward()
        values[f"logits/{name}"] = out.logits.detach().double().numpy()
        values[f"loss/{name}"] = out.loss.detach().double().numpy()
        for param_name, param in model.named_parameters():
            if param.grad is not None:
                values[f"grad/{name}/{param_name}"] = param.grad.double().numpy()
    return values


def run_case(case: Case, implementations=IMPLEMENTATIONS) -> CaseRun:
    """Eager float32, eager float64 and each implementation on `case` (see the module docstring)."""
    import attnkit.hf

    attnkit.hf.register()
    batches = _batches()
    eager = _build(case, "eager")
    run = CaseRun(case)
    reference = eager.state_dict()
    truth_model = copy.deepcopy(eager).double()
    run.eager = _step(eager, batches)
    run.truth = _step(truth_model, batches)
    for implementation in implementations:
        if implementation == FLASH and (reason := _flash_refusal(case)) is not None:
            run.refused[implementation] = reason
            continue
        model = _build(case, implementation)
        for key, tensor in model.state_dict().items():  # the same seed gives the same weights
            assert torch.equal(tensor, reference[key]), f"{case.name}: {key} differs from eager's"
        try:
            run.values[implementation] = _step(model, batches)
        except ValueError as error:
            if not str(error).startswith(f"attn_implementation={implementation!r}"):
                raise
            run.refused[implementation] = str(error)
            continue
        torch.optim.SGD(model.parameters(), lr=0.1).step()  # it trains: a step, then the loss again
        with torch.no_grad():
            run.trained[implementation] = float(model(**batches["padded"]).loss)
    return run


@dataclass(frozen=True)
class Check:
    """One comparison: attnkit's error and eager's against the float64 truth, and the budget."""

    what: str
    ours: float
    theirs: float
    budget: float

    @property
    def ok(self) -> bool:
        return self.ours <= self.budget


def _check(what: str, actual: np.ndarray, oracle: np.ndarray, truth: np.ndarray, factor: float,
           scale: float) -> Check:
    """tests/conftest.py's `assert_within_budget`, as a value."""
    ours = float(np.max(np.abs(actual - truth))) if truth.size else 0.0
    theirs = float(np.max(np.abs(oracle - truth))) if truth.size else 0.0
    epsilon = ULPS * F32_EPS * max(scale, float(np.max(np.abs(truth))) if truth.size else 0.0)
    return Check(what, ours, theirs, factor * theirs + epsilon)


def budget_scale(run: CaseRun, name: str) -> float:
    """The magnitude the epsilon of `name`'s budget counts ulps at: its own largest truth,
    and for a gradient the largest gradient of its batch. Some gradients are exactly 0
    in exact arithmetic (a key bias: softmax ignores a shift of a row's scores), so
    their float32 values are the rounding of terms as large as the other gradients."""
    if not name.startswith("grad/"):
        return float(np.max(np.abs(run.truth[name])))
    batch = name.split("/")[1]
    return max(float(np.max(np.abs(t))) for key, t in run.truth.items() if key.startswith(f"grad/{batch}/"))


def _real_tokens(name: str, array: np.ndarray) -> np.ndarray:
    """The padded batch's logits at its real tokens only (see the module docstring)."""
    if name != "logits/padded":
        return array
    real = _batches()["padded"]["attention_mask"].numpy().astype(bool)  # (B, L)
    return array[real]


def compared(run: CaseRun, implementation: str):
    """(name, attnkit's value, eager float32's, the float64 truth) for every value of `run`,
    as the checks compare them ("attnkit_flash": the padded logits at real tokens)."""
    values = run.values[implementation]
    for name, truth in run.truth.items():
        arrays = (values[name], run.eager[name], truth)
        if implementation == FLASH:
            arrays = tuple(_real_tokens(name, a) for a in arrays)
        yield (name, *arrays)


def checks(run: CaseRun, implementation: str) -> list[Check]:
    """Every comparison of `implementation` in `run`: logits and losses (factor 2), gradients (3)."""
    return [
        _check(name, actual, oracle, truth, GRADIENT_FACTOR if name.startswith("grad/") else FORWARD_FACTOR,
               budget_scale(run, name))
        for name, actual, oracle, truth in compared(run, implementation)
    ]
