"""Inline views in Jupyter: `attnkit.viz.head_view` / `model_view` in a notebook run by nbclient.

The notebook's output cell must hold the view (an iframe whose srcdoc is the
self-contained page), and that output, opened in headless Chromium, must draw:
the frame's page gets ready, with the tokens, the matrix and nothing loaded
from the network.
"""

from __future__ import annotations

import html
import re

import pytest

from conftest import missing_oracle, optional
from attnkit.viz.data import maps_from_random_model
from attnkit.viz.notebook import NotebookView, head_view, model_view, view

TOKENS = ["The", "cat", "<script>alert(1)</script>", "sat"]


def test_views_render_as_an_iframe_holding_the_self_contained_page(tmp_path):
    maps = maps_from_random_model(TOKENS, layers=2, heads=3)
    shown = head_view(maps, layer=1, head=2)
    assert isinstance(shown, NotebookView)
    out = shown._repr_html_()
    assert out.startswith("<iframe ") and out.count("<iframe") == 1 and out.endswith("</iframe>")
    srcdoc = re.search(r'srcdoc="([^"]*)"', out).group(1)  # the page, escaped as one attribute value
    page = html.unescape(srcdoc)
    assert page == shown.html and "<script>alert(1)</script>" not in out
    assert "default-src 'none'" in page and "connect-src 'none'" in page
    assert not re.search(r"https?://", page)  # offline: nothing to fetch
    assert '"view":"head"' in page and '"layer":1' in page and '"head":2' in page
    assert '"view":"model"' in model_view(maps)._repr_html_().replace("&quot;", '"')
    assert shown.save(tmp_path / "v.html").read_text(encoding="utf-8") == shown.html
    with pytest.raises(ValueError, match="one of all, head, model"):
        view(maps, show="grid")
    with pytest.raises(TypeError, match="expected AttentionMaps, a text"):
        head_view(42)


def test_a_text_goes_through_the_named_model():
    shown = head_view("a b c", model="random", hide_special=True, log_scale=True)
    page = shown.html
    assert '"tokens":["a","b","c"]' in page
    assert '"options":{"hide_special":true,"log_scale":true}' in page


def _run_notebook(tmp_path):
    nbformat = optional("nbformat")
    nbclient = optional("nbclient")
    if nbformat is None or nbclient is None or optional("ipykernel") is None:
        missing_oracle("nbclient, nbformat and ipykernel (pip install 'attnkit[test]')")
    from nbformat.v4 import new_code_cell, new_notebook

    notebook = new_notebook(cells=[
        new_code_cell("from attnkit.viz import head_view, maps_from_random_model\n"
                      f"maps = maps_from_random_model({TOKENS!r}, layers=2, heads=3)"),
        new_code_cell("head_view(maps, layer=1, head=2)"),
    ])
    client = nbclient.NotebookClient(notebook, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    return notebook.cells[1].outputs


@pytest.mark.slow
def test_a_notebook_shows_the_view_inline(tmp_path):
    outputs = _run_notebook(tmp_path)
    assert len(outputs) == 1 and outputs[0]["output_type"] == "execute_result"
    rendered = outputs[0]["data"]["text/html"]
    assert rendered.startswith('<iframe class="attnkit-view" srcdoc="')
    page = html.unescape(re.search(r'srcdoc="([^"]*)"', rendered).group(1))
    assert '"tokens":["The","cat","\\u003cscript\\u003ealert(1)\\u003c/script\\u003e","sat"]' in page
    assert "NotebookView" in outputs[0]["data"]["text/plain"]


@pytest.mark.slow
@pytest.mark.browser
def test_the_notebook_output_draws_in_a_browser(tmp_path, chromium_path):
    """The output cell's HTML, put in a page as Jupyter puts it, draws the view in its frame."""
    from playwright.sync_api import sync_playwright

    rendered = _run_notebook(tmp_path)[0]["data"]["text/html"]
    host = tmp_path / "notebook.html"
    host.write_text(f"<!DOCTYPE html><html><body><h1>notebook</h1>{rendered}</body></html>", encoding="utf-8")
    args = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path, args=args)
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        errors, dialogs, requests = [], [], []
        page.on("console", lambda m: m.type == "error" and errors.append(m.text))
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        page.on("request", lambda r: requests.append(r.url))
        page.goto(host.as_uri())
        frame = page.frame_locator("iframe.attnkit-view")
        frame.locator('body[data-ready="1"] .doc').wait_for(timeout=60_000)
        assert frame.locator(".col.left .tok").all_text_contents() == TOKENS
        assert frame.locator("#layer").input_value() == "1" and frame.locator("#head").input_value() == "2"
        assert frame.locator(".model-view").count() == 1 and not frame.locator(".model-view").is_visible()
        browser.close()
    assert errors == [] and dialogs == []
    assert [u for u in requests if not u.startswith(("file:", "data:", "blob:", "about:"))] == []
