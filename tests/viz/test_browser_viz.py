"""The HTML file and the served page in headless Chromium (Debian's), driven by Playwright.

Each test checks: no console errors, no page errors, no dialogs (an injected
`alert` would open one), and no request outside the page's own origin.
Screenshots go to test-artifacts/viz/.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from attnkit.viz.data import maps_from_random_model
from attnkit.viz.html import save_html
from attnkit.serve.server import EXAMPLE

pytestmark = pytest.mark.browser

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "viz"
EVIL = ["<script>alert(1)</script>", "<img src=x onerror=alert(1)>"]


@pytest.fixture(scope="module")
def browser(chromium_path):
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path, args=ARGS)
        yield b
        b.close()


class Watched:
    """A page that records console errors, page errors, dialogs and requests."""

    def __init__(self, browser, width=1400, height=1000):
        self.page = browser.new_page(viewport={"width": width, "height": height})
        self.page.set_default_timeout(90_000)  # CI machines are shared and can be slow
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        self.requests: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))
        self.page.on("request", lambda r: self.requests.append(r.url))

    def check_clean(self, origin: str) -> None:
        assert self.errors == []
        assert self.dialogs == []
        outside = [u for u in self.requests if not (u.startswith(origin) or u.startswith(("data:", "blob:")))]
        assert outside == []

    def matrix(self, index=0) -> str:
        return self.page.locator("canvas.matrix").nth(index).evaluate("c => c.toDataURL()")

    def lines(self, index=0) -> str:
        return self.page.locator("canvas.lines").nth(index).evaluate("c => c.toDataURL()")


def wait_ready(page, timeout=90_000):
    page.wait_for_selector('body[data-ready="1"] .doc', timeout=timeout)


def check_views(w: Watched, shot: str, token_index: int = 2) -> None:
    """Choosing another head changes the picture; hovering a token draws its lines."""
    page = w.page
    before, lines_before = w.matrix(), w.lines()
    current = page.locator("#head").input_value()
    page.select_option("#head", "1" if current != "1" else "0")
    assert w.matrix() != before and w.lines() != lines_before
    page.locator(".col.left .tok").nth(token_index).hover()
    lines = page.locator("canvas.lines").first
    assert lines.get_attribute("data-mode") == "query"
    assert int(lines.get_attribute("data-lines")) > 0
    assert "attends most to" in page.locator(".status").first.text_content()
    page.screenshot(path=str(ARTIFACTS / f"{shot}-hover.png"))
    page.locator(".col.right .tok").nth(token_index).hover()
    assert lines.get_attribute("data-mode") == "key"


def test_html_file_views_and_escaping(browser, tmp_path):
    tokens = ["The", "cat", *EVIL, "sat", "on", "the", "mat", "line\nbreak"]
    maps = maps_from_random_model(tokens, layers=3, heads=4, causal=True)
    path = save_html(maps, tmp_path / "view.html", layer=1, head=2)
    w = Watched(browser)
    w.page.goto(path.as_uri())
    wait_ready(w.page)
    # Token text shows as text: no element was made from it, and nothing ran.
    shown = w.page.locator(".col.left .tok").all_text_contents()
    assert shown == [t.replace("\n", "\u23ce") for t in tokens]  # newlines made visible
    assert w.page.locator(".head-view img, .head-view script, .doc-title img").count() == 0
    assert w.page.locator(".doc-title").text_content() == " ".join(tokens)
    assert w.page.locator("#layer").input_value() == "1" and w.page.locator("#head").input_value() == "2"
    # The page decodes the same weights Python has (8-bit codes of sqrt(w)).
    shown_weights = np.array(w.page.evaluate("() => Array.from(window.attnkit.docs[0].current)"))
    want = maps.head(1, 2).ravel()
    assert np.all(np.abs(np.sqrt(shown_weights) - np.sqrt(want)) <= 1 / 510 + 1e-6)
    w.page.wait_for_selector('body[data-thumbnails="1"]')
    w.page.screenshot(path=str(ARTIFACTS / "html-file.png"), full_page=True)
    check_views(w, "html-file")
    # Mean of heads, then the model view: a click enlarges one head and selects it.
    w.page.select_option("#head", "-1")
    assert w.page.locator("#picked").text_content() == "layer 1, mean of heads"
    mean = np.array(w.page.evaluate("() => Array.from(window.attnkit.docs[0].current)"))
    np.testing.assert_allclose(mean, maps.head(1, None).ravel(), atol=2 / 510)
    w.page.locator(".grid canvas[data-layer='2'][data-head='3']").click()
    assert w.page.locator("#overlay").is_visible()
    assert (w.page.locator("#layer").input_value(), w.page.locator("#head").input_value()) == ("2", "3")
    w.page.screenshot(path=str(ARTIFACTS / "html-file-enlarged.png"))
    w.page.keyboard.press("Escape")
    assert not w.page.locator("#overlay").is_visible()
    w.check_clean(path.as_uri())
    w.page.close()


def test_html_compare_file(browser, tmp_path):
    a = maps_from_random_model("the cat sat on the mat".split(), layers=2, heads=3, seed=0)
    b = maps_from_random_model("the dog sat on the rug".split(), layers=2, heads=3, seed=0)
    path = save_html([a, b], tmp_path / "compare.html")
    w = Watched(browser)
    w.page.goto(path.as_uri())
    wait_ready(w.page)
    assert w.page.locator(".doc").count() == 2
    cells = w.page.locator("#difference td")
    assert cells.count() == 6
    before = [w.matrix(0), w.matrix(1)]
    cells.nth(4).click()  # layer 1, head 1
    assert (w.page.locator("#layer").input_value(), w.page.locator("#head").input_value()) == ("1", "1")
    assert [w.matrix(0), w.matrix(1)] != before
    w.page.screenshot(path=str(ARTIFACTS / "html-compare.png"), full_page=True)
    w.check_clean(path.as_uri())
    w.page.close()


@pytest.mark.slow
def test_html_512_tokens_stays_responsive(browser, tmp_path):
    maps = maps_from_random_model([f"t{i}" for i in range(512)], layers=4, heads=4)
    path = save_html(maps, tmp_path / "long.html")
    w = Watched(browser)
    w.page.goto(path.as_uri())
    wait_ready(w.page)
    # A head change redraws the matrix in its own event handler, while thumbnails are
    # still being painted (no wall clock: how fast is the loaded machine's business).
    before = w.matrix()
    w.page.evaluate(
        """() => { const s = document.getElementById('head'); s.value = '3';
                   s.dispatchEvent(new Event('change')); }"""
    )
    assert w.matrix() != before
    w.page.wait_for_selector('body[data-thumbnails="1"]')
    w.page.locator(".col.left .tok").nth(300).hover()
    assert int(w.page.locator("canvas.lines").first.get_attribute("data-lines")) > 0
    w.page.screenshot(path=str(ARTIFACTS / "html-512.png"))
    w.check_clean(path.as_uri())
    w.page.close()


def test_matrix_labels_colour_scale_hidden_tokens_and_log_scale(browser, tmp_path):
    """The matrix carries its tokens on both axes and a colour scale; 'hide special tokens'
    shows what `AttentionMaps.hide_special` computes; 'log colour scale' repaints."""
    tokens = ["[CLS]", "the", "cat", "sat", "[SEP]"]
    maps = maps_from_random_model(tokens, layers=2, heads=3)
    path = save_html(maps, tmp_path / "view.html", layer=1, head=2)
    w = Watched(browser)
    w.page.goto(path.as_uri())
    w.page.wait_for_selector('body[data-thumbnails="1"]')
    assert w.page.locator(".xlabel").all_text_contents() == tokens
    assert w.page.locator(".ylabel").all_text_contents() == tokens
    top = w.page.locator(".scale .tick.top").text_content()
    assert top == f"{maps.head(1, 2).max():.2f} (max)" and w.page.locator(".scale .tick.low").text_content() == "0"
    before = w.matrix()
    w.page.check("#log-scale")
    assert w.matrix() != before and w.page.locator(".scale").get_attribute("data-log") == "1"
    assert w.page.locator(".scale .tick.low").text_content().startswith("\u2264 ")
    w.page.uncheck("#log-scale")
    w.page.check("#hide-special")
    w.page.wait_for_selector('body[data-thumbnails="1"]')
    assert w.page.locator(".col.left .tok").all_text_contents() == ["the", "cat", "sat"]
    assert w.page.locator(".xlabel").all_text_contents() == ["the", "cat", "sat"]
    assert "2 hidden (special), rows renormalised" in w.page.locator(".doc-meta").text_content()
    hidden = maps.hide_special()
    for head in (2, -1):  # one head, and the mean of heads (each head renormalised first)
        w.page.select_option("#head", str(head))
        shown = np.array(w.page.evaluate("() => Array.from(window.attnkit.docs[0].current)"))
        want = hidden.head(1, None if head < 0 else head).ravel()
        np.testing.assert_allclose(shown, want, atol=4 / 510)  # 8-bit codes, then renormalised
    w.page.screenshot(path=str(ARTIFACTS / "html-hidden.png"), full_page=True)
    w.page.uncheck("#hide-special")
    w.page.wait_for_selector('body[data-thumbnails="1"]')
    assert w.page.locator(".col.left .tok").count() == 5
    w.check_clean(path.as_uri())
    w.page.close()


def test_the_file_opens_with_the_options_of_the_command_line(browser, tmp_path):
    maps = maps_from_random_model(["x", "a", "b", "c"], causal=True)
    path = save_html(maps, tmp_path / "v.html", hide_special=True, log_scale=True)
    w = Watched(browser)
    w.page.goto(path.as_uri())
    wait_ready(w.page)
    assert w.page.locator("#hide-special").is_checked() and w.page.locator("#log-scale").is_checked()
    assert w.page.locator(".col.left .tok").all_text_contents() == ["a", "b", "c"]  # the sink hidden
    w.check_clean(path.as_uri())
    w.page.close()


@pytest.fixture(scope="module")
def server_url():
    import uvicorn

    from attnkit.serve.server import create_app

    app = create_app(models=["random", "minilm"], max_chars=6000, max_tokens=512)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(100):
        if server.started:
            break
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/"
    server.should_exit = True
    thread.join(timeout=5)


@pytest.mark.slow
def test_served_page_typing_a_sentence(browser, server_url):
    w = Watched(browser)
    w.page.goto(server_url)
    w.page.wait_for_selector("#input-form:not([hidden])")
    # The page opens on the example sentence, drawn with the first model it offers.
    wait_ready(w.page)
    assert w.page.locator("#text").input_value() == EXAMPLE
    assert w.page.locator(".col.left .tok").all_text_contents() == EXAMPLE.split()
    text = "the cat " + " ".join(EVIL) + " sat down"
    w.page.fill("#text", text)
    w.page.select_option("#model", "random")
    w.page.click("#submit")
    wait_ready(w.page)
    assert w.page.locator(".col.left .tok").all_text_contents() == text.split()
    assert w.page.locator(".head-view img").count() == 0
    w.page.screenshot(path=str(ARTIFACTS / "served-page.png"), full_page=True)
    check_views(w, "served-page")
    # A long text is truncated to 512 tokens with a warning, and still renders and responds.
    w.page.fill("#text", " ".join(f"w{i}" for i in range(600)))
    w.page.click("#submit")
    w.page.wait_for_selector("#messages div")
    assert "truncated to 512 tokens (it had 600)" in w.page.locator("#messages").text_content()
    wait_ready(w.page)
    assert w.page.locator(".col.left .tok").count() == 512
    before = w.matrix()
    w.page.evaluate(
        """() => { const s = document.getElementById('layer'); s.value = '1';
                   s.dispatchEvent(new Event('change')); }"""
    )
    assert w.matrix() != before
    w.page.locator(".col.left .tok").nth(500).hover()
    assert int(w.page.locator("canvas.lines").first.get_attribute("data-lines")) > 0
    w.page.screenshot(path=str(ARTIFACTS / "served-page-512.png"))
    w.check_clean(server_url.rstrip("/"))
    w.page.close()


@pytest.mark.slow
def test_served_page_with_minilm(browser, server_url, minilm_folder):
    w = Watched(browser)
    w.page.goto(server_url)
    w.page.wait_for_selector("#input-form:not([hidden])")
    w.page.fill("#text", "The cat sat on the mat because it was tired.")
    w.page.select_option("#model", "minilm")
    w.page.click("#submit")
    wait_ready(w.page)
    tokens = w.page.locator(".col.left .tok").all_text_contents()
    assert tokens[0] == "[CLS]" and tokens[-1] == "[SEP]"
    assert w.page.locator(".grid canvas").count() == 6 * 12
    check_views(w, "served-minilm", token_index=2)
    w.page.wait_for_selector('body[data-thumbnails="1"]')
    w.page.screenshot(path=str(ARTIFACTS / "served-minilm.png"), full_page=True)
    w.check_clean(server_url.rstrip("/"))
    w.page.close()


@pytest.mark.slow
def test_served_on_ipv6_loopback_end_to_end(browser, tmp_path):
    """`attnkit serve --host ::1` as a user runs it: the browser's Host header is '[::1]:PORT'."""
    import signal
    import subprocess
    import sys

    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
        probe.bind(("::1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "attnkit", "serve", "--host", "::1", "--port", str(port), "-m", "random"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path,
    )
    try:
        assert server.stdout.readline().decode() == f"attnkit: open http://[::1]:{port}/ (Ctrl+C to stop)\n"
        for _ in range(200):  # the socket listens once uvicorn has started
            with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as client:
                if client.connect_ex(("::1", port)) == 0:
                    break
            time.sleep(0.05)
        url = f"http://[::1]:{port}/"
        w = Watched(browser)
        w.page.goto(url)
        w.page.wait_for_selector("#input-form:not([hidden])")
        w.page.fill("#text", "the cat sat on the mat")
        w.page.select_option("#model", "random")
        w.page.click("#submit")
        wait_ready(w.page)
        assert w.page.locator(".col.left .tok").all_text_contents() == "the cat sat on the mat".split()
        w.check_clean(url.rstrip("/"))
        w.page.close()
    finally:
        server.send_signal(signal.SIGINT)
        _, errors = server.communicate(timeout=30)
    assert server.returncode == 130 and b"Traceback" not in errors  # stopped by Ctrl+C, as a shell reports it


# ----------------------------------------------------------------------------- the served page's form


@pytest.fixture(scope="module")
def small_server_url():
    """A server whose page takes at most 60 characters, offering MiniLM and the random model."""
    from attnkit.serve.server import BackgroundServer, create_app

    with BackgroundServer(create_app(models=["random", "minilm"], max_chars=60, max_tokens=512)) as running:
        yield running.url + "/"


def _open_form(browser, url: str, model: str = "random") -> Watched:
    w = Watched(browser)
    w.page.goto(url)
    w.page.wait_for_selector("#input-form:not([hidden])")
    wait_ready(w.page)  # the example, drawn with the first model
    w.page.select_option("#model", model)
    return w


def test_served_page_enter_and_ctrl_enter_submit_and_shift_enter_breaks_the_line(browser, small_server_url):
    w = _open_form(browser, small_server_url)
    box = w.page.locator("#text")
    for keys in ("Enter", "Control+Enter"):
        box.fill(f"pressing {keys} sends")
        box.press(keys)
        # the submit handler sets the status at once; it clears when the answer is drawn
        w.page.wait_for_selector('body[data-ready="1"] .doc')
        assert w.page.locator(".col.left .tok").all_text_contents() == ["pressing", keys, "sends"]
    box.fill("one line")
    box.press("End")
    box.press("Shift+Enter")
    assert box.input_value() == "one line\n"
    assert w.page.locator("#form-status").text_content() == ""  # nothing was sent
    assert w.page.locator(".col.left .tok").all_text_contents() == ["pressing", "Control+Enter", "sends"]
    w.check_clean(small_server_url.rstrip("/"))
    w.page.close()


def test_served_page_states_each_models_own_token_limit(browser, small_server_url, minilm_folder):
    from attnkit.models.bert import SentenceEncoder

    limit = SentenceEncoder.from_pretrained("minilm").max_seq_length  # 256, from the model's config
    w = _open_form(browser, small_server_url, "minilm")
    header = w.page.locator("#subtitle").text_content()
    assert f"minilm reads at most {limit} tokens" in header and "At most 60 characters" in header
    assert "512" not in header
    w.page.select_option("#model", "random")
    assert "random reads at most 512 tokens" in w.page.locator("#subtitle").text_content()
    w.check_clean(small_server_url.rstrip("/"))
    w.page.close()


def test_served_page_says_a_paste_is_too_long_instead_of_cutting_it(browser, small_server_url):
    w = _open_form(browser, small_server_url)
    box = w.page.locator("#text")
    long_text = "word " * 20  # 100 characters, the page takes 60
    box.fill("")
    box.focus()
    w.page.keyboard.insert_text(long_text)  # as a paste arrives: one input event
    assert box.input_value() == long_text  # kept whole, not cut at 60
    note = w.page.locator("#too-long")
    assert note.text_content() == "The text has 100 characters; this page takes at most 60. Shorten it to see its attention."
    assert w.page.locator("#submit").is_disabled()
    box.press("Enter")
    assert w.page.locator("#form-status").text_content() == ""  # not sent
    box.fill("short enough")
    assert note.text_content() == "" and not w.page.locator("#submit").is_disabled()
    box.press("Enter")
    w.page.wait_for_selector('body[data-ready="1"] .doc')
    assert w.page.locator(".col.left .tok").all_text_contents() == ["short", "enough"]
    w.check_clean(small_server_url.rstrip("/"))
    w.page.close()


# ----------------------------------------------------------------------------- derived maps on the served page


def _page_map(w: Watched) -> np.ndarray:
    """The map the page draws now (window.attnkit.docs[0].current), as (T, T)."""
    values = np.array(w.page.evaluate("() => Array.from(window.attnkit.docs[0].current)"))
    T = int(np.sqrt(values.size))
    return values.reshape(T, T)


@pytest.mark.slow  # measured > 2 s in the quick loop
def test_served_page_draws_rollout_flow_and_value_weighted_maps(browser, small_server_url, minilm_folder):
    from attnkit.viz.derived import DESCRIPTIONS, derive
    from attnkit.viz.providers import get_provider

    text = "the cat sat on the mat"
    w = _open_form(browser, small_server_url)
    w.page.fill("#text", text)
    w.page.click("#submit")
    wait_ready(w.page)
    attention, before = get_provider("random", max_tokens=512).attention(text), w.matrix()
    assert w.page.locator("#head").is_visible() and w.page.locator("#map-description").text_content() == ""
    close = 1 / 510 + 1e-6  # the page holds 8-bit codes of sqrt(w)
    # Choosing rollout redraws the text at once, on the last layer, with no head to choose.
    w.page.select_option("#map", "rollout")
    wait_ready(w.page)
    rollout = derive(attention, "rollout").weights  # (layers, 1, T, T)
    assert w.matrix() != before
    assert w.page.locator("#layer").input_value() == str(rollout.shape[0] - 1)
    assert np.max(np.abs(np.sqrt(_page_map(w)) - np.sqrt(rollout[-1, 0]))) <= close
    assert not w.page.locator("#head").is_visible()
    assert w.page.locator("#picked").text_content().endswith("heads averaged")
    assert w.page.locator("#map-description").text_content() == "Showing " + DESCRIPTIONS["rollout"] + "."
    assert w.page.locator(".doc-meta").first.text_content().startswith("random (rollout)")
    assert w.page.locator(".grid canvas").count() == rollout.shape[0]  # one thumbnail per layer
    w.page.screenshot(path=str(ARTIFACTS / "served-rollout.png"), full_page=True)
    last = w.matrix()
    w.page.select_option("#layer", "0")
    assert w.matrix() != last
    assert np.max(np.abs(np.sqrt(_page_map(w)) - np.sqrt(rollout[0, 0]))) <= close
    # Flow, the same way.
    w.page.select_option("#map", "flow")
    wait_ready(w.page)
    flow = derive(attention, "flow").weights
    assert np.max(np.abs(np.sqrt(_page_map(w)) - np.sqrt(flow[-1, 0]))) <= close
    assert w.page.locator("#map-description").text_content() == "Showing " + DESCRIPTIONS["flow"] + "."
    # The random model has no weights to read: value-weighted says so and keeps the flow drawn.
    w.page.select_option("#map", "value-weighted")
    w.page.wait_for_selector("#messages div.error")
    assert "random is not one" in w.page.locator("#messages").text_content()
    refused = "Failed to load resource: the server responded with a status of 422 (Unprocessable Entity)"
    assert w.errors == [refused]  # Chromium logs the refusal itself; the page showed it above
    w.errors.clear()
    assert w.page.locator(".doc-meta").first.text_content().startswith("random (flow)")
    # MiniLM's value-weighted maps: every head again, each row a share of 1.
    w.page.select_option("#model", "minilm")
    w.page.click("#submit")
    wait_ready(w.page)
    provider = get_provider("minilm", max_tokens=512)
    weighted = derive(provider.attention(text), "value-weighted", model=provider.model).weights
    assert w.page.locator("#head").is_visible()
    layer, head = int(w.page.locator("#layer").input_value()), int(w.page.locator("#head").input_value())
    assert np.max(np.abs(np.sqrt(_page_map(w)) - np.sqrt(weighted[layer, head]))) <= close
    assert w.page.locator(".grid canvas").count() == weighted.shape[0] * weighted.shape[1]
    assert "is changed most by" not in w.page.locator(".status").first.text_content()
    w.page.locator(".col.left .tok").nth(2).hover()
    assert "is changed most by" in w.page.locator(".status").first.text_content()
    w.page.screenshot(path=str(ARTIFACTS / "served-value-weighted.png"), full_page=True)
    # Back to the attention weights: the map the page opened with.
    w.page.select_option("#model", "random")
    w.page.select_option("#map", "attention")
    wait_ready(w.page)
    assert w.page.locator("#map-description").text_content() == ""
    layer, head = int(w.page.locator("#layer").input_value()), int(w.page.locator("#head").input_value())
    assert np.max(np.abs(np.sqrt(_page_map(w)) - np.sqrt(attention.head(layer, head)))) <= close
    w.check_clean(small_server_url.rstrip("/"))
    w.page.close()
