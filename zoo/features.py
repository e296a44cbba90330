"""What a draft head reads from its target: one no-grad forward of an HF Llama-family model.

`target_features` returns, for input ids [B, T]:
- "logits"      [B, T, V]   the target's next-token logits (the distillation teacher),
- "last_hidden" [B, T, H]   the final hidden state after the model's final norm (MTP's input),
- "aux_hidden"  [B, T, 3H]  the outputs of the captured decoder layers, concatenated (EAGLE-3's
                            input); capture id j is the output of layer j-1, as in vLLM.
Layer outputs are taken with forward hooks, so this works for any model whose decoder layers live
in `model.model.layers` (Llama, Qwen2/3, Mistral, ...).
"""
from __future__ import annotations

import torch


def decoder_layers(model) -> torch.nn.ModuleList:
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__} has no model.layers: not a Llama-family causal LM")
    return layers


@torch.no_grad()
def target_features(model, input_ids: torch.Tensor, aux_layer_ids: list[int] | None = None) -> dict:
    layers = decoder_layers(model)
    captured: dict[int, torch.Tensor] = {}
    hooks = []
    for layer_id in aux_layer_ids or []:
        if not 1 <= layer_id <= len(layers):
            raise ValueError(f"aux layer id {layer_id} outside 1..{len(layers)}")

        def keep(module, args, output, layer_id=layer_id):
            captured[layer_id] = output[0] if isinstance(output, tuple) else output

        hooks.append(layers[layer_id - 1].register_forward_hook(keep))
    try:
        out = model(input_ids=input_ids, output_hidden_states=True, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    features = {"logits": out.logits.float(), "last_hidden": out.hidden_states[-1].float()}
    if aux_layer_ids:
        features["aux_hidden"] = torch.cat([captured[i].float() for i in aux_layer_ids], dim=-1)
    return features
