"""`generate` on a (B, T) batch of SmolLM2 (Q4_1): decode tokens/s by the calling thread's CPU
time, one thread, the compiled batched step against the module path (`intervene({})` keeps
the layers on the modules), interleaved, best of 2 rounds.

    PYTHONPATH=src python benchmarks/generate_batch.py
"""
import time, numpy as np
from attnkit.models import AutoCausalLM
from attnkit.runtime import blas_threads
from attnkit.bench.decoder import PROMPT
from attnkit.nn.interface import intervene
m = AutoCausalLM.from_pretrained("smollm2")
ids = m.tokenizer.encode(PROMPT)
new = 17
res = {}
def run(B, modules):
    stamps = []
    with blas_threads(1):
        if modules:
            with intervene({}):
                m.generate([ids] * B, new, stop=(), on_token=lambda _: stamps.append(time.thread_time()))
        else:
            m.generate([ids] * B, new, stop=(), on_token=lambda _: stamps.append(time.thread_time()))
    return B * (len(stamps) - 1) / (stamps[-1] - stamps[0])
for rnd in range(2):
    for B in (1, 4, 8):
        for modules in (False, True):
            res.setdefault((B, modules), []).append(run(B, modules))
for (B, modules), r in sorted(res.items()):
    print(f"B {B} {'modules ' if modules else 'compiled'}: decode tok/s by CPU time, best {max(r):.1f}")
