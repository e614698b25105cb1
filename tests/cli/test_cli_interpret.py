"""`attnkit heads`, `patch`, `lens` and `show --rollout/--flow/--value-weighted`, on a tiny
random Llama GGUF (fast) and the random view model: each number printed is checked against
the library function that computes it (themselves checked against TransformerLens in
tests/test_interpret*.py), the importance against one ablated forward per head; narrow
terminals, files written, errors."""

from __future__ import annotations

import html
import re

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import F32_EPS
from tiny_checkpoints import write_tiny_llama_gguf

runner = CliRunner()


def cli(*args, width=100):
    from attnkit.cli import app

    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": str(width), "NO_COLOR": "1"})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, gguf):
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_llama_gguf(path)
    return path


@pytest.fixture(scope="module")
def tiny_model(tiny):
    from attnkit.models.auto import AutoCausalLM

    return AutoCausalLM.from_pretrained(tiny)


TEXT = "the cat the cat in the hat"


def loss(model, ids) -> float:
    logits = model.forward(ids).astype(np.float64)
    logits -= logits.max(axis=-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    return float(-logp[np.arange(len(ids) - 1), ids[1:]].mean())


# ----------------------------------------------------------------------------- heads


@pytest.mark.slow  # a forward per head of the model, each ablated: 16 s under load (the quick loop's slowest)
def test_importance_is_the_loss_of_one_ablated_forward_per_head(tiny_model):
    """The batched run (each layer's heads as one batch from that layer up) against the plain
    route: `ablate` one head, run the whole model, take the loss."""
    from attnkit.cli.interpret import ablation_losses
    from attnkit.interpret import ablate

    model = tiny_model
    ids = np.asarray(model.tokenizer.encode(TEXT), dtype=np.int64)
    base, ablated = ablation_losses(model, ids)
    assert abs(base - loss(model, ids)) <= 64 * F32_EPS * abs(base)
    for layer in range(ablated.shape[0]):
        for head in range(ablated.shape[1]):
            with ablate(model, [(layer, head)]):
                expected = loss(model, ids)
            # both float32 models of the same sums, in another order: the loss moves by float32
            # rounding of logits of this size (d = 64 terms), far below any real difference
            assert abs(ablated[layer, head] - expected) <= 64 * F32_EPS * max(abs(expected), 1.0), (layer, head)
    assert np.ptp(ablated) > 100 * 64 * F32_EPS * abs(base)  # heads differ: the test can fail


def _rows(output: str) -> list[list[str]]:
    return [line.split() for line in output.splitlines() if re.match(r"^\s*\d+\s+\d+\s", line)]


def test_heads_table_scores_roles_and_order(tiny, tiny_model):
    from attnkit.cli.interpret import ablation_losses
    from attnkit.interpret import detect_heads

    result = cli("heads", TEXT, "--model", tiny, "--threshold", "0.15")
    assert result.exit_code == 0, result.output
    rows = _rows(result.output)
    model = tiny_model
    ids = np.asarray(model.tokenizer.encode(TEXT), dtype=np.int64)
    names = ["previous_token", "duplicate_token", "induction", "first_token", "self"]
    scores = {name: detect_heads(model, ids, name) for name in names}
    base, ablated = ablation_losses(model, ids)
    assert len(rows) == ablated.size  # every head, once
    increases = [float(row[3]) for row in rows]
    assert increases == sorted(increases, reverse=True)  # most important first
    for row in rows:
        layer, head = int(row[0]), int(row[1])
        assert float(row[3]) == pytest.approx(ablated[layer, head] - base, abs=6e-5)  # printed to 4 decimals
        printed = [float(v) for v in row[4:9]]
        expected = [scores[name][layer, head] for name in names]
        np.testing.assert_allclose(printed, expected, atol=6e-4)  # printed to 3 decimals
        best = int(np.argmax(expected))
        role = {0: "previous", 1: "duplicate", 2: "induction", 3: "first", 4: "self"}[best]
        assert row[2] == (role if expected[best] >= 0.15 else "-")
    assert f"over {len(ids) - 1} predictions" in result.output


def test_heads_on_an_encoder_has_detectors_and_no_importance(minilm_folder):
    from attnkit.interpret import detect_heads
    from attnkit.models.bert import SentenceEncoder

    text = "the cat sat on the mat and the cat slept"
    result = cli("heads", text, "--model", "minilm", "--top", "4")
    assert result.exit_code == 0, result.output
    assert "Δloss" not in result.output and "no importance column" in result.output
    encoder = SentenceEncoder.from_pretrained(minilm_folder)
    ids = encoder.tokenizer.encode([text])[0].ids
    previous = detect_heads(encoder, ids, "previous_token")
    for row in _rows(result.output):
        assert float(row[3]) == pytest.approx(previous[int(row[0]), int(row[1])], abs=6e-4)


def test_heads_on_a_narrow_terminal_drops_columns_never_cuts_cells(tiny):
    result = cli("heads", TEXT, "--model", tiny, "--no-importance", "--top", "3", width=36)
    assert result.exit_code == 0, result.output
    assert "…" not in result.output
    assert "columns left out to fit 36 columns" in result.output
    assert all(len(line) <= 36 for line in result.output.splitlines() if re.match(r"^\s*\d+\s+\d+\s", line))
    assert len(_rows(result.output)) == 3


def test_heads_writes_its_grids_as_png_and_html(tiny, tmp_path):
    png, page = tmp_path / "heads.png", tmp_path / "heads.html"
    result = cli("heads", TEXT, "--model", tiny, "--png", png, "--html", page)
    assert result.exit_code == 0, result.output
    assert f"wrote {png} (" in result.output and f"wrote {page} (self-contained" in result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = page.read_text(encoding="utf-8")
    for name in ("loss increase when ablated", "previous", "duplicate", "induction", "first", "self"):
        assert f"<h2>{name}</h2>" in text
    assert text.count('<table class="grid">') == 6 and not re.search(r"https?://", text)
    assert "<script" not in text and "default-src 'none'" in text


def test_heads_errors_are_one_line(tiny, tmp_path):
    bad = cli("heads", TEXT, "--model", tiny, "--threshold", "0")
    assert bad.exit_code == 2 and bad.output.count("\n") == 1 and "--threshold" in bad.output
    missing = cli("heads", TEXT, "--model", tmp_path / "none.gguf")
    assert missing.exit_code == 1 and missing.output.startswith("error: ") and "does not exist" in missing.output
    random = cli("heads", TEXT, "--model", "random")
    assert random.exit_code == 1 and "random draws attention maps only" in random.output
    # a file is written only when the work succeeded
    assert cli("heads", "x", "--model", tiny, "--html", tmp_path / "x.html").exit_code == 1
    assert not (tmp_path / "x.html").exists()


# ----------------------------------------------------------------------------- patch


def test_patch_prints_what_patch_heads_computes(tiny, tiny_model):
    from attnkit.interpret import patch_heads

    model = tiny_model
    clean, corrupt = "the cat sat", "the hat sat"
    answer, wrong = model.tokenizer.encode("a", add_special_tokens=False)[0], \
        model.tokenizer.encode("t", add_special_tokens=False)[0]

    def metric(logits):
        return float(logits[-1, answer].astype(np.float64) - logits[-1, wrong])

    patched = patch_heads(model, clean, corrupt, metric)
    c, k = metric(model.forward(model.tokenizer.encode(clean))), metric(model.forward(model.tokenizer.encode(corrupt)))
    recovered = (patched - k) / (c - k)
    result = cli("patch", "--clean", clean, "--corrupt", corrupt, "--answer", "a", "--wrong", "t",
                 "--model", tiny, "--top", "4")
    assert result.exit_code == 0, result.output
    grid = [line.split() for line in result.output.splitlines() if re.match(r"^[01] ", line)][:2]
    printed = np.array([[float(v.lstrip(" ░▒▓█")) for v in row[1:]] for row in grid])
    np.testing.assert_allclose(printed, recovered, atol=6e-3)  # two decimals
    assert f"clean {c:.4f}, corrupt {k:.4f}" in result.output
    top = [line.split() for line in result.output.split("heads that move the metric most")[1].splitlines()
           if re.match(r"^\s*\d+\s+\d+\s", line)]
    order = np.argsort(-np.abs(recovered), axis=None)[:4]
    assert [(int(r[0]), int(r[1])) for r in top] == [tuple(map(int, np.unravel_index(i, recovered.shape)))
                                                     for i in order]


def test_patch_names_each_token_and_warns_about_a_missing_space(tiny, tiny_model):
    """Each answer is named as the token it became; an answer without its leading space is
    flagged when the spaced form is one token too and likelier after the clean text."""
    model = tiny_model
    clean = "the cat sat"
    logits = model.forward(model.tokenizer.encode(clean))[-1]
    likelier, not_likelier = [], []
    for letter in "abcdefghijklmnopqrstuvwxyz":
        plain = model.tokenizer.encode(letter, add_special_tokens=False)
        spaced = model.tokenizer.encode(" " + letter, add_special_tokens=False)
        if len(plain) == 1 and len(spaced) == 1 and plain != spaced:
            (likelier if logits[spaced[0]] > logits[plain[0]] else not_likelier).append(letter)
    assert likelier and not_likelier  # both branches run
    for letter, warned in ((likelier[0], True), (not_likelier[0], False)):
        result = cli("patch", "--clean", clean, "--corrupt", "the hat sat", "--answer", letter, "--model", tiny,
                     "--top", "0")
        assert result.exit_code == 0, result.output
        token = model.tokenizer.encode(letter, add_special_tokens=False)[0]
        assert f"--answer {letter!r} is the token {letter!r} (id {token})" in result.output
        assert (f"did you mean --answer {' ' + letter!r}?" in result.output) is warned, result.output


def test_patch_warns_when_the_clean_run_gets_the_answer_wrong(tiny, tiny_model):
    """Of an answer and its swap, the clean run prefers one: the other is warned about."""
    model = tiny_model
    logits = model.forward(model.tokenizer.encode("the cat sat"))[-1].astype(np.float64)
    a, t = (model.tokenizer.encode(x, add_special_tokens=False)[0] for x in "at")
    preferred = "a" if logits[a] > logits[t] else "t"
    for answer, wrong in (("a", "t"), ("t", "a")):
        result = cli("patch", "--clean", "the cat sat", "--corrupt", "the hat sat", "--answer", answer,
                     "--wrong", wrong, "--model", tiny, "--top", "0")
        assert result.exit_code == 0, result.output
        assert ("the clean run does not prefer" in result.output) is (answer != preferred), result.output


def test_patch_refuses_what_it_cannot_patch(tiny):
    longer = cli("patch", "--clean", "the cat sat", "--corrupt", "the big hat sat", "--answer", "a", "--model", tiny)
    assert longer.exit_code == 1 and "same number of tokens" in longer.output and longer.output.count("\n") == 1
    several = cli("patch", "--clean", "the cat", "--corrupt", "the hat", "--answer", "cat", "--model", tiny)
    assert several.exit_code == 1 and "expected --answer to be one token of the model, got" in several.output


# ----------------------------------------------------------------------------- lens


def test_lens_last_row_is_the_models_prediction(tiny, tiny_model, tmp_path):
    from attnkit.interpret import logit_lens
    from attnkit.viz.interpret_views import top_tokens

    model = tiny_model
    ids = np.asarray(model.tokenizer.encode("the cat sat"), dtype=np.int64)
    best = top_tokens(model, logit_lens(model, ids), 2)
    logits = model.forward(ids)
    for position in range(len(ids)):
        expected = np.argsort(-logits[position], kind="stable")[:2]
        assert best[-1][position] == [model.tokenizer.decode([int(i)]) for i in expected]
    page = tmp_path / "lens.html"
    result = cli("lens", "the cat sat", "--model", tiny, "--top", "2", "--html", page, width=40)
    assert result.exit_code == 0, result.output
    assert "…" not in result.output
    assert re.search(r"^embed ", result.output, re.M) and re.search(r"^L1 ", result.output, re.M)
    assert page.exists() and "<script" not in page.read_text(encoding="utf-8")
    assert cli("lens", "x", "--model", tiny, "--top", "6").exit_code == 2


def test_top_tokens_lives_in_interpret_and_the_views_keep_it(tiny_model):
    from attnkit.interpret import logit_lens, top_tokens
    from attnkit.viz import interpret_views

    ids = np.asarray(tiny_model.tokenizer.encode("the cat sat"), dtype=np.int64)
    lens = logit_lens(tiny_model, ids)
    assert interpret_views.top_tokens(tiny_model, lens, 3) == top_tokens(tiny_model, lens, 3)
    with pytest.raises(ValueError, match=r"expected lens of shape \(layers \+ 1, T, vocab\)"):
        top_tokens(tiny_model, lens[0], 1)


def test_lens_table_gives_a_cell_the_width_of_its_tokens():
    from rich.console import Console

    from attnkit.viz.interpret_views import lens_table

    top = [[["Paris", " capital", " France"], [" the", " located", " known"]]] * 3  # 3 rows, 2 positions
    console = Console(width=120, record=True, no_color=True)
    for table in lens_table(["The", " capital"], top, width=120, color=False):
        console.print(table)
    lines = console.export_text().splitlines()
    assert len(lines) == 4 and "Paris capital France the located known" in lines[1], lines  # header + 3 rows, no wrapping


def test_lens_rows_stay_one_line_where_the_terminal_has_room(tiny):
    """--top 3 at 120 columns: each layer is one line (cells as wide as their tokens, not cut
    at a fixed 14 and wrapped); at 40 columns the positions go on in blocks, never cut."""
    wide = cli("lens", "the cat sat on", "--model", tiny, "--top", "3", width=120)
    assert wide.exit_code == 0, wide.output
    lines = wide.output.splitlines()
    names = [line.split()[0] for line in lines if re.match(r"^(embed|L\d+) ", line)]
    start = next(i for i, line in enumerate(lines) if line.startswith("embed "))
    assert names == ["embed", "L0", "L1"]  # one table
    assert [line.split()[0] for line in lines[start: start + 3]] == names  # no continuation lines
    assert all(len(line) <= 120 for line in lines)
    narrow = cli("lens", "the cat sat on", "--model", tiny, "--top", "3", width=40)
    assert narrow.exit_code == 0 and "…" not in narrow.output
    assert all(len(line) <= 40 for line in narrow.output.splitlines() if not line.startswith(("Logit", "rows")))


# ----------------------------------------------------------------------------- show


def test_show_rollout_and_flow_in_every_file_view(tmp_path):
    from attnkit.interpret.flow import attention_flow, rollout
    from attnkit.viz.derived import derive
    from attnkit.viz.providers import get_provider

    maps = get_provider("random").attention("the cat sat on the mat")
    np.testing.assert_allclose(derive(maps, "rollout").weights[:, 0], rollout(maps.weights), rtol=1e-6)
    np.testing.assert_allclose(derive(maps, "flow").weights[:, 0], attention_flow(maps.weights), rtol=1e-6)
    for flag in ("--rollout", "--flow"):
        png, page = tmp_path / f"{flag[2:]}.png", tmp_path / f"{flag[2:]}.html"
        result = cli("show", "the cat sat on the mat", "--model", "random", flag, "--layer", "1",
                     "--png", png, "--html", page, width=50)
        assert result.exit_code == 0, result.output
        assert f"random ({flag[2:]}): layer 1, all heads" in result.output
        assert "…" not in result.output
        assert png.exists() and (tmp_path / f"{flag[2:]}-grid.png").exists()
        assert f'"model":"random ({flag[2:]})"' in page.read_text(encoding="utf-8")


def test_show_rollout_and_flow_default_to_the_last_layer():
    """Rollout and flow accumulate through the layers: the default map is the last layer's
    (layer 0's is nearly the identity); plain attention still opens at layer 0."""
    from attnkit.viz.providers import get_provider

    layers = get_provider("random").attention("the cat sat").num_layers
    for flag in ("--rollout", "--flow"):
        result = cli("show", "the cat sat", "--model", "random", flag)
        assert result.exit_code == 0, result.output
        assert f"random ({flag[2:]}): layer {layers - 1}, all heads" in result.output
    plain = cli("show", "the cat sat", "--model", "random", "--no-summary")
    assert plain.exit_code == 0 and "random: layer 0, head 0" in plain.output


def test_show_value_weighted_matches_the_library(tiny):
    from attnkit.interpret.norms import value_weighted
    from attnkit.viz.derived import derive, load_model, normalise_rows
    from attnkit.viz.providers import get_provider

    maps = get_provider(str(tiny)).attention("the cat sat")
    derived = derive(maps, "value-weighted", model=str(tiny))
    norms = value_weighted(load_model(str(tiny)), np.asarray(load_model(str(tiny)).tokenizer.encode("the cat sat")))
    np.testing.assert_allclose(derived.weights, normalise_rows(norms.heads), rtol=1e-6)
    result = cli("show", "the cat sat", "--model", tiny, "--value-weighted", "--head", "1")
    assert result.exit_code == 0, result.output
    assert "(value-weighted): layer 0, head 1" in result.output


def test_show_flags_exclude_each_other():
    both = cli("show", "a b", "--model", "random", "--rollout", "--flow")
    assert both.exit_code == 2 and "--rollout and --flow exclude each other" in both.output
    head = cli("show", "a b", "--model", "random", "--rollout", "--head", "1")
    assert head.exit_code == 2 and "--head and --mean do not apply" in head.output
    random = cli("show", "a b", "--model", "random", "--value-weighted")
    assert random.exit_code == 1 and "value-weighted maps need a model" in random.output


# ----------------------------------------------------------------------------- notebook


def test_notebook_views_are_self_contained_frames():
    from attnkit.viz.interpret_views import grids_view, lens_view

    grid = np.array([[0.1, -0.5], [0.9, 0.0]])
    shown = grids_view({"patching <b>": grid}, title="heads & more")
    out = shown._repr_html_()
    page = html.unescape(re.search(r'srcdoc="([^"]*)"', out).group(1))
    assert page == shown.html and "patching &lt;b&gt;" in page and "heads &amp; more" in page
    assert 'title="layer 0, head 1: -0.5"' in page and "<script" not in page
    assert not re.search(r"https?://", page)
    lens = lens_view(["a", "<b>"], [[["x"], ["y"]], [["z"], ["<i>"]]]).html
    assert "&lt;i&gt;" in lens and "<i>" not in lens
    with pytest.raises(ValueError, match=r"expected the grid 'g' of shape \(layers, heads\), got \(3,\)"):
        grids_view({"g": np.zeros(3)})


def test_derived_view_shows_rollout_flow_and_value_weighted_inline(tiny):
    from attnkit.interpret.flow import rollout
    from attnkit.viz.html import decode_weights
    from attnkit.viz.notebook import NotebookView, derived_view
    from attnkit.viz.providers import get_provider

    shown = derived_view("the cat sat on the mat", "rollout", model="random")
    assert isinstance(shown, NotebookView) and '"model":"random (rollout)"' in shown.html
    data = re.search(r'"weights":"([^"]+)"', shown.html).group(1)
    maps = get_provider("random").attention("the cat sat on the mat")
    expected = rollout(maps.weights)[:, None]
    # the page carries 8-bit codes of sqrt(w): within one code of the truth
    assert np.abs(np.sqrt(decode_weights(data, expected.shape)) - np.sqrt(expected)).max() <= 1 / 255
    assert '"model":' in derived_view("the cat", "value-weighted", model=str(tiny)).html
    with pytest.raises(ValueError, match="value-weighted maps need the model's weights"):
        derived_view(maps, "value-weighted", model="random")


# ----------------------------------------------------------------------------- bench


def test_bench_interpret_is_a_suite_and_reports_the_ratio():
    from attnkit.bench import SUITES, get_suite
    from attnkit.bench.report import goal_failed

    assert SUITES["interpret"] == "attnkit.bench.interpret"
    suite = get_suite("interpret")
    raw = {"tokens": 20, "heads": 270, "layers": 30, "threads": 1, "max_difference_over_spread": 1e-6,
           "seconds": {"attnkit": 2.0, "TransformerLens": 5.0}, "load_s": {"attnkit": 1.0, "TransformerLens": 9.0},
           "blas": "openblas"}
    report = suite.report_from_raw(raw)
    assert [row[0] for row in report.rows] == ["attnkit", "TransformerLens"]
    assert report.rows[0][4] == round(5.0 / 2.0, 2) and goal_failed(report.goals[0])  # 2.5x < 3x
    raw["seconds"]["attnkit"] = 1.0
    assert not goal_failed(suite.report_from_raw(raw).goals[0])  # 5x
    alone = suite.report_from_raw({**raw, "seconds": {"attnkit": 1.0}, "max_difference_over_spread": None,
                                   "load_s": {"attnkit": 1.0, "TransformerLens": None}})
    assert alone.goals[0].startswith("N/A") and len(alone.rows) == 1


@pytest.mark.slow
@pytest.mark.browser
def test_grid_and_lens_pages_draw_in_chromium_and_in_a_notebook_frame(tmp_path, chromium_path):
    """The pages the commands write, and the notebook views' frames, draw in Chromium: every
    cell, no error, no request (their policy forbids scripts and the network)."""
    from playwright.sync_api import sync_playwright

    from attnkit.viz.interpret_views import grids_view, lens_view, render_grids_html

    grid = np.arange(12.0).reshape(3, 4) - 5
    (tmp_path / "grids.html").write_text(render_grids_html({"a": grid, "b": np.abs(grid)}, title="t"), "utf-8")
    frames = (grids_view({"a": grid})._repr_html_()
              + lens_view(["x", "y"], [[["p"], ["q"]], [["r"], ["s"]]])._repr_html_())
    (tmp_path / "notebook.html").write_text(f"<!DOCTYPE html><html><body>{frames}</body></html>", "utf-8")
    args = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path, args=args)
        page = browser.new_page()
        errors, requests = [], []
        page.on("console", lambda m: m.type == "error" and errors.append(m.text))
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: requests.append(r.url))
        page.goto((tmp_path / "grids.html").as_uri())
        assert page.locator("table.grid").count() == 2
        assert page.locator("table.grid td").count() == 2 * grid.size
        assert page.locator("td[title='layer 2, head 3: 6']").count() == 2
        page.goto((tmp_path / "notebook.html").as_uri())
        frames = page.locator("iframe.attnkit-view")
        assert frames.count() == 2
        assert frames.nth(0).content_frame.locator("table.grid td").count() == grid.size
        assert frames.nth(1).content_frame.locator("table.lens td").all_text_contents() == ["p", "q", "r", "s"]
        browser.close()
    assert errors == []
    assert [u for u in requests if not u.startswith(("file:", "data:", "blob:", "about:"))] == []
