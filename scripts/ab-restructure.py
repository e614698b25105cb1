#!/usr/bin/env python3
"""A/B: is anything slower after the 0.2 restructure? Old and new attnkit, the same benches,
alternately, in one sitting.

Checks out OLD (default e6a719e, the commit before the restructure) into a temporary git
worktree and runs `attnkit bench SUITE --quick --json FILE` from it and from this checkout
(each with PYTHONPATH at its own src/), alternately old/new (the first of each pair switching
every round), ROUNDS times. From each run's JSON it reads attnkit's own timings and, as a
control for the machine's drift, one peer's (torch SDPA, sentence-transformers,
transformers):

- flash (the `attention` suite): every "attnkit flash" time (L, causal, fwd / fwd+bwd);
- encoder: attnkit's seconds per workload and thread count;
- decoder: attnkit's seconds per generated token (greedy, prefill included), its prefill,
  its ms per token with a KV cache at each context.

Printed per figure: old and new medians over the rounds and new/old as a time ratio
(> 1: new is slower), the median of the per-round ratios (old and new ran side by side
in each round) with their range, and the peer's ratio beside it: a peer that moved as
much says the machine moved, not attnkit. One geometric mean per suite closes it.

    python scripts/ab-restructure.py                       # decoder, flash, encoder; 3 rounds
    python scripts/ab-restructure.py --suites encoder --rounds 1 --threads 1   # a short check
    python scripts/ab-restructure.py --json ab.json        # also every figure as JSON

Run it on a quiet machine: the ratios are only as good as the machine's noise (the rounds'
range says how large that was). The worktree is removed at the end (--keep keeps it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OLD = "e6a719e"
SUITE_NAMES = {"decoder": "decoder", "flash": "attention", "attention": "attention", "encoder": "encoder"}


# ----------------------------------------------------------------------------- figures


def _flash(raw: dict) -> dict[str, tuple[float, float | None]]:
    """'attnkit flash' seconds per (L, causal, passes), with torch SDPA's (or NumPy naive's) beside."""
    found: dict[tuple, dict[str, float]] = {}
    for m in raw.get("measurements", []):
        key = (m["L"], bool(m["causal"]), m["passes"])
        found.setdefault(key, {})[m["impl"]] = m["seconds"]
    out = {}
    for (L, causal, passes), times in sorted(found.items()):
        if "attnkit flash" in times:
            peer = times.get("torch SDPA", times.get("numpy naive"))
            out[f"flash L={L} {'causal' if causal else 'full'} {passes} s"] = (times["attnkit flash"], peer)
    return out


def _encoder(raw: dict) -> dict[str, tuple[float, float | None]]:
    """attnkit's seconds per (workload, threads, batch), with sentence-transformers' beside."""
    out = {}
    for r in raw.get("results", []):
        name = f"encoder {r['workload']} threads={r['threads']} batch={r['batch_size']} s"
        out[name] = (r["attnkit_seconds"], r.get("reference_seconds"))
    return out


def _decoder(raw: dict) -> dict[str, tuple[float, float | None]]:
    """attnkit's seconds per token (greedy, prefill included) and prefill per thread count, its
    ms per token with a KV cache per context; transformers' seconds per token beside the first."""
    out = {}
    for r in raw.get("results", []):
        rate = r["tokens_per_second"]
        peer = 1.0 / rate["transformers"] if rate.get("transformers") else None
        out[f"decoder threads={r['threads']} s/token"] = (1.0 / rate["attnkit"], peer)
        prefill = r.get("prefill_s", {})
        if "attnkit" in prefill:
            out[f"decoder threads={r['threads']} prefill s"] = (prefill["attnkit"], prefill.get("llama.cpp"))
    for entry in raw.get("per_token", []):
        out[f"decoder cache ms/token context={entry['context']}"] = (entry["with_cache_ms"], None)
    return out


FIGURES = {"attention": _flash, "encoder": _encoder, "decoder": _decoder}


# ----------------------------------------------------------------------------- runs


def _run(tree: Path, suite: str, threads: int | None, quick: bool, work: Path, tag: str) -> dict:
    out = work / f"{tag}-{suite}.json"
    command = [sys.executable, "-m", "attnkit", "bench", suite, "--json", str(out)]
    command += ["--quick"] if quick else []
    command += ["--threads", str(threads)] if threads else []
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    start = time.perf_counter()
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{tag} {suite} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    data = json.loads(out.read_text())
    return {"figures": FIGURES[suite](data["report"]["raw"]), "wall_s": time.perf_counter() - start}


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def _worktree(old: str, keep: bool) -> tuple[Path, callable]:
    path = Path(tempfile.mkdtemp(prefix="attnkit-ab-old-"))
    path.rmdir()
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), old],
                   check=True, capture_output=True, text=True)

    def remove() -> None:
        if keep:
            print(f"old tree kept at {path} (git worktree remove --force {path})")
            return
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], capture_output=True)
        shutil.rmtree(path, ignore_errors=True)

    return path, remove


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", default=OLD, help=f"the commit to compare against (default {OLD})")
    parser.add_argument("--suites", default="decoder,flash,encoder",
                        help="comma-separated: decoder, flash (the attention suite), encoder")
    parser.add_argument("--rounds", type=int, default=3, help="old/new pairs per suite (default 3)")
    parser.add_argument("--threads", type=int, default=None, help="threads for every contender (default: all)")
    parser.add_argument("--full", action="store_true", help="the suites' full runs instead of --quick (long)")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure to this JSON file")
    parser.add_argument("--keep", action="store_true", help="keep the old worktree")
    args = parser.parse_args(argv)
    suites = []
    for name in args.suites.split(","):
        if name.strip() not in SUITE_NAMES:
            parser.error(f"unknown suite {name!r}; expected some of {', '.join(SUITE_NAMES)}")
        suites.append(SUITE_NAMES[name.strip()])
    if args.rounds < 1:
        parser.error(f"expected --rounds >= 1, got {args.rounds}")

    old_tree, remove = _worktree(args.old, args.keep)
    new_commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    print(f"old: {args.old} ({old_tree}); new: {new_commit}{' + uncommitted changes' if dirty else ''} ({ROOT})")
    print(f"suites {', '.join(suites)}; {args.rounds} round(s); {'full' if args.full else '--quick'}; "
          f"threads {args.threads or 'all'}; ratios are new/old times (> 1: new slower)")
    record: dict = {"old": args.old, "new": new_commit, "rounds": args.rounds, "suites": {}}
    try:
        with tempfile.TemporaryDirectory(prefix="attnkit-ab-") as work:
            for suite in suites:
                runs: dict[str, list[dict]] = {"old": [], "new": []}
                for round_ in range(args.rounds):
                    order = ("old", "new") if round_ % 2 == 0 else ("new", "old")
                    for tag in order:
                        tree = old_tree if tag == "old" else ROOT
                        runs[tag].append(_run(tree, suite, args.threads, not args.full, Path(work), tag))
                        print(f"  {suite} round {round_ + 1} {tag}: {runs[tag][-1]['wall_s']:.0f} s", flush=True)
                record["suites"][suite] = _report(suite, runs)
    finally:
        remove()
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))
    return 0


def _report(suite: str, runs: dict[str, list[dict]]) -> dict:
    names = [n for n in runs["new"][0]["figures"] if all(n in r["figures"] for r in runs["old"] + runs["new"])]
    missing = sorted(set(runs["new"][0]["figures"]) ^ set(runs["old"][0]["figures"]))
    print(f"\n{suite}")
    print(f"  {'figure':<46} {'old':>10} {'new':>10} {'new/old':>8} {'per round (min..max)':>22} {'peer':>7}")
    rows, ratios = {}, []
    for name in names:
        old = [r["figures"][name][0] for r in runs["old"]]
        new = [r["figures"][name][0] for r in runs["new"]]
        per_round = [n / o for o, n in zip(old, new)]
        peers = [(r_new["figures"][name][1], r_old["figures"][name][1])
                 for r_old, r_new in zip(runs["old"], runs["new"])]
        peer = [n / o for n, o in peers if n and o]
        ratio = statistics.median(new) / statistics.median(old)
        ratios.append(statistics.median(per_round))
        rows[name] = {"old": old, "new": new, "per_round": per_round, "peer_per_round": peer}
        spread = f"{statistics.median(per_round):.3f} ({min(per_round):.2f}..{max(per_round):.2f})"
        peer_text = f"{statistics.median(peer):.3f}" if peer else "-"
        print(f"  {name:<46} {statistics.median(old):>10.4g} {statistics.median(new):>10.4g} {ratio:>8.3f} "
              f"{spread:>22} {peer_text:>7}")
    print(f"  geometric mean of the per-round medians: {_geomean(ratios):.3f} over {len(ratios)} figure(s)")
    if missing:
        print(f"  in one run only (not compared): {', '.join(missing)}")
    return {"figures": rows, "geomean": _geomean(ratios)}


if __name__ == "__main__":
    sys.exit(main())
