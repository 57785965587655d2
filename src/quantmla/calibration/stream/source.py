"""The source checkpoint of a streamed calibration: a (sharded, possibly block-FP8) safetensors
checkpoint read tensor by tensor (:class:`ShardedCheckpoint`), and the family's own model class built
on the meta device whose modules get real tensors only while they are used (:class:`Skeleton`)."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import re

import torch

from quantmla.calibration.stream.files import _FP8, _ST_DTYPES, INDEX_NAME, read_safetensors_header
from quantmla.calibration.stream.memory import WeightMeter, _tensor_bytes, trim_heap
from quantmla.errors import QuantMLAError
from quantmla.model.spec import MLASpec, is_mla_attention, spec_from_model

_LAYER_RE = re.compile(r"^(?P<prefix>(?:.+\.)?)layers\.(?P<idx>\d+)\.(?P<rest>.+)$")


def _text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


class ShardedCheckpoint:
    """Read access, tensor by tensor, to a (sharded) safetensors checkpoint directory."""

    def __init__(self, path: str):
        self.path = os.path.abspath(os.fspath(path))
        cfg_file = os.path.join(self.path, "config.json")
        if not os.path.isfile(cfg_file):
            raise FileNotFoundError(f"{self.path!r} is not a checkpoint directory: no config.json found there")
        with open(cfg_file) as f:
            self.config_dict = json.load(f)
        from transformers import AutoConfig

        self.config = AutoConfig.from_pretrained(self.path)
        idx = os.path.join(self.path, INDEX_NAME)
        single = os.path.join(self.path, "model.safetensors")
        if os.path.isfile(idx):
            with open(idx) as f:
                self.weight_map: dict[str, str] = json.load(f)["weight_map"]
        elif os.path.isfile(single):
            self.weight_map = {k: "model.safetensors" for k in read_safetensors_header(single)}
        else:
            raise FileNotFoundError(
                f"{self.path} has neither {INDEX_NAME} nor model.safetensors: layer streaming reads safetensors "
                "checkpoints (convert .bin checkpoints with save_pretrained(safe_serialization=True))"
            )
        self._headers: dict[str, dict] = {}
        tc = _text_config(self.config)
        self.num_layers = int(tc.num_hidden_layers)
        by_prefix: dict[str, int] = {}
        for name in self.weight_map:
            m = _LAYER_RE.match(name)
            if m:
                by_prefix[m["prefix"]] = by_prefix.get(m["prefix"], 0) + 1
        if not by_prefix:
            raise QuantMLAError(f"{self.path}: no tensor is named '<prefix>layers.<i>.*'; cannot stream decoder layers")
        self.layer_prefix = max(by_prefix, key=by_prefix.get) + "layers."  # e.g. "model.layers."
        self._layers: dict[int, list[str]] = {}
        self._nonlayer: list[str] = []
        for name in sorted(self.weight_map):
            if name.startswith(self.layer_prefix):
                i = int(name[len(self.layer_prefix) :].split(".", 1)[0])
                self._layers.setdefault(i, []).append(name)
            else:
                self._nonlayer.append(name)
        qc = self.config_dict.get("quantization_config") or {}
        self.fp8_block = tuple(qc.get("weight_block_size") or (128, 128))

    # -- names -----------------------------------------------------------------------------------
    @property
    def other(self) -> list[str]:
        """Tensors outside the decoder stack (embeddings, final norm, head)."""
        return list(self._nonlayer)

    def layer_indices(self) -> list[int]:
        return sorted(self._layers)

    def layer_names(self, i: int) -> list[str]:
        return list(self._layers.get(i, []))

    def layer_key(self, i: int) -> str:
        return f"{self.layer_prefix}{i}."

    def index_digest(self) -> str:
        return hashlib.sha256(json.dumps(self.weight_map, sort_keys=True).encode()).hexdigest()

    def weights_digest(self, sample: int = 1 << 20) -> str:
        """What a resumed run checks the source against beyond its names: config.json, and each shard's size and the
        sha256 of its first and last `sample` bytes (new weights under the same names change them; no full read)."""
        h = hashlib.sha256(json.dumps(self.config_dict, sort_keys=True, default=str).encode())
        for file in sorted(set(self.weight_map.values())):
            path = os.path.join(self.path, file)
            size = os.path.getsize(path)
            h.update(f"{file}:{size}".encode())
            with open(path, "rb") as f:
                h.update(f.read(sample))
                f.seek(max(0, size - sample))
                h.update(f.read(sample))
        return h.hexdigest()

    # -- headers ---------------------------------------------------------------------------------
    def _header(self, file: str) -> dict:
        if file not in self._headers:
            self._headers[file] = read_safetensors_header(os.path.join(self.path, file))
        return self._headers[file]

    def meta(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        h = self._header(self.weight_map[name])[name]
        if h["dtype"] not in _ST_DTYPES:
            raise QuantMLAError(f"{name}: unsupported safetensors dtype {h['dtype']}")
        return _ST_DTYPES[h["dtype"]], tuple(h["shape"])

    def nbytes(self, name: str) -> int:
        b, e = self._header(self.weight_map[name])[name]["data_offsets"]
        return e - b

    # -- FP8 -------------------------------------------------------------------------------------
    def is_fp8_weight(self, name: str) -> bool:
        return self.meta(name)[0] in _FP8 and (name + "_scale_inv") in self.weight_map

    def is_fp8_scale(self, name: str) -> bool:
        return name.endswith("_scale_inv") and name[: -len("_scale_inv")] in self.weight_map and self.is_fp8_weight(name[: -len("_scale_inv")])

    @property
    def has_fp8(self) -> bool:
        return any(n.endswith("_scale_inv") for n in self.weight_map)

    # -- reading ---------------------------------------------------------------------------------
    def read_raw(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self.weight_map:
            raise KeyError(f"{name} is not in {self.path}")
        with safe_open(os.path.join(self.path, self.weight_map[name]), framework="pt") as f:
            return f.get_tensor(name)

    def read(self, name: str) -> torch.Tensor:
        """The tensor as the model computes with it: block-FP8 weights are dequantized to fp32."""
        t = self.read_raw(name)
        if t.dtype in _FP8 and (name + "_scale_inv") in self.weight_map:
            s = self.read_raw(name + "_scale_inv").float()
            bm, bn = self.fp8_block
            m, n = t.shape
            s = s.repeat_interleave(bm, 0)[:m].repeat_interleave(bn, 1)[:, :n]
            t = t.float() * s
        return t

    def output_dtype(self, name: str) -> torch.dtype:
        """dtype a tensor is written with: its own, except dequantized FP8 weights (bfloat16)."""
        dt, _ = self.meta(name)
        return torch.bfloat16 if self.is_fp8_weight(name) else dt


# a fused expert parameter of transformers' MoE modules (checkpoints store it per expert)
EXPERT_RE = re.compile(r"^(?P<pre>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


def _keep_fp32(model: torch.nn.Module) -> list[str]:
    pats = set(getattr(model, "_keep_in_fp32_modules", None) or ()) | set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    return sorted(pats)


class Skeleton:
    """The family's own model class built on the meta device (no memory), whose modules are given
    real tensors only while they are used."""

    def __init__(self, ckpt: ShardedCheckpoint, dtype: torch.dtype, device: torch.device,
                 attn_implementation: str | None, meter: WeightMeter):
        from transformers import AutoModel, AutoModelForCausalLM

        self.ckpt, self.dtype, self.device, self.meter = ckpt, dtype, torch.device(device), meter
        config = copy.deepcopy(ckpt.config)
        config.quantization_config = None if ckpt.has_fp8 else getattr(config, "quantization_config", None)
        if getattr(config, "quantization_config", None) is None and hasattr(config, "quantization_config"):
            del config.quantization_config
        kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
        with torch.device("meta"):
            try:
                self.model = AutoModelForCausalLM.from_config(config, **kw)
            except ValueError:
                self.model = AutoModel.from_config(config, **kw)
        self.config = self.model.config
        self.base = self.model.base_model
        if not hasattr(self.base, "layers"):
            raise QuantMLAError(f"{type(self.base).__name__} has no .layers: layer streaming needs a decoder-only layer stack")
        self.spec: MLASpec = spec_from_model(self.model)
        self.keep_fp32 = _keep_fp32(self.model)
        base_prefix = ckpt.layer_prefix[: -len("layers.")]  # "model."
        self.base_prefix = base_prefix
        self._restore_nonpersistent_buffers()
        self._kwargs: dict[tuple[int, int], list[dict]] = {}

    # -- non-layer modules -----------------------------------------------------------------------
    def _restore_nonpersistent_buffers(self) -> None:
        """Rotary inv_freq, embedding scales...: computed from the config in __init__, lost on meta.
        Rebuild the base model class at toy size on the CPU (no layers, vocab 8) and copy them."""
        cfg = copy.deepcopy(self.config)
        tc = _text_config(cfg)
        tc.num_hidden_layers = 0
        tc.vocab_size = 8
        for k in ("layer_types", "mlp_layer_types"):
            if isinstance(getattr(tc, k, None), list):
                setattr(tc, k, [])
        if getattr(tc, "pad_token_id", None) is not None and tc.pad_token_id >= 8:
            tc.pad_token_id = None
        aux = type(self.base)(tc)
        aux_bufs = dict(aux.named_buffers())
        for mname, mod in self.base.named_modules():
            if mname == "layers" or mname.startswith("layers."):
                continue
            for bname in list(mod._non_persistent_buffers_set):
                full = f"{mname}.{bname}" if mname else bname
                b = getattr(mod, bname, None)
                if b is None or b.device.type != "meta":
                    continue
                if full not in aux_bufs:
                    raise QuantMLAError(f"cannot rebuild the non-persistent buffer {full} of {type(mod).__name__}")
                mod._buffers[bname] = aux_bufs[full].to(self.device)

    def _cast(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and not any(p in name for p in self.keep_fp32):
            t = t.to(self.dtype)
        return t.to(self.device)

    def materialize(self, module: torch.nn.Module, prefix: str) -> int:
        """Give `module` (now on meta) its tensors from the checkpoint (names `prefix` + key).
        Merges per-expert checkpoint tensors into fused expert parameters. Returns bytes loaded."""
        sd = module.state_dict(keep_vars=True)
        loaded: dict[str, torch.Tensor] = {}
        missing = []
        for k, v in sd.items():
            full = prefix + k
            if full in self.ckpt.weight_map:
                loaded[k] = self._cast(full, self.ckpt.read(full))
                continue
            m = EXPERT_RE.match(k)
            if m and v.dim() == 3:
                loaded[k] = self._cast(full, self._merge_experts(prefix + m["pre"], m["proj"], v.shape[0]))
                continue
            if v.device.type != "meta":  # a real buffer the checkpoint does not store
                continue
            missing.append(full)
        if missing:
            raise QuantMLAError(
                f"{self.ckpt.path}: {len(missing)} tensors the model needs are not in the checkpoint, e.g. {missing[:4]}"
            )
        for k, t in loaded.items():
            if tuple(t.shape) != tuple(sd[k].shape):
                raise QuantMLAError(f"{prefix + k}: checkpoint shape {tuple(t.shape)}, model expects {tuple(sd[k].shape)}")
        module.load_state_dict(loaded, strict=False, assign=True)
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            if t.device.type == "meta":
                raise QuantMLAError(f"{prefix + name} stayed on the meta device after loading (not in the checkpoint)")
        n = sum(_tensor_bytes(t) for t in loaded.values())
        self.meter.add(n)
        return n

    def _merge_experts(self, pre: str, proj: str, num: int) -> torch.Tensor:
        """Per-expert checkpoint tensors (``experts.{e}.gate_proj.weight`` ...) -> the fused
        parameter of transformers' expert module (gate_up_proj [E, 2I, H], down_proj [E, H, I]),
        filled in place (peak: the fused tensor plus one expert's)."""
        parts = ("gate_proj", "up_proj") if proj == "gate_up_proj" else ("down_proj",)
        names = [[f"{pre}.{e}.{p}.weight" for p in parts] for e in range(num)]
        absent = [n for row in names for n in row if n not in self.ckpt.weight_map]
        if absent:
            raise QuantMLAError(f"{self.ckpt.path}: expert tensors missing, e.g. {absent[:2]}")
        out = None
        for e, row in enumerate(names):
            off = 0
            for n in row:
                t = self.ckpt.read(n)
                if out is None:
                    rows = t.shape[0] * len(parts)
                    out = torch.empty((num, rows, *t.shape[1:]), dtype=t.dtype)
                out[e, off : off + t.shape[0]] = t
                off += t.shape[0]
                del t
        return out

    def release(self, module: torch.nn.Module, nbytes: int) -> None:
        module.to_empty(device="meta")
        self.meter.sub(nbytes)
        trim_heap()

    # -- layer inputs ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _recording(self):
        """Swap the layer stack for recorders (identity layers that keep their inputs) and the final
        norm for the identity, so the base model's own forward yields every layer's call."""
        rec: list[dict] = [None] * len(self.base.layers)  # type: ignore[list-item]

        class Recorder(torch.nn.Module):
            def __init__(self, i):
                super().__init__()
                self.i = i

            def forward(self, hidden_states, *args, **kwargs):
                if args:
                    raise QuantMLAError("decoder layers called with positional arguments beyond hidden_states")
                rec[self.i] = {"hidden": hidden_states, "kwargs": kwargs}
                return hidden_states

        layers, norm = self.base.layers, getattr(self.base, "norm", None)
        self.base.layers = torch.nn.ModuleList([Recorder(i) for i in range(len(layers))])
        if norm is not None:
            self.base.norm = torch.nn.Identity()
        try:
            yield rec
        finally:
            self.base.layers = layers
            if norm is not None:
                self.base.norm = norm

    @torch.no_grad()
    def layer_kwargs(self, batch: int, seq: int, layer: int) -> dict:
        """Keyword arguments (mask, position ids, position embeddings...) the base model passes to
        decoder layer `layer` for a [batch, seq] input without padding (computed once per shape)."""
        key = (batch, seq)
        if key not in self._kwargs:
            dummy = torch.zeros(batch, seq, self.spec.hidden_size, dtype=self.dtype, device=self.device)
            with self._recording() as rec:
                self.base(inputs_embeds=dummy, use_cache=False)
            self._kwargs[key] = [r["kwargs"] for r in rec]
        return self._kwargs[key][layer]

    @torch.no_grad()
    def embed(self, ids: torch.Tensor, out: torch.Tensor, batch_size: int) -> None:
        """Hidden states entering layer 0 of calibration ids [N, S], written into out [N, S, hidden]."""
        emb = self.base.get_input_embeddings()
        emb_name = next(n for n, m in self.base.named_modules() if m is emb)
        n = self.materialize(emb, f"{self.base_prefix}{emb_name}.")
        try:
            for s in range(0, ids.shape[0], batch_size):
                with self._recording() as rec:
                    self.base(input_ids=ids[s : s + batch_size].to(self.device), use_cache=False)
                out[s : s + batch_size] = rec[0]["hidden"].to(out.device, out.dtype)
        finally:
            self.release(emb, n)

    def layer_module(self, i: int) -> torch.nn.Module:
        return self.base.layers[i]

    def materialize_attention(self, i: int) -> tuple[dict[int, tuple[str, torch.nn.Module]], int]:
        """Only the MLA attention modules of layer i (what a fitting rank needs); -> (mods, bytes)."""
        layer = self.layer_module(i)
        mods = self.mla_submodules(layer)
        n = 0
        for _, (rel, m) in mods.items():
            n += self.materialize(m, f"{self.ckpt.layer_key(i)}{rel}.")
        return mods, n

    def mla_submodules(self, layer: torch.nn.Module) -> dict[int, tuple[str, torch.nn.Module]]:
        """cache slot -> (name relative to the layer, attention module)."""
        out = {}
        for name, m in layer.named_modules():
            if is_mla_attention(m):
                out[int(m.layer_idx)] = (name, m)
        return dict(sorted(out.items()))
