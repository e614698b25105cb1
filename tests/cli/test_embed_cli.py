"""`attnkit embed` and `attnkit similarity` on the embedded all-MiniLM-L6-v2.

What the CLI prints is checked against the library's float32 results with the float64
truth as judge: attnkit's BertModel in float64 (equal to transformers' float64 BertModel
to 1e-14, tests/models/test_bert.py), mean-pooled and L2-normalized in float64.
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


# ----------------------------------------------------------------------------- streaming


def test_embed_json_streams_the_bytes_of_one_document(minilm_folder, monkeypatch):
    """--json is written a window of sentences at a time, and is still `json.dumps` of the whole
    document byte for byte, floats included: for an input of one window (one encode call, as
    before streaming) and of several."""
    import attnkit.cli.embed as embed_cli

    texts = ["Hello world", "Café naïve ☃ 42", "tab\there", "x\x1b]0;t\x07 \u202e", "a longer sentence about heads"]
    encoder = SentenceEncoder.from_pretrained(minilm_folder, num_threads=1)

    def document(windows):
        rows = np.concatenate([encoder.encode(window, batch_size=2) for window in windows])
        embeddings = [{"text": t, "embedding": [float(v) for v in row]} for t, row in zip(texts, rows)]
        return json.dumps({"model": str(encoder.path), "dim": 384, "embeddings": embeddings}) + "\n"

    args = ["embed", *texts, "--json", "--threads", "1", "--batch-size", "2", "--model", str(minilm_folder)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert result.stdout == document([texts])
    monkeypatch.setattr(embed_cli, "STREAM_SENTENCES", 2)  # windows of one batch: 2, 2, 1 sentences
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert result.stdout == document([texts[:2], texts[2:4], texts[4:]])


def test_similarity_json_has_the_bytes_of_one_document(minilm_folder):
    texts = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby."]
    encoder = SentenceEncoder.from_pretrained(minilm_folder, num_threads=1)
    unit = encoder.encode(texts)
    unit = unit / np.maximum(np.linalg.norm(unit, axis=1, keepdims=True), np.float32(1e-12))
    expected = json.dumps({"texts": texts, "similarity": [[float(v) for v in row] for row in unit @ unit.T]}) + "\n"
    result = runner.invoke(app, ["similarity", *texts, "--json", "--threads", "1", "--model", str(minilm_folder)])
    assert result.exit_code == 0, result.output
    assert result.stdout == expected


def test_the_lines_are_found_a_piece_at_a_time_exactly_as_splitlines(monkeypatch):
    """Sentences cuts the text after a line break and splits each piece: the same lines as
    str.splitlines on the whole, for every kind of line break falling on a cut."""
    import attnkit.cli.embed as embed_cli

    rng = np.random.default_rng(7)
    pieces = ["a", "b c", " ", "\t", "\n", "\r", "\r\n", "\v", "\f", "\x1c", "\x1d", "\x1e", "\x85", "\u2028",
              "\u2029", "é", "\u202e", "\x00"]
    for piece_chars in (1, 2, 3, 7):
        monkeypatch.setattr(embed_cli, "PIECE_CHARS", piece_chars)
        for _ in range(200):
            text = "".join(rng.choice(pieces, size=int(rng.integers(0, 30))))
            expected = [line for line in text.splitlines() if line.strip()]
            sentences = embed_cli.Sentences(["first"], text)
            assert list(sentences) == ["first", *expected] and len(sentences) == 1 + len(expected), repr(text)


def test_similarity_refuses_more_sentences_than_its_matrix_takes(tmp_path):
    """n x n values: at most MAX_SIMILARITY_SENTENCES, refused before the model loads."""
    from attnkit.cli.embed import MAX_SIMILARITY_SENTENCES

    path = tmp_path / "many.txt"
    path.write_text("".join(f"sentence {i}\n" for i in range(MAX_SIMILARITY_SENTENCES + 1)))
    result = runner.invoke(app, ["similarity", "--file", str(path), "--model", "/no/such/folder"])
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr == (f"error: expected at most {MAX_SIMILARITY_SENTENCES} sentences to compare (the matrix "
                             f"has n x n values), got {MAX_SIMILARITY_SENTENCES + 1}; attnkit embed --json writes "
                             "the embeddings of any number\n")


@pytest.mark.slow
def test_the_table_shows_at_most_max_table_rows(minilm_folder, monkeypatch):
    import attnkit.cli.embed as embed_cli

    monkeypatch.setattr(embed_cli, "MAX_TABLE_ROWS", 3)
    result = runner.invoke(app, ["embed", "one", "two", "three", "four", "five", "--model", str(minilm_folder)],
                           env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "3 embedding(s) of dimension 384" in result.stdout
    assert "three" in result.stdout and "four" not in result.stdout
    assert "the first 3 of 5 sentences; use --json for all of them, with the full vectors" in result.stdout


WORDS = "the cat sat on a mat dog ran fast attention head layer model token query key value".split()


@pytest.fixture(scope="module")
def wide_tiny_folder(tmp_path_factory, torch, transformers):
    """A random one-layer BERT with MiniLM's width (384) and a vocabulary of WORDS: it loads and
    encodes in a moment, and writes as much JSON per sentence as MiniLM."""
    folder = tmp_path_factory.mktemp("wide_tiny_bert")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    config = transformers.BertConfig(vocab_size=len(vocab), hidden_size=384, num_hidden_layers=1,
                                     num_attention_heads=12, intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.BertModel(config).eval().save_pretrained(folder, safe_serialization=True)
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    return folder


def _peak_rss_mib(path, folder) -> float:
    """Peak resident memory of `attnkit embed --file path --json > /dev/null` in a fresh process."""
    import os
    import subprocess
    import sys

    command = [sys.executable, "-m", "attnkit", "embed", "--file", str(path), "--json", "--threads", "1",
               "--model", str(folder)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    assert process.returncode == 0, process.stderr.read().decode()
    process.stderr.close()
    return usage.ru_maxrss / 1024  # kilobytes on Linux


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(__import__("os"), "wait4"), reason="os.wait4 reports a child's peak memory")
def test_embed_memory_is_bounded_by_the_window_not_the_input(tmp_path, wide_tiny_folder):
    """N short lines, then 4N: the same peak memory within a few MiB. Before streaming every
    line was tokenized and kept, and the whole JSON document built in memory: about 35 KiB
    more per line (run from a shell on this model: 210 MiB at 4096 lines, 620 MiB at 16384;
    streamed, 95 MiB at both). A 64 MiB file of short lines passed 6 GiB."""
    from attnkit.cli.embed import STREAM_SENTENCES

    rng = np.random.default_rng(0)
    peaks = []
    for count in (3 * STREAM_SENTENCES, 12 * STREAM_SENTENCES):
        path = tmp_path / f"lines-{count}.txt"
        path.write_text("".join(" ".join(rng.choice(WORDS, size=int(rng.integers(2, 7)))) + "\n"
                                for _ in range(count)))
        peaks.append(_peak_rss_mib(path, wide_tiny_folder))
    print(f"peak RSS: {peaks[0]:.0f} MiB at {3 * STREAM_SENTENCES} lines, {peaks[1]:.0f} MiB at {12 * STREAM_SENTENCES}")
    assert peaks[1] - peaks[0] < 4, peaks


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
