"""The protocol between the head tools and attention (`multihead.head_access`): a module the
tools never heard of is understood once it says where its heads are, and `Attention` and
`LatentAttention` say it the same way."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from multihead import Attention, LatentAttention, heads
from multihead.head_access import HasHeads, HeadAccess, has_heads

pytestmark = pytest.mark.usefixtures("one_torch_thread")

C, H, V, T = 16, 4, 30, 7


class WrittenOut(nn.Module):
    """A new attention variant: causal MHA written out by hand, nothing of multihead's but
    `head_access`."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(C, C) for _ in range(3))
        self.o_proj = nn.Linear(C, C)

    def head_access(self) -> HeadAccess:
        D = C // H
        return HeadAccess("attention", H, H, D, D, q=self.q_proj, o=self.o_proj, k=self.k_proj, v=self.v_proj)

    def forward(self, x):
        B, T_, _ = x.shape
        q, k, v = (p(x).view(B, T_, H, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        scores = q @ k.transpose(-1, -2) / math.sqrt(C // H)  # (B, H, T, T)
        scores = scores.masked_fill(~torch.ones(T_, T_, dtype=torch.bool).tril(), float("-inf"))
        z = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T_, C)  # (B, T, H * D)
        return self.o_proj(z)


class Block(nn.Module):
    def __init__(self, attn: nn.Module):
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(C), attn

    def forward(self, x):
        return x + self.attn(self.norm(x))


class Tiny(nn.Module):
    def __init__(self, make):
        super().__init__()
        self.emb = nn.Embedding(V, C)
        self.blocks = nn.ModuleList(Block(make()) for _ in range(2))
        self.head = nn.Linear(C, V)

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _pair():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, V, (2, T), generator=g), torch.randint(0, V, (2, T), generator=g)


def _metric(logits):
    return (logits[:, -1, 3] - logits[:, -1, 4]).mean()


def test_a_new_variant_is_scanned_as_multihead_attention_with_the_same_weights():
    torch.manual_seed(0)
    new = Tiny(WrittenOut).eval()
    ours = Tiny(lambda: Attention(C, H, causal=True)).eval()
    ours.load_state_dict(new.state_dict())  # the same parameter names: q/k/v/o_proj
    clean, corrupted = _pair()
    with torch.no_grad():
        assert torch.allclose(new(clean), ours(clean), atol=1e-5)
    for what in ("z", "k", "v"):
        want = heads.patch_scan(ours, clean, corrupted, _metric, what=what)
        got = heads.patch_scan(new, clean, corrupted, _metric, what=what)
        diff = float((got - want).abs().max())
        assert diff < 1e-5 * (1 + float(want.abs().max())), f"{what}: max diff {diff:.2e}"
    got = heads.path_patch(new, clean, corrupted, _metric, [(0, 1)], [(1, 2)])
    want = heads.path_patch(ours, clean, corrupted, _metric, [(0, 1)], [(1, 2)])
    assert abs(got - want) < 1e-5 * (1 + abs(want))


def test_the_built_in_modules_implement_the_protocol():
    a = Attention(C, H, n_kv_heads=2)
    m = LatentAttention(C, H, 8, head_dim=4, rope_dim=2)
    assert has_heads(a) and has_heads(m) and isinstance(a, HasHeads) and not has_heads(nn.Linear(2, 2))
    ha, hm = a.head_access(), m.head_access()
    assert (ha.kind, ha.H, ha.Hkv, ha.D, ha.Dv) == ("attention", H, 2, C // H, C // H)
    assert ha.q is a.q_proj and ha.k is a.k_proj and ha.v is a.v_proj and ha.o is a.o_proj
    assert (hm.kind, hm.H, hm.Hkv, hm.D, hm.Dv) == ("latent", H, H, 4, m.v_head_dim)
    assert hm.kv is m.kv_b_proj and hm.latent is m.kv_a_proj and hm.o is m.o_proj and hm.q is m.q_proj


class Uncalled(Tiny):
    """Blocks held as nn.ModuleDicts its forward never calls (it calls what they hold)."""

    def __init__(self):
        super().__init__(WrittenOut)
        self.blocks = nn.ModuleList(nn.ModuleDict({"norm": nn.LayerNorm(C), "attn": WrittenOut()}) for _ in range(2))

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = x + b["attn"](b["norm"](x))
        return self.head(x)


def test_blocks_the_forward_never_calls_are_refused_by_name():
    """patch_scan names them (its variants' rows would never join the batch); path_patch_scan
    runs the three steps sender by sender, equal to the same weights in called blocks."""
    clean, corrupted = _pair()
    torch.manual_seed(0)
    model = Uncalled().eval()
    with pytest.raises(ValueError, match="never calls \\(ModuleDict"):
        heads.patch_scan(model, clean, corrupted, _metric)
    called = Tiny(WrittenOut).eval()
    called.load_state_dict(model.state_dict())
    got = heads.path_patch_scan(model, clean, corrupted, _metric, [(1, 0)])
    want = heads.path_patch_scan(called, clean, corrupted, _metric, [(1, 0)])
    assert (got - want).abs().max() < 1e-5 * (1 + float(want.abs().max()))


def test_prune_refuses_a_variant_whose_head_counts_it_cannot_set_and_changes_nothing():
    """prune narrows what head_access names, but a variant's forward may read its head count
    from anywhere (WrittenOut's is a constant): it is refused by its class's name before any
    weight changes. The same weights on Attention prune to what ablate computes."""
    torch.manual_seed(0)
    new = Tiny(WrittenOut).eval()
    before = {k: v.clone() for k, v in new.state_dict().items()}
    with pytest.raises(ValueError, match="layer 1 physically: it is a WrittenOut.*heads.ablate"):
        heads.prune(new, [(1, 2)])
    assert all(torch.equal(before[k], v) for k, v in new.state_dict().items())
    ours = Tiny(lambda: Attention(C, H, causal=True)).eval().double()
    ours.load_state_dict(new.double().state_dict())
    clean, _ = _pair()
    with torch.no_grad(), heads.ablate(ours, [(1, 2)]):
        want = ours(clean)
    pruned = heads.prune(ours, [(1, 2)])
    assert pruned.blocks[1].attn.q_proj.out_features == (H - 1) * (C // H)
    with torch.no_grad():
        got = pruned(clean)
    diff = float((got - want).abs().max())
    assert diff < 1e-12 * (1 + float(want.abs().max())), f"max diff {diff:.2e}"
