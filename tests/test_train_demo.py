"""scripts/train_demo.py --smoke end to end: gather, tokenizer, train, export, and the checks.

The export is checked here independently of the script's own check: transformers (tests/reference
dequantizes the experts with its own code) and ftchat must give the same greedy tokens.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from ftchat.engine import generate, load_model, resident_backend
from ftchat.model.tokenizer import Tokenizer
from tests.reference import reference_greedy, reference_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import train_demo  # noqa: E402


def test_smoke_run_exports_a_checkpoint_ftchat_and_transformers_agree_on(tmp_path, capsys):
    out = tmp_path / "demo"
    rc = train_demo.main(["--smoke", "--out", str(out), "--corpus", str(tmp_path / "none")])
    log = capsys.readouterr().out
    assert rc == 0, log
    assert "[done] OK" in log

    cfg = json.loads((out / "config.json").read_text())
    text = cfg["text_config"]
    assert cfg["quantization_config"]["quant_method"] == "modelopt"
    assert set(text["layer_types"]) == {"linear_attention", "indexed_attention"}
    assert text["hc_count"] == 4 and text["ple_layer_ids"] == [2]
    names = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.language_model.layers.0.mlp.experts.0.gate_proj.weight_scale_2" in names
    assert "model.language_model.layers.0.mlp.shared_expert.up_proj.weight" in names

    tok = Tokenizer.from_folder(out)
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"):
        assert special in tok.special_ids
    prompt = tok.encode(tok.render_chat([{"role": "user", "content": "Sort a list."}]))
    ref = reference_model(out)  # asserts: no missing or unexpected keys
    _, _, hf_tokens = reference_greedy(ref, prompt, 6)
    m = load_model(out)
    assert m.layout.kind == "nvfp4"
    ours = [s.tokens[0] for s in generate(m, [prompt], 6, resident_backend(m))]
    assert ours == hf_tokens


def test_smoke_training_moves_the_weights(tmp_path):
    """Negative control for the export: the exported lm_head is not the untrained init."""
    from safetensors import safe_open

    out = tmp_path / "demo"
    assert train_demo.main(["--smoke", "--out", str(out), "--corpus", str(tmp_path)]) == 0
    torch.manual_seed(0)  # the script seeds torch with --seed 0 before building the model
    a = train_demo.parse_args(["--smoke", "--out", str(out)])
    tok = Tokenizer.from_folder(out)
    cfg = train_demo.text_config(a, tok.special_ids["<|endoftext|>"])
    init = train_demo.build_model(cfg, "cpu").state_dict()["lm_head.weight"]
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(out / index["lm_head.weight"]), "pt") as f:
        saved = f.get_tensor("lm_head.weight").float()
    assert saved.shape == init.shape
    assert (saved - init.bfloat16().float()).abs().max() > 1e-3


def test_smoke_run_pauses_and_resumes_from_its_state_folder(tmp_path, capsys):
    """--state/--run-minutes: each run trains at least one step, saves, exits 3; the last one
    finishes the --steps budget from where the previous stopped and exports a checked model."""
    out, state = tmp_path / "demo", tmp_path / "state"
    args = ["--smoke", "--out", str(out), "--corpus", str(tmp_path), "--state", str(state),
            "--run-minutes", "1e-6"]
    assert train_demo.main(args) == 3  # steps 0 -> 1
    assert (state / "train.pt").exists() and not out.exists()
    assert train_demo.main(args) == 3  # 1 -> 2
    capsys.readouterr()
    assert train_demo.main(args) == 0  # 2 -> 3 = --steps: finish, export, check
    log = capsys.readouterr().out
    assert "[train] resumed at step 2" in log and "[data] from" in log
    assert "[done] OK" in log
    assert torch.load(state / "train.pt", weights_only=False)["step"] == 2


def test_batched_indexer_equals_the_reference_selection():
    """The training-time indexer (batched) selects exactly the reference's tokens."""
    from transformers import Qwen4ExpTextConfig
    from transformers.models.qwen4_exp import modeling_qwen4_exp as hf

    a = train_demo.parse_args(["--smoke", "--out", "unused"])
    cfg = train_demo.text_config(a, 7)
    cfg.update(indexer_budget=8, indexer_compress_ratio=4, hidden_size=32, head_dim=16)
    conf = Qwen4ExpTextConfig(**cfg)
    torch.manual_seed(0)
    ix = hf.Qwen4ExpTextQSAIndexer(conf, 3)
    rope = hf.Qwen4ExpTextRotaryEmbedding(conf)
    B, T = 2, 37  # a tail block at the end; more blocks than the budget keeps
    x = torch.randn(B, T, 32)
    pe = rope(x, torch.arange(T)[None].expand(B, T))
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None].expand(B, 1, T, T)
    want = ix(x, pe, causal, None)
    with train_demo.batched_indexer():
        got = ix(x, pe, causal, None)
    assert hf.Qwen4ExpTextQSAIndexer.forward is not train_demo.batched_indexer_forward
    assert want.shape == got.shape == (B, 1, T, T)
    assert torch.equal(want, got)
    assert not torch.equal(want, causal)  # sparse: the control that selection happened
