"""attnkit's views of transformers architectures it has no port of (`attnkit.hf.views`).

Tiny random models (a Qwen2 decoder with grouped-query attention, a RoBERTa encoder,
BART and T5 encoder-decoders) are saved to a folder with a tiny word-level
tokenizer.json, as `save_pretrained` would leave a real checkpoint. `attnkit show
--model FOLDER` runs them through transformers with attnkit's "attnkit" attention,
recorded by `attnkit.record_attention`; the maps must equal transformers' own
`output_attentions` from "eager" attention within float32 noise: attnkit's error
against a float64 eager run at most 2x eager float32's.
"""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import assert_within_budget, optional

from attnkit.cli import app

runner = CliRunner()
ENV = {"COLUMNS": "120", "NO_COLOR": "1"}
TEXT = "the cat sat on the mat because it was tired"
WORDS = "[PAD] [UNK] [CLS] [SEP] the cat sat on mat because it was tired a dog ran".split()

# Small configs with large initial weights, so that the untrained heads attend unevenly.
CONFIGS = {
    "qwen2": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=64, max_position_embeddings=64, initializer_range=0.5),
    "roberta": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                    max_position_embeddings=64, pad_token_id=0, initializer_range=0.5),
    "bart": dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                 encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=0, bos_token_id=2,
                 eos_token_id=3, decoder_start_token_id=3, init_std=0.5),
    "t5": dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, pad_token_id=0,
               eos_token_id=3, decoder_start_token_id=0, initializer_factor=4.0),
}
TEMPLATES = {"qwen2": "[CLS] $A"}  # a decoder: a start token only; the others "[CLS] $A [SEP]"


def _save_tokenizer(folder, template: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=template, special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    tokenizer.add_special_tokens(["[PAD]", "[UNK]", "[CLS]", "[SEP]"])
    tokenizer.save(str(folder / "tokenizer.json"))


@pytest.fixture(scope="session")
def folders(tmp_path_factory, torch, transformers):
    """model_type -> a folder holding a random model of that type and a tokenizer."""
    made = {}
    for model_type, options in CONFIGS.items():
        folder = tmp_path_factory.mktemp(model_type)
        config = transformers.AutoConfig.for_model(model_type, vocab_size=len(WORDS), **options)
        torch.manual_seed(0)
        transformers.AutoModel.from_config(config).save_pretrained(folder)
        _save_tokenizer(folder, TEMPLATES.get(model_type, "[CLS] $A [SEP]"))
        made[model_type] = folder
    return made


def _eager_maps(folder, ids, torch, transformers, dtype) -> np.ndarray:
    """transformers' own maps with "eager" attention, in call order: (layers, H, T, T)."""
    model = transformers.AutoModel.from_pretrained(folder, attn_implementation="eager", dtype=dtype).eval()
    input_ids = torch.tensor([ids])
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    if model.config.is_encoder_decoder:
        inputs["decoder_input_ids"] = input_ids
    with torch.no_grad():
        out = model(**inputs, output_attentions=True)
    if model.config.is_encoder_decoder:
        decoder = [m for pair in zip(out.decoder_attentions, out.cross_attentions) for m in pair]
        maps = [*out.encoder_attentions, *decoder]
    else:
        maps = list(out.attentions)
    return np.stack([m[0].double().numpy() for m in maps])


ENCODER_DECODERS = [pytest.param(t, marks=pytest.mark.slow) for t in ("bart", "t5")]  # 3-5 s each here


@pytest.mark.parametrize("model_type", ["qwen2", "roberta", *ENCODER_DECODERS])
def test_maps_equal_eager_output_attentions(folders, model_type, torch, transformers):
    from attnkit.hf.views import TransformersViewModel

    model = TransformersViewModel.from_folder(folders[model_type])
    result = model.attention(TEXT)
    ids = model.tokenizer.encode(TEXT).ids
    assert result.weights.dtype == np.float32 and result.tokens[1:4] == ["the", "cat", "sat"]
    oracle = _eager_maps(folders[model_type], ids, torch, transformers, torch.float32)
    truth = _eager_maps(folders[model_type], ids, torch, transformers, torch.float64)
    assert result.weights.shape == truth.shape
    assert_within_budget(result.weights, oracle, truth, f"{model_type} attention maps", factor=2)
    assert truth.max() > 2 / len(ids)  # the heads do not attend evenly: the comparison means something
    assert model.causal == (model_type == "qwen2")
    if model_type in ("bart", "t5"):
        assert result.layer_names == ("encoder 0", "encoder 1", "decoder 0", "decoder 0 cross attention",
                                      "decoder 1", "decoder 1 cross attention")
        assert model.layer_names() == result.layer_names
    else:
        assert result.layer_names is None


def test_record_attention_accepts_a_transformers_model(folders, torch, transformers):
    """The one recorder: `attnkit.record_attention(hf_model)`, NumPy (B, H, L, S) maps in call order."""
    import attnkit
    import attnkit.hf

    attnkit.hf.register()
    model = transformers.AutoModel.from_pretrained(folders["qwen2"], attn_implementation="attnkit").eval()
    input_ids = torch.tensor([[2, 4, 5, 6, 7, 8]])
    with torch.no_grad(), attnkit.record_attention(model) as recording:
        out = model(input_ids, output_attentions=True)
    assert len(recording) == 2 and all(isinstance(m, np.ndarray) for m in recording)
    assert {m.shape for m in recording.maps} == {(1, 4, 6, 6)} and recording[0].dtype == np.float32
    for ours, theirs in zip(recording, out.attentions):
        np.testing.assert_array_equal(ours, theirs.numpy())  # the weights the attention function returned
    assert not any(getattr(m, "_attnkit_recorders", ()) for m in model.modules())  # closed: nothing recorded
    with torch.no_grad(), attnkit.record_attention(model) as outer, attnkit.record_attention(model) as inner:
        model(input_ids)
    assert len(outer) == len(inner) == 2  # recordings nest

    eager = transformers.AutoModel.from_pretrained(folders["qwen2"], attn_implementation="eager").eval()
    with torch.no_grad(), attnkit.record_attention(eager) as recording:
        eager(input_ids)
    assert len(recording) == 0  # eager attention does not know attnkit's recorders


def test_without_the_adapter_a_transformers_model_is_refused_with_the_way_in(folders, transformers, monkeypatch):
    import attnkit
    from attnkit.nn import interface

    model = transformers.AutoModel.from_pretrained(folders["roberta"], attn_implementation="eager")
    monkeypatch.setattr(interface, "RECORDING_ADAPTERS", [])  # as before `import attnkit.hf`
    with pytest.raises(ValueError, match=r"RobertaModel has no attention module to record \(a transformers model "
                                         r"records after `import attnkit.hf`"):
        with attnkit.record_attention(model):
            pass


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen2", "roberta", "bart"])
def test_show_runs_any_transformers_folder(folders, model_type):
    folder = folders[model_type]
    result = runner.invoke(app, ["show", TEXT, "--model", str(folder), "--layer", "1", "--head", "2"], env=ENV)
    assert result.exit_code == 0, result.output
    assert f"{folder.name}: layer 1" in result.stdout and "tired" in result.stdout
    if model_type == "bart":
        result = runner.invoke(app, ["show", TEXT, "--model", str(folder), "--layer", "3"], env=ENV)
        assert result.exit_code == 0, result.output
        assert "layer 3 (decoder 0 cross attention), head 0" in result.stdout


@pytest.mark.slow
def test_png_html_and_compare_from_a_transformers_folder(folders, tmp_path):
    folder = str(folders["bart"])
    html = tmp_path / "view.html"
    args = ["show", TEXT, "--model", folder, "--html", str(html)]
    if optional("matplotlib") is not None:
        args += ["--png", str(tmp_path / "view.png")]
    result = runner.invoke(app, args, env=ENV)
    assert result.exit_code == 0, result.output
    page = html.read_text(encoding="utf-8")
    assert "mat" in page and "decoder 1 cross attention" in page  # the page names the layers too
    if optional("matplotlib") is not None:
        assert (tmp_path / "view.png").read_bytes().startswith(b"\x89PNG")
    result = runner.invoke(app, ["compare", TEXT, "a dog ran", "--model", folder], env=ENV)
    assert result.exit_code == 0, result.output


def test_the_notebook_view_takes_a_transformers_folder(folders):
    from attnkit.viz.notebook import view

    page = view("a dog ran", model=str(folders["roberta"]))
    assert "dog" in page.html


def test_folders_of_attnkits_own_architectures_keep_attnkits_models(tmp_path, monkeypatch):
    """BERT, Llama (Qwen2, Mistral) and GPT-2 folders run on attnkit's own ports; any other
    model_type on transformers."""
    from attnkit.viz import providers

    chosen = []
    for kind in ("encoder", "decoder", "transformers"):
        monkeypatch.setattr(providers, f"_{kind}_provider", lambda path, name, limit, kind=kind: chosen.append(kind))
    for model_type in ("bert", "llama", "gpt2", "qwen2", "t5"):
        folder = tmp_path / model_type
        folder.mkdir()
        (folder / "config.json").write_text(f'{{"model_type": "{model_type}"}}', encoding="utf-8")
        providers._load(str(folder), 512)
    assert chosen == ["encoder", "decoder", "decoder", "decoder", "transformers"]


def test_a_missing_hf_extra_is_named(tmp_path, monkeypatch):
    from attnkit import runtime
    from attnkit.viz.providers import ModelNotAvailableError, _transformers_provider

    def missing(module, extra, purpose):
        raise runtime.MissingExtraError(
            f"{purpose} needs the package {module!r}, which is not installed; "
            f"install it with: pip install 'attnkit[{extra}]'"
        )

    monkeypatch.setattr(runtime, "require", missing)
    with pytest.raises(ModelNotAvailableError, match=r"pip install 'attnkit\[hf\]'"):
        _transformers_provider(tmp_path, "folder", 512)


def test_a_folder_without_a_tokenizer_is_refused(folders, tmp_path):
    from attnkit.hf.views import TransformersViewModel

    (tmp_path / "config.json").write_bytes((folders["qwen2"] / "config.json").read_bytes())
    with pytest.raises(ValueError, match="holding tokenizer.json"):
        TransformersViewModel.from_folder(tmp_path)


def test_layer_names_label_the_maps():
    from attnkit.viz.data import AttentionMaps

    weights = np.full((3, 2, 2, 2), 0.5, dtype=np.float32)
    names = ("encoder 0", "decoder 0", "decoder 0 cross attention")
    maps = AttentionMaps(tokens=("a", "b"), weights=weights, layer_names=names)
    assert maps.label(2, 1) == "layer 2 (decoder 0 cross attention), head 1"
    assert maps.label(0, None) == "layer 0 (encoder 0), mean of 2 heads"
    assert maps.hide_special().layer_names == names
    assert AttentionMaps(tokens=("a", "b"), weights=weights).label(2, 1) == "layer 2, head 1"
    with pytest.raises(ValueError, match="expected 3 layer names like layers, got 2"):
        AttentionMaps(tokens=("a", "b"), weights=weights, layer_names=names[:2])


def test_serve_offers_a_transformers_folder(folders):
    if optional("fastapi") is None or optional("httpx") is None:
        pytest.skip("attnkit serve needs fastapi (pip install 'attnkit[serve]') and its test client httpx")
    from fastapi.testclient import TestClient

    from attnkit.serve.server import create_app

    folder = str(folders["t5"])
    client = TestClient(create_app(models=[folder], max_chars=200, max_tokens=16))
    answer = client.post("/api/attention", json={"text": TEXT, "model": folder, "layer": 3, "head": 1})
    assert answer.status_code == 200, answer.text
    doc = answer.json()["docs"][0]
    assert doc["layers"] == 6 and doc["layer_names"][3] == "decoder 0 cross attention"


@pytest.mark.slow  # over 2 s in the quick loop (2-core Xeon, 2026-12-08)
def test_the_views_tokenize_as_transformers_does_not_with_tokenizer_json_padding(transformers):
    """MiniLM's tokenizer.json pads to a fixed 128 and cuts at 128; transformers' tokenizer
    call does neither unless asked, and the views must not either: a 13-token sentence is 13
    positions (it was 128, the words lost among [PAD] rows), a long one is not cut at 128."""
    from attnkit.hf.views import TransformersViewModel
    from attnkit.models.embedded import minilm_path

    folder = minilm_path()
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    model = TransformersViewModel.from_folder(folder)
    for text in ("The cat sat on the mat because it was tired.", " ".join(["attention"] * 150)):
        ids = reference(text)["input_ids"]
        result = model.attention(text)
        assert result.tokens == reference.convert_ids_to_tokens(ids)
        assert result.weights.shape == (6, 12, len(ids), len(ids)) and result.full_count == len(ids)
        assert not any(result.special[1:-1]) and "[PAD]" not in result.tokens
    text = "The cat sat on the mat because it was tired."
    result = model.attention(text, max_tokens=6)  # cut when asked, its special tokens kept
    ids = reference(text, truncation=True, max_length=6)["input_ids"]
    assert result.tokens == reference.convert_ids_to_tokens(ids) and result.full_count == len(reference(text)["input_ids"])
