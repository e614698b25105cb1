"""A/B: the batched compiled step with one row against the one-sequence step it replaced.

The one-sequence compiled decode step (`step.decode_step`) became the N = 1 case of the
batched step (`step.batch_step`, issue 43). This loads SmolLM2's GGUF (Q4_1) once, takes
the old step's two files from a git revision (default 85ab2cd, before the change) into a
temporary folder as modules of their own (their native library named by their own digest),
builds both frames over the same blocks, and times one decode step of each in alternating
order, by the calling thread's CPU time (one thread: what a machine loaded by other work
does not inflate; `--threads 2` times wall clock), at a few cache lengths. Both use the
product loops of the checkout (`attnkit.quant`): the A/B is the step's own structure.

    PYTHONPATH=src python benchmarks/batched_step_one_row.py --revision 85ab2cd --rounds 40
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def old_step(revision: str, folder: Path):
    """The step module of `revision` (step.py importing its own step_kernels.py)."""
    root = Path(__file__).resolve().parents[1]

    def show(path: str) -> str:
        return subprocess.run(["git", "-C", str(root), "show", f"{revision}:{path}"], capture_output=True, text=True,
                              check=True).stdout

    (folder / "old_step_kernels.py").write_text(show("src/attnkit/models/llama/step_kernels.py"))
    step = show("src/attnkit/models/llama/step.py")
    step = step.replace("from attnkit.models.llama.step_kernels import", "from old_step_kernels import")
    step = step.replace('f"llama_step_{source_digest()}"', 'f"llama_oldstep_{source_digest()}"')
    (folder / "old_step.py").write_text(step)
    sys.path.insert(0, str(folder))
    import old_step as module

    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--revision", default="85ab2cd")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--slots", type=int, nargs="+", default=[60, 500, 1000])
    args = parser.parse_args()
    from attnkit.models import AutoCausalLM
    from attnkit.models.llama import fused, step

    model = AutoCausalLM.from_pretrained("smollm2")
    found = fused._prepared(model)
    table, orders, floats, norms = found.frame.keep[:4]
    c = model.config
    with tempfile.TemporaryDirectory() as folder:
        old = old_step(args.revision, Path(folder))
        old_frame = old.prepare(table, orders, list(norms), list(floats[1:]), floats[0], c.num_heads, c.num_kv_heads,
                                c.head_dim, found.frame.vocab)
        shape = (c.num_layers, c.num_kv_heads, max(args.slots) + 1, c.head_dim)
        keys = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        contenders = {"one-sequence step (old)": (old.decode_step, old_frame, keys.copy(), keys.copy()),
                      "batched step, N = 1": (step.decode_step, found.frame, keys.copy(), keys.copy())}
        clock = time.thread_time if args.threads == 1 else time.perf_counter
        print(f"SmolLM2 Q4_1 decode step, {args.threads} thread(s), {'CPU' if args.threads == 1 else 'wall'} "
              f"time, best and median of {args.rounds} alternating rounds")
        for slot in args.slots:
            cos, sin = model.rotary.at(slot)
            times: dict[str, list[float]] = {name: [] for name in contenders}
            for k in range(args.rounds):
                for name in list(contenders)[:: 1 if k % 2 else -1]:
                    fn, frame, kk, vv = contenders[name]
                    start = clock()
                    fn(7, slot, frame, cos, sin, kk, vv, parts=args.threads)
                    times[name].append(clock() - start)
            line = ", ".join(f"{name} {1e3 * min(t):.2f} / {1e3 * float(np.median(t)):.2f} ms"
                             for name, t in times.items())
            old_t, new_t = (float(np.median(t)) for t in times.values())
            print(f"  {slot} cached: {line}; old / new (medians) {old_t / new_t:.3f}")


if __name__ == "__main__":
    main()
