"""The hf suite: a random 4-layer Llama in transformers, forward + backward, on
"eager", "sdpa", "attnkit", "attnkit_flash" and "attnkit_tiled" attention side by side
(attnkit_flash: the tiled kernel through transformers' FlashAttention route;
attnkit_tiled: the same kernel through its 4-D masks).

Model: LlamaConfig(hidden 256, 4 heads of 64, 2 key/value heads, intermediate
512, vocab 256, 4 layers), float32, batch 1, causal LM loss over L tokens
(L = 1024, 2048, 4096; --quick: 256, 512), no padding (transformers hands a
plain causal pattern to sdpa and to attnkit as is_causal, no mask).

- time: one training step's forward + backward, the contenders timed round-robin
  in one process (`time_round_robin`: order reversed every other round, best of
  the rounds); "vs sdpa" is the median over rounds of sdpa's time / this one's.
- peak memory: the most resident memory one forward + backward adds above what
  the process held before it (model, inputs), sampled every millisecond
  (`peak_rss_bytes`), each contender in a fresh Python process so that no
  allocator cache from another contender hides or inflates its peak. torch's
  CPU allocations are invisible to tracemalloc; resident size is what the
  machine gives.

The project's goals (`goals`, shown by `attnkit bench hf --goals`): attnkit_flash's
peak memory <= 1/4 of eager's at L = 4096, and its fwd+bwd time >= 0.8x sdpa's
(sdpa time / its time >= 0.8); the goal lines give both for attnkit_tiled too.
"""

from __future__ import annotations

import json
import subprocess
import sys

from attnkit.bench.report import BenchReport, Progress
from attnkit.deprecation import keyword_only
from attnkit.runtime import cpu_count

IMPLEMENTATIONS = ("eager", "sdpa", "attnkit", "attnkit_flash", "attnkit_tiled")
MEMORY_EFFICIENT = ("attnkit_flash", "attnkit_tiled")  # the contenders the goals are about
FULL_LENGTHS, QUICK_LENGTHS = (1024, 2048, 4096), (256, 512)
GOAL_L, MEMORY_GOAL, SPEED_GOAL = 4096, 0.25, 0.8
CONFIG = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=8192, attention_dropout=0.0,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
COLUMNS = ["L", "impl", "fwd+bwd s", "vs sdpa", "peak MiB", "vs eager"]


def _model(implementation: str):
    import torch
    import transformers

    import attnkit.hf

    attnkit.hf.register()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**CONFIG)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=implementation)


def _step_fn(model, L: int):
    """One forward + backward of the LM loss on L random tokens, as a no-argument call."""
    import torch

    ids = torch.randint(3, CONFIG["vocab_size"], (1, L), generator=torch.Generator().manual_seed(L))

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return float(loss.detach())

    return step


def measure_peak_bytes(implementation: str, L: int, threads: int) -> int | None:
    """Peak resident growth of one forward + backward, in this process (call it in a fresh one)."""
    import torch

    from attnkit.bench.measure import peak_rss_bytes

    torch.set_num_threads(threads)
    model = _model(implementation)
    step = _step_fn(model, L)
    return peak_rss_bytes(step)


def _peak_in_fresh_process(implementation: str, L: int, threads: int) -> int | None:
    code = (
        "import json, sys\n"
        "from attnkit.bench.hf import measure_peak_bytes\n"
        f"sys.stdout.write(json.dumps(measure_peak_bytes({implementation!r}, {L}, {threads})))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"measuring {implementation} at L={L} failed: {result.stderr.strip()[-500:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


@keyword_only("quick", "progress", "threads")
def run(*, quick: bool, progress: Progress, threads: int | None = None) -> BenchReport:
    import torch

    from attnkit.bench.torch_modules import time_round_robin

    threads = threads or cpu_count()
    torch.set_num_threads(threads)
    lengths = QUICK_LENGTHS if quick else FULL_LENGTHS
    rounds, budget = (3, 30.0) if quick else (5, 240.0)
    progress.total(len(lengths) * (1 + len(IMPLEMENTATIONS)))
    models = {name: _model(name) for name in IMPLEMENTATIONS}
    rows, raw, goals = [], {"config": CONFIG, "threads": threads, "lengths": {}}, []
    for L in lengths:
        progress.step(f"L={L}: time, {', '.join(IMPLEMENTATIONS)} round-robin")
        # sdpa first: "paired_median" is the first contender's time / each one's, round by round
        order = ["sdpa"] + [name for name in IMPLEMENTATIONS if name != "sdpa"]
        timed = time_round_robin({name: _step_fn(models[name], L) for name in order}, rounds, budget)
        peaks = {}
        for name in IMPLEMENTATIONS:
            progress.step(f"L={L}: peak memory of {name} (fresh process)")
            peaks[name] = _peak_in_fresh_process(name, L, threads)
        raw["lengths"][L] = {"time": timed, "peak_bytes": peaks}
        for name in IMPLEMENTATIONS:
            peak, eager_peak = peaks[name], peaks["eager"]
            rows.append([
                L, name, round(timed[name]["best_s"], 3), round(timed[name]["paired_median"], 2),
                None if peak is None else round(peak / 2**20, 1),
                None if not (peak and eager_peak) else round(peak / eager_peak, 3),
            ])
        for name in MEMORY_EFFICIENT:
            speed = timed[name]["paired_median"]
            goals.append(f"{'PASS' if speed >= SPEED_GOAL else 'FAIL'} L={L}: {name} fwd+bwd at {speed:.2f}x "
                         f"sdpa's speed (goal >= {SPEED_GOAL})")
            if peaks[name] is not None and peaks["eager"]:
                share = peaks[name] / peaks["eager"]
                verdict = ("PASS" if share <= MEMORY_GOAL else "FAIL") if L == GOAL_L else "info"
                where = "" if L == GOAL_L else f" at L={GOAL_L}, not this length"
                goals.append(f"{verdict} L={L}: {name} peak memory {share:.3f} of eager's "
                             f"(goal <= {MEMORY_GOAL}{where})")
    notes = [f"float32, batch 1, {threads} torch threads; time: best of round-robin rounds; "
             "peak: resident growth of one fwd+bwd, fresh process per contender",
             "vs sdpa: median over rounds of sdpa's time / this one's (> 1: faster); "
             "vs eager: this one's peak / eager's"]
    title = "transformers Llama (4 layers, 256 wide, 4 heads): attention implementations, fwd+bwd"
    return BenchReport(title, COLUMNS, rows, notes, raw, goals)
