"""Print docs/hf.md's conformance table: every case of attnkit.hf.conformance, every implementation.

    python scripts/hf_conformance.py [MODEL_TYPE ...]

For each architecture: what it exercises, then per implementation the forward
(logits and loss) and the gradients (every parameter) against the float64
truth, as "ok" and the worst error as a fraction of its budget (attnkit's error
<= 2x eager float32's for the forward, 3x for gradients, + 8 ulps), or the
refusal ("attnkit_flash" compares the padded batch's logits at its real tokens: the
flash route unpads). tests/hf/test_hf.py runs the same cases. Exit status 1 if a check fails.
"""

from __future__ import annotations

import sys
import warnings

import transformers

from attnkit.hf.conformance import CASES, IMPLEMENTATIONS, checks, run_case


def _cell(found) -> str:
    worst = max(found, key=lambda c: c.ours / c.budget if c.budget else 0.0)
    share = worst.ours / worst.budget if worst.budget else 0.0
    return f"{'ok' if all(c.ok for c in found) else 'FAIL'} ({share:.2f})"


def main(names: list[str]) -> int:
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    header = ["architecture", "exercises"]
    for implementation in IMPLEMENTATIONS:
        header += [f"{implementation} forward", f"{implementation} gradients"]
    header.append("refused")
    print(f"transformers {transformers.__version__}; cell: verdict (worst error / its budget)\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    failed = False
    for case in CASES:
        if names and case.name not in names:
            continue
        run = run_case(case)
        row = [case.name, ", ".join(case.features)]
        for implementation in IMPLEMENTATIONS:
            if implementation in run.refused:
                row += ["refused", "refused"]
                continue
            found = checks(run, implementation)
            forward = [c for c in found if not c.what.startswith("grad/")]
            gradients = [c for c in found if c.what.startswith("grad/")]
            failed |= not all(c.ok for c in found)
            row += [_cell(forward), _cell(gradients)]
        refused = [f"{name}: {message.split(' cannot compute ')[1].split(', which')[0]}"
                   for name, message in run.refused.items()]
        row.append("; ".join(refused) or "-")
        print("| " + " | ".join(row) + " |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
