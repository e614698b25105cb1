"""`attnkit show`, `attnkit compare` and `attnkit serve`: views of attention."""

from __future__ import annotations

import contextlib
import ipaddress
import signal
import socket
import sys
from collections.abc import Iterator
from typing import Optional

import typer

from attnkit.cli import _interrupt
from attnkit.cli._app import app, check_int, check_text, console, fail, say, usage, use_color, warn
from attnkit.cli._output import Output, beside, plan, write_all
from attnkit.cli.models import ANY, BACKEND_HELP, check_backend, model_option
from attnkit.extras import require

_MODEL_HELP = ("minilm (embedded encoder), smollm2 (embedded decoder), random (untrained), or a model path "
               "(a .gguf file or a model folder, of any transformers architecture).")
_HIDE_HELP = ("Drop the special tokens ([CLS], [SEP], <|im_start|>...) and, in a causal model, the first "
              "token (the attention sink), then renormalise each row to sum to 1.")
_LOG_HELP = "Colour on a log scale over the 3 decades below the largest weight, so small weights show."
MAX_TOKENS = 1024
"""The largest --max-tokens: weights are layers x heads x T x T (SmolLM2 at 1024 tokens: 1.1 GB)."""
MAX_SERVE_CHARS = 100_000
"""The largest `serve --max-chars`."""
MAX_SERVE_NEW_TOKENS = 8192
"""The largest `serve --max-new-tokens`."""
MAX_SERVE_BATCH = 256
"""The most completions `serve --max-batch` decodes together."""
MAX_SERVE_KV_TOKENS = 2**22
"""The most tokens `serve --kv-tokens` (and --step-tokens) take."""


def _check_texts(max_tokens: int, *texts: tuple[str, str]) -> None:
    """Usage errors for the text arguments and --max-tokens, before anything runs."""
    for name, text in texts:
        check_text(name, text)
        if not text.strip():
            usage(f"expected a non-empty text for {name}, got {text!r}")
    check_int("--max-tokens", max_tokens, 1, MAX_TOKENS)


def _compute(text: str, model: str, max_tokens: int, backend: str = "naive"):
    """AttentionMaps for `text`, or a clean exit with the reason."""
    from attnkit.viz.providers import ModelNotAvailableError, get_provider

    try:
        maps = get_provider(model, max_tokens=max_tokens, backend=backend).attention(text)
    except (ModelNotAvailableError, ValueError, TypeError) as error:
        fail(str(error))
    if maps.truncated_from:
        warn(
            f"the text has {maps.truncated_from} tokens; "
            f"showing the first {maps.num_tokens} (the most this view takes is {max_tokens})"
        )
    return maps


def _selection(maps, layer: int, head: int, mean: bool) -> tuple[int, int | None]:
    try:
        layer = maps.check_layer(layer)
        return layer, None if mean else maps.check_head(head)
    except ValueError as error:
        fail(str(error))


def _plan_views(png: Optional[str], html: Optional[str]) -> dict[str, Output]:
    """Every file the command will write, checked before any work (see cli/_output.py)."""
    outputs = {}
    if png is not None:
        outputs["png"] = plan("--png", png, (".png",))
        require("matplotlib", "png", "--png")
        outputs["grid"] = beside(outputs["png"], outputs["png"].path.stem + "-grid.png")
    if html is not None:
        outputs["html"] = plan("--html", html, (".html", ".htm"))
    return outputs


def _write_views(outputs: dict[str, Output], maps, layer: int, head: int | None, *,
                 hide_special: bool = False, log_scale: bool = False) -> None:
    """Write the planned files all or none, then say exactly which were written.

    `maps` are the maps as the model gave them: the PNGs drop the special tokens when
    `hide_special` says so; the HTML page keeps them all, with its checkbox ticked."""
    from attnkit.viz.html import save_html

    shown = maps.hide_special() if hide_special else maps
    jobs = []
    if "png" in outputs:
        from attnkit.viz.png import save_grid_png, save_head_png

        jobs.append((outputs["png"], lambda path: save_head_png(shown, path, layer, head, log_scale=log_scale)))
        jobs.append((outputs["grid"], lambda path: save_grid_png(shown, path, log_scale=log_scale)))
    if "html" in outputs:
        jobs.append((outputs["html"], lambda path: save_html(
            maps, path, layer=layer, head=head, hide_special=hide_special, log_scale=log_scale)))
    sizes = write_all(jobs)
    if "png" in outputs:
        (w, h), (gw, gh) = sizes[0], sizes[1]
        _wrote(f"{outputs['png'].path} ({w}x{h}) and {outputs['grid'].path} ({gw}x{gh})")
    if "html" in outputs:
        _wrote(f"{outputs['html'].path} (self-contained; open it in a browser)")


def _wrote(what: str) -> None:
    say("wrote " + what)


FLOW_PROBLEMS_NOTED = 2000
"""`show --flow` warns that it will be slow above this many max-flow problems (layers x T²)."""
_ROLLOUT_HELP = ("Show attention rollout instead (Abnar & Zuidema): per layer, how much each input token "
                 "is in each token after that layer; heads averaged, residual folded in.")
_FLOW_HELP = ("Show attention flow instead (Abnar & Zuidema): per layer, the maximum flow from each token "
              "down to each input token; slow on long texts.")
_VALUE_WEIGHTED_HELP = ("Show value-weighted attention instead (Kobayashi et al.): the norm of what each key "
                        "token adds, ||weight x value x output projection||, rows scaled to sum to 1.")


def _derived_kind(rollout: bool, flow: bool, value_weighted: bool, mean: bool, head: int) -> str:
    """Which map `show` draws: 'attention', or one of the derived maps (at most one flag)."""
    chosen = [name for name, on in (("rollout", rollout), ("flow", flow), ("value-weighted", value_weighted)) if on]
    if len(chosen) > 1:
        usage(f"--{chosen[0]} and --{chosen[1]} exclude each other; choose one map to show")
    kind = chosen[0] if chosen else "attention"
    if kind in ("rollout", "flow") and (mean or head != 0):
        usage(f"--{kind} averages the heads itself: it has one map per layer, so --head and --mean do not apply")
    return kind


def _derive(maps, kind: str, model: str):
    """`maps`, or the map `kind` derived from them (viz/derived.py), or a clean exit with the reason."""
    if kind == "attention":
        return maps
    from attnkit.viz.derived import derive

    problems = maps.num_layers * maps.num_tokens ** 2
    if kind == "flow" and problems > FLOW_PROBLEMS_NOTED:
        warn(f"attention flow on {maps.num_tokens} tokens and {maps.num_layers} layers solves {problems} "
             "maximum-flow problems; this can take minutes (--rollout is immediate)")
    try:
        return derive(maps, kind, model=model)
    except (ValueError, TypeError, OSError, KeyError) as error:
        fail(str(error))


def _window_line(maps) -> str:
    """Which layers are global and which local, in words: 'Layers 5, 11, 17 global; the
    others local (sliding window of 512 tokens).'"""
    globals_ = [str(layer) for layer in range(maps.num_layers) if maps.windows[layer] is None]
    windows = sorted({w for w in maps.windows if w is not None})
    sizes = " or ".join(str(w) for w in windows)
    if not globals_:
        return f"Every layer local (sliding window of {sizes} tokens)."
    return (f"Layer{'s' if len(globals_) > 1 else ''} {', '.join(globals_)} global; the others local "
            f"(sliding window of {sizes} tokens).")


@app.command()
def show(
    text: str = typer.Argument(..., help="The sentence to look at."),
    model: str = typer.Option("minilm", "--model", "-m", help=_MODEL_HELP),
    layer: Optional[int] = typer.Option(
        None, "--layer", "-l", help="Layer to show (0-based; negative counts from the end). Default: 0; with "
        "--rollout or --flow the last layer (they accumulate through the layers)."
    ),
    head: int = typer.Option(0, "--head", help="Head to show (0-based)."),
    mean: bool = typer.Option(False, "--mean", help="Show the mean of the layer's heads instead of one head."),
    png: Optional[str] = typer.Option(
        None, "--png", metavar="FILE.png", help="Also write this head as FILE.png, and all heads as FILE-grid.png."
    ),
    html: Optional[str] = typer.Option(
        None, "--html", metavar="FILE.html", help="Also write a self-contained interactive HTML file."
    ),
    values: bool = typer.Option(False, "--values", help="Print the weights in the heatmap's cells."),
    no_color: bool = typer.Option(False, "--no-color", help="Shade with ░▒▓█ instead of colour."),
    summary: bool = typer.Option(True, "--summary/--no-summary", help="Show what every head does (layers x heads)."),
    hide_special: bool = typer.Option(False, "--hide-special", help=_HIDE_HELP),
    log_scale: bool = typer.Option(False, "--log-scale", help=_LOG_HELP),
    max_tokens: int = typer.Option(
        512, "--max-tokens", help=f"Truncate longer texts to this many tokens (at most {MAX_TOKENS})."
    ),
    rollout: bool = typer.Option(False, "--rollout", help=_ROLLOUT_HELP),
    flow: bool = typer.Option(False, "--flow", help=_FLOW_HELP),
    value_weighted: bool = typer.Option(False, "--value-weighted", help=_VALUE_WEIGHTED_HELP),
    backend: str = typer.Option("naive", "--backend", help=BACKEND_HELP + " The maps are recorded, so a backend "
                                "that forms no weights (flash) gives way to naive for them."),
) -> None:
    """Show where a model's attention goes on TEXT: heatmap of one head and a summary of all."""
    from attnkit.viz.summary import summarize_heads
    from attnkit.viz.terminal import maps_heatmap, summary_table

    _check_texts(max_tokens, ("TEXT", text))
    check_backend(backend)
    kind = _derived_kind(rollout, flow, value_weighted, mean, head)
    model_option(model, ANY, "show")
    outputs = _plan_views(png, html)
    maps = _derive(_compute(text, model, max_tokens, backend), kind, model)
    if layer is None:
        layer = -1 if kind in ("rollout", "flow") else 0
    layer, chosen = _selection(maps, layer, 0 if kind in ("rollout", "flow") else head, mean)
    color = use_color(no_color)
    shown = maps.hide_special() if hide_special else maps
    console.print(maps_heatmap(shown, layer, chosen, color=color, values=values, width=console.width,
                               log_scale=log_scale))
    if kind != "attention":
        from attnkit.viz.derived import DESCRIPTIONS

        console.print(DESCRIPTIONS[kind], style="dim")
    if summary and kind not in ("rollout", "flow"):  # one map per layer: the heatmap is all there is
        console.print()
        console.print(summary_table(summarize_heads(shown), color=color))
        if maps.windows is not None:
            console.print(_window_line(maps), style="dim")
    _write_views(outputs, maps, layer, chosen, hide_special=hide_special, log_scale=log_scale)


@app.command()
def compare(
    text_a: str = typer.Argument(..., metavar="A", help="First sentence."),
    text_b: str = typer.Argument(..., metavar="B", help="Second sentence."),
    model: str = typer.Option("minilm", "--model", "-m", help=_MODEL_HELP),
    layer: int = typer.Option(0, "--layer", "-l", help="Layer to show side by side."),
    head: int = typer.Option(0, "--head", help="Head to show side by side."),
    mean: bool = typer.Option(False, "--mean", help="Show the mean of the layer's heads."),
    top: int = typer.Option(8, "--top", help="How many of the most different heads to list (>= 0)."),
    html: Optional[str] = typer.Option(
        None, "--html", metavar="FILE.html", help="Also write both as one interactive HTML file."
    ),
    no_color: bool = typer.Option(False, "--no-color", help="Shade with ░▒▓█ instead of colour."),
    hide_special: bool = typer.Option(False, "--hide-special", help=_HIDE_HELP),
    log_scale: bool = typer.Option(False, "--log-scale", help=_LOG_HELP),
    max_tokens: int = typer.Option(
        512, "--max-tokens", help=f"Truncate longer texts to this many tokens (at most {MAX_TOKENS})."
    ),
) -> None:
    """The same model on two sentences, side by side, and the heads whose patterns differ most."""
    import numpy as np

    from attnkit.viz.summary import pattern_difference, summarize_heads
    from attnkit.viz.tables import fitted_table
    from attnkit.viz.terminal import heatmap_pools, maps_heatmap, side_by_side

    _check_texts(max_tokens, ("A", text_a), ("B", text_b))
    check_int("--top", top, 0)
    model_option(model, ANY, "compare")
    outputs = {"html": plan("--html", html, (".html", ".htm"))} if html is not None else {}
    full_a = _compute(text_a, model, max_tokens)
    full_b = _compute(text_b, model, max_tokens)
    maps_a, maps_b = (full_a.hide_special(), full_b.hide_special()) if hide_special else (full_a, full_b)
    layer, chosen = _selection(maps_a, layer, head, mean)
    color = use_color(no_color)
    # side by side when both fit at half the width with a column per key; else each map
    # gets the whole width and they stand one under the other
    half = max(30, (console.width - 3) // 2)
    width = console.width if any(heatmap_pools(m.tokens, half) for m in (maps_a, maps_b)) else half
    left = maps_heatmap(maps_a, layer, chosen, color=color, width=width, log_scale=log_scale)
    right = maps_heatmap(maps_b, layer, chosen, color=color, width=width, log_scale=log_scale)
    console.print(side_by_side(left, right))

    diff = pattern_difference(maps_a, maps_b)
    same_length = maps_a.num_tokens == maps_b.num_tokens
    sa, sb = summarize_heads(maps_a), summarize_heads(maps_b)
    order = sorted(((float(diff[index]), index) for index in np.ndindex(diff.shape)), reverse=True)
    def describe(summary, ly: int, h: int) -> str:
        """'first P03 F91 S02 1.2b': the pattern, the three scores in %, the entropy in bits."""
        scores = " ".join(
            f"{code}{min(99, int(round(100 * float(values[ly, h])))):02d}"
            for code, values in (("P", summary.previous), ("F", summary.first), ("S", summary.self))
        )
        return f"{summary.pattern[ly, h]:<8} {scores} {summary.entropy[ly, h]:.1f}b"

    rows = [[str(ly), str(h), f"{value:.3f}", describe(sa, ly, h), describe(sb, ly, h)]
            for value, (ly, h) in order[:top]]
    console.print()  # at a width where the five columns do not fit, blocks that repeat layer and head
    console.print(fitted_table(["layer", "head", "difference", "A", "B"], rows, title="Where the patterns differ most",
                               keys=2, justify=["right"] * 3 + ["left"] * 2, box=None))
    how = (
        "difference: mean total variation distance of matching rows (0 same, 1 disjoint)"
        if same_length
        else "lengths differ: difference = the largest change of P, F, S or entropy/uniform"
    )
    console.print(how, style="dim")
    console.print("P, F, S: % of weight on the previous token, first token, itself; b: bits", style="dim")
    console.print(f"mean difference over all heads: {float(diff.mean()):.3f}", style="dim")
    if outputs:
        from attnkit.viz.html import save_html

        write_all([(outputs["html"], lambda path: save_html(
            [full_a, full_b], path, layer=layer, head=chosen, hide_special=hide_special, log_scale=log_scale))])
        _wrote(f"{outputs['html'].path} (self-contained; open it in a browser)")


def _listen(host: str, port: int) -> tuple[socket.socket, str]:
    """A socket bound to host:port (so the port is known free before anything is printed),
    and the address it is bound to."""
    name = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as error:
        fail(f"cannot listen on --host {host}: {getattr(error, 'strerror', None) or error}")
    family, kind, proto, _, address = next((i for i in infos if i[0] == socket.AF_INET), infos[0])
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as error:
        sock.close()
        fail(f"cannot listen on {_url_host(name)}:{port}: {(error.strerror or str(error)).lower()}")
    return sock, sock.getsockname()[0]


def _url_host(name: str) -> str:
    return f"[{name}]" if ":" in name else name


def _run_server(application, sock: socket.socket) -> None:
    """Serve `application` on the bound socket until Ctrl+C, then raise KeyboardInterrupt
    (the command line's exit 130).

    The command owns SIGINT for the whole run instead of leaving the exit code to where
    the signal lands: uvicorn stops gracefully on SIGINT and then re-raises it into
    whatever handler it found (asyncio's, which turns it into a KeyboardInterrupt only if
    its main task is still running; or SIG_IGN, inherited by a background job, which
    swallows it, and the process exits 0). Here the handler it finds, before, during
    and after serving, is ours: it asks the server to stop and notes the interrupt in the
    command line's record (`attnkit.cli._interrupt`), which also holds any Ctrl+C that
    landed while the commands loaded and that a library swallowed: then the server never
    starts. A second Ctrl+C stops at once, without waiting for open requests.
    """
    from attnkit.serve.server import web_server

    server = web_server(application)

    def on_interrupt(signum: int, frame: object) -> None:
        _interrupt.note(signum)
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True

    previous = signal.signal(signal.SIGINT, on_interrupt)
    try:
        if _interrupt.received():  # a Ctrl+C while loading that some library swallowed
            return
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGINT, previous)
        if _interrupt.received():
            raise KeyboardInterrupt


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (default: this machine only; IPv6 too, as ::1)."),
    port: int = typer.Option(8000, "--port", "-p", help="Port to listen on (1-65535)."),
    model: list[str] = typer.Option(
        ["minilm", "smollm2", "random"], "--model", "-m", metavar="MODEL", help=_MODEL_HELP + " Repeat to offer several."
    ),
    max_chars: int = typer.Option(2000, "--max-chars", help=f"Refuse longer texts (at most {MAX_SERVE_CHARS})."),
    max_tokens: int = typer.Option(
        512, "--max-tokens", help=f"Truncate longer texts to this many tokens (at most {MAX_TOKENS})."
    ),
    max_new_tokens: int = typer.Option(
        1024, "--max-new-tokens", help="The most tokens one completion of the OpenAI API generates "
        f"(its default when a request gives no max_tokens; at most {MAX_SERVE_NEW_TOKENS})."
    ),
    api_key: Optional[str] = typer.Option(
        None, "--api-key", envvar="ATTNKIT_API_KEY", show_envvar=True,
        help="Answer the OpenAI API only with `Authorization: Bearer KEY` (the openai client's api_key).",
    ),
    preload: bool = typer.Option(
        False, "--preload", help="Load the API's models before serving instead of on their first request."
    ),
    access_log: bool = typer.Option(
        True, "--access-log/--no-access-log",
        help="Log each request on stderr (client, method, path, status, time), as uvicorn's access log does.",
    ),
    max_batch: int = typer.Option(
        8, "--max-batch", help="Completions decoded together per model (also the most `n`); more requests wait in "
        f"a queue, and beyond it get 429 (at most {MAX_SERVE_BATCH})."
    ),
    kv_tokens: int = typer.Option(
        16384, "--kv-tokens", help="Tokens each model's paged KV cache holds, shared by its requests (prompt + "
        "max_tokens beyond it: 400; when it fills, the youngest request waits and is recomputed)."
    ),
    step_tokens: int = typer.Option(
        16, "--step-tokens", help="The most token rows of one batched step: every running decode row, then chunks "
        "of new prompts up to this many (smaller: steadier streams while a long prompt arrives; larger: that "
        "prompt's first token sooner)."
    ),
) -> None:
    """A local web page: type a sentence, pick a model, explore its attention. Beside it, an
    OpenAI-compatible API under /v1 (embeddings from encoders, completions and chat from decoders)."""
    from attnkit.viz.providers import ModelNotAvailableError, check_model_name

    check_text("--host", host)
    if not host.strip():
        usage("expected --host to be an address or a host name, got ''")
    check_int("--port", port, 1, 65535)
    check_int("--max-chars", max_chars, 1, MAX_SERVE_CHARS)
    check_int("--max-tokens", max_tokens, 1, MAX_TOKENS)
    check_int("--max-new-tokens", max_new_tokens, 1, MAX_SERVE_NEW_TOKENS)
    check_int("--max-batch", max_batch, 1, MAX_SERVE_BATCH)
    check_int("--kv-tokens", kv_tokens, 16, MAX_SERVE_KV_TOKENS)
    check_int("--step-tokens", step_tokens, 1, MAX_SERVE_KV_TOKENS)
    if api_key is not None:
        check_text("--api-key", api_key)
        if not api_key.strip() or not api_key.isprintable():
            usage("expected --api-key to be printable text, got an empty or unprintable key")
    models = list(dict.fromkeys(model))  # once each, in order
    for name in models:
        try:
            check_model_name(name)
        except ModelNotAvailableError as error:
            fail(str(error))
    from attnkit.serve.server import create_app, missing_web_package

    missing = missing_web_package()
    if missing:
        fail(f"`attnkit serve` needs FastAPI and uvicorn ({missing} is missing); "
             "install them with: pip install 'attnkit[serve]'")

    sock, address = _listen(host, port)
    name = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    loopback = ipaddress.ip_address(address.split("%")[0]).is_loopback
    # On this machine only, answer only requests addressed to it (no DNS rebinding).
    allowed = sorted({"127.0.0.1", "localhost", "::1", address, name.lower()}) if loopback else None
    try:
        application = create_app(models=models, max_chars=max_chars, max_tokens=max_tokens, allowed_hosts=allowed,
                                  max_new_tokens=max_new_tokens, api_key=api_key, max_batch=max_batch,
                                  kv_tokens=kv_tokens, step_tokens=step_tokens)
        if preload:
            _preload(application.state.models)
    except ValueError as error:
        sock.close()
        fail(str(error))
    if not loopback:
        warn(f"binding {host}: other machines can reach this page" + ("" if api_key else " and its API (--api-key)"))
    bound = ipaddress.ip_address(address.split("%")[0])
    if bound.is_unspecified:  # 0.0.0.0 or ::, which no browser opens: this machine's own names instead
        say(f"attnkit: open http://{'[::1]' if bound.version == 6 else '127.0.0.1'}:{port}/ (Ctrl+C to stop)")
        for url in _network_urls(port):
            say(f"attnkit: from other machines: {url}")
    else:
        say(f"attnkit: open http://{_url_host(name)}:{port}/ (Ctrl+C to stop)")
    with _requests_logged(access_log):
        _run_server(application, sock)


@contextlib.contextmanager
def _requests_logged(on: bool) -> Iterator[None]:
    """While serving, show the server's request lines (`attnkit.serve.access_log`) on
    stderr, one a line; the logger is as it was afterwards."""
    import logging

    from attnkit.serve.access_log import ACCESS_LOGGER

    if not on:
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger(ACCESS_LOGGER)
    saved = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.level, logger.propagate = saved


def _preload(pool) -> None:
    """Load the API's models now (`serve --preload`), saying which."""
    from attnkit.cli._app import err_console
    from attnkit.serve.openai_models import ModelLoadError

    for name in pool.kinds:
        with err_console.status(f"loading {name}..."):
            try:
                pool.get(name)
            except ModelLoadError as error:
                raise ValueError(str(error)) from None


def _network_urls(port: int) -> list[str]:
    """The URLs other machines may use: this machine's name and its addresses that are not loopback."""
    name = socket.gethostname()
    urls = [f"http://{name}:{port}/"] if name else []
    try:
        infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, OSError):
        infos = []
    for info in infos:
        found = ipaddress.ip_address(str(info[4][0]).split("%")[0])
        url = f"http://{_url_host(str(found))}:{port}/"
        if not (found.is_loopback or found.is_link_local) and url not in urls:
            urls.append(url)
    return urls
