"""The distributed suite: ring attention at a fixed total length over W = 1, 2, 4 ranks.

Causal self-attention, float32, B = 1, H = 4 heads of E = 64, the sequence
cut zigzag over W gloo processes on this machine (`run_on_ranks`), forward and
backward. Per configuration, each rank measures:

- time of forward + backward (median of the repeats; a step takes as long as
  its slowest rank);
- peak memory: the growth of the process's resident size during forward and
  backward, inputs and gradients included (sampled every millisecond);
- saved activations: the bytes autograd keeps from the forward for the backward
  (what a training step holds per attention layer);
- communication: bytes each rank sends per step, forward and backward.

Rings run with overlap (the next key/value shard is on the wire while the
current one is computed) and without (each transfer completes before compute).
W = 1 is the same code with no transfer. On a machine with fewer cores than
ranks the processes share cores: times then show contention, not speed-up;
the report says how many CPUs there were.
"""

from __future__ import annotations

import statistics

from attnkit.bench.report import BenchReport, Progress
from attnkit.deprecation import keyword_only
from attnkit.runtime import cpu_count

HEADS, HEAD_DIM = 4, 64
DEPTH = 4  # the full run also stacks this many attention layers, as a model keeps their activations
COLUMNS = ["layers", "W", "overlap", "L / rank", "fwd+bwd ms", "peak MiB / rank", "peak vs W=1", "saved MiB / rank",
           "saved vs W=1", "sent MiB / rank / step"]


def _rank_step(rank: int, world: int, length: int, overlap: bool, repeats: int, depth: int = 1):
    """run_on_ranks worker: time, peak memory, saved activations and bytes sent of one rank."""
    import time

    import torch
    import torch.distributed as dist

    from attnkit.bench.measure import peak_rss_bytes
    from attnkit.torch.distributed import ring_attention, shard_bounds

    try:  # glibc: every tensor of 64 KiB and up mmap'ed, so that freeing it shows in the resident size
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass
    local = sum(b - a for a, b in shard_bounds(length, world, "zigzag")[rank])
    g = torch.Generator().manual_seed(rank)
    stats: dict = {}

    def step():
        q, k, v, do = (torch.randn(1, HEADS, local, HEAD_DIM, generator=g) for _ in range(4))
        q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
        out = q
        for _ in range(depth):  # `depth` attention layers, each keeping its activations for the backward
            out = ring_attention(out, k, v, causal=True, layout="zigzag", overlap=overlap, stats=stats)
        out.backward(do)
        return q.grad

    saved: dict = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()  # each storage once
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()  # warm-up, and the saved bytes
    times, peaks = [], []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        peaks.append(peak_rss_bytes(step))
        times.append(time.perf_counter() - start)
    return {"times": times, "peak": max(p or 0 for p in peaks), "saved": sum(saved.values()),
            "sent": stats.get("backward_bytes", 0) + stats.get("forward_bytes", 0)}


def _link_bandwidth(rank: int, world: int, megabytes: int, repeats: int) -> float:
    """run_on_ranks worker: bytes per second one rank sends to the next while receiving
    from the previous (the ring's exchange), median of `repeats`."""
    import time

    import torch
    import torch.distributed as dist

    send = torch.ones(megabytes << 18)  # float32: megabytes MiB
    recv = torch.empty_like(send)
    peer_next, peer_prev = (rank + 1) % world, (rank - 1) % world
    rates = []
    for _ in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer_next), dist.P2POp(dist.irecv, recv, peer_prev)])
        for work in works:
            work.wait()
        rates.append(send.numel() * 4 / (time.perf_counter() - start))
    return statistics.median(rates[1:])


@keyword_only("quick", "progress", "threads")
def run(*, quick: bool, progress: Progress, threads: int | None = None) -> BenchReport:
    from attnkit.torch.ranks import run_on_ranks

    length = 2048 if quick else 8192
    repeats = 2 if quick else 3
    configs = [(1, True, 1), (2, True, 1), (2, False, 1)]
    if not quick:
        configs += [(4, True, 1), (4, False, 1), (1, True, DEPTH), (2, True, DEPTH)]
    progress.total(len(configs) + 1)
    progress.step("gloo point-to-point bandwidth, 2 ranks")
    outcomes = run_on_ranks(_link_bandwidth, 2, 16, 3 if quick else 7, timeout_s=120, threads=1)
    bandwidth = min(o.value for o in outcomes) if all(o.error is None for o in outcomes) else None
    measured = {}
    for world, overlap, depth in configs:
        progress.step(f"W={world}, overlap={overlap}, {depth} layer(s)")
        outcomes = run_on_ranks(_rank_step, world, length, overlap, repeats, depth, timeout_s=600, threads=1)
        errors = [o.error for o in outcomes if o.error]
        if errors:
            raise RuntimeError(f"distributed bench W={world}: {errors[0]}")
        values = [o.value for o in outcomes]
        step_times = [max(v["times"][i] for v in values) for i in range(repeats)]
        measured[(world, overlap, depth)] = {
            "ms": 1e3 * statistics.median(step_times),
            "peak": max(v["peak"] for v in values),
            "saved": max(v["saved"] for v in values),
            "sent": max(v["sent"] for v in values),
            "per_rank": values,
        }
    mib = 2.0**20
    rows = []
    for (world, overlap, depth), m in measured.items():
        base = measured[(1, True, depth)]
        rows.append([
            depth, world, "yes" if overlap else "no", length // world, round(m["ms"], 1), round(m["peak"] / mib, 1),
            round(m["peak"] / base["peak"], 2) if base["peak"] else None, round(m["saved"] / mib, 2),
            round(m["saved"] / base["saved"], 2), round(m["sent"] / mib, 2),
        ])
    cpus = cpu_count()
    notes = [
        f"causal ring attention, zigzag, float32, B=1, H={HEADS}, E={HEAD_DIM}, total length {length}; "
        f"forward + backward; one torch thread per rank, gloo on {cpus} CPU(s)",
        "peak = resident-size growth during the step (inputs, gradients, transfer buffers); "
        "saved = what autograd keeps from the forward for the backward",
        "sent per step = K/V shards (W - 1 hops, forward and backward) + dK/dV accumulators (W hops)",
    ]
    if bandwidth is not None:
        notes.append(f"gloo point-to-point on this machine (loopback TCP, 16 MiB messages both ways): "
                     f"{bandwidth / 1e9:.2f} GB/s per direction")
    if cpus < max(w for w, _, _ in configs):
        notes.append(f"more ranks than CPUs ({cpus}): the ranks share cores, so times show contention, not speed-up")
    raw = {"length": length, "heads": HEADS, "bandwidth_bytes_per_s": bandwidth, "head_dim": HEAD_DIM, "repeats": repeats, "cpus": cpus,
           "configs": [{"world": w, "overlap": o, "layers": d, **m} for (w, o, d), m in measured.items()]}
    return BenchReport("ring attention at a fixed total length", COLUMNS, rows, notes, raw)
