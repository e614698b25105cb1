"""Regenerate the pictures in docs/visualization.md from the commands it lists (needs the
embedded MiniLM and SmolLM2, matplotlib, FastAPI, and Debian's Chromium for the screenshots).

    python docs/images/make_images.py

Terminal pictures are the real output of `attnkit show` / `attnkit compare` (run with
colour forced), drawn by rich as SVG and photographed by Chromium; PNGs are the files the
commands write; HTML pictures are the files `--html` writes and the served page.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.text import Text

HERE = Path(__file__).resolve().parent
SENTENCE = "The cat sat on the mat because it was tired."
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]


def attnkit(*args: str, columns: int = 84, color: bool = True, cwd: Path | None = None) -> str:
    """Run the command as a user would and return what it printed on stdout."""
    env = {**os.environ, "COLUMNS": str(columns)}
    env.pop("NO_COLOR", None)
    if color:
        env.update(FORCE_COLOR="1", COLORTERM="truecolor", TERM="xterm-256color")
    else:
        env.update(TERM="dumb")
        env.pop("FORCE_COLOR", None)
    done = subprocess.run([sys.executable, "-m", "attnkit", *args], env=env, cwd=cwd, check=True,
                          capture_output=True, text=True)
    return done.stdout


def terminal_svg(output: str, path: Path, width: int = 84, title: str = "attnkit show") -> None:
    console = Console(record=True, width=width, color_system="truecolor", force_terminal=True,
                      file=open(os.devnull, "w"))
    console.print(Text.from_ansi(output), soft_wrap=True)
    console.save_svg(str(path), title=title)


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    # The terminal: one head with its column numbers and key, the summary of every head.
    shown = attnkit("show", SENTENCE, "--layer", "0", "--head", "2")
    terminal_svg(shown, tmp / "show.svg")
    terminal_svg(attnkit("show", SENTENCE, "--layer", "0", "--head", "2", "--no-summary", color=False),
                 tmp / "show-plain.svg")
    terminal_svg(attnkit("show", SENTENCE, "--layer", "3", "--head", "5", "--no-summary", "--hide-special"),
                 tmp / "show-hidden.svg")
    terminal_svg(attnkit("compare", "The cat sat on the mat.", "The dog lay on the rug.", "--layer", "1",
                         "--head", "0", "--top", "3", columns=100), tmp / "compare.svg", 100, "attnkit compare")

    # PNG: the files the commands write.
    def png(name: str, *args: str, grid: str | None = None) -> None:
        attnkit("show", SENTENCE, *args, "--no-summary", "--png", str(tmp / "out.png"), color=False)
        shutil.copy(tmp / "out.png", HERE / name)
        if grid:
            shutil.copy(tmp / "out-grid.png", HERE / grid)

    png("minilm-layer0-head2.png", "--layer", "0", "--head", "2", grid="minilm-grid.png")
    png("minilm-layer2-mean.png", "--layer", "2", "--mean")
    png("minilm-layer3-head5-hidden.png", "--layer", "3", "--head", "5", "--hide-special")
    png("minilm-layer0-head0-log.png", "--layer", "0", "--head", "0", "--log-scale")
    png("smollm2-layer3-head0-causal.png", "--model", "smollm2", "--layer", "3", "--head", "0")  # masked cells grey

    # HTML: the files --html writes, and a notebook's inline view.
    attnkit("show", SENTENCE, "--layer", "0", "--head", "2", "--no-summary", "--html", str(tmp / "view.html"))
    attnkit("compare", "The cat sat on the mat.", "The dog lay on the rug.", "--layer", "1", "--head", "0",
            "--html", str(tmp / "compare.html"))
    from attnkit.viz import head_view

    inline = head_view(SENTENCE, model="minilm", layer=0, head=2)
    (tmp / "notebook.html").write_text(
        "<!DOCTYPE html><html><body style='font: 14px sans-serif; margin: 16px'>"
        "<pre style='background:#f5f5f5;padding:8px'>from attnkit.viz import head_view\n"
        f"head_view(\"{SENTENCE}\", model=\"minilm\", layer=0, head=2)</pre>"
        f"{inline._repr_html_()}</body></html>", encoding="utf-8")

    import uvicorn
    from playwright.sync_api import sync_playwright

    from attnkit.serve.server import create_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(), log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/"

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        for name in ("show", "show-plain", "show-hidden", "compare"):
            svg = (tmp / f"{name}.svg").read_text(encoding="utf-8")
            page.set_content("<html><body style='margin:0'><div style='width:1000px'>"
                             "<style>svg { display: block; width: 100%; height: auto; }</style>"
                             f"{svg}</div></body></html>")
            page.locator("svg").screenshot(path=str(HERE / f"terminal-{name}.png"))
        page.goto((tmp / "view.html").as_uri())
        page.wait_for_selector('body[data-thumbnails="1"]')
        page.locator(".col.left .tok").nth(2).hover()
        page.locator(".doc").screenshot(path=str(HERE / "html-head-view.png"))
        page.locator(".model-view").screenshot(path=str(HERE / "html-model-view.png"))
        page.check("#hide-special")
        page.check("#log-scale")
        page.wait_for_selector('body[data-thumbnails="1"]')
        page.evaluate("window.scrollTo(0, 0)")  # the controls with their boxes ticked, and the views
        page.screenshot(path=str(HERE / "html-hidden-log.png"), clip={"x": 0, "y": 0, "width": 1200, "height": 640})
        page.uncheck("#hide-special")
        page.uncheck("#log-scale")
        page.wait_for_selector('body[data-thumbnails="1"]')
        page.locator(".grid canvas[data-layer='1'][data-head='8']").click()
        page.screenshot(path=str(HERE / "html-enlarged.png"))
        page.keyboard.press("Escape")
        page.goto((tmp / "compare.html").as_uri())
        page.wait_for_selector('body[data-thumbnails="1"]')
        page.locator(".col.left .tok").nth(2).hover()
        page.screenshot(path=str(HERE / "html-compare.png"), full_page=False)
        page.locator("#difference").screenshot(path=str(HERE / "html-difference.png"))
        page.goto((tmp / "notebook.html").as_uri())
        page.frame_locator("iframe").locator('body[data-ready="1"] .doc').wait_for()
        page.screenshot(path=str(HERE / "notebook-head-view.png"), full_page=True)
        page.goto(url)  # opens on the example sentence, already drawn
        page.wait_for_selector('body[data-ready="1"] .doc')
        page.screenshot(path=str(HERE / "served-example.png"))
        page.fill("#text", "She put the book on the table, and then she read it.")
        page.select_option("#model", "minilm")
        page.click("#submit")
        page.wait_for_function(
            "() => document.body.dataset.ready === '1' && "
            "document.querySelector('.doc-title').textContent.startsWith('She put')"
        )
        page.select_option("#layer", "2")
        page.locator(".col.left .tok").nth(11).hover()
        page.screenshot(path=str(HERE / "served-page.png"))
        page.set_viewport_size({"width": 1300, "height": 1100})
        page.fill("#text", "Alice gave Bob the book because he asked for it.")
        page.select_option("#model", "smollm2")
        page.click("#submit")
        page.wait_for_function(
            "() => document.body.dataset.ready === '1' && "
            "document.querySelector('.doc-meta').textContent.startsWith('smollm2')",
            timeout=180_000,
        )
        page.wait_for_selector('body[data-thumbnails="1"]')
        page.select_option("#layer", "5")
        page.locator(".col.left .tok").nth(8).hover()
        page.screenshot(path=str(HERE / "served-smollm2.png"))
        browser.close()
    server.should_exit = True


if __name__ == "__main__":
    main()
