"""The transformers reference (qwen4_exp) on the same weights, for the oracle tests.

NVFP4 weights (experts, and dense projections stored quantized) are dequantized here with the
test's own code (not ftchat's), and QSA block ties are made deterministic in the reference the same way ftchat breaks them (lowest block index).
"""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import torch
from safetensors import safe_open

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _read_all(folder: Path) -> dict[str, torch.Tensor]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for f in sorted(set(index.values())):
        with safe_open(str(folder / f), "pt") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


def _dequant(packed, scale, g):
    lo, hi = packed & 0xF, packed >> 4
    codes = torch.stack([lo, hi], dim=-1).flatten(-2).long()
    vals = torch.tensor(E2M1)[codes]
    return vals * scale.float().repeat_interleave(16, dim=-1) * g


def reference_model(folder: Path):
    """Qwen4ExpForCausalLM in fp32 holding the checkpoint's weights (NVFP4 ones dequantized)."""
    from transformers import AutoConfig, Qwen4ExpForCausalLM

    folder = Path(folder)
    cfg = AutoConfig.from_pretrained(folder)
    text = getattr(cfg, "text_config", cfg)
    model = Qwen4ExpForCausalLM(text).eval()
    raw = _read_all(folder)
    sd = {}
    for k, v in raw.items():
        k = k.replace("model.language_model.", "model.")
        if k.endswith(".weight_scale") or k.endswith(".weight_scale_2") or k.endswith("_global_scale"):
            continue
        if v.dtype == torch.uint8 and (k.endswith(".weight") or k.endswith(".weight_packed")):
            # NVFP4: routed experts, and dense projections a checkpoint stores quantized
            base = k.rsplit(".", 1)[0]
            src = "model.language_model." + base[len("model."):]
            if k.endswith(".weight_packed"):
                g = 1.0 / raw[src + ".weight_global_scale"].float()
            else:
                g = raw[src + ".weight_scale_2"].float()
            v = _dequant(v, raw[src + ".weight_scale"], g)
            k = base + ".weight"
        sd[k] = v.float() if v.is_floating_point() else v
    stacked = {}
    n_exp = text.num_experts
    for i in range(text.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts"
        gate = [sd.pop(f"{p}.{e}.gate_proj.weight") for e in range(n_exp)]
        up = [sd.pop(f"{p}.{e}.up_proj.weight") for e in range(n_exp)]
        down = [sd.pop(f"{p}.{e}.down_proj.weight") for e in range(n_exp)]
        stacked[f"{p}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
        stacked[f"{p}.down_proj"] = torch.stack(down)
    sd.update(stacked)
    for i in range(text.num_hidden_layers):  # the n-gram table: HF concatenates the shards
        shards = sorted((k for k in sd if f"layers.{i}.ple.ple_embedding.ngram_embedding.shard_" in k),
                        key=lambda k: int(k.split("shard_")[1].split(".")[0]))
        if shards:
            sd[f"model.layers.{i}.ple.ple_embedding.ngram_embedding.weight"] = torch.cat(
                [sd.pop(k) for k in shards])
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if "rotary" not in k]
    assert not missing and not unexpected, (missing, unexpected)
    return model


def _stable_topk(self, k, dim=-1, largest=True, sorted=True):
    idx = torch.sort(self, dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
    return torch.return_types.topk((self.gather(dim, idx), idx))


def lowest_index_ties():
    """Tensor.topk (used by the reference's QSA indexer) picks the lowest index among ties."""
    return mock.patch.object(torch.Tensor, "topk", _stable_topk)


@torch.no_grad()
def reference_greedy(model, prompt: list[int], steps: int):
    """Prefill logits [T, V], then per decode step its logits [V] and token, with the HF cache."""
    from transformers import DynamicCache

    with lowest_index_ties():
        cache = DynamicCache(config=model.config)
        out = model(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        prefill = out.logits[0]
        logits, tokens = [], []
        nxt = prefill[-1].argmax()
        for _ in range(steps):
            tokens.append(int(nxt))
            out = model(nxt.view(1, 1), past_key_values=out.past_key_values, use_cache=True)
            logits.append(out.logits[0, -1])
            nxt = out.logits[0, -1].argmax()
    return prefill, torch.stack(logits), tokens


@torch.no_grad()
def reference_full(model, ids: list[int]):
    with lowest_index_ties():
        return model(torch.tensor([ids])).logits[0]
