"""attnkit: attention from first principles to production.

The NumPy core lives in `attnkit.functional` (its main names are re-exported
here), modules in `attnkit.nn`, real checkpoints in `attnkit.models`, views in
`attnkit.viz`, and the PyTorch side in `attnkit.torch` (optional extra).
Importing attnkit never imports torch, matplotlib or a web framework.
"""

from __future__ import annotations

__version__ = "0.1.0"
