"""The induction-head model trained context-parallel: its sequence split over processes.

    torchrun --nproc-per-node 2 -m attnkit.torch.train_cp --png head.png
    attnkit train --context-parallel 2          # launches the processes itself

Every rank builds the same `InductionModel` (same seed) and draws the same
batches; each keeps its shard of every sequence (`shard_sequence`, zigzag by
default), embeds it with its global positions, and runs the blocks with
`context_parallel` set, so that attention spans the whole sequence through
ring (or Ulysses) attention. Each rank's loss is its share of the
single-process loss (the sum over its predictable positions divided by the
count over the whole batch); the gradients are summed over the ranks with one
all-reduce, then every rank takes the same clipped AdamW step as
`train_induction`. The loss curve is the single-process one up to float32
rounding (tests/torch/test_distributed.py checks 50 steps).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from attnkit.torch.distributed import ContextParallel, shard_bounds
from attnkit.torch.ranks import run_on_ranks
from attnkit.torch.induction import (
    InductionConfig, InductionModel, StepMetrics, evaluate, find_copy_head, make_batch, plot_copy_head,
)

__all__ = ["train_context_parallel", "train_on_local_ranks", "main"]


def _optimizer(model: InductionModel, config: InductionConfig):
    """train_induction's AdamW (decay on matrices but embeddings) and warmup-cosine schedule."""
    def decays(name, p):
        return p.dim() >= 2 and "embed" not in name and "pos" not in name

    decay = [p for n, p in model.named_parameters() if decays(n, p)]
    rest = [p for n, p in model.named_parameters() if not decays(n, p)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=config.lr, betas=(0.9, 0.98),
    )

    def lr_at(step: int) -> float:  # linear warmup, cosine decay to 10%
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)


def _forward_shard(model: InductionModel, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Logits (B, L_local, vocab) of this rank's positions; attention spans every rank's."""
    x = model.embed(tokens) + model.pos(positions)  # (B, L_local, d_model)
    for block in model.blocks:
        x = block(x, is_causal=True)
    return model.unembed(model.norm(x))


def train_context_parallel(
    config: InductionConfig = InductionConfig(),
    group=None,
    *,
    layout: str = "zigzag",
    method: str = "ring",
    callback: Callable[[StepMetrics], None] | None = None,
) -> tuple[InductionModel, list[StepMetrics]]:
    """train_induction's run with every sequence sharded over the ranks of `group`.

    Call it on every rank of an initialized process group. Returns (model, the
    per-step history), the same on every rank (loss and accuracy are over the
    whole batch). No held-out evaluation: call `induction.evaluate` on the model.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(config.seed)
    model = InductionModel(config)
    spec = ContextParallel(group, layout, method)
    for block in model.blocks:
        block.attn.context_parallel = spec
    model.train()
    optimizer, scheduler = _optimizer(model, config)
    data = torch.Generator().manual_seed(config.seed + 1_000_003)  # train_induction's data stream
    T = config.seq_len
    positions = torch.cat([torch.arange(a, b) for a, b in shard_bounds(T, world, layout)[rank]])  # (L_local,)
    parameters = [p for p in model.parameters()]
    history: list[StepMetrics] = []
    for step in range(config.steps):
        tokens, period = make_batch(config, config.batch_size, data)
        # position t predicts token t + 1, inside the repetition (t >= period)
        predictable = (positions[None, :] < T - 1) & (positions[None, :] >= period[:, None])  # (B, L_local)
        count = int(((torch.arange(T - 1)[None, :] >= period[:, None])).sum())  # over the whole batch
        logits = _forward_shard(model, tokens[:, positions], positions)
        targets = tokens[:, (positions + 1).clamp(max=T - 1)]
        chosen, wanted = logits[predictable], targets[predictable]
        loss = F.cross_entropy(chosen, wanted, reduction="sum") / count
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        for p in parameters:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = torch.cat([p.grad.reshape(-1) for p in parameters])
        totals = torch.stack([loss.detach(), (chosen.detach().argmax(-1) == wanted).sum().to(loss.dtype)])
        merged = torch.cat([grads, totals])
        dist.all_reduce(merged, group=group)  # the whole batch's gradient, loss and correct count
        offset = 0
        for p in parameters:
            p.grad.copy_(merged[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        scheduler.step()
        metrics = StepMetrics(step + 1, float(merged[-2]), float(merged[-1]) / count)
        history.append(metrics)
        if callback is not None:
            callback(metrics)
    model.eval()
    for block in model.blocks:
        block.attn.context_parallel = None  # a model for one process again (evaluate, find_copy_head)
    return model, history


def _rank_train(rank: int, world: int, fields: dict, layout: str, method: str):
    """run_on_ranks' worker: rank 0 returns (history, state_dict), the others (history, None)."""
    model, history = train_context_parallel(InductionConfig(**fields), layout=layout, method=method)
    return [tuple(m) for m in history], (model.state_dict() if rank == 0 else None)


def train_on_local_ranks(config: InductionConfig, world_size: int, *, layout: str = "zigzag",
                         method: str = "ring", timeout_s: float = 600.0) -> tuple[InductionModel, list[StepMetrics]]:
    """train_context_parallel in `world_size` local processes (gloo); returns rank 0's
    trained model and history. Raises RuntimeError with the first rank's error."""
    fields = {name: getattr(config, name) for name in config.__dataclass_fields__}
    outcomes = run_on_ranks(_rank_train, world_size, fields, layout, method, timeout_s=timeout_s)
    errors = [f"rank {r}: {o.error}" for r, o in enumerate(outcomes) if o.error is not None]
    if errors:
        raise RuntimeError("context-parallel training failed: " + "; ".join(errors))
    history, state = outcomes[0].value
    model = InductionModel(config)
    model.load_state_dict(state)
    model.eval()
    return model, [StepMetrics(*m) for m in history]


LAUNCH = "torchrun --nproc-per-node 2 -m attnkit.torch.train_cp"
# The example's default run: InductionConfig's model and learning rate, half its steps. The
# one-process run (the same loss curve) reaches 99.9-100% held-out accuracy at 200 steps for
# seeds 0, 1 and 2 (two processes' time for it: docs/benchmarks.md).
DEFAULT_STEPS = 200


def _example_config(steps: int = DEFAULT_STEPS, **overrides) -> InductionConfig:
    """The example's InductionConfig: `steps`, a warmup of an eighth of them (at most 50), as `attnkit train`."""
    return InductionConfig(steps=steps, warmup_steps=min(50, max(1, steps // 8)), **overrides)


def _summary(history: list[StepMetrics], model: InductionModel, seconds: float, world: int) -> list[str]:
    """The closing lines: the last step's loss and accuracy, the held-out accuracy, the time, and what they mean."""
    config = model.config
    last = history[-1]
    eval_loss, eval_accuracy = evaluate(model)
    head = find_copy_head(model)
    chance = 1.0 / (config.vocab_size - 1)
    if eval_accuracy >= 0.95:
        meaning = (f"the model learned to copy: predicting the repeated half needs an induction head, here "
                   f"layer {head.layer} head {head.head} (it puts {head.score:.0%} of its weight on the token to copy)")
    else:
        meaning = (f"not learned yet (chance is {chance:.0%}, learned is about 100%): "
                   f"train longer, --steps {max(2 * config.steps, InductionConfig.steps)}")
    return [
        f"trained {last.step} steps in {seconds:.1f} s on {world} processes, each holding 1/{world} of every sequence",
        f"final training loss {last.loss:.4f}, accuracy {last.accuracy:.1%} (the last batch's repeated half)",
        f"held-out accuracy {eval_accuracy:.1%} on fresh sequences (loss {eval_loss:.4f}; chance {chance:.0%})",
        meaning,
    ]


def _check_png(name: str | None) -> str | None:
    """The reason `name` cannot be written as the picture, or None."""
    if name is None:
        return None
    folder = os.path.dirname(os.path.abspath(name))
    if not name.lower().endswith(".png"):
        return f"expected --png to name a .png file, got {name!r}"
    if os.path.isdir(name):
        return f"cannot write --png {name}: it is a folder"
    if not os.path.isdir(folder):
        return f"cannot write --png {name}: folder {folder!r} does not exist"
    if importlib.util.find_spec("matplotlib") is None:
        return "--png needs matplotlib: pip install 'attnkit[png]'"
    return None


def main(argv: list[str] | None = None) -> int:
    """`torchrun --nproc-per-node N -m attnkit.torch.train_cp [options]`: rank 0 reports.

    Prints the configuration, the loss and accuracy at every tenth of the steps, and a
    summary (final loss and accuracy, held-out accuracy, time, and what they mean); with
    `--png FILE.png` it saves the copying head's attention and says so. Started without
    torchrun, it says in one line how to start it and returns 2.
    """
    defaults = InductionConfig()
    parser = argparse.ArgumentParser(
        prog="python -m attnkit.torch.train_cp",
        description=f"Train the induction-head model context-parallel: each sequence split over the processes "
                    f"that torchrun starts ({LAUNCH}).",
    )
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                        help=f"optimizer steps (default {DEFAULT_STEPS}, enough to learn the task)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--half-len", type=int, default=defaults.half_len)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--lr", type=float, default=defaults.lr,
                        help=f"peak AdamW learning rate (default {defaults.lr})")
    parser.add_argument("--layout", choices=("zigzag", "contiguous"), default="zigzag")
    parser.add_argument("--method", choices=("ring", "ulysses"), default="ring")
    parser.add_argument("--png", metavar="FILE.png", help="save the copying head's attention as a PNG")
    args = parser.parse_args(argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        sys.stderr.write(f"error: attnkit.torch.train_cp is one of several processes that torchrun starts: "
                         f"run {LAUNCH} (or attnkit train --context-parallel 2, which starts them itself)\n")
        return 2
    problem = _check_png(args.png)
    try:
        config = _example_config(args.steps, seed=args.seed, half_len=args.half_len, batch_size=args.batch_size,
                                 lr=args.lr)
    except ValueError as error:
        problem = problem or str(error)
    if problem is not None:
        if os.environ["RANK"] == "0":
            sys.stderr.write(f"error: {problem}\n")
        return 2
    dist.init_process_group("gloo")  # CPU processes; see docs/distributed.md for NCCL
    try:
        torch.set_num_threads(1)
        rank, world = dist.get_rank(), dist.get_world_size()
        every = max(1, config.steps // 10)

        def say(line: str) -> None:
            if rank == 0:
                sys.stdout.write(line + "\n")
                sys.stdout.flush()

        def report(metrics: StepMetrics) -> None:
            if metrics.step % every == 0 or metrics.step in (1, config.steps):
                say(f"step {metrics.step:{len(str(config.steps))}d}/{config.steps}  loss {metrics.loss:.4f}  "
                    f"accuracy {metrics.accuracy:6.1%}")

        say(f"context-parallel training of the induction-head model on {world} processes ({args.method}, "
            f"{args.layout}): {config.steps} steps, sequences of {config.half_len} random tokens then the same again")
        start = time.perf_counter()
        model, history = train_context_parallel(config, layout=args.layout, method=args.method, callback=report)
        seconds = time.perf_counter() - start
        if rank == 0:
            for line in _summary(history, model, seconds, world):
                say(line)
            if args.png is not None:
                existed = os.path.exists(args.png)
                plot_copy_head(find_copy_head(model), args.png, config.half_len)
                say(f"wrote {args.png}" + (" (replaced the file that was there)" if existed else ""))
        # Leave together: a rank that tore its gloo group down while rank 0 still drew the
        # picture could abort at exit ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
