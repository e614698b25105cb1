"""`attnkit embed` and `attnkit similarity` on the embedded all-MiniLM-L6-v2.

What the CLI prints is checked against the library's float32 results with the float64
truth as judge: attnkit's BertModel in float64 (equal to transformers' float64 BertModel
to 1e-14, tests/test_bert.py), mean-pooled and L2-normalized in float64.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import assert_within_budget
from typer.testing import CliRunner

from attnkit.cli import app
from attnkit.models import SentenceEncoder
from attnkit.models.bert import load_bert

runner = CliRunner()


@pytest.fixture(scope="module")
def encoder(minilm_folder):
    return SentenceEncoder.from_pretrained(minilm_folder)


@pytest.fixture(scope="module")
def model64(minilm_folder):
    return load_bert(minilm_folder).astype(np.float64)


def _truth(model64, encoder, texts):
    """float64 embeddings: mean of the last hidden states over the tokens, L2-normalized."""
    rows = []
    for encoding in encoder.tokenizer.encode(texts):
        mean = model64(np.array([encoding.ids])).last_hidden_state[0].mean(0)
        rows.append(mean / np.linalg.norm(mean))
    return np.array(rows)


def _json(result):
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.slow
def test_embed_json_matches_library(encoder, model64):
    texts = ["Hello world", "Café naïve ☃ 42"]
    payload = _json(runner.invoke(app, ["embed", *texts, "--json"]))
    assert payload["dim"] == 384
    assert [e["text"] for e in payload["embeddings"]] == texts
    got = np.array([e["embedding"] for e in payload["embeddings"]])
    # the printed floats are the float32 values exactly, as accurate as the library's
    assert np.array_equal(got, got.astype(np.float32))
    assert_within_budget(got, encoder.encode(texts), _truth(model64, encoder, texts), what="embed --json")


def test_embed_on_the_flash_backend(encoder, model64):
    """`--backend flash` runs the encoder on the tiled kernel: within the float64-grounded
    budget of the naive backend's embeddings."""
    texts = ["Hello world", "A longer sentence, so that the lengths in the batch differ."]
    payload = _json(runner.invoke(app, ["embed", *texts, "--json", "--backend", "flash"]))
    got = np.array([e["embedding"] for e in payload["embeddings"]])
    assert_within_budget(got, encoder.encode(texts), _truth(model64, encoder, texts), what="embed --backend flash")


@pytest.mark.slow
@pytest.mark.usefixtures("minilm_folder")
def test_embed_table_output():
    result = runner.invoke(app, ["embed", "A cat sat on the mat."])
    assert result.exit_code == 0, result.output
    assert "1 embedding(s) of dimension 384" in result.stdout and "1.0000" in result.stdout


@pytest.mark.slow
def test_embed_from_file_and_stdin(tmp_path, encoder, model64):
    lines = [f"sentence number {i} about attention" for i in range(40)]
    path = tmp_path / "sentences.txt"
    path.write_text("\n".join(lines[:20]) + "\n\n" + "\n".join(lines[20:]) + "\n")
    from_file = _json(runner.invoke(app, ["embed", "--file", str(path), "--json", "--batch-size", "8"]))
    assert [e["text"] for e in from_file["embeddings"]] == lines  # blank line skipped, order kept
    from_stdin = _json(runner.invoke(app, ["embed", "-", "--json"], input="\n".join(lines[:3])))
    assert [e["text"] for e in from_stdin["embeddings"]] == lines[:3]
    got = np.array([e["embedding"] for e in from_file["embeddings"]])
    # batches of 8 here, 32 in the library: float32 results differ in the last bits
    assert_within_budget(got, encoder.encode(lines), _truth(model64, encoder, lines), what="embed --file")


@pytest.mark.slow
def test_similarity(encoder, model64):
    texts = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby."]
    payload = _json(runner.invoke(app, ["similarity", *texts, "--json"]))
    matrix = np.array(payload["similarity"])
    truth = _truth(model64, encoder, texts)
    assert_within_budget(matrix, encoder.similarity(texts), truth @ truth.T, what="similarity --json")
    table = runner.invoke(app, ["similarity", *texts])
    assert table.exit_code == 0 and f"{matrix[0, 1]:.3f}" in table.stdout
    pair = runner.invoke(app, ["similarity", *texts[:2]])
    assert pair.exit_code == 0 and f"cosine similarity: {matrix[0, 1]:.4f}" in pair.stdout


@pytest.mark.parametrize(
    "args, code, words",
    [
        (["embed"], 2, "expected at least one sentence"),
        (["similarity", "only one"], 2, "expected at least two sentences to compare, got 1"),
        (["embed", "x", "--batch-size", "0"], 2, "expected --batch-size >= 1, got 0"),
        (["embed", "x", "--threads", "0"], 2, "expected --threads in 1..256, got 0"),
        (["embed", "-", "--file", "f.txt"], 2, "expected sentences from '-' (stdin) or from --file, got both"),
        (["embed", "x\udcff"], 2, "TEXT is not valid UTF-8: byte 0xff at offset 1"),
        (["embed", "x", "--model", "/no/such/folder"], 1, "does not exist"),
        (["embed", "--file", "/no/such/file.txt"], 1, "cannot read --file /no/such/file.txt: no such file or directory"),
        (["embed", "x", "--backend", "nope"], 2, "expected --backend to be one of flash, naive, got 'nope'"),
        (["similarity", "x", "y", "--backend", ""], 2, "expected --backend to be one of flash, naive, got ''"),
    ],
)
def test_cli_errors(args, code, words):
    """Checked before the model loads: one line on stderr, nothing on stdout (docs/conventions.md)."""
    result = runner.invoke(app, args)
    assert result.exit_code == code, result.output
    assert result.stdout == "" and result.stderr == f"error: {result.stderr[7:]}" and result.stderr.count("\n") == 1
    assert words in result.stderr


def test_invalid_utf8_in_a_file_or_stdin_is_refused_with_its_offset(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes("fine\ncaf\u00e9 \xff".encode("latin-1"))
    result = runner.invoke(app, ["embed", "--file", str(path)])
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr == f"error: --file {path} is not valid UTF-8: byte 0xe9 at offset 8\n"
    result = runner.invoke(app, ["similarity", "-"], input=b"ok\n\xfe\xff\n")
    assert result.exit_code == 1 and result.stderr == "error: stdin is not valid UTF-8: byte 0xfe at offset 3\n"


@pytest.mark.slow
@pytest.mark.usefixtures("minilm_folder")
def test_user_text_is_shown_as_data(tmp_path):
    """Markup is printed as typed; escape sequences from a file are shown escaped, never sent."""
    result = runner.invoke(app, ["similarity", "[red]b", "[link=https://evil.example]click[/link]", "c"],
                           env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "[red]b" in result.stdout and "[link=https://evil.example]click[/link]" in result.stdout
    assert "\x1b" not in result.stdout
    result = runner.invoke(app, ["embed", "[/]", "x\x1b]0;PWNED\x07"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "[/]" in result.stdout and "x\\x1b]0;PWNED\\x07" in result.stdout
    assert "\x1b" not in result.stdout and "\x07" not in result.stdout
    path = tmp_path / "f.txt"
    path.write_bytes(b"x\x1b]0;PWNED\x07\n")
    result = runner.invoke(app, ["embed", "--file", str(path)], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "x\\x1b]0;PWNED\\x07" in result.stdout and "\x1b" not in result.stdout


def test_importing_the_encoder_stays_light():
    import subprocess
    import sys

    probe = (
        "import sys, attnkit.models, attnkit.cli.embed, attnkit.bench.encoder\n"
        "from attnkit.models import SentenceEncoder\n"
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    loaded = set(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split())
    heavy = loaded & {"torch", "transformers", "sentence_transformers", "tokenizers", "safetensors", "scipy"}
    assert not heavy, f"importing the encoder pulled in {sorted(heavy)}"
