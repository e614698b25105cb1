"""One-time work before a decoder's first token: the native kernels built (or loaded) for
this CPU, said before it starts, with progress while it runs, and kept out of tokens/s.

A quantized model's first `generate` in an empty cache builds two native libraries
(`attnkit.kernels.native`: the products and the decode step), tens of seconds on two
cores. `prepare(model)` runs one short warm-up generation first, when
`native.build_needed()` says a build is coming, with the library's build events shown on
stderr: a line saying what is about to happen and about how long, before it starts; a
spinner with the elapsed time while it runs (in a terminal); a line when it is done (or
that another process built it meanwhile). Warnings the library gives meanwhile (a build
that failed) are shown as one line each; a numba that is installed but does not import
turns the kernels off first, in one line (the NumPy reference runs).
"""

from __future__ import annotations

import warnings

from attnkit.cli._app import err_console, note


class _BuildProgress:
    """`native.reporting`'s callback: notices on their own lines, a spinner between them."""

    def __init__(self) -> None:
        self.status = None

    def __call__(self, event) -> None:
        if event.stage == "start":
            note(f"building the native kernels ({event.library}) for this CPU, once: about {event.seconds:.0f} s "
                 "(later runs load them in well under a second)")
            self.status = err_console.status(f"building the native kernels ({event.library})...")
            self.status.start()
            return
        if self.status is not None:
            self.status.stop()
            self.status = None
        if event.stage == "built":
            note(f"built the native kernels ({event.library}) in {event.seconds:.1f} s ({event.detail})")
        elif event.stage == "rebuilt":
            note(f"rebuilt the damaged native kernels ({event.library}) in {event.seconds:.1f} s ({event.detail})")
        elif event.stage == "loaded":
            note(f"loaded the native kernels ({event.library}) that another process built meanwhile "
                 f"(waited {event.seconds:.1f} s; {event.detail})")

    def close(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None


def prepare(model) -> None:
    """Build or load the native kernels `model`'s generation will run, before any text is
    printed (nothing happens when they are on disk, or off)."""
    from attnkit.kernels import native

    generate = getattr(model, "generate", None)
    if generate is None or not native.build_needed():  # a model without generate builds nothing here
        return
    import numpy as np

    from attnkit import kernels

    try:
        kernels.numba()  # a build imports it anyway; a numba that does not import turns the kernels off here
    except RuntimeError:
        note(f"{kernels.reason_disabled()}: the compiled kernels are off and the NumPy reference runs the model",
             style="yellow")
        return

    progress = _BuildProgress()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with native.reporting(progress):
                bos = getattr(model.tokenizer, "bos_token_id", None) or 0  # two tokens: products, one step
                generate(np.array([bos, bos]), 2, stop=())
        finally:
            progress.close()
    seen = set()
    for warning in caught:
        message = str(warning.message).removeprefix("attnkit: ")
        if message not in seen:
            seen.add(message)
            note(message, style="yellow")
