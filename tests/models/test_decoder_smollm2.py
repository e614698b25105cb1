"""SmolLM2-135M-Instruct (the embedded Q4_1 GGUF) against transformers loading the same file.

One load of each model per module (they take seconds). Checks: logits on several prompts
(float32 error budgets against a float64 evaluation of the same weights), the first 64
greedy tokens on 5 prompts, the tokenizer and the chat template.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from conftest import F32_EPS, assert_within_budget, max_abs_err

from attnkit.models.auto import AutoCausalLM

pytestmark = pytest.mark.slow  # every test loads the real checkpoint

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Attention is a soft lookup: a query is compared with every key, and",
    "Once upon a time, in a small village by the sea, there lived",
    "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def models(torch, transformers, smollm2_file):
    # One torch thread: on a busy 2-core machine torch's 2-thread decoding is several times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = smollm2_file
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = AutoCausalLM.from_pretrained(path)
    yield hf.eval(), hf_tokenizer, ours
    torch.set_num_threads(threads)


def test_config_read_from_gguf(models):
    _, _, ours = models
    c = ours.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert c.rope_theta == 100000.0 and c.tie_word_embeddings and c.vocab_size == 49152


def test_tokenizer_and_template_match(models):
    _, hf_tokenizer, ours = models
    for text in PROMPTS + ["Numbers 1234567 and café naïve 日本語 🙂  spaces\n\n"]:
        assert ours.tokenizer.encode(text) == hf_tokenizer(text)["input_ids"], text
    for messages in (
        [{"role": "user", "content": "Hi!"}],
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Why?"},
         {"role": "assistant", "content": "Because."}, {"role": "user", "content": "Ok"}],
    ):
        expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.tokenizer.apply_chat_template(messages) == expected


def test_logits_match_transformers(models, torch):
    """attnkit's float32 logits are within 2x transformers' float32 error of the float64 truth
    (transformers' model cast to float64), over 4 prompts."""
    hf, hf_tokenizer, ours = models
    hf64 = copy.deepcopy(hf).double()
    prompts = [np.array(hf_tokenizer(text)["input_ids"]) for text in PROMPTS[:4]]
    theirs, truth = [], []
    with torch.no_grad():
        for ids in prompts:
            theirs.append(hf(torch.from_numpy(ids[None])).logits[0].numpy())
            truth.append(hf64(torch.from_numpy(ids[None])).logits[0].numpy())
    del hf64
    mine = [ours(ids) for ids in prompts]
    ours.astype(np.float64)
    try:
        mine64 = [ours(ids) for ids in prompts]
    finally:
        ours.astype(np.float32)
    mine, mine64, theirs, truth = (np.concatenate(x) for x in (mine, mine64, theirs, truth))
    assert mine.dtype == np.float32 and mine64.dtype == np.float64
    # Measured (AMD EPYC, OpenBLAS SkylakeX and Haswell kernels): transformers float32 is
    # 4e-5..6e-5 from the truth, attnkit float32 5e-5..8e-5; logits reach ~36, so the
    # 8-ulp epsilon is 3.4e-5.
    assert_within_budget(mine, theirs, truth, what="SmolLM2 float32 logits, 4 prompts")
    # attnkit in float64 is closer to the truth than transformers in float32 is. Not 1e-10:
    # transformers' LlamaRMSNorm normalizes in float32 even in a float64 model, which moves
    # its float64 logits ~1.7e-5 (attnkit float64 vs transformers float32: 5.8e-5).
    ours64_err, theirs_err = max_abs_err(mine64, truth), max_abs_err(theirs, truth)
    print(f"SmolLM2 float64 logits: attnkit {ours64_err:.2e} from transformers float64 "
          f"(transformers float32: {theirs_err:.2e})")
    assert ours64_err < theirs_err


def test_first_64_greedy_tokens_match_transformers(models, torch):
    hf, hf_tokenizer, ours = models
    for text in PROMPTS:
        ids = np.array(hf_tokenizer(text)["input_ids"])
        with torch.no_grad():
            ref = hf.generate(
                torch.from_numpy(ids[None]), max_new_tokens=64, do_sample=False, eos_token_id=None,
                pad_token_id=2, attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            )[0].numpy()
        out = ours.generate(ids, 64, stop=())
        assert len(out) == len(ids) + 64
        np.testing.assert_array_equal(out, ref, err_msg=text)


def test_generate_stops_at_end_of_turn(models):
    _, _, ours = models
    ids = ours.tokenizer.encode_chat([{"role": "user", "content": "Say hi."}])
    out = ours.generate(np.array(ids), 200)
    assert out[-1] == ours.tokenizer.eos_token_id and len(out) < len(ids) + 200


def test_attention_map_for_visualization(models):
    _, _, ours = models
    result = ours.attention("The cat sat on the mat.")
    T = len(result.tokens)
    assert result.weights.shape == (30, 9, T, T)
    # A row of T float32 probabilities sums to 1 within ~T eps (the float32 sum of the
    # softmax denominator, one rounding per division); summed here in float64, 4x that.
    np.testing.assert_allclose(result.weights.sum(-1, dtype=np.float64), 1.0, rtol=0, atol=4 * T * F32_EPS)
    assert "".join(result.tokens) == "The cat sat on the mat."
