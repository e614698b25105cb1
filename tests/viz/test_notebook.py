"""Inline views in Jupyter: `attnkit.viz.head_view` / `model_view` in a notebook run by nbclient.

The notebook's output cell must hold the view (an iframe whose srcdoc is the
self-contained page), and that output, opened in headless Chromium, must draw:
the frame's page gets ready, with the tokens, the matrix and nothing loaded
from the network.
"""

from __future__ import annotations

import html
import re

import numpy as np
import pytest

from conftest import missing_oracle, optional
from attnkit.viz.data import AttentionMaps, maps_from_random_model
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


# ----------------------------------------------------------------------------- bertviz's calls

# bertviz 1.4.1's parameters (bertviz/head_view.py, bertviz/model_view.py), in order
BERTVIZ_HEAD_VIEW = ("attention", "tokens", "sentence_b_start", "prettify_tokens", "layer", "heads",
                     "encoder_attention", "decoder_attention", "cross_attention", "encoder_tokens",
                     "decoder_tokens", "include_layers", "html_action")
BERTVIZ_MODEL_VIEW = ("attention", "tokens", "sentence_b_start", "prettify_tokens", "display_mode",
                      "encoder_attention", "decoder_attention", "cross_attention", "encoder_tokens",
                      "decoder_tokens", "include_layers", "include_heads", "html_action")


def test_head_view_has_bertviz_parameters_in_bertviz_order():
    import inspect

    ours = list(inspect.signature(head_view).parameters)
    assert tuple(ours[: len(BERTVIZ_HEAD_VIEW)]) == BERTVIZ_HEAD_VIEW
    model = inspect.signature(model_view).parameters
    # positionally as bertviz up to prettify_tokens; display_mode (bertviz's colours) is not taken
    assert tuple(model)[:4] == BERTVIZ_MODEL_VIEW[:4]
    assert set(BERTVIZ_MODEL_VIEW) - set(model) == {"display_mode"}
    bertviz = optional("bertviz")
    if bertviz is not None:  # the real thing, where it is installed
        assert tuple(inspect.signature(bertviz.head_view).parameters) == BERTVIZ_HEAD_VIEW


def _transformers_attentions(maps, kind):
    """maps' weights as transformers returns them: a tuple of one (1, H, T, T) map per layer."""
    if kind == "numpy":
        return tuple(maps.weights[layer][None] for layer in range(maps.num_layers))
    torch = pytest.importorskip("torch")
    return tuple(torch.from_numpy(maps.weights[layer][None].copy()) for layer in range(maps.num_layers))


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_head_view_takes_transformers_attentions_and_tokens_positionally(kind):
    from attnkit.viz.html import decode_weights

    maps = maps_from_random_model(["[CLS]", "Ġthe", "cat", "▁sat", "on</w>", "[SEP]"], layers=3, heads=2)
    attention = _transformers_attentions(maps, kind)
    shown = head_view(attention, list(maps.tokens))
    assert isinstance(shown, NotebookView) and '"view":"head"' in shown.html
    # prettify_tokens (bertviz's default): the BPE markers are spaces, '</w>' goes
    assert '"tokens":["[CLS]"," the","cat"," sat","on","[SEP]"]' in shown.html
    raw = head_view(attention, list(maps.tokens), prettify_tokens=False).html
    assert '"tokens":["[CLS]","Ġthe","cat","▁sat","on\\u003c/w\\u003e","[SEP]"]' in raw
    stacked = AttentionMaps(maps.tokens, attention).weights  # the tuple, as AttentionMaps takes it
    assert stacked.shape == (3, 2, 6, 6) and np.array_equal(stacked, maps.weights)
    coded = re.search(r'"weights":"([^"]*)"', shown.html).group(1)
    np.testing.assert_allclose(decode_weights(coded, (3, 2, 6, 6)), maps.weights, atol=2 / 255)
    assert isinstance(model_view(attention, list(maps.tokens)), NotebookView)


def test_bertviz_keywords_sentence_b_include_layers_heads_and_html_action(monkeypatch):
    maps = maps_from_random_model([f"t{i}" for i in range(7)], layers=4, heads=3)
    attention = _transformers_attentions(maps, "numpy")
    tokens = list(maps.tokens)
    returned = head_view(attention, tokens, sentence_b_start=3, include_layers=[1, 3], layer=3, heads=[2],
                         html_action="return")
    page = returned.data  # as bertviz's returned HTML object: .data is the page
    assert page == returned.html and '"layers":2' in page and '"layer":1' in page and '"head":2' in page
    assert '"layer_names":["model layer 1","model layer 3"]' in page
    assert "sentence A is tokens 0-2, sentence B tokens 3-6" in page
    assert '"head":-1' in head_view(attention, tokens, heads=[0, 1]).html  # several heads: the layer's mean
    assert '"heads":2' in model_view(attention, tokens, include_heads=[0, 2], html_action="return").html
    with pytest.raises(ValueError, match=r"layer in include_layers \[1, 3\], got 0"):
        head_view(attention, tokens, include_layers=[1, 3], layer=0)
    with pytest.raises(ValueError, match="sentence_b_start in 1..6"):
        head_view(attention, tokens, sentence_b_start=7)
    with pytest.raises(ValueError, match="html_action 'view' or 'return'"):
        head_view(attention, tokens, html_action="show")
    with pytest.raises(ValueError, match="encoder-decoder arguments"):
        head_view(encoder_attention=attention, encoder_tokens=tokens)
    with pytest.raises(ValueError, match="batch size 1"):
        head_view(tuple(np.concatenate([a, a]) for a in attention), tokens)
    with pytest.raises(ValueError, match="T=6 like tokens"):
        head_view(attention, tokens[:-1])
    display = pytest.importorskip("IPython.display")
    shown = []
    monkeypatch.setattr(display, "display", shown.append)
    assert head_view(attention, tokens, html_action="view") is None  # bertviz: displayed now, nothing returned
    assert len(shown) == 1 and isinstance(shown[0], NotebookView)


@pytest.mark.slow
def test_bertviz_readme_example_runs_with_the_import_swapped(minilm_folder, transformers, torch):
    """bertviz's README (head view, then a sentence pair), on the embedded MiniLM folder."""
    from attnkit.viz import head_view, model_view  # was: from bertviz import head_view, model_view

    model = transformers.AutoModel.from_pretrained(str(minilm_folder), output_attentions=True,
                                                   attn_implementation="eager")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(minilm_folder))
    inputs = tokenizer.encode("The cat sat on the mat", return_tensors="pt")
    outputs = model(inputs)
    with pytest.raises(ValueError, match="pass outputs.attentions"):  # the README's outputs[-1] in transformers 5
        head_view(outputs[-1], tokenizer.convert_ids_to_tokens(inputs[0]))
    attention = outputs.attentions  # the README's outputs[-1] before transformers 5
    tokens = tokenizer.convert_ids_to_tokens(inputs[0])
    shown = head_view(attention, tokens)
    assert '"tokens":["[CLS]","the","cat","sat","on","the","mat","[SEP]"]' in shown.html
    assert '"layers":6' in shown.html and '"heads":12' in shown.html
    np.testing.assert_array_equal(AttentionMaps(tokens, attention).weights,
                                  np.stack([a[0].detach().numpy() for a in attention]))

    inputs = tokenizer("The cat sat on the mat", "The cat lay on the rug", return_tensors="pt")  # encode_plus before 5
    attention = model(inputs["input_ids"], token_type_ids=inputs["token_type_ids"]).attentions
    sentence_b_start = inputs["token_type_ids"][0].tolist().index(1)
    tokens = tokenizer.convert_ids_to_tokens(inputs["input_ids"][0])
    html = model_view(attention, tokens, sentence_b_start, html_action="return")
    assert f"sentence B tokens {sentence_b_start}-{len(tokens) - 1}" in html.data
