"""Regenerate the pictures in docs/visualization.md (needs the embedded MiniLM,
matplotlib, and Debian's Chromium for the screenshots).

    python docs/images/make_images.py
"""

from __future__ import annotations

import socket
import tempfile
import threading
import time
from pathlib import Path

from rich.console import Console

from attnkit.viz.html import save_html
from attnkit.viz.png import save_grid_png, save_head_png
from attnkit.viz.providers import get_provider
from attnkit.viz.summary import summarize_heads
from attnkit.viz.terminal import maps_heatmap, side_by_side, summary_table

HERE = Path(__file__).resolve().parent
SENTENCE = "The cat sat on the mat because it was tired."
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]


def terminal_svg(renderables, path: Path, width: int = 84) -> None:
    console = Console(record=True, width=width, color_system="truecolor", force_terminal=True, file=open("/dev/null", "w"))
    for r in renderables:
        console.print(r)
    console.save_svg(str(path), title="attnkit show")


def main() -> None:
    minilm = get_provider("minilm")
    maps = minilm.attention(SENTENCE)
    save_head_png(maps, HERE / "minilm-layer0-head2.png", 0, 2)
    save_head_png(maps, HERE / "minilm-layer2-mean.png", 2, None)
    save_grid_png(maps, HERE / "minilm-grid.png")
    tmp = Path(tempfile.mkdtemp())
    terminal_svg([maps_heatmap(maps, 0, 2, width=84), "", summary_table(summarize_heads(maps))], tmp / "show.svg")
    terminal_svg([maps_heatmap(maps, 0, 2, color=False, width=84)], tmp / "show-plain.svg")
    a = minilm.attention("The cat sat on the mat.")
    b = minilm.attention("The dog lay on the rug.")
    terminal_svg([side_by_side(maps_heatmap(a, 1, 0, width=48), maps_heatmap(b, 1, 0, width=48))], tmp / "compare.svg", 100)
    save_html(maps, tmp / "view.html", layer=0, head=2)
    save_html([a, b], tmp / "compare.html", layer=1, head=0)

    import uvicorn
    from playwright.sync_api import sync_playwright

    from attnkit.viz.server import create_app

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
        for name in ("show", "show-plain", "compare"):
            page.goto((tmp / f"{name}.svg").as_uri())
            page.locator("svg").screenshot(path=str(HERE / f"terminal-{name}.png"))
        page.goto((tmp / "view.html").as_uri())
        page.wait_for_selector('body[data-thumbnails="1"]')
        page.locator(".col.left .tok").nth(2).hover()
        page.locator(".doc").screenshot(path=str(HERE / "html-head-view.png"))
        page.locator(".model-view").screenshot(path=str(HERE / "html-model-view.png"))
        page.locator(".grid canvas[data-layer='1'][data-head='8']").click()
        page.screenshot(path=str(HERE / "html-enlarged.png"))
        page.keyboard.press("Escape")
        page.goto((tmp / "compare.html").as_uri())
        page.wait_for_selector('body[data-thumbnails="1"]')
        page.locator(".col.left .tok").nth(2).hover()
        page.screenshot(path=str(HERE / "html-compare.png"), full_page=False)
        page.locator("#difference").screenshot(path=str(HERE / "html-difference.png"))
        page.goto(url)
        page.fill("#text", "She put the book on the table, and then she read it.")
        page.select_option("#model", "minilm")
        page.click("#submit")
        page.wait_for_selector('body[data-ready="1"] .doc')
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
