"""The induction-head task behind `attnkit train`: attention that learns to copy."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from attnkit.cli import app
from conftest import optional

torch = optional("torch")
# attnkit.torch needs torch; without it every test here skips (or fails under
# ATTNKIT_REQUIRE_ORACLES=1) through the fixture below, and the file still collects
if torch is not None:
    from attnkit.torch.induction import (
        InductionConfig,
        InductionModel,
        evaluate,
        find_copy_head,
        make_batch,
        train_induction,
    )

pytestmark = pytest.mark.usefixtures("torch")  # every test here trains or runs `attnkit train`, which needs torch


@pytest.fixture
def one_thread(torch):
    """The small model trains fastest on one thread (and CI has two cores for two workers)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_batches_repeat_their_first_half():
    config = InductionConfig()
    batch = make_batch(config, 32, torch.Generator().manual_seed(0), fixed_period=True)
    n = config.half_len
    assert batch.tokens.shape == (32, 2 * n)
    assert torch.equal(batch.tokens[:, :n], batch.tokens[:, n:])
    assert all(len(set(row[:n].tolist())) == n for row in batch.tokens)  # distinct, so the copy is unambiguous
    varied = make_batch(config, 256, torch.Generator().manual_seed(1))
    assert set(varied.period.tolist()) == set(range(config.min_half_len, n + 1))
    for row, k in zip(varied.tokens, varied.period.tolist()):
        assert torch.equal(row[k:], row[: 2 * n - k])


def test_an_untrained_model_cannot_do_the_task():
    """The accuracy bar below means something: chance is about 1/(vocab - 1)."""
    _, accuracy = evaluate(InductionModel(InductionConfig()), batches=2)
    assert accuracy < 0.2


def test_training_is_reproducible(one_thread):
    config = InductionConfig(steps=8, seed=3)
    first = [m.loss for m in train_induction(config, eval_batches=1).history]
    second = [m.loss for m in train_induction(config, eval_batches=1).history]
    assert first == second
    other = [m.loss for m in train_induction(InductionConfig(steps=8, seed=4), eval_batches=1).history]
    assert other != first


@pytest.mark.slow
def test_seeded_run_learns_to_copy(one_thread, tmp_path):
    """The default configuration reaches >= 99% next-token accuracy on the repeated
    half of held-out sequences, and a layer-2 head attends along the copy stripe."""
    result = train_induction(InductionConfig(seed=0))
    assert result.eval_accuracy >= 0.99, f"held-out repeated-half accuracy {result.eval_accuracy:.2%}"
    _, varied = evaluate(result.model, fixed_period=False)
    assert varied >= 0.99, f"with periods {InductionConfig.min_half_len}..{InductionConfig.half_len}: {varied:.2%}"
    head = find_copy_head(result.model)
    assert head.layer >= 1  # an induction head needs the previous-token information of an earlier layer
    assert head.score > 0.8
    n = result.model.config.half_len
    stripe = head.weights[torch.arange(n, 2 * n - 1), torch.arange(1, n)]
    assert stripe.min() > 0.5


def test_cli_trains_and_saves_the_picture(tmp_path, one_thread):
    out = tmp_path / "head.png"
    runner = CliRunner()
    args = ["train", "--steps", "5", "--out", str(out), "--d-model", "16", "--heads", "2",
            "--d-ff", "16", "--batch-size", "8", "--threads", "1"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "held-out accuracy" in result.output and "copying head" in result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {out}\n" in result.output  # a new file: nothing replaced
    # five steps do not learn the task, and the summary says so rather than leaving a bare number
    words = " ".join(result.output.split())  # the table wraps its values at the terminal's width
    accuracy = float(re.search(r"held-out accuracy, repeated half \(n \+ n\) ([\d.]+)%", words).group(1))
    assert accuracy < 95 and "not learned yet" in words and "--steps 400" in words

    out.write_bytes(b"an earlier picture")
    again = runner.invoke(app, args)
    assert again.exit_code == 0, again.output
    assert f"wrote {out} (replaced the file that was there)" in again.output  # never overwritten silently
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_train_cp_without_torchrun_says_in_one_line_how_to_start_it(monkeypatch, capsys):
    from attnkit.torch import train_cp

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert train_cp.main(["--steps", "3"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in captured.err
    assert "torchrun --nproc-per-node 2 -m attnkit.torch.train_cp" in lines[0]
    assert "attnkit train --context-parallel 2" in lines[0]
    assert captured.out == ""


@pytest.mark.slow
def test_train_cp_default_run_learns_to_copy(one_thread):
    """The torchrun example's default steps are enough to learn the task: its loss curve is
    the one-process run's (tests/torch/test_distributed.py), and that run reaches the bar."""
    from attnkit.torch import train_cp

    result = train_induction(train_cp._example_config(), eval_batches=2)
    assert result.model.config.steps == train_cp.DEFAULT_STEPS
    assert result.eval_accuracy >= 0.99, f"held-out repeated-half accuracy {result.eval_accuracy:.2%}"


@pytest.mark.slow
def test_train_cp_under_torchrun_reports_sparsely_and_saves_the_picture(tmp_path, one_thread):
    """The torchrun example: a step line every tenth of the run, a summary whose final
    loss is the one-process run's (context parallelism changes no number), the picture."""
    picture = tmp_path / "head.png"
    picture.write_bytes(b"an earlier picture")
    steps, half_len, batch = 20, 6, 8
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "attnkit.torch.train_cp",
               "--steps", str(steps), "--half-len", str(half_len), "--batch-size", str(batch), "--png", str(picture)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    step_lines = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in step_lines] == ["1/20"] + [f"{s}/20" for s in range(2, 21, 2)]
    from attnkit.torch import train_cp

    single = train_induction(train_cp._example_config(steps, half_len=half_len, batch_size=batch), eval_batches=1)
    final = re.search(r"final training loss ([\d.]+), accuracy", done.stdout)
    assert final, done.stdout
    assert abs(float(final.group(1)) - single.history[-1].loss) <= 1e-4  # printed to 4 decimals
    assert re.search(r"held-out accuracy [\d.]+% on fresh sequences", done.stdout)
    assert "not learned yet" in done.stdout and re.search(r"trained 20 steps in [\d.]+ s on 2 processes", done.stdout)
    assert f"wrote {picture} (replaced the file that was there)" in done.stdout
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_rejects_bad_configurations(tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["train", "--half-len", "30", "--vocab-size", "16", "--out", str(tmp_path / "x.png")])
    assert result.exit_code == 2
    assert "half_len <= vocab_size" in result.output
    result = runner.invoke(app, ["train", "--out", str(tmp_path / "missing" / "x.png")])
    assert result.exit_code == 1 and "does not exist" in result.output  # checked before training starts
