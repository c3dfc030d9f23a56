"""Tiny random transformers decoders for the registry's model suite and its compile tests
(not a test module): Llama (GQA 8/2), Qwen2 (q/k/v biases), Mistral (MQA, a window of 5),
GPT-2 (its layer-scaled scores) and Gemma 3 (a window of 5 on its sliding layers, global
ones between them), 2 layers of width 64, built from config classes (no downloads), and a
left-padded batch of 12 tokens: longer than every window."""

from __future__ import annotations

import torch

V = 101  # vocabulary
T = 12  # tokens of the batch: longer than the windows
WINDOW = 5
MODELS = ["llama", "qwen2", "mistral", "gpt2", "gemma3"]
_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=V, max_position_embeddings=64,
               pad_token_id=0, bos_token_id=1, eos_token_id=2)


def config(name: str, layers: int = 2):
    """(config, causal-LM class) of a tiny model."""
    import transformers as t

    common = dict(_COMMON, num_hidden_layers=layers)

    if name == "llama":
        return t.LlamaConfig(num_attention_heads=8, num_key_value_heads=2, **common), t.LlamaForCausalLM
    if name == "qwen2":
        return t.Qwen2Config(num_attention_heads=4, num_key_value_heads=2, **common), t.Qwen2ForCausalLM
    if name == "mistral":
        return (t.MistralConfig(num_attention_heads=4, num_key_value_heads=1, sliding_window=WINDOW, **common),
                t.MistralForCausalLM)
    if name == "gpt2":  # no dropout, so that training-mode forwards compare
        return (t.GPT2Config(n_embd=64, n_layer=layers, n_head=4, n_positions=64, vocab_size=V, resid_pdrop=0.0,
                             embd_pdrop=0.0, attn_pdrop=0.0, scale_attn_by_inverse_layer_idx=True, bos_token_id=1,
                             eos_token_id=2, pad_token_id=0), t.GPT2LMHeadModel)
    if name == "gemma3":  # the sliding layer first: a window, then a global layer
        return (t.Gemma3TextConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                                   layer_types=["sliding_attention", "full_attention"] * (layers // 2)
                                   + ["sliding_attention"] * (layers % 2), **common),
                t.Gemma3ForCausalLM)
    raise KeyError(name)


def build(name: str, impl: str = "multihead", layers: int = 2):
    """The tiny model in eval mode, random biases (a dropped one shows), on `impl`."""
    import multihead.interop.hf  # noqa: F401  (registers "multihead")

    cfg, cls = config(name, layers)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("bias") and "ln" not in pname and "norm" not in pname and p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    model.set_attn_implementation(impl)
    return model


def batch(B: int = 2, padded: bool = True) -> dict:
    """input_ids `(B, T)` and a 0/1 attention mask, the last row left-padded by 3."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (B, T), generator=g)
    keep = torch.ones(B, T, dtype=torch.long)
    if padded:
        keep[-1, :3] = 0
        ids[-1, :3] = 0
    return {"input_ids": ids, "attention_mask": keep}


def real_rows(t: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The rows of `t` `(B, T, ...)` at real (not padded) positions, concatenated."""
    return torch.cat([t[b, keep[b].bool()] for b in range(t.shape[0])])
