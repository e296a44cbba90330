"""zoo.heads: MTP and EAGLE-3 math against references, and their checkpoint formats."""
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from zoo.distill import head_loss, unroll
from zoo.features import target_features
from zoo.heads.eagle3 import EAGLE3_WEIGHT_NAMES, Eagle3Head, default_aux_layer_ids, draft_vocab
from zoo.heads.mtp import MTP_MODULE_NAMES, MTPHead

H, V, L = 32, 96, 5


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=48, num_hidden_layers=L,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, attn_implementation="sdpa")
    return LlamaForCausalLM(config).eval()


def _heads(target):
    gen = torch.Generator().manual_seed(1)
    mtp = MTPHead.from_target(target, gen).eval()
    counts = torch.arange(V, 0, -1)
    d2t, t2d = draft_vocab(counts, 40, always=(V - 1,))
    eagle3 = Eagle3Head.from_target(target, d2t, t2d, default_aux_layer_ids(L), gen).eval()
    with torch.no_grad():  # non-trivial norms, so that a swapped norm would show
        for head in (mtp, eagle3):
            for name, p in head.named_parameters():
                if name.endswith("norm.weight") and not name.startswith("shared_head"):
                    p.uniform_(0.5, 1.5, generator=gen)
    return mtp, eagle3


def test_mtp_block_is_a_standard_llama_decoder_layer(target):
    """The MTP block must be exactly HF's LlamaDecoderLayer, so an engine can reuse its own layer."""
    mtp, _ = _heads(target)
    layer = LlamaDecoderLayer(target.config, layer_idx=0).eval()
    layer.load_state_dict({k: v for k, v in mtp.state_dict().items()
                           if k.split(".")[0] in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")})
    x = torch.randn(2, 7, H)
    pos = torch.arange(7).expand(2, 7)
    want = layer(x, position_embeddings=LlamaRotaryEmbedding(target.config)(x, pos))
    want = want[0] if isinstance(want, tuple) else want
    got = x + mtp.self_attn(mtp.input_layernorm(x), pos, [])
    got = got + mtp.mlp(mtp.post_attention_layernorm(got))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ---- reference: the draft chain at inference time, one token at a time with a plain KV list ----

def _rope(x, pos, theta=10000.0):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = pos * inv
    cos, sin = torch.cat([ang, ang]).cos(), torch.cat([ang, ang]).sin()
    return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin


def _ref_step(head, hidden, token, pos, kv):
    """One position of one draft step; kv is the list of (k, v) [heads, dim] this token may see."""
    emb = head.embed_tokens(token) if head.kind == "mtp" else head.embed(token)
    if head.kind == "mtp":
        x = head.eh_proj(torch.cat([head.enorm(emb), head.hnorm(hidden)]))
        attn_in, residual, attn, layer = head.input_layernorm(x), x, head.self_attn, head
    else:
        g = head.fc(hidden) if hidden.shape[-1] != H else hidden
        layer = head.midlayer
        attn_in = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(g)])
        residual, attn = g, layer.self_attn
    n, nkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q = _rope(attn.q_proj(attn_in).view(n, d), pos)
    k = _rope(attn.k_proj(attn_in).view(nkv, d), pos)
    v = attn.v_proj(attn_in).view(nkv, d)
    kv = kv + [(k, v)]
    keys = torch.stack([k for k, _ in kv], 1)  # [kv_heads, len, d]
    vals = torch.stack([v for _, v in kv], 1)
    group = n // nkv
    out = torch.stack([torch.softmax(keys[h // group] @ q[h] / d**0.5, -1) @ vals[h // group] for h in range(n)])
    y = residual + attn.o_proj(out.reshape(-1))
    y = y + layer.mlp(layer.post_attention_layernorm(y))
    if head.kind == "mtp":
        out_h = head.shared_head.norm(y)
        return out_h, head.shared_head.head(out_h), (k, v)
    return y, head.lm_head(head.norm(y)), (k, v)


@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_parallel_training_time_test_equals_sequential_drafting(target, kind):
    mtp, eagle3 = _heads(target)
    head = mtp if kind == "mtp" else eagle3
    ids = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(3))
    features = target_features(target, ids, eagle3.aux_layer_ids)
    depth = 3
    with torch.no_grad():
        parallel = unroll(head, features, ids, depth)
        first = head.first_hidden(features)[0]
        prefix_kv = []  # step-0 keys of the accepted prefix, built as an engine would
        for i in range(ids.shape[1] - 1):
            _, logits, kv = _ref_step(head, first[i], ids[0, i + 1], i, prefix_kv)
            torch.testing.assert_close(parallel[0][0, i], logits, atol=1e-5, rtol=1e-4)
            chain_kv, hidden = [], _ref_step(head, first[i], ids[0, i + 1], i, prefix_kv)[0]
            prefix_kv = prefix_kv + [kv]
            for step in range(1, depth):
                if i + 1 + step >= ids.shape[1]:
                    break
                hidden, logits, ckv = _ref_step(head, hidden, ids[0, i + 1 + step], i + step, prefix_kv + chain_kv)
                chain_kv.append(ckv)
                torch.testing.assert_close(parallel[step][0, i], logits, atol=1e-5, rtol=1e-4)


def test_features_follow_vllm_capture_convention(target):
    ids = torch.randint(0, V, (2, 6))
    out = target(input_ids=ids, output_hidden_states=True)
    features = target_features(target, ids, [1, 2, 4])
    want = torch.cat([out.hidden_states[j] for j in (1, 2, 4)], -1)  # hidden_states[j] = output of layer j-1
    torch.testing.assert_close(features["aux_hidden"], want)
    torch.testing.assert_close(features["last_hidden"], out.hidden_states[-1])  # after the final norm
    torch.testing.assert_close(features["logits"], out.logits)


def test_mtp_checkpoint_layout(target, tmp_path):
    mtp, _ = _heads(target)
    mtp.save(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    assert set(state) == {f"model.layers.{L}.{name}" for name in MTP_MODULE_NAMES}
    p = f"model.layers.{L}."
    assert state[p + "eh_proj.weight"].shape == (H, 2 * H)
    assert state[p + "shared_head.head.weight"].shape == (V, H)
    assert torch.equal(state[p + "embed_tokens.weight"], target.model.embed_tokens.weight)
    assert torch.equal(state[p + "shared_head.norm.weight"], target.model.norm.weight)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["num_hidden_layers"] == L
    assert config["hidden_size"] == H and config["num_key_value_heads"] == 2
    reloaded = MTPHead.load(tmp_path)
    ids = torch.randint(0, V, (1, 5))
    features = target_features(target, ids)
    with torch.no_grad():
        torch.testing.assert_close(unroll(reloaded, features, ids, 2)[1], unroll(mtp, features, ids, 2)[1])


def test_eagle3_checkpoint_layout(target, tmp_path):
    _, eagle3 = _heads(target)
    eagle3.save(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    assert set(state) == set(EAGLE3_WEIGHT_NAMES)
    assert state["fc.weight"].shape == (H, 3 * H)
    assert state["midlayer.self_attn.q_proj.weight"].shape == (4 * 8, 2 * H)
    assert state["midlayer.self_attn.k_proj.weight"].shape == (2 * 8, 2 * H)
    assert state["lm_head.weight"].shape == (40, H)
    d2t, t2d = state["d2t"], state["t2d"]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and t2d.shape == (V,)
    assert int(t2d.sum()) == 40 and t2d[torch.arange(40) + d2t].all()
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == 40 and config["vocab_size"] == V and config["target_hidden_size"] == H
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == default_aux_layer_ids(L)
    reloaded = Eagle3Head.load(tmp_path, target.get_input_embeddings())
    ids = torch.randint(0, V, (1, 5))
    features = target_features(target, ids, eagle3.aux_layer_ids)
    with torch.no_grad():
        torch.testing.assert_close(unroll(reloaded, features, ids, 2)[1], unroll(eagle3, features, ids, 2)[1])


def test_draft_vocab_keeps_frequent_and_forced_tokens():
    counts = torch.tensor([5, 0, 9, 9, 1, 7])
    d2t, t2d = draft_vocab(counts, 3, always=(1,))
    assert t2d.tolist() == [False, True, True, True, False, False]  # forced 1, then 2 and 3 (ties -> lower id)
    assert (torch.arange(3) + d2t).tolist() == [1, 2, 3]
    assert default_aux_layer_ids(32) == [2, 16, 29] and default_aux_layer_ids(8) == [2, 4, 5]
    assert default_aux_layer_ids(6) == [1, 3, 5] and default_aux_layer_ids(4) == [1, 2, 3]
    with pytest.raises(ValueError):
        default_aux_layer_ids(3)


@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_training_reduces_head_loss(target, kind):
    """A few optimizer steps on one batch must lower the distillation loss (gradients flow)."""
    mtp, eagle3 = _heads(target)
    head = (mtp if kind == "mtp" else eagle3).train()
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(5))
    real = torch.ones_like(ids, dtype=torch.float32)
    features = target_features(target, ids, eagle3.aux_layer_ids)
    probs = torch.softmax(features["logits"] * 30, -1)  # a peaked teacher leaves room to learn
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    first = None
    for _ in range(30):
        loss = head_loss(head, features, probs, ids, real, 2)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first * 0.9
    if kind == "mtp":  # shared weights stay the target's
        assert torch.equal(head.shared_head.head.weight, target.lm_head.weight)


@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_hard_labels_are_the_targets_argmax_in_the_heads_vocabulary(target, kind):
    """hard=True is cross-entropy against the target's argmax at the predicted position, mapped to
    the draft vocabulary for EAGLE-3 (positions whose argmax it cannot express do not count)."""
    mtp, eagle3 = _heads(target)
    head = mtp if kind == "mtp" else eagle3
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(7))
    weight = torch.rand(2, 12, generator=torch.Generator().manual_seed(8))
    features = target_features(target, ids, eagle3.aux_layer_ids)
    probs = torch.softmax(features["logits"], -1)
    logits = unroll(head, features, ids, 1)[0]
    label, w = probs.argmax(-1)[:, 1:-1], weight[:, 2:]  # index i predicts token i+2, as the target at i+1
    if kind == "eagle3":
        draft_ids = torch.arange(head.d2t.numel()) + head.d2t
        w = w * head.t2d[label]
        label = torch.searchsorted(draft_ids, label).clamp(max=draft_ids.numel() - 1)
    nll = torch.nn.functional.cross_entropy(logits[:, :-2].flatten(0, 1), label.flatten(), reduction="none")
    want = (nll * w.flatten()).sum() / w.sum()
    got = head_loss(head, features, probs, ids, weight, 1, hard=True)
    torch.testing.assert_close(got, want)
