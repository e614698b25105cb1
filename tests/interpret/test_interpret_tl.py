"""attnkit.interpret against TransformerLens 4.3 on the same weights.

A random transformers GPT-2 and a random Llama (grouped-query attention) are saved to a
folder with a tokenizer; TransformerLens loads the folder (`TransformerBridge.boot_transformers`)
in float32 (the oracle) and float64 (the truth), attnkit loads the same folder. Each result
must be as close to the float64 truth as twice TransformerLens's float32 result is, plus a
few float32 ulps (conftest.assert_within_budget): detector scores, head and residual
patching, the logit lens and direct logit attribution (against the bridge in compatibility
mode, as TransformerLens documents it).
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_within_budget, require

pytestmark = pytest.mark.slow  # TransformerLens takes ~20 s to import

VOCAB = 120
TEXT = "w5 w17 w3 w40 w8 w5 w17 w3 w40 w22 w9"  # a repeat: induction and duplicate heads have work


def _tokenizer(transformers):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB - 2)}
    vocab["<unk>"], vocab["<bos>"] = VOCAB - 2, VOCAB - 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<bos>",
                                                eos_token="<bos>")


def _spread(model, torch, skip=()):
    """Random weights with sharper attention than the default init, and norms that are not 1/0;
    parameters named in `skip` stay as initialized."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(s in name for s in skip):
                continue
            noise = torch.randn(param.shape, generator=generator, dtype=param.dtype)
            if param.ndim == 1:  # norms around 1, biases around 0
                param.copy_((1.0 if "ln" in name or "norm" in name else 0.0) + 0.2 * noise
                            if name.endswith("weight") else 0.2 * noise)
            else:
                param.copy_(0.15 * noise)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    torch = require("torch")
    transformers = require("transformers")
    tokenizer = _tokenizer(transformers)
    out = {}
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=64, bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1)).eval()
    # the value biases and ln_1's bias (which reaches the values through W_V) stay 0:
    # TransformerLens's compatibility mode folds them into b_O, moving their part of each
    # head's attribution into the bias term (attnkit keeps what a head writes in the head)
    _spread(gpt2, torch, skip=("c_attn.bias", "ln_1.bias"))
    with torch.no_grad():
        for block in gpt2.transformer.h:
            block.attn.c_attn.bias[:128] = 0.2 * torch.randn(128)  # query and key biases
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)).eval()
    _spread(llama, torch)
    for name, model in (("gpt2", gpt2), ("llama", llama)):
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        out[name] = folder
    return out


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def case(request, folders):
    """(attnkit model, TransformerLens float32 bridge, float64 bridge, token ids with BOS)."""
    torch = require("torch")
    transformers = require("transformers")
    require("transformer_lens")
    from transformer_lens.model_bridge import TransformerBridge

    from attnkit.models import AutoCausalLM

    folder = folders[request.param]
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    b32 = TransformerBridge.boot_transformers(str(folder), tokenizer=tokenizer)
    b64 = TransformerBridge.boot_transformers(str(folder), tokenizer=tokenizer, dtype=torch.float64)
    ids = b32.to_tokens(TEXT)[0].numpy()  # BOS first, as TransformerLens tokenizes
    return AutoCausalLM.from_pretrained(folder), b32, b64, ids


def _np(tensor):
    return tensor.detach().to(dtype=__import__("torch").float64).numpy()


@pytest.mark.parametrize("pattern", ["previous_token", "duplicate_token", "induction"])
def test_detectors_match_detect_head(case, pattern):
    from transformer_lens.head_detector import detect_head

    from attnkit.interpret import detect_heads

    model, b32, b64, ids = case
    ours = detect_heads(model, ids, pattern)
    theirs = _np(detect_head(b32, TEXT, f"{pattern}_head"))
    truth = _np(detect_head(b64, TEXT, f"{pattern}_head"))
    assert ours.shape == truth.shape == (3, 4)
    assert_within_budget(ours, theirs, truth, f"{pattern} scores")


def _logit_diff(answer, wrong):
    def numpy_metric(logits):
        return logits[-1, answer] - logits[-1, wrong]

    def torch_metric(logits):
        return logits[0, -1, answer] - logits[0, -1, wrong]
    return numpy_metric, torch_metric


CORRUPT = "w5 w17 w3 w40 w8 w6 w17 w30 w40 w22 w9"  # two tokens changed


def _logit_scale(model, corrupt):
    """The metric is a difference of two logits: its rounding scales with the logits' size,
    not with the difference (the ulps of the budget count at max |logit|)."""
    return float(np.abs(model(corrupt[0].numpy())).max())


def test_patch_heads_matches_attn_head_out_all_pos(case):
    from transformer_lens import patching

    from attnkit.interpret import patch_heads

    model, b32, b64, ids = case
    corrupt = b32.to_tokens(CORRUPT)
    ours_metric, their_metric = _logit_diff(int(ids[4]), int(ids[6]))
    ours = patch_heads(model, ids, corrupt[0].numpy(), ours_metric)

    def tl(bridge):
        _, cache = bridge.run_with_cache(bridge.to_tokens(TEXT))
        return _np(patching.get_act_patch_attn_head_out_all_pos(bridge, corrupt, cache, their_metric))

    truth, theirs = tl(b64), tl(b32)
    assert ours.shape == truth.shape == (3, 4)
    assert np.ptp(truth) > 0  # the heads differ: the check has something to see
    assert_within_budget(ours, theirs, truth, "head patching", scale=_logit_scale(model, corrupt))


def test_patch_residual_matches_resid_pre(case):
    from transformer_lens import patching

    from attnkit.interpret import patch_residual

    model, b32, b64, ids = case
    corrupt = b32.to_tokens(CORRUPT)
    ours_metric, their_metric = _logit_diff(int(ids[4]), int(ids[6]))
    ours = patch_residual(model, ids, corrupt[0].numpy(), ours_metric)

    def tl(bridge):
        _, cache = bridge.run_with_cache(bridge.to_tokens(TEXT))
        return _np(patching.get_act_patch_resid_pre(bridge, corrupt, cache, their_metric))

    truth, theirs = tl(b64), tl(b32)
    assert ours.shape == truth.shape == (3, len(ids))
    assert_within_budget(ours, theirs, truth, "residual patching", scale=_logit_scale(model, corrupt))


def test_logit_lens_matches(case):
    from transformer_lens.tools.analysis.logit_lens import logit_lens as tl_lens

    from attnkit.interpret import logit_lens

    model, b32, b64, ids = case
    tokens = b32.to_tokens(TEXT)
    ours = logit_lens(model, ids)
    truth = _np(tl_lens(b64, tokens, positions=None).values)[:, 0]  # (layers + 1, T, vocab)
    theirs = _np(tl_lens(b32, tokens, positions=None).values)[:, 0]
    assert ours.shape == truth.shape == (4, len(ids), VOCAB)
    assert_within_budget(ours, theirs, truth, "logit lens")
    np.testing.assert_array_equal(ours[-1], model(ids))  # the last entry is the model's logits


def test_direct_logit_attribution_matches_compatibility_mode(case):
    from attnkit.interpret import direct_logit_attribution

    model, b32, b64, ids = case
    answer, wrong = int(ids[4]), int(ids[6])
    ours = direct_logit_attribution(model, ids, answer, wrong)

    def tl(bridge):
        bridge.enable_compatibility_mode(disable_warnings=True)
        _, cache = bridge.run_with_cache(bridge.to_tokens(TEXT))
        stack = cache.stack_head_results(layer=-1, pos_slice=-1)  # (L*H, 1, d)
        attrs = cache.logit_attrs(stack, tokens=answer, incorrect_tokens=wrong, pos_slice=-1)  # applies ln_final
        return _np(attrs).reshape(3, 4)

    truth, theirs = tl(b64), tl(b32)
    assert_within_budget(ours.heads, theirs, truth, "direct logit attribution")


# ----------------------------------------------------------------------------- SmolLM2


@pytest.fixture(scope="module")
def smollm2_bridges(smollm2_file):
    """SmolLM2 through transformers' GGUF loader (`hf_model=`), in float32 and float64."""
    import copy

    torch = require("torch")
    transformers = require("transformers")
    require("transformer_lens")
    from transformer_lens.model_bridge import TransformerBridge

    folder, name = str(smollm2_file.parent), smollm2_file.name
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    hf64 = copy.deepcopy(hf).double()
    boot = TransformerBridge.boot_transformers
    return (boot("HuggingFaceTB/SmolLM2-135M-Instruct", hf_model=hf, tokenizer=tokenizer),
            boot("HuggingFaceTB/SmolLM2-135M-Instruct", hf_model=hf64, tokenizer=tokenizer, dtype=torch.float64))


def test_smollm2_detectors_and_lens_match(smollm2_bridges):
    from transformer_lens.head_detector import detect_head
    from transformer_lens.tools.analysis.logit_lens import logit_lens as tl_lens

    from attnkit.interpret import detect_heads, logit_lens
    from attnkit.models import AutoCausalLM

    b32, b64 = smollm2_bridges
    model = AutoCausalLM.from_pretrained()
    text = "The cat sat on the mat. The cat sat on the mat, and the dog"
    ids = b32.to_tokens(text)[0].numpy()
    for pattern in ("previous_token", "induction"):
        ours = detect_heads(model, ids, pattern)
        theirs = _np(detect_head(b32, text, f"{pattern}_head"))
        truth = _np(detect_head(b64, text, f"{pattern}_head"))
        assert ours.shape == truth.shape == (30, 9)
        assert_within_budget(ours, theirs, truth, f"SmolLM2 {pattern} scores")
    tokens = b32.to_tokens(text)
    ours = logit_lens(model, ids)[:, -1]  # (31, vocab), the last position
    theirs = _np(tl_lens(b32, tokens).values)[:, 0]
    truth = _np(tl_lens(b64, tokens).values)[:, 0]
    assert_within_budget(ours, theirs, truth, "SmolLM2 logit lens, last position")
