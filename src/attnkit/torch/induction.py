"""A task only attention can solve: copy a random sequence (induction heads).

Each example is n distinct random tokens followed by the same n tokens again.
Inside the repeated half, the next token is the one that followed the current
token's first occurrence: a model predicts it by finding that occurrence and
copying its successor (an induction head: one head marks "the token before me
was X", a head in the next layer attends to the position after the earlier X).
Nothing else in the prefix determines it, so accuracy on the repeated half is
a direct measure of what attention learned.

Accuracy is measured on the n - 1 predictions whose targets are the second to
last tokens of the repeated half (the first repeated token follows the last
random one and cannot be predicted).

The model is a small decoder built from attnkit.torch.TransformerBlock (pre-LN,
causal). `train_induction` is deterministic for a seed on a given machine; the
CLI (`attnkit train`) wraps it with a progress bar and draws the copying head.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from attnkit.torch.block import TransformerBlock

__all__ = [
    "CopyHead",
    "InductionConfig",
    "InductionModel",
    "StepMetrics",
    "TrainResult",
    "evaluate",
    "find_copy_head",
    "Batch",
    "make_batch",
    "plot_copy_head",
    "train_induction",
]


@dataclass(frozen=True)
class InductionConfig:
    """Task, model and optimizer sizes. The defaults train in about a minute on a 2-core CPU."""

    vocab_size: int = 24  # tokens 0..vocab_size-1; the n tokens of a sequence are distinct
    half_len: int = 12  # n: sequences are 2n tokens; at test time n random then the same n again
    min_half_len: int = 6  # training draws the period k from [min_half_len, half_len]
    d_model: int = 64
    num_heads: int = 4
    num_layers: int = 2
    d_ff: int = 128
    activation: str = "gelu"
    batch_size: int = 64
    steps: int = 400
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup_steps: int = 50
    seed: int = 0

    def __post_init__(self) -> None:
        positive = ("vocab_size", "half_len", "d_model", "num_heads", "num_layers", "d_ff", "batch_size", "steps")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"expected {name} to be a positive int, got {value!r}")
        if self.half_len < 2:
            raise ValueError(f"expected half_len >= 2 (one predictable token at least), got {self.half_len}")
        if not 2 <= self.min_half_len <= self.half_len:
            raise ValueError(
                f"expected 2 <= min_half_len <= half_len, got min_half_len={self.min_half_len}, half_len={self.half_len}"
            )
        if self.half_len > self.vocab_size:
            raise ValueError(
                f"expected half_len <= vocab_size (the first half has distinct tokens), "
                f"got half_len={self.half_len}, vocab_size={self.vocab_size}"
            )
        if self.d_model % self.num_heads:
            raise ValueError(f"expected num_heads to divide d_model, got {self.d_model} and {self.num_heads}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"expected lr > 0, got {self.lr}")

    @property
    def seq_len(self) -> int:
        return 2 * self.half_len


class Batch(NamedTuple):
    tokens: torch.Tensor  # (B, 2n) int64
    period: torch.Tensor  # (B,) k: tokens[t] == tokens[t - k] for t >= k


def make_batch(
    config: InductionConfig, batch_size: int, generator: torch.Generator, *, fixed_period: bool = False
) -> Batch:
    """Sequences of 2n tokens made of k distinct random tokens repeated: t -> x[t mod k].

    k is drawn per sequence from [min_half_len, half_len] (so no fixed position
    offset solves the task, only looking up the earlier occurrence), or is n for
    every sequence with fixed_period=True: n random tokens followed by the same n.
    """
    n, T = config.half_len, config.seq_len
    order = torch.rand(batch_size, config.vocab_size, generator=generator).argsort(dim=-1)  # (B, V)
    first = order[:, :n]  # (B, n) distinct tokens per row
    if fixed_period or config.min_half_len == n:
        period = torch.full((batch_size,), n)
    else:
        period = torch.randint(config.min_half_len, n + 1, (batch_size,), generator=generator)  # (B,)
    index = torch.arange(T)[None, :] % period[:, None]  # (B, T)
    return Batch(first.gather(1, index), period)


class InductionModel(nn.Module):
    """Token + learned position embeddings, pre-LN causal TransformerBlocks, final LayerNorm, unembedding."""

    def __init__(self, config: InductionConfig) -> None:
        super().__init__()
        self.config = config
        generator = torch.Generator().manual_seed(config.seed)
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.pos = nn.Embedding(config.seq_len, config.d_model)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(self.embed.weight.shape, generator=generator) * 0.5)
            self.pos.weight.copy_(torch.randn(self.pos.weight.shape, generator=generator) * 0.5)
        self.blocks = nn.ModuleList(
            TransformerBlock(
                config.d_model,
                config.num_heads,
                config.d_ff,
                activation=config.activation,
                norm_first=True,
                seed=config.seed + 1 + i,  # attnkit.nn's initial weights for this seed
            )
            for i in range(config.num_layers)
        )
        self.norm = nn.LayerNorm(config.d_model)
        self.unembed = nn.Linear(config.d_model, config.vocab_size)
        with torch.no_grad():
            bound = 1.0 / math.sqrt(config.d_model)
            self.unembed.weight.copy_(torch.rand(self.unembed.weight.shape, generator=generator) * 2 * bound - bound)
            self.unembed.bias.zero_()

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2 or tokens.shape[1] > self.config.seq_len:
            raise ValueError(f"expected tokens of shape (B, T) with T <= {self.config.seq_len}, got {tuple(tokens.shape)}")
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.embed(tokens) + self.pos(positions)  # (B, T, d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) -> next-token logits (B, T, vocab_size)."""
        x = self._embed(tokens)
        for block in self.blocks:
            x = block(x, is_causal=True)
        return self.unembed(self.norm(x))

    @torch.no_grad()
    def attention_maps(self, tokens: torch.Tensor) -> torch.Tensor:
        """Every head's attention weights: (num_layers, B, num_heads, T, T).

        """
        x = self._embed(tokens)
        maps = []
        for block in self.blocks:
            x, weights = block(x, is_causal=True, need_weights=True, average_attn_weights=False)
            maps.append(weights)  # (B, H, T, T)
        return torch.stack(maps)


def _repeat_half(logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The predictable predictions and their targets: (N, vocab) logits, (N,) tokens.

    Position t predicts token t + 1; inside the repetition (t >= k) that token is
    known from the first occurrence of token t. For k = n these are the n - 1
    predictions at positions n..2n-2.
    """
    tokens, period = batch
    positions = torch.arange(tokens.shape[1] - 1)  # (T-1,)
    predictable = positions[None, :] >= period[:, None]  # (B, T-1)
    return logits[:, :-1][predictable], tokens[:, 1:][predictable]


class StepMetrics(NamedTuple):
    step: int
    loss: float
    accuracy: float  # on the repeated half of this training batch


class TrainResult(NamedTuple):
    model: InductionModel
    history: list[StepMetrics]
    eval_accuracy: float  # on fresh held-out sequences
    eval_loss: float
    seconds: float


@torch.no_grad()
def evaluate(
    model: InductionModel, batches: int = 8, batch_size: int = 256, seed: int = 10_000, *, fixed_period: bool = True
) -> tuple[float, float]:
    """(loss, accuracy) on the repeated half of fresh sequences drawn from `seed`.

    fixed_period=True is the task as stated: n random tokens, then the same n.
    """
    config = model.config
    generator = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    correct = total = 0
    loss_sum = 0.0
    for _ in range(batches):
        batch = make_batch(config, batch_size, generator, fixed_period=fixed_period)
        logits, targets = _repeat_half(model(batch.tokens), batch)
        loss_sum += F.cross_entropy(logits, targets, reduction="sum").item()
        correct += (logits.argmax(-1) == targets).sum().item()
        total += targets.numel()
    model.train(was_training)
    return loss_sum / total, correct / total


def train_induction(
    config: InductionConfig = InductionConfig(),
    callback: Callable[[StepMetrics], None] | None = None,
    *,
    eval_batches: int = 8,
) -> TrainResult:
    """Train an InductionModel on fresh batches of the copy task; seeded and deterministic.

    Arguments:
        config: sizes and optimizer settings (config.seed drives init and data).
        callback: called after every step with StepMetrics (the CLI's progress bar).
        eval_batches: held-out batches of 256 sequences for the final accuracy.
    Returns:
        TrainResult(model in eval mode, per-step history, held-out accuracy and loss, seconds).
    """
    torch.manual_seed(config.seed)  # nothing in training draws from it; set for code that might
    model = InductionModel(config)
    model.train()
    data = torch.Generator().manual_seed(config.seed + 1_000_003)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n and "pos" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n and "pos" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=config.lr,
        betas=(0.9, 0.98),
    )

    def lr_at(step: int) -> float:  # linear warmup, cosine decay to 10%
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    history: list[StepMetrics] = []
    start = time.perf_counter()
    for step in range(config.steps):
        batch = make_batch(config, config.batch_size, data)
        logits, targets = _repeat_half(model(batch.tokens), batch)
        loss = F.cross_entropy(logits, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        accuracy = (logits.detach().argmax(-1) == targets).float().mean().item()
        metrics = StepMetrics(step + 1, loss.item(), accuracy)
        history.append(metrics)
        if callback is not None:
            callback(metrics)
    seconds = time.perf_counter() - start
    model.eval()
    eval_loss, eval_accuracy = evaluate(model, batches=eval_batches)
    return TrainResult(model, history, eval_accuracy, eval_loss, seconds)


class CopyHead(NamedTuple):
    layer: int
    head: int
    score: float  # mean weight a repeated-half query puts on the token after its earlier occurrence
    scores: torch.Tensor  # (num_layers, num_heads), every head's score
    weights: torch.Tensor  # (T, T), this head's attention on the example sequence
    tokens: torch.Tensor  # (T,), the example sequence


@torch.no_grad()
def find_copy_head(model: InductionModel, seed: int = 20_000, batch_size: int = 64) -> CopyHead:
    """The head that attends from each repeated token to the successor of its first
    occurrence (query t to key t - n + 1), scored on fresh sequences."""
    config = model.config
    n = config.half_len
    tokens = make_batch(config, batch_size, torch.Generator().manual_seed(seed), fixed_period=True).tokens
    maps = model.attention_maps(tokens)  # (layers, B, H, T, T)
    queries = torch.arange(n, 2 * n - 1)  # the repeated-half queries that predict a token
    stripe = maps[..., queries, queries - n + 1]  # (layers, B, H, n)
    scores = stripe.mean(dim=(1, 3))  # (layers, H)
    best = int(scores.argmax())
    layer, head = divmod(best, config.num_heads)
    return CopyHead(layer, head, float(scores[layer, head]), scores, maps[layer, 0, head], tokens[0])


def plot_copy_head(copy_head: CopyHead, path, half_len: int) -> None:
    """Save the copying head's attention on one sequence as a PNG heatmap."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    weights = copy_head.weights.float().numpy()
    labels = [str(int(t)) for t in copy_head.tokens]
    T = len(labels)
    fig, ax = plt.subplots(figsize=(6.4, 5.6), dpi=120)
    image = ax.imshow(weights, cmap="viridis", vmin=0.0, vmax=1.0)
    ax.set_xticks(range(T), labels, fontsize=7)
    ax.set_yticks(range(T), labels, fontsize=7)
    ax.set_xlabel("key (attended-to token)")
    ax.set_ylabel("query (current token)")
    ax.axhline(half_len - 0.5, color="white", linewidth=0.8, linestyle="--")
    ax.axvline(half_len - 0.5, color="white", linewidth=0.8, linestyle="--")
    ax.set_title(
        f"layer {copy_head.layer} head {copy_head.head}: the copying head\n"
        f"query t attends to key t-{half_len - 1} (score {copy_head.score:.2f})",
        fontsize=10,
    )
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="attention weight")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def with_overrides(config: InductionConfig, **overrides) -> InductionConfig:
    """`config` with the given fields replaced (None values ignored)."""
    return replace(config, **{k: v for k, v in overrides.items() if v is not None})
