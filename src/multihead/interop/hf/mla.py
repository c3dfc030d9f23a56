"""MHA/GQA -> MLA for transformers Llama-family models (Llama, Mistral, Qwen2, Qwen3).

`transformers_to_mla(model, kv_rank, rope_dim=r)` (what `multihead.convert.to_mla` calls
for a transformers model; use that) returns a deep copy of the model whose attention
layers run on multihead's `LatentAttention`: keys and values of every head come from one
shared latent per token, and only that latent, R + r values per token and layer, sits in
transformers' cache; decoding takes the absorbed path (W_UK folded into the query, W_UV
after). `generate()` works as before.

Partial RoPE after MHA2MLA (Ji et al., 2025, "Towards Economical Inference: Enabling
DeepSeek's Multi-Head Latent Attention in Any Transformer-based LLMs"), the latent from a joint
truncated SVD of the nope keys and the values. transformers is never imported here: the model's
own modules are read and replaced.

Details: docs/mla.md, "How `transformers_to_mla` converts a layer".
"""

from __future__ import annotations

import copy
import math

import torch
from torch import Tensor, nn

from multihead.checks import is_int
from multihead.conversion_parts import ConversionReport, LayerConversion, relative_error
from multihead.interop.hf.calibrated import calibration_ids, layer_stats, turn_pairs
from multihead.interop.hf.layers import layer_inputs, sliding_window_of
from multihead.interop.hf.registry import hf_mask
from multihead.latent import LatentAttention
from multihead.rope import apply_rotary

__all__ = ["BASES", "FAMILY", "KEEP", "LatentLlamaAttention", "mla_layers", "rope_pair_scores", "transformers_to_mla"]

FAMILY = ("LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention")
KEEP = ("rotation", "norm", "high")
BASES = ("output", "weights", "activations")


def mla_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every attention layer `to_mla` converts."""
    return [(name, m) for name, m in model.named_modules() if type(m).__name__ in FAMILY]


def _sizes(attn: nn.Module) -> tuple[int, int, int, int, int]:
    """(H, Hkv, D, Dv, C) of one attention layer."""
    D = attn.head_dim
    C = attn.q_proj.in_features
    return attn.q_proj.out_features // D, attn.k_proj.out_features // D, D, attn.v_proj.out_features // \
        (attn.k_proj.out_features // D), C


def _norm(attn: nn.Module, name: str) -> nn.Module | None:
    return getattr(attn, name, None)


# ------------------------------------------------------------ which pairs stay rotary


def _pair_norms(t: Tensor) -> Tensor:
    """(..., D) in HF's half-split layout -> (..., D/2): the norm of each rotary pair (f, f + D/2)."""
    half = t.shape[-1] // 2
    return (t[..., :half].square() + t[..., half:].square()).sqrt()


def _weight_scores(attn: nn.Module) -> Tensor:
    """(Hkv, D/2) pair scores from the weights alone: sum over the group's query heads of
    ||W_q,h^(f)||_F ||W_k^(f)||_F (times the q/k norm's gains where there is one)."""
    H, Hkv, D, _, C = _sizes(attn)

    def norms(lin, n, norm):
        w = lin.weight.detach().double().view(n, D, C)
        row = w.norm(dim=-1)  # (n, D): each feature's norm under an isotropic input
        if norm is not None:  # RMSNorm(W x) = w * W x / rms(W x): each head at rms 1, times its gains
            row = row / (w.square().sum((1, 2)) / D).sqrt()[:, None] * norm.weight.detach().double().abs()
        return _pair_norms(row)  # (n, D/2)

    q = norms(attn.q_proj, H, _norm(attn, "q_norm")).view(Hkv, H // Hkv, D // 2).sum(1)  # (Hkv, D/2)
    return q * norms(attn.k_proj, Hkv, _norm(attn, "k_norm"))


def _activation_scores(attn: nn.Module, xs: list[Tensor]) -> Tensor:
    """(Hkv, D/2) pair scores from the layer's inputs: sum over the group's query heads of
    E_t ||q_h^(f)|| E_t ||k^(f)|| (after the q/k norms; RoPE does not change a pair's norm)."""
    H, Hkv, D, _, _ = _sizes(attn)
    qs, ks = [], []
    with torch.no_grad():
        for x in xs:
            x = x.reshape(-1, x.shape[-1])  # (tokens, C)
            q, k = attn.q_proj(x).view(-1, H, D), attn.k_proj(x).view(-1, Hkv, D)
            if _norm(attn, "q_norm") is not None:
                q, k = attn.q_norm(q), attn.k_norm(k)
            qs.append(_pair_norms(q.double()))
            ks.append(_pair_norms(k.double()))
    q, k = torch.cat(qs).mean(0), torch.cat(ks).mean(0)  # (H, D/2), (Hkv, D/2)
    return q.view(Hkv, H // Hkv, D // 2).sum(1) * k


def _layer_inputs(model: nn.Module, layers: list[tuple[str, nn.Module]], calibration) -> dict[str, list[Tensor]]:
    """Each attention layer's input hidden states when the model reads `calibration`."""
    ids = calibration_ids(calibration, fn="rope_pair_scores", vocab=model.get_input_embeddings().num_embeddings)
    seen = layer_inputs(model, [m for _, m in layers], ids)
    return {name: xs for (name, _), xs in zip(layers, seen)}


def rope_pair_scores(model: nn.Module, *, calibration: Tensor | None = None) -> dict[str, Tensor]:
    """The "norm" choice's score of every rotary pair: layer name -> `(Hkv, D/2)` float64,
    pair f = features (f, f + D/2) of a head in transformers' half-split layout (f = 0 is
    the highest frequency). From `calibration` token ids run through `model`, or from the
    weights when None."""
    layers = mla_layers(model)
    if calibration is None:
        return {name: _weight_scores(m) for name, m in layers}
    inputs = _layer_inputs(model, layers, calibration)
    return {name: _activation_scores(m, inputs[name]) for name, m in layers}


def _rotation_scores(st) -> Tensor:
    """(Hkv, D/2) the "rotation" choice's score of every pair: what dropping its rotation
    costs, sum over the group's query heads of value_scale_h E||q_h^(f)||^2 E||k^(f)||^2
    (1 - |phasor_hf|^2) (calibrated.py: the score variance left once the rotation is
    replaced by its mean under the attention)."""
    H, Hkv, half = st.q2.shape[0], st.k2.shape[0], st.q2.shape[1] // 2
    q = (st.q2[:, :half] + st.q2[:, half:]) * st.value_scale[:, None]  # (H, D/2)
    q = q * (1 - st.phasor.abs().square()).clamp(min=0)
    k = st.k2[:, :half] + st.k2[:, half:]  # (Hkv, D/2)
    return q.view(Hkv, H // Hkv, half).sum(1) * k


def _kept_pairs(scores: Tensor | None, Hkv: int, D: int, k: int, keep: str) -> Tensor:
    """(Hkv, k) frequency indices kept rotary in each key/value head, ascending."""
    if keep == "high" or scores is None or k == D // 2:
        return torch.arange(k).expand(Hkv, k).clone()
    return scores.topk(k, dim=1).indices.sort(dim=1).values


# ------------------------------------------------------------------ the layer


class LatentLlamaAttention(nn.Module):
    """What `to_mla` puts in place of a Llama-family attention layer.

    Attributes:
        mla: the `LatentAttention` that holds the projections and attends (registered:
            its parameters are this layer's).
        rope_pairs: `(Hkv, k)` the frequency indices each key/value head keeps rotary.
        slot_freq: `(r/2,)` buffer, the frequency index of each pair of the RoPE key
            (cos/sin are read from the model's angles at these columns).
        pe_rows, nope_rows: `(r,)`, `(Hkv * (D - 2k),)` buffers, rows of the original k_proj
            that make the RoPE key and the nope keys.
        k_proj, v_proj, k_norm, latent_proj, q_gain: only for a layer with q/k norms (Qwen3),
            which computes its latent from the exact normalised keys (docs/mla.md).
    """

    def __init__(self, original: nn.Module, mla: LatentAttention, pairs: Tensor, slot_freq: Tensor,
                 pe_rows: Tensor, nope_rows: Tensor):
        super().__init__()
        self.mla = mla
        self.rope_pairs = pairs
        self.register_buffer("slot_freq", slot_freq, persistent=False)
        self.register_buffer("pe_rows", pe_rows, persistent=False)
        self.register_buffer("nope_rows", nope_rows, persistent=False)
        self.layer_idx = getattr(original, "layer_idx", None)
        self.config = getattr(original, "config", None)
        self.head_dim = original.head_dim
        self.is_causal = True
        self.k_proj = self.v_proj = self.k_norm = self.latent_proj = None
        self.q_gain = None
        self.q_norm_eps = 0.0
        self.train(original.training)

    def extra_repr(self) -> str:
        m = self.mla
        return (f"layer_idx={self.layer_idx}, kv_rank={m.kv_rank}, rope_dim={m.rope_dim}: caches "
                f"{m.kv_rank + m.rope_dim} values per token, decodes on the absorbed path")

    def _rotary(self, position_embeddings) -> tuple[Tensor, Tensor] | None:
        """transformers' (cos, sin), each `(B, T, D)` = cat(freqs, freqs), at the kept
        frequencies -> `(B, 1, T, r/2)` each."""
        if not self.mla.rope_dim:
            return None
        if position_embeddings is None:
            raise ValueError("LatentLlamaAttention needs the model's position_embeddings (cos, sin): call it "
                             "from its decoder layer")
        cos, sin = position_embeddings
        return cos[..., self.slot_freq][:, None], sin[..., self.slot_freq][:, None]

    def forward(self, hidden_states: Tensor, position_embeddings=None, attention_mask: Tensor | None = None,
                cache=None, past_key_values=None, **kwargs) -> tuple[Tensor, None]:
        """transformers' Llama attention signature: x `(B, T, C)` -> (out `(B, T, C)`, None)."""
        if self.training and float(getattr(self.config, "attention_dropout", 0.0) or 0.0) > 0:
            raise ValueError("the MLA layer has no attention dropout; set config.attention_dropout=0 to train it")
        cache = cache if cache is not None else past_key_values
        x = hidden_states
        T = x.shape[1]
        rotary = self._rotary(position_embeddings)
        mask = hf_mask(attention_mask, x.dtype)

        def store(latent: Tensor) -> Tensor:
            """This call's latents `(B, T, R + r)` -> every cached one `(B, S, R + r)`."""
            if cache is not None:
                # the latent as the "keys" of one head and zero-width "values", as interop.hf.use_latent_attention does
                keys, _ = cache.update(latent[:, None], latent[:, None, :, :0], self.layer_idx, kwargs=kwargs)
                latent = keys[:, 0]
            if mask is None and 1 < T < latent.shape[1]:  # a static cache's prefill: the slots after T are empty
                latent = latent[:, :T]
            return latent

        if self.k_norm is None:
            return self.mla.forward(x, mask=mask, rotary=rotary, store=store), None
        q_nope, q_pe = self.queries(x, rotary)
        latent = store(self.latents(x, rotary))
        m = self.mla
        attend = m.attend_absorbed if m.absorb_is_cheaper(T, latent.shape[1]) else m.attend_naive
        out, _ = attend(q_nope, q_pe, latent, mask)  # (B, H, T, Dv)
        return m.o_proj(out.transpose(1, 2).reshape(x.shape[0], T, -1)), None

    def queries(self, x: Tensor, rotary) -> tuple[Tensor, Tensor]:
        """A q-normed layer's queries: q_nope `(B, H, T, Dn)`, rotated q_pe `(B, H, T, r)`.

        The laid-out query [q_nope ; q_pe] holds each head's D features (and zeros), so
        the RMS over those D features is the original q_norm's."""
        m = self.mla
        B, T, _ = x.shape
        q = m.q_proj(x).view(B, T, m.n_heads, -1)  # (B, T, H, Dn + r)
        dtype = q.dtype
        q = q.float()
        q = q * torch.rsqrt(q.square().sum(-1, keepdim=True) / self.head_dim + self.q_norm_eps)
        q = (self.q_gain * q.to(dtype)).transpose(1, 2)  # (B, H, T, Dn + r); q_gain carries the scale ratio
        q_nope, q_pe = q.split([m.head_dim, m.rope_dim], dim=-1)
        if rotary is not None:
            q_pe = apply_rotary(q_pe, *rotary)
        return q_nope, q_pe

    def latents(self, x: Tensor, rotary) -> Tensor:
        """A k-normed layer's latents `(B, T, R + r)`: c = U_R^T [k_nope ; v] of the exact
        normalised keys, and the rotated RoPE key."""
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, T, -1, self.head_dim)).reshape(B, T, -1)  # (B, T, Hkv*D)
        v = self.v_proj(x)  # (B, T, Hkv*Dv)
        c = self.latent_proj(torch.cat([k[..., self.nope_rows], v], dim=-1))  # (B, T, R)
        k_pe = k[..., self.pe_rows]  # (B, T, r)
        if rotary is not None:
            k_pe = apply_rotary(k_pe[:, None], *rotary)[:, 0]
        return torch.cat([c, k_pe], dim=-1)


# ------------------------------------------------------------------ conversion


def _check(model: nn.Module, kv_rank, rope_dim, keep) -> list[tuple[str, nn.Module]]:
    name = type(model).__name__
    layers = mla_layers(model)
    if any(type(m).__name__.startswith("Gemma3") for m in model.modules()) and not layers:
        raise ValueError(
            f"to_mla: {name} is Gemma 3, which is not converted to MLA: it normalises every query and key head "
            "(QK-norm, RMSNorm with Gemma's 1 + w gains) before RoPE, so its keys are not a linear function of the "
            "input that one shared latent's down-projection could produce, and its layers alternate a sliding "
            "window with RoPE base 10,000 and global layers with base 1,000,000, which one decoupled RoPE key "
            "does not hold. valid: Llama, Mistral, Qwen2 models (Qwen3's QK-norm is kept exact by recomputing "
            "its normalised keys); Gemma 3's own cache is already one key/value head (MQA)")
    if not layers:
        raise TypeError(f"to_mla: {name} has no {', '.join(FAMILY)} layer; valid: Llama, Mistral, Qwen2, Qwen3 "
                        "models (a DeepSeek-V2/V3 model is MLA already: multihead.interop.hf.use_latent_attention)")
    if keep not in KEEP:
        raise ValueError(f"to_mla: keep must be one of {', '.join(KEEP)}; received {keep!r}")
    H, Hkv, D, Dv, C = _sizes(layers[0][1])
    for lname, m in layers:
        if _sizes(m)[:4] != (H, Hkv, D, Dv):
            raise ValueError(f"to_mla: layer {lname} has (H, Hkv, D, Dv) = {_sizes(m)[:4]}, the first layer "
                             f"{(H, Hkv, D, Dv)}; valid: a model whose layers share one geometry")
    valid = list(range(0, Hkv * D + 1, 2 * Hkv))
    if isinstance(rope_dim, bool) or not isinstance(rope_dim, int) or rope_dim not in valid:
        shown = valid if len(valid) <= 12 else valid[:5] + ["..."] + valid[-3:]
        raise ValueError(f"to_mla: rope_dim must be a multiple of 2 * Hkv = {2 * Hkv} in 0..{Hkv * D} (each of the "
                         f"{Hkv} key/value heads keeps rope_dim / {2 * Hkv} of its {D // 2} rotary pairs; "
                         f"{Hkv * D} = every pair, exact); received {rope_dim!r}; valid: "
                         f"{', '.join(map(str, shown))}")
    rows = Hkv * (D - rope_dim // Hkv) + Hkv * Dv
    m = layers[0][1]
    cols = C + (m.v_proj.bias is not None and _norm(m, "k_norm") is None)  # the value bias's column
    top = min(rows, cols)
    if not is_int(kv_rank) or not 1 <= kv_rank <= top:
        error = ValueError if is_int(kv_rank) else TypeError
        raise error(f"to_mla: kv_rank must be an int in 1..{top}, the rank of the stacked [W_k,nope ; W_v] "
                         f"({rows} rows: {Hkv} heads x ({D - rope_dim // Hkv} nope key + {Dv} value features), "
                         f"{cols} columns) at rope_dim={rope_dim}; received {kv_rank!r}"
                         + (f"; exact: rope_dim={Hkv * D}, kv_rank={Hkv * Dv}" if rope_dim != Hkv * D else ""))
    return layers


def _features(attn: nn.Module, xs: list[Tensor], m: Tensor, nope_rows: Tensor, qk_norm: bool) -> Tensor:
    """The layer's K/V features f = [k_nope ; v] `(N, rows)` float64 on its inputs `xs`: M [x ; 1]
    (the map the SVD factors), or for a k-normed layer the exact normalised keys and values."""
    x = torch.cat([t.reshape(-1, t.shape[-1]) for t in xs])  # (N, C)
    if not qk_norm:
        x = x.double()
        if m.shape[1] > x.shape[1]:
            x = torch.cat([x, x.new_ones(len(x), 1)], dim=1)  # (N, C + 1)
        return x @ m.T
    with torch.no_grad():
        k = attn.k_norm(attn.k_proj(x).view(len(x), -1, attn.head_dim)).reshape(len(x), -1)  # (N, Hkv*D)
        return torch.cat([k[:, nope_rows], attn.v_proj(x)], dim=1).double()


def _output_maps(attn: nn.Module, st, f: Tensor, q_nope: Tensor, R: int) -> tuple[Tensor, Tensor]:
    """The "output" basis: (proj `(R, rows)`, up `(rows, R)`), latent c = proj f, f ~ up c.

    The rank-R subspace is the top principal one of the features f = [k_nope ; v] `(N, rows)`
    measured in the metric of what the attention output sees: a key error dk of group j
    moves head h's score by scaling q_h . dk and its output by about value_scale_h times that,
    so the key block is sum_h value_scale_h scaling^2 E[q_h q_h^T] over the group's queries
    `q_nope` `(N, H, Dn)`; a value error dv moves the output by W_o,h dv, so the value block is
    sum_h W_o,h^T W_o,h. The up-projection is the least-squares one given c (the best in any
    metric, as it is unconstrained)."""
    H, Hkv, D, Dv, C = _sizes(attn)
    G, N = H // Hkv, len(f)
    scale2 = float(getattr(attn, "scaling", D ** -0.5)) ** 2
    wo = attn.o_proj.weight.detach().double().view(C, H, Dv).transpose(0, 1)  # (H, C, Dv)
    blocks = []
    for j in range(Hkv):
        qs = q_nope[:, j * G:(j + 1) * G]  # (N, G, Dn)
        blocks.append(torch.einsum("g,nga,ngb->ab", st.value_scale[j * G:(j + 1) * G], qs, qs) * scale2 / N)
    blocks += [torch.einsum("gca,gcb->ab", wo[j * G:(j + 1) * G], wo[j * G:(j + 1) * G]) for j in range(Hkv)]
    blocks = [b + 1e-9 * float(b.diagonal().mean().clamp(min=1e-30)) * torch.eye(len(b), dtype=b.dtype)
              for b in blocks]
    chol = torch.block_diag(*[torch.linalg.cholesky(b) for b in blocks])  # (rows, rows), metric = L L^T
    g = f @ chol  # (N, rows): ||g|| is the error in the metric
    _, vecs = torch.linalg.eigh(g.T @ g)  # ascending
    proj = (chol @ vecs.flip(1)[:, :R]).T  # (R, rows)
    c = f @ proj.T  # (N, R)
    up = torch.linalg.lstsq(c, f).solution.T  # (rows, R)
    return proj, up


class _Layout:
    """Where each query head's features go in the latent layer: `[nope (Dn) ; pe (r)]`.

    Slot s of the RoPE key is key head s // k at frequency pairs[s // k, s % k]; half-split:
    features s and s + r/2. `src[h]` names, for each of head h's Dn + r features, the source
    feature of its D (-1: a zero)."""

    def __init__(self, pairs: Tensor, H: int, Hkv: int, D: int, rope_dim: int):
        G, half, k = H // Hkv, D // 2, rope_dim // (2 * Hkv)
        r2 = rope_dim // 2
        self.H, self.rope_dim = H, rope_dim
        self.Dn_live = D - 2 * k
        # LatentAttention's head_dim is >= 1: a zero feature when every pair is rotary
        self.Dn = Dn = max(1, self.Dn_live)
        slot_head = torch.arange(Hkv).repeat_interleave(k)  # (r/2,)
        self.slot_freq = slot_freq = pairs.reshape(-1)  # (r/2,)
        pe_feat = torch.cat([slot_freq, slot_freq + half])  # (r,): the feature of its head
        self.pe_rows = torch.cat([slot_head, slot_head]) * D + pe_feat  # (r,) rows of k_proj
        self.nope = [[i for i in range(D) if i % half not in set(pairs[j].tolist())] for j in range(Hkv)]
        self.nope_rows = torch.tensor([j * D + i for j in range(Hkv) for i in self.nope[j]], dtype=torch.long)
        src = torch.full((H, Dn + rope_dim), -1, dtype=torch.long)
        for h in range(H):
            j = h // G
            src[h, :self.Dn_live] = torch.tensor(self.nope[j], dtype=torch.long)
            mine = (slot_head == j).nonzero().flatten()
            src[h, Dn + mine] = slot_freq[mine]
            src[h, Dn + r2 + mine] = slot_freq[mine] + half
        self.src, self.live = src, src >= 0  # (H, Dn + r)

    def __call__(self, t: Tensor) -> Tensor:
        """(H, D, ...) per-head query rows -> (H, Dn + r, ...) in the layout, zeros where none."""
        H, width, tail = self.H, self.Dn + self.rope_dim, [1] * (t.dim() - 2)
        out = t.gather(1, self.src.clamp(min=0).view(H, -1, *tail).expand(H, width, *t.shape[2:]))
        return out * self.live.view(H, -1, *tail).to(out.dtype)


def _kv_map(attn: nn.Module, nope_rows: Tensor, qk_norm: bool) -> Tensor:
    """M, the map `(rows, C [+1])` from x (and a bias column) to the features [k_nope ; v] the latent
    stores; for a k-normed layer, that of the exact normalised nope keys and the values (docs/mla.md)."""
    _, Hkv, D, _, C = _sizes(attn)
    wk = attn.k_proj.weight.detach().double()  # (Hkv*D, C)
    wv = attn.v_proj.weight.detach().double()  # (Hkv*Dv, C)
    if qk_norm:
        gain = attn.k_norm.weight.detach().double()  # (D,)
        s = (wk.view(Hkv, D, C).square().sum((1, 2)) / D).sqrt()  # (Hkv,): head j's RMS, isotropic input
        return torch.cat([(wk.view(Hkv, D, C) * (gain[None, :, None] / s[:, None, None])).reshape(-1, C)[nope_rows],
                          wv])  # (rows, C)
    m = torch.cat([wk[nope_rows], wv])  # (rows, C): the nope key bias is a shift softmax ignores
    bv = attn.v_proj.bias
    if bv is not None:
        col = torch.cat([torch.zeros(len(nope_rows), dtype=torch.float64), bv.detach().double()])
        m = torch.cat([m, col[:, None]], dim=1)  # (rows, C + 1)
    return m


def _query_map(attn: nn.Module, pairs: Tensor, basis: str, qk_norm: bool, stats) -> tuple[Tensor, Tensor | None]:
    """The query weight `(H, D, C)` and bias `(H, D, 1)` float64; under the "output" basis the dropped
    pairs' queries take their mean rotation: q' . k = E[q . R(theta (i - j)) k] under the attention."""
    H, Hkv, D, _, C = _sizes(attn)
    wq = attn.q_proj.weight.detach().double().view(H, D, C)
    bq = None if attn.q_proj.bias is None else attn.q_proj.bias.detach().double().view(H, D, 1)
    if basis == "output" and not qk_norm:
        dropped = torch.ones(H, D // 2, dtype=torch.bool)
        for h in range(H):
            dropped[h, pairs[h // (H // Hkv)]] = False
        a = torch.where(dropped, stats.phasor, torch.ones_like(stats.phasor)).to(wq.device)  # (H, D/2)
        wq = turn_pairs(wq, a)  # (calibrated.py)
        bq = None if bq is None else turn_pairs(bq, a)
    return wq, bq


def _latent_basis(attn: nn.Module, basis: str, m: Tensor, f: Tensor | None, wq: Tensor, bq: Tensor | None,
                  lay: _Layout, qk_norm: bool, stats, R: int) -> tuple[Tensor, Tensor]:
    """(proj `(R, rows)`, up `(rows, R)`): the latent is c = proj f and f ~ up c, by `basis`."""
    if basis == "output":
        H, Hkv, D, _, C = _sizes(attn)
        with torch.no_grad():
            x = stats.x.to(attn.q_proj.weight.dtype)
            q = (x.double() @ wq.reshape(H * D, C).T + (0 if bq is None else bq.reshape(-1))).view(-1, H, D)
            if qk_norm:
                q = attn.q_norm(attn.q_proj(x).view(len(x), H, D)).double()
        q_nope = torch.stack([q[:, h, lay.nope[h // (H // Hkv)]] for h in range(H)], dim=1)  # (N, H, Dn_live)
        return _output_maps(attn, stats, f, q_nope, R)
    if basis == "activations":  # the top principal directions of the features on the calibration tokens
        _, vecs = torch.linalg.eigh(f.T @ f)  # ascending
        up = vecs.flip(1)[:, :R]
        return up.T, up
    U, _, _ = torch.linalg.svd(m, full_matrices=False)  # the top left singular vectors of the map
    up = U[:, :R]  # (rows, R), orthonormal columns
    return up.T, up


def _latent_attention(attn: nn.Module, lay: _Layout, R: int, backend: str, latent_bias: bool) -> LatentAttention:
    """An empty `LatentAttention` shaped like `attn`'s conversion, on its device and dtype."""
    H, _, D, Dv, C = _sizes(attn)
    has_bias = any(getattr(attn, n).bias is not None for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    mla = LatentAttention(C, H, R, head_dim=lay.Dn, rope_dim=lay.rope_dim, v_head_dim=Dv, causal=True,
                          backend=backend, latent_norm=False, bias=has_bias, rope_interleaved=False,
                          rope_base=float(getattr(attn.config, "rope_theta", None) or 10000.0),
                          sliding_window=sliding_window_of(attn))
    if attn.q_proj.bias is None:
        mla.q_proj.register_parameter("bias", None)
    if attn.o_proj.bias is None:
        mla.o_proj.register_parameter("bias", None)
    if not latent_bias:
        mla.kv_a_proj.register_parameter("bias", None)
    w = attn.q_proj.weight
    return mla.to(device=w.device, dtype=w.dtype)


def _convert_layer(attn: nn.Module, kv_rank: int, rope_dim: int, pairs: Tensor, backend: str,
                   xs: list[Tensor] | None = None, basis: str = "weights", stats=None
                   ) -> tuple[LatentLlamaAttention, float, float | None]:
    H, Hkv, D, Dv, C = _sizes(attn)
    G, R = H // Hkv, kv_rank
    lay = _Layout(pairs, H, Hkv, D, rope_dim)
    qk_norm = _norm(attn, "k_norm") is not None
    bk = attn.k_proj.bias
    m = _kv_map(attn, lay.nope_rows, qk_norm)  # (rows, C [+1])
    f = None if xs is None else _features(attn, xs, m, lay.nope_rows, qk_norm)  # (N, rows)
    wq, bq = _query_map(attn, pairs, basis, qk_norm, stats)
    proj, up = _latent_basis(attn, basis, m, f, wq, bq, lay, qk_norm, stats, R)
    nk = len(lay.nope_rows)
    up_k = up[:nk].view(Hkv, lay.Dn_live, R)
    up_k = torch.cat([up_k, up_k.new_zeros(Hkv, lay.Dn - lay.Dn_live, R)], dim=1)  # (Hkv, Dn, R)
    up_v = up[nk:].view(Hkv, Dv, R)
    up_kv = torch.cat([up_k, up_v], dim=1).repeat_interleave(G, dim=0)  # (H, Dn + Dv, R)

    w = attn.q_proj.weight
    ratio = float(getattr(attn, "scaling", D ** -0.5)) * math.sqrt(lay.Dn + rope_dim)  # to LatentAttention's scale
    latent_bias = not qk_norm and (attn.v_proj.bias is not None or (bk is not None and rope_dim))
    mla = _latent_attention(attn, lay, R, backend, latent_bias)
    q_ratio = 1.0 if qk_norm else ratio  # a q-normed layer's scale rides on its gains (the norm undoes a weight)
    with torch.no_grad():
        mla.q_proj.weight.copy_(lay(wq).reshape(-1, C) * q_ratio)
        if bq is not None:
            mla.q_proj.bias.copy_(lay(bq).reshape(-1) * q_ratio)
        mla.o_proj.load_state_dict(attn.o_proj.state_dict())
        mla.kv_b_proj.weight.copy_(up_kv.reshape(-1, R))
        if not qk_norm:
            down = proj @ m  # (R, C [+1])
            wk = attn.k_proj.weight.detach().double()  # (Hkv*D, C)
            mla.kv_a_proj.weight.copy_(torch.cat([down[:, :C], wk[lay.pe_rows]]))  # (R + r, C)
            if latent_bias:
                b_lat = down[:, C] if m.shape[1] > C else torch.zeros(R, dtype=torch.float64)
                b_pe = (bk.detach().double()[lay.pe_rows] if bk is not None
                        else torch.zeros(rope_dim, dtype=torch.float64))
                mla.kv_a_proj.bias.copy_(torch.cat([b_lat, b_pe]))
    layer = LatentLlamaAttention(attn, mla, pairs, lay.slot_freq.to(w.device), lay.pe_rows.to(w.device),
                                 lay.nope_rows.to(w.device))
    if qk_norm:
        mla.kv_a_proj = None  # the latent comes from the kept k_proj / v_proj through latent_proj
        layer.k_proj, layer.v_proj, layer.k_norm = attn.k_proj, attn.v_proj, attn.k_norm
        layer.latent_proj = nn.Linear(up.shape[0], R, bias=False).to(device=w.device, dtype=w.dtype)
        gain_q = attn.q_norm.weight.detach().double()[None, :, None].expand(H, D, 1)
        with torch.no_grad():
            layer.latent_proj.weight.copy_(proj)
            # the exact keys carry w_k and 1/rms themselves; the basis was weighted by 1/s only to choose it
        layer.q_gain = nn.Parameter((lay(gain_q.contiguous())[..., 0] * ratio).to(device=w.device, dtype=w.dtype))
        layer.q_norm_eps = float(getattr(attn.q_norm, "variance_epsilon", getattr(attn.q_norm, "eps", 1e-6)))
        layer.train(attn.training)
    error = relative_error(m, up @ (proj @ m))
    data_error = None if f is None else relative_error(f, (f @ proj.T) @ up.T)
    return layer, error, data_error


def transformers_to_mla(model: nn.Module, kv_rank: int, *, rope_dim: int | None, keep: str | None = None,
                        basis: str | None = None, calibration=None, tokenizer=None, backend: str = "auto",
                        return_report: bool = False):
    """A copy of a Llama-family transformers model on multihead's MLA (docs/mla.md).

    Args:
        kv_rank: R, the width of the shared latent (<= the rank of [W_k,nope ; W_v]).
        rope_dim: r, the width of the decoupled RoPE key: a multiple of 2 * Hkv up to
            Hkv * D (every pair rotary); required.
        keep: which rotary pairs stay rotary: "rotation" (the default with calibration: the
            pairs whose rotation costs most to drop, docs/mla.md), "norm" (MHA2MLA's
            query-key norm product) or "high" (the highest frequencies; the default without).
        basis: "output" (the default with calibration: the principal subspace of the K/V
            features in the metric of the attention output, the dropped pairs' queries
            turned by their mean rotation), "activations" (the principal directions of the
            K/V features [k_nope ; v] on the calibration tokens), or "weights" (the SVD of
            the map, no data; the default without calibration).
        calibration: text (a str, with `tokenizer`) or token ids `(T,)` / `(B, T)` run through
            the model for the data-aware choices; a few thousand tokens are enough.
        tokenizer: the model's tokenizer, to read calibration text.

    Returns:
        the new model, or `(model, multihead.convert.ConversionReport)` with every layer's
        relative K/V reconstruction error ||M - M'|| / ||M|| and, with calibration,
        `data_error`: that of the features on the calibration tokens; the report's `init`
        names the basis and the rotary rule, and `rope_pairs` the pairs each layer kept.
        The input model is untouched.
    """
    if rope_dim is None:
        layers = mla_layers(model)
        hint = ""
        if layers:
            _, Hkv, D, Dv, _ = _sizes(layers[0][1])
            hint = f"; valid: a multiple of {2 * Hkv} in 0..{Hkv * D} (exact: rope_dim={Hkv * D}, kv_rank={Hkv * Dv})"
        raise ValueError("to_mla: a transformers model has RoPE in every layer, so rope_dim (the decoupled RoPE "
                         f"key's width) must be given; received None{hint}")
    data = calibration is not None
    keep = keep if keep is not None else ("rotation" if data else "high")
    basis = basis if basis is not None else ("output" if data else "weights")
    layers = _check(model, kv_rank, rope_dim, keep)
    _, Hkv, D, _, _ = _sizes(layers[0][1])
    k = rope_dim // (2 * Hkv)
    if basis not in BASES:
        raise ValueError(f"to_mla: basis must be one of {', '.join(BASES)}; received {basis!r}")
    needs = [f"{n}={v!r}" for n, v in (("basis", basis), ("keep", keep)) if v in ("activations", "output", "rotation")]
    if needs and calibration is None:
        raise ValueError(f"to_mla: {', '.join(needs)} reads the layers on calibration tokens; received "
                         "calibration=None; valid: calibration=text (with tokenizer=) or token ids (B, T)")
    if calibration is not None and keep == "high" and basis == "weights":
        raise ValueError(f"to_mla: calibration= feeds the data-aware choices; received it with keep={keep!r}, "
                         f"basis={basis!r}, which read no data; valid: keep='rotation' or 'norm', or basis='output' "
                         "or 'activations' (the defaults with calibration), or no calibration")
    stats = {} if calibration is None else layer_stats(model, layers, calibration_ids(
        calibration, tokenizer, vocab=model.get_input_embeddings().num_embeddings))
    inputs = {name: [st.x] for name, st in stats.items()}
    scores = {}
    if keep != "high" and 0 < k < D // 2:
        pick = {"rotation": lambda name, m: _rotation_scores(stats[name]),
                "norm": lambda name, m: _activation_scores(m, inputs[name]) if inputs else _weight_scores(m)}[keep]
        scores = {name: pick(name, m) for name, m in layers}
    new = copy.deepcopy(model)
    rows = []
    for name, attn in mla_layers(new):
        pairs = _kept_pairs(scores.get(name), Hkv, D, k, keep)
        layer, error, data_error = _convert_layer(attn, kv_rank, rope_dim, pairs, backend, inputs.get(name), basis,
                                                  stats.get(name))
        parent, _, child = name.rpartition(".")
        setattr(new.get_submodule(parent) if parent else new, child, layer)
        rows.append(LayerConversion(name, error, data_error, tuple(tuple(p) for p in pairs.tolist())))
    names = {"weights": "svd", "activations": "pca", "output": "output-pca"}
    report = ConversionReport(f"MLA-{kv_rank}", f"{names[basis]}, rope {keep}", tuple(rows))
    _refuse_save_pretrained(new)
    return (new, report) if return_report else new


def _refuse_save_pretrained(model: nn.Module) -> None:
    """Make the converted model's `save_pretrained` (and push_to_hub, which calls it) refuse:
    it would write a folder labelled with the original class (LlamaForCausalLM) whose
    attention weights stock transformers does not know, so a reload re-initialises every
    attention layer at random. The way out is named in the error."""
    import types

    name = type(model).__name__

    def refuse(self, *args, **kwargs):
        raise ValueError(
            f"save_pretrained: this {name} runs multihead's LatentLlamaAttention (convert.to_mla), which stock "
            f"transformers cannot load as a {name}: it would re-initialise every attention layer. Save it as "
            "DeepSeek-V2, which transformers loads: multihead.interop.hf.deepseek_export.to_deepseek_v2(model, "
            "calibration=ids).save_pretrained(folder) (its latent norm is fitted, see docs/mla.md); or keep the "
            "weights with torch.save(model.state_dict(), path) and convert again before loading them")

    model.save_pretrained = types.MethodType(refuse, model)
