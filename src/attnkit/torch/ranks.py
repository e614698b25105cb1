"""Run a function on W local ranks: `run_on_ranks` starts W fresh processes joined in
one gloo process group on this machine and collects each rank's result or error.

For tests and benchmarks of `attnkit.torch.distributed` (and anything else that
needs a small process group on one machine). `attnkit.torch.distributed`
re-exports both names, so `from attnkit.torch.distributed import run_on_ranks`
still works.
"""

from __future__ import annotations

import datetime
import pickle
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

__all__ = ["RankOutcome", "run_on_ranks"]


class RankOutcome(NamedTuple):
    """What one rank of `run_on_ranks` returned, or the error it raised (one line), or None."""

    value: object
    error: str | None


def _rank_main(rank, world, fn, args, init_file, timeout_s, threads, queue):
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        try:
            # plain pickle: tensors travel by value, not as shared memory the exiting rank would take along
            queue.put((rank, pickle.dumps(fn(rank, world, *args)), None))
        finally:
            dist.destroy_process_group()
    except BaseException as error:  # noqa: BLE001  (reported to the parent, which raises)
        queue.put((rank, None, f"{type(error).__name__}: {error}".splitlines()[0][:2000]))


def run_on_ranks(fn: Callable, world_size: int, *args, timeout_s: float = 60.0, threads: int = 1) -> list[RankOutcome]:
    """Run `fn(rank, world_size, *args)` in `world_size` fresh processes joined in one
    gloo process group on this machine; return each rank's RankOutcome, in rank order.

    fn and args must be picklable (a module-level function) and fn's result too.
    The group's timeout is `timeout_s`, so a rank left waiting on a dead peer
    raises; a rank that exits without a result gets an error naming its exit
    code; past 2 * timeout_s + 30 s the ranks still running are terminated and
    get a "timed out" error. For tests and benchmarks."""
    import multiprocessing
    import os
    import queue as queue_module
    import tempfile
    import time

    context = multiprocessing.get_context("spawn")
    results: dict[int, RankOutcome] = {}
    with tempfile.TemporaryDirectory() as folder:
        init_file = os.path.join(folder, "rendezvous")
        queue = context.Queue()
        processes = [context.Process(target=_rank_main, daemon=True,
                                     args=(rank, world_size, fn, args, init_file, timeout_s, threads, queue))
                     for rank in range(world_size)]
        for process in processes:
            process.start()
        deadline = time.monotonic() + 2 * timeout_s + 30
        exited_at: dict[int, float] = {}
        while len(results) < world_size and time.monotonic() < deadline:
            try:
                rank, value, error = queue.get(timeout=0.2)
                results[rank] = RankOutcome(None if value is None else pickle.loads(value), error)
                continue
            except queue_module.Empty:
                pass
            now = time.monotonic()
            for rank, process in enumerate(processes):
                if rank not in results and process.exitcode is not None:
                    # its result may still be in the pipe: give it a moment
                    if now - exited_at.setdefault(rank, now) > 2.0:
                        results[rank] = RankOutcome(None, f"rank {rank} exited with code {process.exitcode}")
        for rank, process in enumerate(processes):
            if rank not in results:
                results[rank] = RankOutcome(None, f"rank {rank} timed out")
            process.join(timeout=5)
            if process.is_alive():
                process.terminate()
                process.join()
    return [results[rank] for rank in range(world_size)]
