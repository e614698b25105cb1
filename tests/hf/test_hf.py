"""attnkit.hf: "attnkit", "attnkit_flash" and "attnkit_tiled" as transformers attention implementations.

Oracles: transformers' own "eager" attention, in float32 and (on the same
weights cast to float64) as the truth; torch autograd in float64 for the
softcap of the tiled kernel; plain torch attention in float32 and float64 for
attnkit's flash_attn functions (attnkit.hf.flash_api). The architecture cases are attnkit.hf.conformance's,
the ones scripts/hf_conformance.py turns into docs/hf.md's table.
"""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest

from conftest import assert_within_budget, optional

import attnkit

torch = optional("torch")
transformers_module = optional("transformers")
hf = importlib.import_module("attnkit.hf") if torch and transformers_module else None
conformance = importlib.import_module("attnkit.hf.conformance") if hf else None
hf_attention = importlib.import_module("attnkit.hf.attention") if hf else None
flash_api = importlib.import_module("attnkit.hf.flash_api") if hf else None

pytestmark = pytest.mark.usefixtures("torch", "transformers")

# Llama runs every time (the done-when: it trains on every implementation); every other architecture
# takes over 2 s here and is marked slow.
FAST = {"llama"}
CASES = conformance.CASES if conformance else ()


def _cases():
    return [pytest.param(case, id=case.name, marks=() if case.name in FAST else pytest.mark.slow) for case in CASES]


def _llama(implementation="eager", **overrides):
    transformers = transformers_module
    hf.register()
    config = transformers.LlamaConfig(**{**conformance._DECODER, **overrides})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=implementation)


# ----------------------------------------------------------------------------- registration


def test_register_is_idempotent_and_adds_every_implementation():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    assert hf.register() == ("attnkit", "attnkit_flash", "attnkit_tiled")
    assert hf.register() == ("attnkit", "attnkit_flash", "attnkit_tiled")  # twice changes nothing
    for name, function in hf.IMPLEMENTATIONS.items():
        assert AttentionInterface._global_mapping[name] is function
        mask = flash_attention_mask if name == "attnkit_flash" else hf_attention.attnkit_mask
        assert AttentionMaskInterface._global_mapping[name] is mask
    model = _llama("attnkit")
    assert model.config._attn_implementation == "attnkit"
    for name in ("attnkit_flash", "attnkit_tiled", "attnkit_flash"):
        model.set_attn_implementation(name)
        assert model.config._attn_implementation == name


def test_attnkit_flash_builds_and_trains_from_config():
    """The issue's done-when, word for word: from_config(cfg, attn_implementation="attnkit_flash")."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    hf.register()
    cfg = LlamaConfig(**conformance._DECODER)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="attnkit_flash")
    ids = torch.randint(3, 90, (2, 12))
    before = model(ids, labels=ids).loss
    before.backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    with torch.no_grad():
        assert float(model(ids, labels=ids).loss) < float(before.detach())


# ----------------------------------------------------------------------------- conformance


@pytest.mark.parametrize("case", _cases())
def test_architecture_conforms_to_eager(case):
    """Logits, loss and every parameter gradient of one training step, on a batch
    without padding and one with, within the float64-grounded budget of eager's;
    and the model built with from_config(..., attn_implementation=name) trains."""
    run = conformance.run_case(case)
    for implementation in conformance.IMPLEMENTATIONS:
        if implementation in run.refused:
            # the refusals a case may meet: no attention sinks in the tiled kernel; no flash route
            # where transformers gives the class none (T5) or swaps the name for its own kernels (gpt-oss)
            message = run.refused[implementation]
            assert case.model_type in message and "cannot compute" in message, message
            if implementation == "attnkit_tiled":
                assert "attention sinks" in case.features and "sinks" in message, message
            else:
                assert implementation == "attnkit_flash" and case.model_type in ("t5", "gpt_oss"), message
                assert "attnkit_tiled" in message, message
            continue
        assert set(run.values[implementation]) == set(run.truth)
        for name, actual, oracle, truth in conformance.compared(run, implementation):
            factor = conformance.GRADIENT_FACTOR if name.startswith("grad/") else conformance.FORWARD_FACTOR
            assert_within_budget(actual, oracle, truth, f"{case.name} {implementation} {name}",
                                 factor=factor, scale=conformance.budget_scale(run, name))
        assert np.isfinite(run.trained[implementation])


# ----------------------------------------------------------------------------- masks: the cheap paths


class _Spy:
    """Wraps attnkit.hf.attention.flash_attention and keeps each call's mask and is_causal."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = hf_attention.flash_attention

        def spy(*args, **kwargs):
            self.calls.append((kwargs.get("attn_mask"), kwargs.get("is_causal")))
            return real(*args, **kwargs)

        monkeypatch.setattr(hf_attention, "flash_attention", spy)


def test_plain_causal_hands_no_mask_and_uses_is_causal(monkeypatch):
    spy = _Spy(monkeypatch)
    model = _llama("attnkit_tiled")
    model(torch.randint(3, 90, (2, 12)))
    assert spy.calls and all(mask is None and causal for mask, causal in spy.calls)


def test_encoder_padding_is_a_key_mask(monkeypatch):
    spy = _Spy(monkeypatch)
    hf.register()
    config = transformers_module.BertConfig(**conformance._BERT)
    model = transformers_module.AutoModelForMaskedLM.from_config(config, attn_implementation="attnkit_tiled")
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 7:] = 0
    model(torch.randint(3, 90, (2, 10)), attention_mask=mask)
    assert spy.calls
    for attn_mask, causal in spy.calls:
        assert attn_mask.shape == (2, 1, 1, 10) and attn_mask.dtype == torch.bool and not causal
        assert attn_mask[1, 0, 0].tolist() == [True] * 7 + [False] * 3
    spy.calls.clear()
    model(torch.randint(3, 90, (2, 10)))  # no padding: no mask at all
    assert all(attn_mask is None and not causal for attn_mask, causal in spy.calls)


def test_sliding_window_mask_is_transformers_window(monkeypatch):
    spy = _Spy(monkeypatch)
    hf.register()
    config = transformers_module.AutoConfig.for_model("mistral", **{**conformance._DECODER, "sliding_window": 3})
    model = transformers_module.AutoModelForCausalLM.from_config(config, attn_implementation="attnkit_tiled")
    model(torch.randint(3, 90, (1, 6)))
    attn_mask, causal = spy.calls[0]
    i, j = torch.arange(6)[:, None], torch.arange(6)[None, :]
    assert not causal and torch.equal(attn_mask[0, 0], (j <= i) & (j > i - 3))


# ----------------------------------------------------------------------------- what each gives and refuses


def test_output_attentions_match_eager():
    ids = torch.randint(3, 90, (2, 9))
    eager = _llama("eager")
    truth_model = _llama("eager").double()
    ours = _llama("attnkit")
    got = ours(ids, output_attentions=True).attentions
    want = eager(ids, output_attentions=True).attentions
    truth = truth_model(ids, output_attentions=True).attentions
    assert len(got) == len(want) == 2
    for layer, (a, e, t) in enumerate(zip(got, want, truth)):
        assert a.shape == (2, 4, 9, 9)
        assert_within_budget(a.detach().numpy(), e.detach().numpy(), t.detach().numpy(), f"layer {layer} weights")


def test_recordings_receive_the_weights_in_every_implementation():
    """The views' contract: every recording open in the calling thread gets each call's
    (B, H, L, S) weights; the tiled and flash implementations compute exactly meanwhile."""
    ids = torch.randint(3, 90, (1, 7))
    reference = _llama("attnkit")(ids, output_attentions=True).attentions
    for implementation in ("attnkit", "attnkit_flash", "attnkit_tiled"):
        model = _llama(implementation)
        with attnkit.record_attention(model) as first, attnkit.record_attention(model) as second:
            model(ids)
        assert len(first) == len(second) == 2
        for recorded, again, want in zip(first, second, reference):
            np.testing.assert_array_equal(recorded, want.detach().to(torch.float32).numpy())
            np.testing.assert_array_equal(again, recorded)
        assert not any(hasattr(layer.self_attn, "_attnkit_recorders") for layer in model.model.layers)

def test_unknown_keywords_with_values_are_refused_by_name():
    model = _llama("attnkit")
    module = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 5, 8)
    kv = torch.randn(1, 2, 5, 8)
    for function in hf.IMPLEMENTATIONS.values():
        out, _ = function(module, q, kv, kv, None, mystery=None)  # None carries nothing: accepted
        assert out.shape == (1, 5, 4, 8)
        with pytest.raises(ValueError, match=r"cannot compute the keyword argument\(s\) mystery, which llama "
                                             r"\(LlamaAttention\) uses"):
            function(module, q, kv, kv, None, mystery=3)


def test_tiled_and_flash_take_sinks_as_the_exact_route_does():
    """s_aux (attention sinks) on attnkit_tiled and attnkit_flash: the exact route's output
    (they were refused before; tests/functional/test_sinks.py checks them against eager gpt-oss)."""
    module = _llama("attnkit_tiled").model.layers[0].self_attn
    q, kv = torch.randn(1, 4, 5, 8, dtype=torch.float64), torch.randn(1, 2, 5, 8, dtype=torch.float64)
    sinks = torch.randn(4, dtype=torch.float64)
    exact, _ = hf_attention.attnkit_attention(module, q, kv, kv, None, s_aux=sinks)
    for function in (hf_attention.attnkit_tiled_attention, hf_attention.attnkit_flash_attention):
        output, _ = function(module, q, kv, kv, None, s_aux=sinks)
        torch.testing.assert_close(output, exact, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("implementation", ["attnkit_tiled", "attnkit_flash"])
def test_tiled_trains_with_attention_dropout(implementation):
    """Dropout in training mode only; the same torch seed gives the same step."""
    ids = torch.randint(3, 90, (2, 10))
    model = _llama(implementation, attention_dropout=0.3)
    model.eval()
    plain = model(ids).logits
    model.train()
    losses = []
    for _ in range(2):
        torch.manual_seed(7)
        model.zero_grad()
        out = model(ids, labels=ids)
        out.loss.backward()
        losses.append((out.loss.detach(), model.model.layers[0].self_attn.q_proj.weight.grad.clone()))
        assert not torch.allclose(out.logits, plain)
    assert torch.equal(losses[0][0], losses[1][0]) and torch.equal(losses[0][1], losses[1][1])


@pytest.mark.slow  # over 2 s in the quick loop (2-core Xeon, 2026-12-08)
def test_flash_dropout_gradients_match_finite_differences():
    """flash_attention(..., dropout_p): the backward draws each tile's mask again (gradcheck,
    float64, several tiles, with causal, GQA and softcap)."""
    from attnkit.torch import flash_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 9, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 11, 4, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 11, 4, generator=g, dtype=torch.float64, requires_grad=True)

    def dropped(q, k, v):
        torch.manual_seed(5)  # the same masks on every call
        return flash_attention(q, k, v, is_causal=True, causal_align="bottom_right", enable_gqa=True,
                               dropout_p=0.3, softcap=3.0, block_q=4, block_k=4)

    assert torch.autograd.gradcheck(dropped, (q, k, v))
    kept = flash_attention(q, k, v, is_causal=True, causal_align="bottom_right", enable_gqa=True, softcap=3.0)
    assert not torch.allclose(dropped(q, k, v), kept)
    with pytest.raises(ValueError, match=r"expected dropout_p in \[0, 1\)"):
        flash_attention(q, k, v, enable_gqa=True, dropout_p=1.0)


def test_attnkit_dropout_drops_weights_in_training_only():
    model = _llama("attnkit", attention_dropout=0.5)
    module = model.model.layers[0].self_attn
    q, kv = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8)
    _, kept = hf_attention.attnkit_attention(module, q, kv, kv, None)  # dropout=0.0, as in eval mode
    torch.manual_seed(0)
    _, dropped = hf_attention.attnkit_attention(module, q, kv, kv, None, dropout=0.5)
    # every weight is either dropped or kept and scaled by 1 / (1 - p)
    assert torch.all((dropped == 0) | torch.isclose(dropped, 2 * kept))
    assert (dropped == 0).any() and (dropped != 0).any()


def test_fully_masked_rows_give_zero():
    module = _llama("attnkit").model.layers[0].self_attn
    q, kv = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    mask[..., 1, :] = False
    for function in hf.IMPLEMENTATIONS.values():
        out, _ = function(module, q, kv, kv, mask)
        assert torch.all(out[:, 1] == 0) and torch.isfinite(out).all()


# ----------------------------------------------------------------------------- attnkit_flash: the flash route


def test_flash_route_unpads_into_varlen_and_never_builds_a_4d_mask(monkeypatch):
    """A padded batch reaches flash_attn_varlen_func (one call per sequence and layer, no mask:
    a window goes as `window`); no padding reaches flash_attn_func with causal and no mask."""
    calls = []
    real = flash_api.flash_attention

    def spy(q, k, v, **kwargs):
        calls.append((q.shape, kwargs.get("attn_mask"), kwargs.get("is_causal", False)))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(flash_api, "flash_attention", spy)
    model = _llama("attnkit_flash")
    model(torch.randint(3, 90, (2, 10)))
    assert len(calls) == 2 and all(shape == (2, 4, 10, 8) and mask is None and causal for shape, mask, causal in calls)
    calls.clear()
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 6:] = 0
    model(torch.randint(3, 90, (2, 10)), attention_mask=mask)
    assert [shape for shape, _, _ in calls] == [(4, 10, 8), (4, 6, 8)] * 2
    assert all(m is None and causal for _, m, causal in calls)


def test_flash_packed_sequences_match_each_sequence_alone():
    """Packed sequences (batch 1, position_ids restarting at 0) take the varlen route: each
    sequence sees only itself, as eager on each sequence alone."""
    eager, ours = _llama("eager"), _llama("attnkit_flash")
    first, second = torch.randint(3, 90, (1, 5)), torch.randint(3, 90, (1, 7))
    packed = torch.cat([first, second], dim=1)
    positions = torch.cat([torch.arange(5), torch.arange(7)])[None]
    got = ours(packed, position_ids=positions).logits
    want = torch.cat([eager(first).logits, eager(second).logits], dim=1)
    truth_model = _llama("eager").double()
    truth = torch.cat([truth_model(first).logits, truth_model(second).logits], dim=1)
    assert_within_budget(got.detach().numpy(), want.detach().numpy(), truth.detach().numpy(), "packed logits")


def test_flash_reseats_after_another_flash_implementation_was_loaded():
    """lazy_import_flash_attention keeps one loaded implementation: switching to another and back works."""
    from transformers import modeling_flash_attention_utils as fa

    model = _llama("attnkit_flash")
    ids = torch.randint(3, 90, (1, 8))
    want = model(ids).logits
    fa._loaded_implementation, fa._flash_fn, fa._flash_varlen_fn = "someone_else", None, None
    assert torch.equal(model(ids).logits, want)
    assert fa._loaded_implementation == "attnkit_flash" and fa._flash_varlen_fn is flash_api.flash_attn_varlen_func
    fa._loaded_implementation = "someone_else"
    hf.register()  # before building another model after one: register() seats again
    assert _llama("attnkit_flash").config._attn_implementation == "attnkit_flash"


def test_flash_refuses_what_the_flash_interface_cannot_carry():
    module = _llama("attnkit_flash").model.layers[0].self_attn
    q, kv = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match=r"'attnkit_flash' cannot compute a position bias, which llama"):
        hf_attention.attnkit_flash_attention(module, q, kv, kv, None, position_bias=torch.zeros(1, 4, 5, 5))
    with pytest.raises(ValueError, match=r"cannot compute the keyword argument\(s\) block_table, which llama"):
        hf_attention.attnkit_flash_attention(module, q, kv, kv, None, block_table=torch.zeros(1, 1))
    qf, kvf = q.transpose(1, 2), kv.transpose(1, 2)
    for keyword, value in (("alibi_slopes", torch.zeros(4)), ("return_attn_probs", True)):
        with pytest.raises(ValueError, match="attnkit's flash_attn functions cannot compute"):
            flash_api.flash_attn_func(qf, kvf, kvf, **{keyword: value})
    with pytest.raises(ValueError, match=r"expected q of shape \(B, L, H, E\), got \(5, 4, 8\)"):
        flash_api.flash_attn_func(qf[0], kvf, kvf)
    with pytest.raises(ValueError, match="expected cu_seqlens_q and cu_seqlens_k of one length"):
        flash_api.flash_attn_varlen_func(qf[0], kvf[0], kvf[0], torch.tensor([0, 5]), torch.tensor([0, 2, 5]))
    # offsets that fall or skip rows would leave output rows uncomputed or computed twice: refused
    for bad_q, bad_k in (([0, 3, 2, 5], [0, 2, 4, 5]), ([1, 5], [0, 5]), ([0, 5], [0, 6]), ([0, 5], [-1, 5])):
        with pytest.raises(ValueError, match=r"each rising from 0 \(never falling\) to total_q=5 and total_k=5"):
            flash_api.flash_attn_varlen_func(qf[0], kvf[0], kvf[0], torch.tensor(bad_q), torch.tensor(bad_k))


def _dense(q, k, v, *, causal, window, scale, softcap, dtype):
    """FlashAttention's semantics written out: q (L, Hq, E), k, v (S, Hkv, E) -> (L, Hq, E)."""
    q, k, v = (x.to(dtype).transpose(0, 1) for x in (q, k, v))
    groups = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
    s = (q * scale) @ k.transpose(-1, -2)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    L, S = s.shape[-2:]
    pos, j = torch.arange(L)[:, None] + S - L, torch.arange(S)[None, :]
    left, right = window
    right = 0 if causal and right < 0 else (min(right, 0) if causal else right)
    allowed = torch.ones(L, S, dtype=torch.bool)
    if left >= 0:
        allowed &= j >= pos - left
    if right >= 0:
        allowed &= j <= pos + right
    s = s.masked_fill(~allowed, -math.inf)
    w = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return (w @ v).transpose(0, 1)


@pytest.mark.parametrize("causal, window, softcap", [
    (True, (-1, -1), 0.0), (True, (3, 3), 0.0), (False, (2, 4), 5.0), (False, (-1, -1), 0.0), (False, (-1, 1), 0.0),
])
def test_flash_api_varlen_and_dense_match_attention_written_out(monkeypatch, causal, window, softcap):
    """flash_attn_varlen_func over three packed sequences (one with fewer queries than keys, one
    with more) and flash_attn_func on one batch, forward and gradients, against the formula in
    float32 (oracle) and float64 (truth); 4 x 3 tiles so that a window's band crosses several."""
    real = flash_api.flash_attention
    monkeypatch.setattr(flash_api, "flash_attention", lambda *args, **kwargs: real(*args, block_q=4, block_k=3, **kwargs))
    g = torch.Generator().manual_seed(11)
    lq, lk = [5, 9, 7], [5, 6, 11]
    Hq, Hkv, E = 4, 2, 8
    q64 = torch.randn(sum(lq), Hq, E, generator=g, dtype=torch.float64) * 2
    k64 = torch.randn(sum(lk), Hkv, E, generator=g, dtype=torch.float64)
    v64 = torch.randn(sum(lk), Hkv, E, generator=g, dtype=torch.float64)
    grad64 = torch.randn(sum(lq), Hq, E, generator=g, dtype=torch.float64)
    cq, ck = torch.tensor([0, *np.cumsum(lq)]), torch.tensor([0, *np.cumsum(lk)])
    scale = 0.3

    def reference(dtype):
        def fn(q, k, v):
            pieces = [_dense(q[cq[n]:cq[n + 1]], k[ck[n]:ck[n + 1]], v[ck[n]:ck[n + 1]], causal=causal,
                             window=window, scale=scale, softcap=softcap, dtype=dtype) for n in range(3)]
            return torch.cat(pieces)
        return fn

    def ours(q, k, v):
        return flash_api.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), softmax_scale=scale,
                                                causal=causal, window_size=window, softcap=softcap)

    def run(fn, dtype):
        inputs = [x.detach().to(dtype).requires_grad_() for x in (q64, k64, v64)]
        out = fn(*inputs)
        return [x.detach().double().numpy() for x in (out, *torch.autograd.grad(out, inputs, grad64.to(dtype)))]

    truth, oracle, got = run(reference(torch.float64), torch.float64), run(reference(torch.float32), torch.float32), \
        run(ours, torch.float32)
    for what, a, o, t in zip(("output", "dq", "dk", "dv"), got, oracle, truth):
        assert_within_budget(a, o, t, f"varlen {what}", factor=2 if what == "output" else 3)
    # the padded-batch function: sequence 1 (9 queries over 6 keys) as a batch of one
    q, k, v = q64[5:14].float()[None], k64[5:11].float()[None], v64[5:11].float()[None]
    out = flash_api.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, window_size=window, softcap=softcap)
    want = _dense(q[0].double(), k[0].double(), v[0].double(), causal=causal, window=window, scale=scale,
                  softcap=softcap, dtype=torch.float64)
    assert_within_budget(out[0].detach().double().numpy(), oracle[0][5:14], want.numpy(), "flash_attn_func output")


# ----------------------------------------------------------------------------- the tiled kernel's softcap


@pytest.mark.parametrize("softcap", [2.0, 30.0])
def test_flash_softcap_against_autograd(softcap):
    """flash_attention(..., softcap=c): c * tanh(scores / c) before the mask, forward and
    backward, float32 within the budget of the same formula in plain torch float32."""
    from attnkit.torch import flash_attention

    g = torch.Generator().manual_seed(3)
    B, Hq, Hkv, L, S, E = 2, 4, 2, 19, 23, 8
    q64 = (torch.randn(B, Hq, L, E, generator=g, dtype=torch.float64) * 4).requires_grad_()
    k64 = torch.randn(B, Hkv, S, E, generator=g, dtype=torch.float64).requires_grad_()
    v64 = torch.randn(B, Hkv, S, E, generator=g, dtype=torch.float64).requires_grad_()
    bias64 = torch.randn(B, 1, L, S, generator=g, dtype=torch.float64).requires_grad_()
    grad_out = torch.randn(B, Hq, L, E, generator=g, dtype=torch.float64)

    def dense(q, k, v, bias):
        k, v = k.repeat_interleave(Hq // Hkv, dim=1), v.repeat_interleave(Hq // Hkv, dim=1)
        s = (q / math.sqrt(E)) @ k.transpose(-1, -2)
        s = softcap * torch.tanh(s / softcap) + bias
        s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(S - L), -math.inf)
        return torch.softmax(s, dim=-1) @ v

    def flash(q, k, v, bias):
        return flash_attention(q, k, v, attn_mask=bias, is_causal=True, causal_align="bottom_right",
                               enable_gqa=True, softcap=softcap, block_q=8, block_k=8)

    def run(fn, dtype):
        inputs = [t.detach().to(dtype).requires_grad_() for t in (q64, k64, v64, bias64)]
        out = fn(*inputs)
        grads = torch.autograd.grad(out, inputs, grad_out.to(dtype))
        return [x.detach().double().numpy() for x in (out, *grads)]

    truth, oracle, ours = run(dense, torch.float64), run(dense, torch.float32), run(flash, torch.float32)
    for what, a, o, t in zip(("output", "dq", "dk", "dv", "dbias"), ours, oracle, truth):
        assert_within_budget(a, o, t, what, factor=2 if what == "output" else 3)
    with pytest.raises(ValueError, match="expected softcap to be None or a positive finite number"):
        flash_attention(q64, k64, v64, enable_gqa=True, softcap=-1.0)


# ----------------------------------------------------------------------------- generation


@pytest.mark.slow
def test_greedy_generation_matches_eager():
    """A KV cache: one query over every cached key (no mask, no causal), prefill with is_causal."""
    ids = torch.randint(3, 90, (1, 6))
    want = _llama("eager").generate(ids, max_new_tokens=6, do_sample=False)
    for implementation in hf.IMPLEMENTATIONS:
        got = _llama(implementation).generate(ids, max_new_tokens=6, do_sample=False)
        assert torch.equal(got, want), implementation


# ----------------------------------------------------------------------------- the bench suite


@pytest.mark.slow
def test_bench_suite_reports_every_contender_and_the_goals(monkeypatch):
    from attnkit.bench import SUITES, NullProgress, run_suite
    from attnkit.bench import hf as suite

    assert SUITES["hf"] == "attnkit.bench.hf"
    monkeypatch.setattr(suite, "QUICK_LENGTHS", (64,))
    report = run_suite("hf", quick=True, progress=NullProgress(), threads=1)
    assert [row[1] for row in report.rows] == list(suite.IMPLEMENTATIONS)
    assert all(row[0] == 64 and row[2] > 0 and row[4] is not None for row in report.rows)
    assert any("sdpa's speed" in goal and goal.startswith(("PASS", "FAIL")) for goal in report.goals)
    assert not any("goal" in note for note in report.findings())
    assert set(report.raw["lengths"][64]["peak_bytes"]) == set(suite.IMPLEMENTATIONS)


@pytest.mark.parametrize("implementation", ["attnkit_flash", "attnkit_tiled"])
def test_weightless_implementations_warn_once_and_return_what_sdpa_returns(monkeypatch, implementation):
    """output_attentions=True on a kernel that forms no weights: one warning, as transformers'
    own sdpa gives, and the attentions sdpa's model returns (none), never a silent empty tuple."""
    import warnings

    monkeypatch.setattr(hf_attention, "_WARNED_NO_WEIGHTS", set())
    ids = torch.randint(3, 90, (2, 9))
    sdpa = _llama("sdpa")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = sdpa(ids, output_attentions=True)
        want_tuple = sdpa(ids, output_attentions=True, return_dict=False)
    model = _llama(implementation)
    with warnings.catch_warnings(record=True) as quiet:
        warnings.simplefilter("always")
        model(ids)  # not asked for weights: nothing to say
    assert not [w for w in quiet if implementation in str(w.message)]
    with pytest.warns(UserWarning, match=f"attn_implementation='{implementation}' does not form attention weights"):
        got = model(ids, output_attentions=True)
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        got_tuple = model(ids, output_attentions=True, return_dict=False)  # said once: not again
    assert not [w for w in again if "does not form attention weights" in str(w.message)]
    assert type(got.attentions) is type(want.attentions) and len(got.attentions) == len(want.attentions)
    assert all(a is None for a in got.attentions)
    assert len(got_tuple) == len(want_tuple)
    assert [type(x) for x in got_tuple] == [type(x) for x in want_tuple]
    assert len(got_tuple[-1]) == len(want_tuple[-1])  # the attentions, as sdpa's
