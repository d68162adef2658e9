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


def _decode_matches_full_forward(m, ref_forward, p: list[int], steps: int) -> float:
    """Max abs difference of ftchat's prefill and decode logits against the reference's full
    forward over the prompt and the tokens ftchat chose (asserting each was its argmax)."""
    out = list(generate(m, [p], steps, resident_backend(m)))
    toks = [s.tokens[0] for s in out]
    with torch.no_grad():
        full = ref_forward(torch.tensor([p + toks[:-1]]))[0, len(p) - 1:]  # [steps, V]
    assert toks == full.argmax(-1).tolist()
    return (torch.stack([s.logits[0] for s in out]) - full).abs().max().item()


def test_multimodal_wrapper_checkpoint_loads_its_language_model(tmp_path):
    """A Qwen3_5MoeForConditionalGeneration saved by transformers (model_type qwen3_5_moe,
    text under model.language_model., a vision tower beside it): ftchat runs the text model."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    from tests.qwen3_checkpoints import hf_classes, randomize

    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  patch_size=4, temporal_patch_size=1, spatial_merge_size=1,
                  num_position_embeddings=16)
    torch.manual_seed(5)
    ref = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(
        text_config=hf_classes("qwen3_5_moe")[2], vision_config=vision)).eval()
    randomize(ref, 5)
    ref.save_pretrained(tmp_path / "wrapped")
    m = load_model(tmp_path / "wrapped")
    assert m.family.name == "qwen3_5_moe"
    assert not any("visual" in k for k in m.weights.tensors)
    diff = _decode_matches_full_forward(m, lambda x: ref(input_ids=x).logits, prompt(30, 6), 12)
    print(f"\n[oracle] qwen3_5_moe multimodal wrapper: {diff:.3e}")
    assert diff < TOL


def test_stacked_bf16_experts_read_as_per_expert_ones(qwen3_folders, refs, tmp_path):
    """The same weights with each layer's experts stacked ([E, 2I, D] gate|up, [E, D, I] down,
    the layout transformers holds them in): the same logits as the per-expert folder."""
    import shutil

    from safetensors.torch import load_file, save_file

    src, dst = qwen3_folders["qwen3_5_moe"], tmp_path / "stacked"
    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    a = load_model(src).args
    for i in range(a.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts"
        parts = {n: [sd.pop(f"{p}.{e}.{n}.weight") for e in range(a.num_experts)]
                 for n in ("gate_proj", "up_proj", "down_proj")}
        sd[f"{p}.gate_up_proj"] = torch.stack([torch.cat(gu) for gu in
                                               zip(parts["gate_proj"], parts["up_proj"])])
        sd[f"{p}.down_proj"] = torch.stack(parts["down_proj"])
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    m = load_model(dst)
    assert torch.equal(m.host_rows, load_model(src).host_rows)
    diff = _decode_matches_full_forward(m, lambda x: refs["qwen3_5_moe"](x).logits,
                                        prompt(20, 7), 8)
    assert diff < TOL
