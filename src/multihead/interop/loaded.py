"""A model that can be captured: the interface `multihead.inspect` and `multihead.lab`
share, and its Hugging Face implementation.

`LoadedModel` is what a capture needs of a model: encode text, name tokens, and run ids
returning the attention weights of chosen layers and heads; and what the head tools'
commands read through it, whatever the model's source: its inputs for a text, the token
after a text, its logits, the last real position. `HFModel` runs any
transformers model whose attention goes through transformers' attention registry, on
attn_implementation="multihead" (`multihead.interop.hf`). It lives one floor below the
tools, so a tool (inspect, lab) implements or uses it without importing another tool.
Errors are `ModelError` (a ValueError) with what was received and what is valid.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch and transformers are imported where they are used
    import torch
    from torch import Tensor

__all__ = ["HFModel", "LoadedModel", "ModelError"]


class ModelError(ValueError):
    """A model that cannot be loaded or run as asked; the message says why and what works."""


class LoadedModel:
    """A model `capture` and `induction_scores` can run. Subclass it for a new source.

    Attributes:
        name: a short name for labels.
        n_layers, n_heads: the attention geometry (query heads per layer).
        max_positions: the longest input the model takes, in tokens (None: unbounded).
        causal: whether its attention is causal (decoder) or bidirectional (encoder).
        special_tokens: token strings that are special (delimiters such as [SEP], </s>).
        meta: anything worth recording in a capture's meta.
    """

    name: str = "model"
    n_layers: int
    n_heads: int
    max_positions: int | None = None
    causal: bool = False
    special_tokens: tuple[str, ...] = ()
    meta: dict

    def encode(self, text: str, max_length: int | None = None) -> list[int]:
        """Token ids of `text` with the model's special tokens, at most max_length of them."""
        raise NotImplementedError

    def tokens(self, ids: Sequence[int]) -> list[str]:
        """The token strings of `ids`."""
        raise NotImplementedError

    def wrap(self, ids: Sequence[int]) -> tuple[list[int], int]:
        """`ids` with the special tokens a text gets around it, and the offset of ids[0]."""
        return list(ids), 0

    def random_ids(self, shape: tuple[int, ...], generator: torch.Generator) -> Tensor:
        """Uniformly random ordinary (non-special) token ids of `shape`."""
        raise NotImplementedError

    def attention(self, ids: Tensor, heads: dict[int, tuple[int, ...]]) -> dict[int, Tensor]:
        """Run ids `(B, T)`; return {layer: weights `(B, len(heads[layer]), T, T)`}."""
        raise NotImplementedError

    def copy(self) -> LoadedModel:
        """A deep copy whose model a tool may change (prune, convert, ablate in place) while
        this one, perhaps shared through `load_model`'s session cache, stays as it was."""
        import copy

        return copy.deepcopy(self)

    # What the head tools' commands read. The defaults are a plain vocabulary's (a `multihead
    # lab` checkpoint: one id per token as written, no special tokens); HFModel overrides
    # them with its tokenizer's reading.

    random_tokens: str = "uniform over the vocabulary"  # what `token_source` draws, in words

    def inputs(self, text: str):
        """`text` as the model's forward takes it, a batch of one: `(1, T)` ids, the model's
        special tokens (its BOS) included."""
        import torch

        return torch.tensor([self.encode(text)])

    def input_ids(self, inputs) -> Tensor:
        """The `(B, T)` ids of `inputs` (what `inputs(text)` returns)."""
        return inputs

    @staticmethod
    def logits(out) -> Tensor:
        """The logits of a forward's output `out` (a tensor, or an output holding `.logits`)."""
        import torch

        if isinstance(out, torch.Tensor):
            return out
        lg = getattr(out, "logits", None)
        if not isinstance(lg, torch.Tensor):
            raise ModelError(f"the model's output ({type(out).__name__}) holds no logits; a next-token metric reads "
                             "a language model's own logits (use a decoder LM such as --model smollm2)")
        return lg

    def forward(self, inputs) -> Tensor:
        """The logits of the model on `inputs` (what `inputs(text)` returns, or ids `(B, T)`)."""
        return self.logits(self.model(**inputs) if isinstance(inputs, Mapping) else self.model(inputs))

    def last_real_position(self, ids: Sequence[int]) -> int:
        """The last position of `ids` that is not a special token ([SEP], </s>): where a
        next-token answer is read."""
        return len(ids) - 1

    def token_after(self, text: str, token: str, flag: str = "--answer") -> tuple[int, str]:
        """The id and piece of `token` as the model would write it right after `text` (a BPE
        tokenizer's space-led piece after a word); ValueError naming `flag` unless it is one
        token the model knows (`multihead.tokens.next_token`)."""
        from multihead.tokens import next_token  # a leaf module: it imports nothing of multihead's

        return next_token(self, flag, text, token)

    def prefix_ids(self) -> list[int]:
        """The ids the model's tokenizer puts before every text (Gemma's `<bos>`); none here."""
        return []

    @property
    def token_source(self):
        """What `multihead.heads.tasks.induction` draws random tokens from (its `vocab`)."""
        raise NotImplementedError

    def word_tokenizer(self, use: str):
        """The model's word-level (Hugging Face) tokenizer, which tasks with names (IOI) need;
        ModelError naming `use` when it has none."""
        raise ModelError(f"{use} needs a model with a word-level tokenizer (a Hugging Face LM such as --model "
                         "smollm2); a lab model's vocabulary has no names")

    def why_not_lm(self) -> str | None:
        """None when the model predicts the next token (a decoder with logits over its
        vocabulary); else why not, as a phrase ("is a bidirectional encoder")."""
        return None if self.causal else "is a bidirectional encoder"


class HFModel(LoadedModel):
    """A Hugging Face model + tokenizer, run on attn_implementation="multihead".

    The model keeps its own modules and weights; only its attention implementation is
    switched to multihead's (`model.set_attn_implementation("multihead")`, in place),
    which computes the same outputs. One probe forward on three tokens finds the
    attention modules that call transformers' attention registry, in the order they run:
    those are the "layers" here (self-attention, and for an encoder-decoder the decoder's
    self- and cross-attention too, `meta["layer_kinds"]`). A capture asks them for chosen
    heads through a `multihead.interop.hf.WeightsRequest`: the weights come back in it,
    computed for those heads only beside the fused kernel, and the forward stops after
    the last layer asked. An encoder-decoder reads the text on both sides, so its
    cross-attention is `(T, T)` too: decoder token t attending to encoder token s.
    """

    def __init__(self, model, tokenizer, name: str | None = None):
        if not hasattr(tokenizer, "convert_ids_to_tokens"):
            raise ModelError(f"expected a (model, tokenizer) pair; the second item is a "
                               f"{type(tokenizer).__name__}, not a Hugging Face tokenizer")
        config = getattr(model, "config", None)
        self.name = name or getattr(config, "_name_or_path", "") or type(model).__name__
        _use_multihead(model, self.name)
        model.eval()
        self.model = model
        self.tokenizer = tokenizer
        self.encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
        calls = self._probe()
        self.layers = [call.module for call in calls]
        self.layer_kinds = ["cross" if call.T != call.S else "self" for call in calls]
        heads = sorted({call.H for call in calls})
        self.n_layers = len(self.layers)
        self.n_heads = heads[0]
        self.causal = all(bool(getattr(m, "is_causal", False))
                          for m, kind in zip(self.layers, self.layer_kinds) if kind == "self")
        limits = [getattr(config, key, None) for key in ("max_position_embeddings", "n_positions")]
        limits = [int(n) for n in limits if isinstance(n, int) and n > 0]
        self.max_positions = min(limits) if limits else None
        self.special_tokens = tuple(getattr(tokenizer, "all_special_tokens", ()))
        names = {id(m): n for n, m in model.named_modules()}
        self.meta = {
            "model_type": getattr(config, "model_type", type(model).__name__),
            "n_kv_heads": calls[0].Hkv,
            "head_dim": calls[0].D,
            "causal": self.causal,
            "attn_implementation": "multihead",
            "max_positions": self.max_positions,
        }
        if len(heads) > 1:
            self.meta["n_heads_per_layer"] = [call.H for call in calls]
        if "cross" in self.layer_kinds:
            self.meta["layer_kinds"] = list(self.layer_kinds)
            self.meta["layer_names"] = [names.get(id(m), "?") for m in self.layers]
        self._ordinary = None

    @property
    def has_lm_head(self) -> bool:
        """Whether the model carries its own language-model head (`get_output_embeddings()`:
        a causal LM's `lm_head`, a masked LM's decoder), so its outputs hold `.logits` over the
        vocabulary. A base model (`BertModel`, the bundled MiniLM) has none: its last hidden
        states are not logits, and a next-token metric on it would read noise."""
        get = getattr(self.model, "get_output_embeddings", None)
        return callable(get) and get() is not None

    @property
    def is_causal_lm(self) -> bool:
        """Whether the model predicts the next token: a decoder-only model (causal attention,
        not an encoder-decoder) with its own LM head, such as `LlamaForCausalLM`."""
        return self.has_lm_head and self.causal and not self.encoder_decoder

    def copy(self) -> HFModel:
        """A deep copy of the model (its weights included) sharing the tokenizer, which no tool
        changes; the copy's `layers` are the copied model's attention modules."""
        import copy

        return copy.deepcopy(self, {id(self.tokenizer): self.tokenizer})

    random_tokens = "uniform over the tokenizer's ordinary tokens"

    def inputs(self, text: str):
        return self.tokenizer(text, return_tensors="pt")

    def input_ids(self, inputs) -> Tensor:
        return inputs["input_ids"] if isinstance(inputs, Mapping) else inputs

    def last_real_position(self, ids: Sequence[int]) -> int:
        special = set(getattr(self.tokenizer, "all_special_ids", ()))
        real = [i for i, t in enumerate(ids) if t not in special]
        return real[-1] if real else len(ids) - 1

    def prefix_ids(self) -> list[int]:
        from multihead.tokens import prefix  # a leaf module: it imports nothing of multihead's

        return prefix(self.tokenizer)

    @property
    def token_source(self):
        return self.tokenizer

    def word_tokenizer(self, use: str):
        return self.tokenizer

    def why_not_lm(self) -> str | None:
        if self.is_causal_lm:
            return None
        return ("has no language-model head" if not self.has_lm_head else
                "is an encoder-decoder" if self.encoder_decoder else "is a bidirectional encoder")

    def _inputs(self, ids: Tensor, decoder_ids: Tensor | None = None) -> dict:
        import torch

        device = next(self.model.parameters()).device
        ids = ids.to(device)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if self.encoder_decoder:
            inputs["decoder_input_ids"] = ids if decoder_ids is None else decoder_ids.to(device)
        return inputs

    def _probe(self):
        """The attention modules that call the registry, in call order, with their shapes."""
        import torch

        from multihead.interop.hf import WeightsRequest

        vocab = int(getattr(self.model.config, "vocab_size", 2) or 2)
        ids = torch.full((1, 3), min(1, vocab - 1), dtype=torch.long)
        request = WeightsRequest(probe=True)
        try:
            request.run(self.model, **self._inputs(ids, ids[:, :2]))  # cross-attention: T = 2, S = 3
        except (TypeError, ValueError, RuntimeError) as err:
            raise ModelError(f"{self.name!r}: a forward on attn_implementation='multihead' failed "
                               f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from None
        calls = request.calls
        if not calls:
            raise ModelError(f"{self.name!r} ({type(self.model).__name__}): its attention does not go "
                               "through the attention registry, so multihead can neither run nor capture it; "
                               + _REACHES)
        if len({id(c.module) for c in calls}) != len(calls):
            raise ModelError(f"{self.name!r}: one attention module runs several times per forward (layers "
                               "share weights, as in ALBERT); inspect captures models whose layers are distinct")
        return calls

    def encode(self, text: str, max_length: int | None = None) -> list[int]:
        kwargs = {"truncation": True, "max_length": max_length} if max_length else {}
        return list(self.tokenizer(text, **kwargs)["input_ids"])

    def tokens(self, ids: Sequence[int]) -> list[str]:
        return list(self.tokenizer.convert_ids_to_tokens(list(ids)))

    def wrap(self, ids: Sequence[int]) -> tuple[list[int], int]:
        tok = self.tokenizer
        ids = list(ids)
        full = list(tok.build_inputs_with_special_tokens(ids)) if hasattr(tok, "build_inputs_with_special_tokens") \
            else ids
        offset = next((i for i in range(len(full) - len(ids) + 1) if full[i:i + len(ids)] == ids), 0)
        bos = getattr(tok, "bos_token_id", None)
        if offset == 0 and bos is not None and (not full or full[0] != bos):
            full, offset = [bos, *full], 1  # as TransformerLens prepends BOS to GPT-2 input
        return full, offset

    def random_ids(self, shape: tuple[int, ...], generator: torch.Generator) -> Tensor:
        import torch

        if self._ordinary is None:
            special = set(getattr(self.tokenizer, "all_special_ids", ()))
            bracketed = re.compile(r"^(\[.*\]|<.*>|<\|.*\|>)$")
            vocab = self.tokenizer.get_vocab()
            self._ordinary = torch.tensor(sorted(i for t, i in vocab.items()
                                                 if i not in special and not bracketed.match(t)))
        pick = torch.randint(len(self._ordinary), shape, generator=generator)
        return self._ordinary[pick]

    def attention(self, ids: Tensor, heads: dict[int, tuple[int, ...]]) -> dict[int, Tensor]:
        from multihead.interop.hf import WeightsRequest

        if not heads:
            return {}
        request = WeightsRequest({self.layers[layer]: tuple(h) for layer, h in heads.items()}, stop=True)
        request.run(self.model, **self._inputs(ids))
        return {layer: request.get(self.layers[layer]) for layer in heads}


_REACHES = ("capturing works on models whose attention does (BERT/RoBERTa, GPT-2, Llama, Mistral, Qwen2/3, "
            "Gemma-2, Phi-3, GPT-NeoX, BART, T5, ViT, DeepSeek-V2, ...; Falcon does not)")


def _use_multihead(model, name: str) -> None:
    """Switch a transformers model to attn_implementation="multihead", or say why it cannot."""
    try:
        import multihead.interop.hf  # noqa: F401 (registers "multihead")
    except ImportError as err:
        raise ModelError(f"capturing a Hugging Face model needs transformers: pip install 'multihead[hf]' "
                         f"(from a checkout of the repository: pip install -e '.[hf]') ({err})") from None
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise ModelError(f"{name!r}: a {type(model).__name__} is not a transformers model "
                         "(no config / set_attn_implementation)")
    if getattr(config, "_attn_implementation", None) != "multihead":
        try:
            model.set_attn_implementation("multihead")
        except (ValueError, KeyError, ImportError) as err:
            raise ModelError(f"{name!r}: cannot run on attn_implementation='multihead' ({err})") from None
    if getattr(config, "_attn_implementation", None) != "multihead":
        raise ModelError(f"{name!r} ({type(model).__name__}): transformers cannot switch its attention "
                         "implementation, because its attention does not go through the attention registry; "
                         + _REACHES)
