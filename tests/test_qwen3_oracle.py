"""The Qwen3 MoE line (qwen3_5_moe, qwen3_next, qwen3_moe) against transformers 5.23 on
checkpoints transformers wrote (random weights, fp32 on the CPU): prefill and decode logits,
greedy tokens, and the greedy reply through the chat template against `generate`.

Each test prints its measured max abs logit difference (pytest -s shows them).
"""

from __future__ import annotations

import pytest
import torch

from ftchat.engine import generate, load_model, prefill, resident_backend
from ftchat.model.tokenizer import Tokenizer
from tests.qwen3_checkpoints import FAMILIES, VOCAB, reference_model
from tests.reference import reference_full, reference_greedy

TOL = 1e-4  # fp32 logits of magnitude ~1-5


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 500, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def refs(qwen3_folders):
    return {f: reference_model(folder) for f, folder in qwen3_folders.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_checkpoint_loads_as_its_family(family, qwen3_folders):
    m = load_model(qwen3_folders[family])
    assert m.family.name == family
    assert m.layout.kind == "bf16" and m.host_rows.shape[0] == m.args.num_hidden_layers * 16


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_decode_match_transformers(family, qwen3_folders, refs):
    m = load_model(qwen3_folders[family])
    p = prompt(40, 0)  # 40 tokens: a chunked GDN prefill (chunks of 64) with padding
    hf_prefill, hf_logits, hf_tokens = reference_greedy(refs[family], p, 25)
    state = m.family.new_state(m.args, 1, 128, "cpu", torch.float32)
    ex = resident_backend(m)
    d0 = (prefill(m, state, 0, torch.tensor(p), 0, ex) - hf_prefill).abs().max().item()
    steps = list(generate(m, [p], 25, ex))
    ours = torch.stack([s.logits[0] for s in steps[1:]])  # logits after each fed token
    d1 = (ours - hf_logits[:24]).abs().max().item()
    print(f"\n[oracle] {family}: prefill 40 tokens {d0:.3e}, 24 decode steps {d1:.3e}")
    assert d0 < TOL and d1 < TOL
    assert [s.tokens[0] for s in steps] == hf_tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_long_prefill_and_a_batch_of_two_match(family, qwen3_folders, refs):
    """A 150-token prefill (three GDN chunks, the last partial) and a batch of two prompts of
    different lengths decoding together."""
    m = load_model(qwen3_folders[family])
    p = prompt(150, 1)
    state = m.family.new_state(m.args, 1, 160, "cpu", torch.float32)
    ours = prefill(m, state, 0, torch.tensor(p), 0, resident_backend(m))
    d0 = (ours - reference_full(refs[family], p)).abs().max().item()
    prompts = [prompt(23, 2), prompt(9, 3)]
    steps = list(generate(m, prompts, 16, resident_backend(m)))
    worst = 0.0
    for b, q in enumerate(prompts):
        hf_prefill, hf_logits, hf_tokens = reference_greedy(refs[family], q, 16)
        ref = torch.cat([hf_prefill[-1:], hf_logits[:15]])
        worst = max(worst, (torch.stack([s.logits[b] for s in steps]) - ref).abs().max().item())
        assert [s.tokens[b] for s in steps] == hf_tokens
    print(f"\n[oracle] {family}: 150-token prefill {d0:.3e}, bs 2 decode {worst:.3e}")
    assert d0 < TOL and worst < TOL


MESSAGES = ["Hello! Who are you?", "Write a haiku about the sea.", "What is 17 * 23?"]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_chat_reply_equals_transformers_generate(family, qwen3_folders, refs):
    from transformers import AutoTokenizer

    folder = qwen3_folders[family]
    tok, hf_tok = Tokenizer.from_folder(folder), AutoTokenizer.from_pretrained(folder)
    m = load_model(folder)
    for text in MESSAGES:
        chat = [{"role": "user", "content": text}]
        ids = tok.encode(tok.render_chat(chat))
        hf_ids = hf_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        hf_ids = hf_ids["input_ids"] if isinstance(hf_ids, dict) or hasattr(hf_ids, "keys") \
            else hf_ids
        assert ids == list(hf_ids)
        with torch.no_grad():
            x = torch.tensor([ids])  # the mask given: generate would infer it from a pad id
            out = refs[family].generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12,
                                        do_sample=False, eos_token_id=None,
                                        pad_token_id=VOCAB - 1)
        hf_reply = hf_tok.decode(out[0, len(ids):].tolist())
        ours = [s.tokens[0] for s in generate(m, [ids], 12, resident_backend(m))]
        assert tok.decode(ours) == hf_reply and ours == out[0, len(ids):].tolist()
