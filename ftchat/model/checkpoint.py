"""Reading a checkpoint folder: config, sharded safetensors, bf16 or NVFP4 (two dialects). The
config's model_type picks the family (ftchat/model/registry.py), whose tensor inventory says what
to read.

Dense weights come back as one name -> tensor dict (names relative to the text-model prefix);
routed experts come back one layer at a time as packed rows [E, R] (ftchat.codecs.rows layout),
which is what the host store holds. Every problem is one ModelError naming the file and tensor.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from ftchat.codecs import nvfp4
from ftchat.codecs.fp8 import FP8, dequantize_blocks
from ftchat.codecs.rows import RowLayout
from ftchat.errors import ModelError
from ftchat.kernels import ple_gather
from ftchat.model.config import json_kind, read_config_json
from ftchat.model.ngram_table import HostTable, NGramTable, load_host_table
from ftchat.model.registry import family_for_config

PREFIXES = ("model.language_model.", "model.")
BF16 = "bf16"  # any unquantized float checkpoint
FP8_BLOCK = "fp8-block"  # Qwen's block-FP8: every FP8 weight dequantized at load, experts to bf16
FLOAT_EXPERTS = (BF16, FP8_BLOCK)  # formats whose expert rows are bf16 (or fp32)
INDEX = "model.safetensors.index.json"


class Checkpoint:
    """A checkpoint folder: which file holds which tensor, the text prefix and the format."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._handles: dict[Path, object] = {}  # open safetensors files
        if not self.folder.is_dir():
            raise ModelError(f"{self.folder}: no such model folder")
        self.hf_config = read_config_json(self.folder)
        where = str(self.folder / "config.json")
        self.family = family_for_config(self.hf_config, where)
        self.args = self.family.parse_config(self.hf_config, where)
        self.files = self._index()  # tensor name -> shard path
        self.prefix = next((p for p in PREFIXES if f"{p}embed_tokens.weight" in self.files), None)
        if self.prefix is None:
            raise ModelError(f"{self.folder}: no embed_tokens.weight under {' or '.join(PREFIXES)}")
        self.fp8_block: tuple[int, int] = (128, 128)  # block of a block-FP8 checkpoint
        self.format = BF16  # until detected
        self.format = self._detect_format()
        self._check_layer_count()

    def _check_layer_count(self) -> None:
        """config.json's num_hidden_layers against the layers the tensors hold: fewer in the
        config would silently drop the checkpoint's last layers."""
        layer = re.compile(re.escape(self.prefix) + r"layers\.(\d+)\.")
        found = {int(m.group(1)) for name in self.files if (m := layer.match(name))}
        n = self.args.num_hidden_layers
        if found and max(found) >= n:
            raise ModelError(f"{self.folder / 'config.json'}: num_hidden_layers is {n} but the "
                             f"checkpoint holds layers 0 to {max(found)}; config.json does not "
                             "describe these weights")

    # ===== files and tensors =====
    def _index(self) -> dict[str, Path]:
        idx = self.folder / INDEX
        if idx.is_file():
            try:
                data = json.loads(idx.read_text())
            except (OSError, ValueError) as e:
                raise ModelError(f"{idx}: unreadable index ({e})") from None
            weight_map = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(weight_map, dict) or not all(
                    isinstance(f, str) and f for f in weight_map.values()):
                raise ModelError(f"{idx}: unreadable index (expected \"weight_map\": an object "
                                 "giving each tensor's file name)")
            outside = next((f for f in weight_map.values() if os.path.isabs(f)
                            or os.path.normpath(f).split(os.sep)[0] == ".."), None)
            if outside is not None:  # a model is read from its own folder, nothing beside it
                raise ModelError(f"{idx}: the shard {outside!r} is outside the model folder")
            files = {name: self.folder / f for name, f in weight_map.items()}
            for name, f in files.items():
                if not f.is_file():
                    raise ModelError(f"{f}: missing shard (the index lists {name} in it)")
            return files
        single = self.folder / "model.safetensors"
        if not single.is_file():
            raise ModelError(f"{self.folder}: no {INDEX} and no model.safetensors")
        return {name: single for name in self._open(single).keys()}

    def _open(self, path: Path):
        h = self._handles.get(path)
        if h is None:
            try:
                h = self._handles[path] = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError, ValueError) as e:
                raise ModelError(f"{path}: unreadable safetensors file ({e}); it is damaged or "
                                 "incomplete: download it again") from None
        return h

    def has(self, name: str) -> bool:
        return self._full(name) in self.files

    def _full(self, name: str) -> str:
        return name if name.startswith("lm_head.") else self.prefix + name

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> Tensor:
        """Tensor `name` (relative to the text prefix), checked against `shape` when given."""
        full = self._full(name)
        path = self.files.get(full)
        if path is None:
            raise ModelError(f"{self.folder}: tensor {full} missing from the checkpoint")
        try:
            t = self._open(path).get_tensor(full)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise ModelError(f"{path}: cannot read tensor {full} ({e})") from None
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise ModelError(
                f"{path}: tensor {full} has shape {list(t.shape)}, expected {list(shape)}")
        if t.dtype == FP8 and self.format == FP8_BLOCK and name.endswith(".weight"):
            # block-FP8: codes times their block's scale (NVFP4 block scales are e4m3 too)
            scale = name + "_scale_inv"
            if not self.has(scale):
                raise ModelError(f"{path}: FP8 tensor {full} has no {self._full(scale)}")
            return dequantize_blocks(t, self.get(scale), self.fp8_block)
        return t

    # ===== format =====
    def _detect_format(self) -> str:
        text = self.hf_config.get("text_config")
        qc = self.hf_config.get("quantization_config") or (
            text.get("quantization_config") if isinstance(text, dict) else None)
        if qc is not None and not isinstance(qc, dict):
            raise ModelError(f"{self.folder / 'config.json'}: \"quantization_config\" must be a "
                             f"JSON object, got {json_kind(qc)}")
        hf_quant = self.folder / "hf_quant_config.json"
        if qc is None and hf_quant.is_file():
            try:
                q = json.loads(hf_quant.read_text())
            except (OSError, ValueError) as e:
                raise ModelError(f"{hf_quant}: unreadable ({e})") from None
            q = q.get("quantization", {}) if isinstance(q, dict) else q
            if not isinstance(q, dict):
                raise ModelError(f"{hf_quant}: expected {{\"quantization\": {{...}}}}, got "
                                 f"{json_kind(q)}")
            qc = {"quant_method": "modelopt", **q}
        if qc and str(qc.get("quant_method", "")).lower() == "fp8":
            return self._fp8_blocks(qc)
        dialect = nvfp4.dialect_from_quant_config(qc) if qc else None
        probe = self.prefix + self.family.expert_name(0, 0, "gate_proj")
        found = nvfp4.detect_dialect(self.files, probe)
        if dialect is not None and found is not None and found != dialect:
            raise ModelError(f"{self.folder}: quantization config says {dialect}, tensors say {found}")
        return dialect or found or BF16

    def _fp8_blocks(self, qc: dict) -> str:
        """FP8_BLOCK for Qwen's block-FP8 quantization config (e4m3, weight_block_size [bn,
        bk]); ModelError for another FP8 scheme."""
        block = qc.get("weight_block_size")
        fmt = str(qc.get("fmt", "e4m3")).lower()
        if (fmt != "e4m3" or not isinstance(block, list) or len(block) != 2
                or not all(isinstance(b, int) and b > 0 for b in block)):
            raise ModelError(f"{self.folder}: unsupported FP8 quantization (fmt {fmt!r}, "
                             f"weight_block_size {block!r}); ftchat reads e4m3 weights with a "
                             "scale per [bn, bk] block (weight_scale_inv)")
        self.fp8_block = (block[0], block[1])
        return FP8_BLOCK

    def row_layout(self, dtype: torch.dtype | None = None) -> RowLayout:
        a = self.args
        if self.format in FLOAT_EXPERTS:
            dt = dtype or self._expert_dtype()
            return RowLayout("bf16", a.hidden_size, a.moe_intermediate_size, dt)
        return RowLayout("nvfp4", a.hidden_size, a.moe_intermediate_size)

    def _expert_dtype(self) -> torch.dtype:
        name = self.prefix + self.family.expert_name(0, 0, "gate_proj") + ".weight"
        if name not in self.files:
            name = self.prefix + "layers.0.mlp.experts.gate_up_proj"
        if name not in self.files:
            raise ModelError(f"{self.folder}: no routed expert weights for layer 0")
        stored = self._open(self.files[name]).get_slice(name).get_dtype()
        return torch.float32 if stored == "F32" else torch.bfloat16  # rows keep fp32 exact

    # ===== dense weights =====
    def linear(self, name: str, shape: tuple[int, ...], keep_nvfp4: bool = False
               ) -> Tensor | nvfp4.Nvfp4Weight:
        """A [out, in] weight `name` (ending in .weight), dequantized when stored as NVFP4, or
        with keep_nvfp4 kept so (an Nvfp4Weight)."""
        base = name[: -len(".weight")]
        for dialect in nvfp4.DIALECTS:
            names = nvfp4.tensor_names(dialect, base)
            if self.has(names["packed"]) and self.has(names["block_scale"]) and (
                    dialect != nvfp4.MODELOPT or self.has(names["global"])):
                packed, scale, g = nvfp4.from_checkpoint(dialect, self.get, base)
                w = nvfp4.Nvfp4Weight.of(packed, scale, g)
                if tuple(w.shape) != tuple(shape):
                    raise ModelError(f"{self.folder}: NVFP4 tensor {base} dequantizes to "
                                     f"{list(w.shape)}, expected {list(shape)}")
                return w if keep_nvfp4 else nvfp4.dequantize(packed, scale, g)
        return self.get(name, shape)

    def kept_nvfp4(self) -> bool:
        """Whether load keeps some dense weight in NVFP4 (the GDN qkv / z projections of an NVFP4
        checkpoint), from the file headers alone."""
        for name, spec in self.family.dense_specs(self.args).items():
            if spec.kept_nvfp4:
                base = name[: -len(".weight")]  # a ModelOpt packed tensor is named .weight too
                return any(self.has(nvfp4.tensor_names(d, base)["block_scale"])
                           for d in nvfp4.DIALECTS)
        return False

    def dense(self, dtype: torch.dtype, device: str | torch.device = "cpu",
              progress: Callable[[int, int], None] | None = None,
              table_in_place_bytes: int = 2 << 30, table_host: bool = False,
              table_progress: Callable[[int, int], None] | None = None) -> dict[str, Tensor]:
        """Every non-expert weight, cast to dtype (int64 buffers kept). A PLE table larger than
        table_in_place_bytes (at dtype) stays in host memory in its stored dtype: in its files
        (an NGramTable), or with table_host read whole into one host tensor (a HostTable,
        table_progress(i, n) per shard); a smaller one is dequantized and concatenated."""
        a = self.args
        specs = self.family.dense_specs(a)
        out: dict[str, Tensor] = {}
        finite: dict[str, Tensor] = {}  # name -> bool tensor: no NaN or Inf in it
        shards: dict[str, list[str]] = {}
        for n, (name, spec) in enumerate(specs.items()):
            if ".ngram_embedding.shard_" in name:
                self.get_shape(name, spec.shape)
                shards.setdefault(name.split(".shard_")[0] + ".weight", []).append(name)
                continue
            if spec.init == "int64":
                t = self.get(name, spec.shape)
            elif name.endswith(".weight") and spec.quantizable:
                t = self.linear(name, spec.shape, spec.kept_nvfp4)
            else:
                t = self.get(name, spec.shape)
            keep = isinstance(t, nvfp4.Nvfp4Weight) or t.dtype == torch.int64
            if not keep:
                self._check_float(name, t)
            out[name] = t.to(device) if keep else t.to(device, dtype)
            if not keep:
                finite[name] = torch.isfinite(out[name]).all()  # read back once, below
            if progress:
                progress(n + 1, len(specs))
        for name, parts in shards.items():
            out[name] = self._ngram_table(name, parts, dtype, table_in_place_bytes, table_host,
                                          table_progress)
            self._check_hash_rows(name, out, out[name].shape[0])
        if not self.has("lm_head.weight") and getattr(a, "tie_word_embeddings", False):
            out["lm_head.weight"] = out["embed_tokens.weight"]  # tied: the embedding's weight
        else:
            head = self.linear("lm_head.weight", (a.vocab_size, a.hidden_size))
            out["lm_head.weight"] = self._check_float("lm_head.weight", head).to(device, dtype)
        finite["lm_head.weight"] = torch.isfinite(out["lm_head.weight"]).all()
        self._check_finite(finite)
        return out

    def _check_float(self, name: str, t: Tensor) -> Tensor:
        """Refuse integer storage where the format has float weights (an I16 tensor would load
        as numbers, not as weights)."""
        if not t.is_floating_point():
            full = self._full(name)
            raise ModelError(f"{self.files[full]}: tensor {full} is stored as "
                             f"{str(t.dtype).removeprefix('torch.')}, expected floating-point "
                             "weights: the file does not hold this model's weights")
        return t

    def _check_finite(self, finite: dict[str, Tensor]) -> None:
        """Refuse dense weights holding NaN or Inf (one flag per tensor, read back at once)."""
        flags = torch.stack(list(finite.values())).tolist()  # SYNC: once, at load
        bad = [name for name, ok in zip(finite, flags) if not ok]
        if bad:
            full = self._full(bad[0])
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise ModelError(f"{self.files[full]}: tensor {full}{more} holds NaN or Inf values "
                             f"(at the load dtype): the checkpoint is damaged; download it again")

    def get_shape(self, name: str, shape: tuple[int, ...]) -> None:
        """Check a tensor's shape from the file header, without reading it."""
        full = self._full(name)
        path = self.files.get(full)
        if path is None:
            raise ModelError(f"{self.folder}: tensor {full} missing from the checkpoint")
        got = tuple(self._open(path).get_slice(full).get_shape())
        if got != tuple(shape):
            raise ModelError(f"{path}: tensor {full} has shape {list(got)}, expected {list(shape)}")

    def check_shapes(self) -> None:
        """Every dense tensor and the first routed expert against config.json, from the file
        headers alone (no tensor is read): a config that does not describe these weights is an
        error here, not a report of the wrong sizes."""
        a = self.args
        for name, spec in self.family.dense_specs(a).items():
            self._check_shape(name, spec.shape, spec.quantizable)
        if self.has("lm_head.weight") or not getattr(a, "tie_word_embeddings", False):
            self._check_shape("lm_head.weight", (a.vocab_size, a.hidden_size), True)
        stacked = "layers.0.mlp.experts.gate_up_proj"
        if self.format in FLOAT_EXPERTS and self.has(stacked):
            E, I, H = a.num_experts, a.moe_intermediate_size, a.hidden_size
            self._check_shape(stacked, (E, 2 * I, H))
            self._check_shape("layers.0.mlp.experts.down_proj", (E, H, I))
        else:
            for proj, shape in self.family.expert_specs(a).items():
                self._check_shape(self.family.expert_name(0, 0, proj) + ".weight", shape, True)

    def _check_shape(self, name: str, shape: tuple[int, ...], nvfp4_ok: bool = False) -> None:
        """The header shape of `name`; with nvfp4_ok, NVFP4 storage (packed [N, K/2]) counts."""
        if nvfp4_ok:
            base = name[: -len(".weight")]
            for dialect in nvfp4.DIALECTS:
                names = nvfp4.tensor_names(dialect, base)
                if self.has(names["packed"]) and self.has(names["block_scale"]) and (
                        dialect != nvfp4.MODELOPT or self.has(names["global"])):
                    name, shape = names["packed"], (shape[0], shape[1] // 2)
                    break
        full = self._full(name)
        path = self.files.get(full)
        if path is None:
            raise ModelError(f"{self.folder}: tensor {full} missing from the checkpoint; "
                             "config.json does not describe these weights")
        got = tuple(self._open(path).get_slice(full).get_shape())
        if got != tuple(shape):
            raise ModelError(f"{path}: tensor {full} has shape {list(got)}, config.json implies "
                             f"{list(shape)}: config.json does not describe these weights")

    def _ngram_table(self, name: str, parts: list[str], dtype: torch.dtype, in_place_bytes: int,
                     host: bool = False, progress: Callable[[int, int], None] | None = None
                     ) -> Tensor | NGramTable | HostTable:
        """The n-gram table (docs/model.md section 7.4): fp8 times its scalar scale, or float.
        Over in_place_bytes at dtype: kept in its stored dtype (HostTable with host, else
        NGramTable); otherwise dequantized to dtype and concatenated (CPU)."""
        scale_name = name[: -len(".weight")] + ".weight_scale"
        # an fp32 value (the multiply in ple_gather.dequantize is fp32)
        scale = float(self.get(scale_name).float()) if self.has(scale_name) else None
        rows = sum(self._open(self.files[self._full(p)]).get_slice(self._full(p)).get_shape()[0]
                   for p in parts)
        width = self._open(self.files[self._full(parts[0])]).get_slice(
            self._full(parts[0])).get_shape()[1]
        if rows * width * torch.empty((), dtype=dtype).element_size() > in_place_bytes:
            files = [(self.files[self._full(p)], self._full(p)) for p in parts]
            if host:
                return load_host_table(files, scale, dtype, progress)
            return NGramTable(files, scale, dtype)
        return torch.cat([ple_gather.dequantize(self.get(p), scale, dtype) for p in parts])

    def _check_hash_rows(self, name: str, dense: dict[str, Tensor], num_rows: int) -> None:
        """Every row the hash can address (offset_j + [0, P_j), section 7.1) lies in the table:
        the gather kernel reads host memory at those rows unchecked."""
        base = name[: -len("ngram_embedding.weight")]
        primes = dense[base + "ngram_heads_vocab_sizes"]
        offsets = dense[base + "ngram_heads_offsets"]
        lo, hi = int(offsets.min()), int((offsets + primes).max())
        if int(primes.min()) < 1 or lo < 0 or hi > num_rows:
            raise ModelError(f"{self.folder}: {base}ngram_heads_vocab_sizes/offsets address rows "
                             f"[{lo}, {hi}) outside the n-gram table's {num_rows} rows")

    # ===== routed experts =====
    def expert_rows(self, layer: int, layout: RowLayout) -> Tensor:
        """All routed experts of `layer` as packed rows [E, R] uint8."""
        a = self.args
        rows = torch.empty(a.num_experts, layout.nbytes, dtype=torch.uint8)
        stacked = f"layers.{layer}.mlp.experts.gate_up_proj"
        if self.format in FLOAT_EXPERTS and self.has(stacked):
            gu = self.get(stacked, (a.num_experts, 2 * a.moe_intermediate_size, a.hidden_size))
            dn = self.get(f"layers.{layer}.mlp.experts.down_proj",
                          (a.num_experts, a.hidden_size, a.moe_intermediate_size))
            for e in range(a.num_experts):
                rows[e] = layout.pack({"gate_up": gu[e], "down": dn[e]})
            return rows
        for e in range(a.num_experts):
            rows[e] = layout.pack(self._expert_parts(layer, e))
        return rows

    def _expert_parts(self, layer: int, e: int) -> dict[str, Tensor]:
        shapes = self.family.expert_specs(self.args)
        if self.format in FLOAT_EXPERTS:
            w = {p: self.get(self.family.expert_name(layer, e, p) + ".weight", s)
                 for p, s in shapes.items()}
            return {"gate_up": torch.cat([w["gate_proj"], w["up_proj"]]), "down": w["down_proj"]}
        q = {}
        for p, (n, k) in shapes.items():
            base = self.family.expert_name(layer, e, p)
            packed, scale, g = nvfp4.from_checkpoint(self.format, self.get, base)
            if tuple(packed.shape) != (n, k // 2) or tuple(scale.shape) != (n, k // 16):
                raise ModelError(f"{self.folder}: NVFP4 tensor {base} has shape "
                                 f"{list(packed.shape)}, expected {[n, k // 2]}")
            q[p] = (packed, scale, g.float().reshape(()).expand(n))
        return {
            "gate_up": torch.cat([q["gate_proj"][0], q["up_proj"][0]]),
            "gate_up_scale": torch.cat([q["gate_proj"][1], q["up_proj"][1]]),
            "gate_up_global": torch.cat([q["gate_proj"][2], q["up_proj"][2]]),
            "down": q["down_proj"][0],
            "down_scale": q["down_proj"][1],
            "down_global": q["down_proj"][2],
        }

    def iter_expert_rows(self, layout: RowLayout) -> Iterator[tuple[int, Tensor]]:
        for layer in range(self.args.num_hidden_layers):
            yield layer, self.expert_rows(layer, layout)
