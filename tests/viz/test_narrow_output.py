"""Narrow and piped output: tables go on in blocks with every cell whole, heatmaps name every token.

`attnkit bench encoder --quick | cat` printed headers like `sente… to… b…` (rich squeezed
no-wrap columns into 80 columns), and `attnkit compare` at 80 columns pooled a 15-token
sentence into rows labelled `0-1`, `2-3`, losing the words. Each check runs at 40, 80 and
120 columns, and piped without $COLUMNS (rich's 80).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types

import pytest
from typer.testing import CliRunner

import attnkit.bench
from attnkit.bench import attention
from attnkit.bench.report import BenchReport
from attnkit.cli import app

runner = CliRunner()
WIDTHS = [40, 80, 120]

# The encoder suite's table as a first run prints it (its column names, values of its kinds)
ENCODER_COLUMNS = ["sentences", "tokens", "batch", "threads", "attnkit/s", "s-t/s", "ratio", "ORT/s", "ratio ORT",
                   "vs 1 thread", "max diff"]
ENCODER_ROWS = [["64 varied", 1534, 64, 1, 412.5, 251.3, 1.64, None, None, None, "3.1e-07"],
                ["256 varied", 6169, 32, 2, 1012.7, 601.9, 1.68, 733.2, 1.38, 1.91, "2.9e-07"]]
ATTENTION_ROWS = [[1024, "yes", "fwd+bwd", "attnkit flash", 48.125, 71.3, 3.4, "0.87x"],
                  [1024, "no", "fwd", "torch SDPA", 12.5, 85.9, 2.1, "1.00x"]]


def _suite(report: BenchReport):
    return types.SimpleNamespace(run=lambda *, quick, progress, threads=None: report)


@pytest.fixture
def fake_suites(monkeypatch):
    reports = {
        "wide": BenchReport("all-MiniLM-L6-v2 sentence embeddings: attnkit vs sentence-transformers and ONNX Runtime",
                            ENCODER_COLUMNS, ENCODER_ROWS, ["CPU: a test machine"]),
        "kernels": BenchReport("Attention kernels", attention.COLUMNS, ATTENTION_ROWS, []),
    }
    for name in reports:
        monkeypatch.setitem(attnkit.bench.SUITES, name, "a test suite")
    monkeypatch.setattr(attnkit.bench, "get_suite", lambda name: _suite(reports[name]))
    return reports


def _cell(value) -> str:  # what the table shows (cli/bench.py's formatting, written out)
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 10 else f"{value:.2f}"
    return str(value)


def check_table(out: str, report: BenchReport, width: int, keys: int) -> None:
    """Every header word and every cell printed whole, each row's cells in order, no line wider
    than `width`, no '…'."""
    lines = out.splitlines()
    assert "…" not in out, out
    assert all(len(line.rstrip()) <= width for line in lines), [line for line in lines if len(line.rstrip()) > width]
    words = out.split()
    for header in report.columns:
        for word in header.split():
            assert word in words, (header, out)
    normalized = [" ".join(line.split()) for line in lines if line.strip()]
    if not any(line.split()[:2] == report.columns[0].split()[:1] + report.columns[1].split()[:1]
               for line in normalized):  # narrower than keys + one column: a record per row
        records = [f"{name} {_cell(value)}" for row in report.rows for name, value in zip(report.columns, row)]
        start = normalized.index(records[0])
        assert normalized[start:start + len(records)] == records, out
        return
    for row in report.rows:
        cells = [_cell(v) for v in row]
        key = "  ".join(cells[:keys])
        prefix = re.compile(r"^\s*" + r"\s+".join(re.escape(c) for c in cells[:keys]) + r"(\s|$)")
        found = [prefix.sub("", line).split() for line in lines if prefix.match(line)]
        assert found, f"row {key!r} not found in\n{out}"
        shown = [cell for block in found for cell in block]
        assert shown == [word for c in cells[keys:] for word in c.split()], (key, shown, out)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("suite, keys", [("wide", 4), ("kernels", 4)])
def test_bench_tables_fit_the_width_in_blocks(fake_suites, suite, keys, width):
    result = runner.invoke(app, ["bench", suite, "--quick"], env={"COLUMNS": str(width), "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    check_table(result.stdout, fake_suites[suite], width, keys)
    if width == 120 and suite == "wide":  # wide enough: one table, the header on one line
        assert sum(1 for line in result.stdout.splitlines() if line.split()[:2] == ["sentences", "tokens"]) == 1


def test_bench_table_piped_without_columns(tmp_path):
    """A real pipe (not a terminal, no $COLUMNS): rich's 80 columns, cells whole."""
    script = (
        "import types, attnkit.bench as b\n"
        "from attnkit.bench.report import BenchReport\n"
        f"report = BenchReport('encoder', {ENCODER_COLUMNS!r}, {ENCODER_ROWS!r}, [])\n"
        "b.SUITES['wide'] = 'a test suite'\n"
        "b.get_suite = lambda name: types.SimpleNamespace(run=lambda *, quick, progress, threads=None: report)\n"
        "from attnkit.cli import app\n"
        "app(['bench', 'wide', '--quick'], prog_name='attnkit')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    report = BenchReport("encoder", ENCODER_COLUMNS, ENCODER_ROWS, [])
    check_table(done.stdout, report, 80, 4)
    assert any(line.split()[:1] == ["sentences"] and len(line.split()) < len(ENCODER_COLUMNS) + 2
               for line in done.stdout.splitlines())  # split into blocks at 80, not one long line


def test_fitted_table_wraps_a_column_too_wide_for_any_block():
    """A column wider than the whole line beside the keys: its cells wrap at spaces, never '…'."""
    import io

    from rich.console import Console

    from attnkit.viz.tables import fitted_table

    sentence = "a long note that cannot fit on one line of thirty cells at all"
    out = io.StringIO()
    Console(file=out, width=30, color_system=None).print(fitted_table(["n", "note"], [["1", sentence]]))
    text = out.getvalue()
    assert "…" not in text and all(len(line.rstrip()) <= 30 for line in text.splitlines())
    assert " ".join(text.split()).endswith(sentence)  # every word, in order
    with pytest.raises(ValueError, match="expected 2 cells in row 0 like the columns, got 1"):
        fitted_table(["n", "note"], [["1"]])


# ----------------------------------------------------------------------------- compare


A = "The quick brown fox jumps over the lazy dog while the cat sleeps soundly nearby."
B = "A slow red fox walks under the busy dog while a cat naps loudly nearby."


def _row_tokens(text: str) -> list[tuple[str, int]]:
    """(token, position) of every heatmap row label in `text`."""
    return [(m.group(1), int(m.group(2))) for m in re.finditer(r"(\S+) +(\d+) [ ░▒▓█]", text)]


@pytest.mark.parametrize("width", WIDTHS + [None])
def test_compare_names_every_token_at_any_width(width):
    from attnkit.viz.providers import get_provider

    env = {"NO_COLOR": "1"} if width is None else {"COLUMNS": str(width), "NO_COLOR": "1"}
    if width is None:
        env["COLUMNS"] = ""  # CliRunner's output is not a terminal: rich's 80 columns
    result = runner.invoke(app, ["compare", A, B, "--model", "random", "--no-color"], env=env)
    assert result.exit_code == 0, result.output
    views = result.stdout.split("Where the patterns differ most")[0]
    assert "…" not in views
    limit = width or 80
    assert all(len(line.rstrip()) <= limit for line in views.splitlines()), views
    provider = get_provider("random")
    shown = _row_tokens(views)
    for text in (A, B):  # the oracle: the provider's own tokens, each a row with its position
        tokens = provider.attention(text).tokens
        for i, token in enumerate(tokens):
            assert (token, i) in shown, (token, i, views)


def test_long_texts_pool_rows_and_list_every_token():
    """Past MAX_ROWS tokens the rows pool too; then every token is listed, whole, under the legend."""
    import io

    import numpy as np
    from rich.console import Console

    from attnkit.viz.terminal import MAX_ROWS, heatmap

    T = MAX_ROWS + 12
    tokens = [f"w{i}" for i in range(T - 1)] + ["internationalization"]
    weights = np.random.default_rng(0).dirichlet(np.ones(T), size=T)
    out = io.StringIO()
    Console(file=out, width=60, color_system=None).print(heatmap(weights, tokens, color=False, width=60))
    text = out.getvalue()
    assert f"{T} tokens pooled in blocks of" in text
    listed = " ".join(text.split("tokens:", 1)[1].split())
    assert all(f"{i}:{t}" in listed.split() for i, t in enumerate(tokens))
    assert all(len(line.rstrip()) <= 60 for line in text.splitlines())


def test_pooled_key_columns_keep_rows_summing_to_one():
    import numpy as np

    from attnkit.viz.terminal import pool_columns

    weights = np.random.default_rng(1).dirichlet(np.ones(23), size=23)
    pooled = pool_columns(weights, 5)
    assert pooled.shape == (23, 5)
    np.testing.assert_allclose(pooled.sum(axis=1), 1.0, atol=1e-12)
    ref = np.array([[weights[i, j:j + 5].sum() for j in range(0, 23, 5)] for i in range(23)])
    np.testing.assert_allclose(pooled, ref, atol=1e-12)


@pytest.mark.parametrize("T, width", [(18, 38), (18, 80), (40, 80), (5, 30)])
def test_heatmap_pools_says_what_heatmap_does(T, width):
    """`heatmap_pools` (what a caller asks before choosing side by side or one under the other)
    agrees with the heatmap's own key line."""
    import io

    import numpy as np
    from rich.console import Console

    from attnkit.viz.terminal import heatmap, heatmap_pools

    tokens = [f"tok{i}" for i in range(T)]
    out = io.StringIO()
    weights = np.full((T, T), 1.0 / T)
    Console(file=out, width=width, color_system=None).print(heatmap(weights, tokens, color=False, width=width))
    assert heatmap_pools(tokens, width) == ("in blocks of" in out.getvalue())
    assert all(f"tok{i} " in out.getvalue() for i in range(T))  # a row per token, named


# ------------------------------------------------- compare's table, demo, walkthrough, similarity


def _compare_oracle(top: int = 8):
    """The rows `compare A B --model random` lists: the provider's maps, the library's
    pattern difference and head summary, largest difference first."""
    import numpy as np

    from attnkit.viz.providers import get_provider
    from attnkit.viz.summary import pattern_difference, summarize_heads

    provider = get_provider("random")
    maps_a, maps_b = provider.attention(A), provider.attention(B)
    diff = pattern_difference(maps_a, maps_b)
    sa, sb = summarize_heads(maps_a), summarize_heads(maps_b)

    def describe(summary, ly, h):
        scores = [f"{code}{min(99, int(round(100 * float(values[ly, h])))):02d}"
                  for code, values in (("P", summary.previous), ("F", summary.first), ("S", summary.self))]
        return [str(summary.pattern[ly, h]), *scores, f"{summary.entropy[ly, h]:.1f}b"]

    order = sorted(((float(diff[index]), index) for index in np.ndindex(diff.shape)), reverse=True)[:top]
    rows = [([str(ly), str(h)], [f"{value:.3f}", *describe(sa, ly, h), *describe(sb, ly, h)])
            for value, (ly, h) in order]
    return maps_a, maps_b, rows


def _keyed_cells(lines: list[str], keys: list[str]) -> list[str]:
    """The words after `keys` on every line that opens with them, block after block."""
    prefix = re.compile(r"^\s*" + r"\s+".join(re.escape(k) for k in keys) + r"(\s|$)")
    return [word for line in lines if prefix.match(line) for word in prefix.sub("", line).split()]


@pytest.mark.parametrize("width", [40, 80, None])
def test_compare_differ_table_whole_and_maps_unpooled_where_they_fit(width):
    """The differing heads' table keeps every cell whole (it read `differ…` at 40 columns);
    each map gets the whole width when half would sum key columns in blocks, so at 80
    columns (and piped: rich's 80) every key has a column of its own."""
    from attnkit.viz.terminal import heatmap_pools

    env = {"NO_COLOR": "1", "COLUMNS": "" if width is None else str(width)}
    result = runner.invoke(app, ["compare", A, B, "--model", "random", "--no-color"], env=env)
    assert result.exit_code == 0, result.output
    limit = width or 80
    views, table = result.stdout.split("Where the patterns differ most")
    assert "…" not in result.stdout
    assert all(len(line.rstrip()) <= limit for line in result.stdout.splitlines()), result.stdout
    maps_a, maps_b, rows = _compare_oracle()
    # a map sums key columns only when even the whole width holds no column per key
    pooled = [heatmap_pools(maps.tokens, limit) for maps in (maps_a, maps_b)]
    assert views.count("in blocks of") == sum(pooled), views
    assert views.count("columns: keys, same numbers") == 2 - sum(pooled), views
    if limit >= 80:
        assert not any(pooled)  # the 15-token sentences fit at 80: no block of keys
    lines = table.split("difference: mean total variation")[0].splitlines()
    for header in ("layer", "head", "difference", "A", "B"):
        assert header in " ".join(lines).split(), (header, table)
    for keys, cells in rows:
        assert _keyed_cells(lines, keys) == cells, (keys, table)


def _box_rows(lines: list[str]) -> list[tuple[str, list[str]]]:
    """(first cell, other cells) of each body line of a boxed table ('│' between cells)."""
    found = []
    for line in lines:
        if "│" in line:
            first, *rest = [cell.strip() for cell in line.split("│")]
            found.append((first, rest))
    return found


def test_demo_weight_table_whole_at_40_columns():
    """`attnkit demo` at 40 columns printed 6 cells as `0.…`: now the word columns go on in
    blocks, each repeating the row's word, every weight whole."""
    import numpy as np

    from attnkit.cli.demo import DEMO_SENTENCE
    from attnkit.nn import SingleHeadSelfAttention

    result = runner.invoke(app, ["demo", "--heads", "1"], env={"COLUMNS": "40", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    text = result.stdout.split("Attention weights:")[1].split("rows: queries")[0]
    assert "…" not in text and all(len(line.rstrip()) <= 40 for line in text.splitlines()), text
    tokens = DEMO_SENTENCE.split()
    # the oracle: the demo's head on the demo's embeddings (seed 42, d_model 16)
    x = np.random.default_rng(42).standard_normal((len(tokens), 16)).astype(np.float32)
    _, weights = SingleHeadSelfAttention(16, 8, seed=42)(x)
    headers = [word for line in text.splitlines() if "┃" in line for word in line.replace("┃", " ").split()]
    assert headers == tokens, text  # every word's column, in order, once
    rows = _box_rows(text.splitlines())
    for i, token in enumerate(tokens):
        shown = [cell for first, rest in rows if first == token for cell in rest]
        assert shown == [f"{w:.3f}" for w in weights[i]], (token, text)


def test_walkthrough_matrices_whole_at_30_columns():
    """Each matrix of `attnkit walkthrough` at 30 columns: every value whole, in blocks that
    repeat the row names, and the values are the step-by-step math in float64."""
    import numpy as np

    from attnkit.walkthrough import walkthrough

    result = runner.invoke(app, ["walkthrough"], env={"COLUMNS": "30", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    assert "…" not in result.stdout
    assert all(len(line.rstrip()) <= 30 for line in result.stdout.splitlines()), result.stdout
    trace = walkthrough()
    x = trace.x.astype(np.float64)
    matrices = [x]
    for h, head in enumerate(trace.heads):
        q = x[:, 2 * h:2 * h + 2]  # identity projections: Q = K = V = these columns
        scores = q @ q.T
        scaled = scores / np.sqrt(2)
        weights = np.exp(scaled - scaled.max(axis=1, keepdims=True))
        weights /= weights.sum(axis=1, keepdims=True)
        truth = [q, scores, scaled, weights, weights @ q]
        got = [head.query, head.scores, head.scaled_scores, head.weights, head.output]
        for g, t in zip(got, truth):
            np.testing.assert_allclose(g, t, atol=1e-6)
        matrices += got
    matrices.append(trace.concatenated)
    # the body rows in order: blocks of (t0, t1, t2); a matrix is one block or several side by side
    rows = _box_rows(result.stdout.splitlines())
    blocks = [rows[i:i + 3] for i in range(0, len(rows), 3)]
    assert all([first for first, _ in block] == ["t0", "t1", "t2"] for block in blocks), rows
    for matrix in matrices:
        cells = [[] for _ in range(3)]
        while len(cells[0]) < matrix.shape[1]:
            for i, (_, rest) in enumerate(blocks.pop(0)):
                cells[i] += rest
        assert cells == [[f"{v:.4f}" for v in row] for row in matrix], (matrix, result.stdout)
    assert not blocks


@pytest.mark.usefixtures("minilm_folder")
def test_similarity_table_cells_whole_at_40_columns():
    """`attnkit similarity` at 40 columns cut `about tax…`: now the columns go on in blocks
    (each repeating # and the text) or, narrower than that, a record per sentence."""
    import json

    texts = ["A man is eating food.", "A man eats bread.", "The girl carries a baby.", "About taxes and roads."]
    data = json.loads(runner.invoke(app, ["similarity", *texts, "--json"]).stdout)
    matrix = data["similarity"]
    columns = ["#", "text", *(str(i) for i in range(len(texts)))]
    rows = [[str(i), text, *("—" if j == i else f"{v:.3f}" for j, v in enumerate(row))]
            for i, (text, row) in enumerate(zip(texts, matrix))]
    for width in (40, 80):
        result = runner.invoke(app, ["similarity", *texts], env={"COLUMNS": str(width), "NO_COLOR": "1"})
        assert result.exit_code == 0, result.output
        out = result.stdout.split("cosine similarity", 1)[1].split("bold: each sentence")[0]
        check_table(out, BenchReport("similarity", columns, rows, []), width, 2)
