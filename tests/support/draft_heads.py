"""Draft heads in the published layouts, written as small random checkpoints beside a target (DeepSeek-V3
MTP, EAGLE-3), and a plain-torch reference that recomputes a head's greedy drafts from scratch."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


# ----------------------------------------------------------------------------- checkpoint builders
def _llama_config(target_dir) -> dict:
    return json.loads((Path(target_dir) / "config.json").read_text())


def _block(prefix: str, h: int, inter: int, heads: int, kv_heads: int, hd: int, g, in_features: int | None = None,
           scale: float = 1.0) -> dict:
    w = lambda *shape: torch.randn(*shape, generator=g) * scale / math.sqrt(shape[-1])  # noqa: E731
    n = lambda: 1.0 + 0.1 * torch.randn(h, generator=g)  # noqa: E731
    fin = in_features or h
    return {
        prefix + "input_layernorm.weight": n(), prefix + "post_attention_layernorm.weight": n(),
        prefix + "self_attn.q_proj.weight": w(heads * hd, fin), prefix + "self_attn.k_proj.weight": w(kv_heads * hd, fin),
        prefix + "self_attn.v_proj.weight": w(kv_heads * hd, fin), prefix + "self_attn.o_proj.weight": w(h, heads * hd),
        prefix + "mlp.gate_proj.weight": w(inter, h), prefix + "mlp.up_proj.weight": w(inter, h),
        prefix + "mlp.down_proj.weight": w(h, inter),
    }


def make_mtp_head(path, target_dir, seed: int = 0, shared: bool = True) -> Path:
    """DeepSeek-V3 MTP layout: model.layers.{N}.*, config = target's + num_nextn_predict_layers.
    `shared=False` omits embed_tokens and shared_head (the engine then uses the target's)."""
    cfg = _llama_config(target_dir)
    h, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    g = torch.Generator().manual_seed(seed)
    p = f"model.layers.{L}."
    t = _block(p, h, cfg["intermediate_size"], heads, kv, h // heads, g, scale=2.0)
    t[p + "enorm.weight"] = torch.ones(h)
    t[p + "hnorm.weight"] = torch.ones(h)
    t[p + "eh_proj.weight"] = torch.randn(h, 2 * h, generator=g) * 2 / math.sqrt(2 * h)
    if shared:
        target = load_file(str(Path(target_dir) / "model.safetensors"))
        t[p + "embed_tokens.weight"] = target["model.embed_tokens.weight"]
        t[p + "shared_head.norm.weight"] = target["model.norm.weight"]
        t[p + "shared_head.head.weight"] = target.get("lm_head.weight", target["model.embed_tokens.weight"])
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in t.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    return path


def make_eagle3_head(path, target_dir, seed: int = 0, draft_vocab: int | None = 200, aux_ids=(1, 2, 1)) -> Path:
    """EAGLE-3 authors' layout: fc, midlayer.*, norm, lm_head [draft_vocab, H], d2t, t2d."""
    cfg = _llama_config(target_dir)
    h, V = cfg["hidden_size"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dv = draft_vocab or V
    g = torch.Generator().manual_seed(seed)
    t = _block("midlayer.", h, cfg["intermediate_size"], heads, kv, h // heads, g, in_features=2 * h, scale=2.0)
    t["midlayer.hidden_norm.weight"] = torch.ones(h)
    t["fc.weight"] = torch.randn(h, 3 * h, generator=g) * 2 / math.sqrt(3 * h)
    t["norm.weight"] = torch.ones(h)
    t["lm_head.weight"] = torch.randn(dv, h, generator=g) * 4 / math.sqrt(h)
    used = torch.sort(torch.randperm(V, generator=g)[:dv]).values
    t["d2t"] = used - torch.arange(dv)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    t["t2d"] = t2d
    config = {k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                  "rms_norm_eps", "max_position_embeddings", "vocab_size", "hidden_act")}
    config.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                  draft_vocab_size=dv, target_hidden_size=h, tie_word_embeddings=False,
                  eagle_config={"eagle_aux_hidden_state_layer_ids": list(aux_ids), "use_aux_hidden_state": True})
    if "rope_parameters" in cfg:
        config["rope_parameters"] = cfg["rope_parameters"]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in t.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


# ------------------------------------------------------------------------------ plain-torch reference
def _rms(x, w, eps):
    x = x.float()
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin


class RefHead:
    """A head recomputed from scratch over a whole sequence: an explicit list of (position, k, v),
    each query attends to every key at a position <= its own."""

    def __init__(self, tensors: dict, prefix: str, cfg: dict, embed: torch.Tensor, kind: str):
        self.t, self.p, self.kind, self.embed = tensors, prefix, kind, embed
        self.heads, self.kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.hd = cfg["hidden_size"] // self.heads
        self.eps = cfg["rms_norm_eps"]
        self.theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
        self.keys: list = []  # (positions [n], k [n, kv, hd], v)

    def w(self, name):
        return self.t[self.p + name].float()

    def attention(self, x, pos):
        n = x.shape[0]
        q = (x @ self.w("self_attn.q_proj.weight").T).view(n, self.heads, self.hd)
        k = (x @ self.w("self_attn.k_proj.weight").T).view(n, self.kv, self.hd)
        v = (x @ self.w("self_attn.v_proj.weight").T).view(n, self.kv, self.hd)
        q, k = _rope(q, pos, self.theta), _rope(k, pos, self.theta)
        self.keys.append((pos, k, v))
        kp = torch.cat([p for p, _, _ in self.keys])
        K = torch.cat([k for _, k, _ in self.keys]).repeat_interleave(self.heads // self.kv, 1)
        V = torch.cat([v for _, _, v in self.keys]).repeat_interleave(self.heads // self.kv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, K) / math.sqrt(self.hd)
        scores = scores.masked_fill(kp[None, None, :] > pos[None, :, None], float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), V).reshape(n, -1)
        return out @ self.w("self_attn.o_proj.weight").T

    def mlp(self, x):
        gate, up = x @ self.w("mlp.gate_proj.weight").T, x @ self.w("mlp.up_proj.weight").T
        return (torch.nn.functional.silu(gate) * up) @ self.w("mlp.down_proj.weight").T

    def step(self, hidden, tokens, pos):
        """-> (state fed back, draft logits)."""
        e = self.embed[tokens]
        if self.kind == "mtp":
            x = torch.cat([_rms(e, self.w("enorm.weight"), self.eps), _rms(hidden, self.w("hnorm.weight"), self.eps)], -1)
            x = x @ self.w("eh_proj.weight").T
            x = x + self.attention(_rms(x, self.w("input_layernorm.weight"), self.eps), pos)
            x = x + self.mlp(_rms(x, self.w("post_attention_layernorm.weight"), self.eps))
            out = _rms(x, self.w("shared_head.norm.weight"), self.eps)
            return out, out @ self.w("shared_head.head.weight").T
        if hidden.shape[-1] != e.shape[-1]:
            hidden = hidden @ self.t["fc.weight"].float().T
        z = torch.cat([_rms(e, self.w("midlayer.input_layernorm.weight"), self.eps),
                       _rms(hidden, self.w("midlayer.hidden_norm.weight"), self.eps)], -1)
        self.p = "midlayer."
        x = hidden + self.attention(z, pos)
        x = x + self.mlp(_rms(x, self.w("post_attention_layernorm.weight"), self.eps))
        self.p = ""
        return x, _rms(x, self.t["norm.weight"].float(), self.eps) @ self.t["lm_head.weight"].float().T


def reference_drafts(hf, head_dir, kind: str, tokens: list[int], k: int) -> list[int]:
    """Greedy drafts after `tokens` (the last one sampled by the target, not yet run through it)."""
    cfg = json.loads((Path(head_dir) / "config.json").read_text())
    tensors = load_file(str(Path(head_dir) / "model.safetensors"))
    L = hf.config.num_hidden_layers
    prefix = f"model.layers.{L}." if kind == "mtp" else ""
    embed = hf.get_input_embeddings().weight.float()
    ids = torch.tensor([tokens[:-1]])
    captured = {}
    hooks = [layer.register_forward_hook(lambda m, a, o, i=i: captured.__setitem__(i, o[0] if isinstance(o, tuple) else o))
             for i, layer in enumerate(hf.model.layers)]
    with torch.no_grad():
        final = hf.model(ids).last_hidden_state[0].float()
    for h in hooks:
        h.remove()
    if kind == "mtp":
        first = final
        d2t = None
        tensors.setdefault(prefix + "shared_head.head.weight", hf.get_output_embeddings().weight)
        tensors.setdefault(prefix + "shared_head.norm.weight", hf.model.norm.weight)
    else:
        aux = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        first = torch.cat([captured[j - 1][0].float() for j in aux], -1)
        d2t = tensors["d2t"]
    ref = RefHead(tensors, prefix, cfg, embed, kind)
    with torch.no_grad():
        n = len(tokens)
        state, logits = ref.step(first, torch.tensor(tokens[1:]), torch.arange(n - 1))
        state, logits = state[-1:], logits[-1:]
        drafts = []
        for s in range(k):
            best = int(logits[0].argmax())
            drafts.append(best + int(d2t[best]) if d2t is not None else best)
            if s + 1 < k:
                state, logits = ref.step(state, torch.tensor(drafts[-1:]), torch.tensor([n - 1 + s]))
    return drafts
