"""Read a Hugging Face `config.json` into a `ModelGeometry`, traps included.

Reading is bounded and never trusts the file (a regular file only, at most
MAX_CONFIG_BYTES, closed-form layer counts; bad UTF-8, deep JSON, huge numbers and wrong
types are each a ValueError naming the file and the field). The traps each family sets for
a naive calculator (fused projections, windows, MoE, MLA, ...) are listed in the docs.

Details: docs/plan.md, "The traps of each config family".
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from multihead.checks import divisibility_error
from multihead.plan.geometry import (
    AttentionGeometry,
    FeedForward,
    LatentGeometry,
    MixtureOfExperts,
    ModelGeometry,
)
from multihead.plan.presets import PRESETS, did_you_mean, find_preset, preset_config

MAX_CONFIG_BYTES = 4 * 2**20  # published config.json files are a few KB; 4 MiB is generous
MAX_FIELD = 2**40  # no width, count or length of a real model comes near this


class _Fields:
    """Typed access to a config dict; a missing or bad field names itself and the family."""

    def __init__(self, data: Mapping, family: str, source: str):
        self.data, self.family, self.source = data, family, source

    def _fail(self, msg: str):
        raise ValueError(f"{self.source}: {msg}")

    def int(self, *names: str, default=..., allow_none: bool = False, minimum: int = 1):
        for name in names:
            if name in self.data:
                value = self.data[name]
                if value is None and allow_none:
                    return None
                if isinstance(value, bool) or not isinstance(value, int):
                    self._fail(f"field '{name}' of a {self.family} config must be an integer; "
                               f"received {_short(value)}")
                if value < minimum:
                    self._fail(f"field '{name}' of a {self.family} config must be >= {minimum}; "
                               f"received {value}")
                if value > MAX_FIELD:
                    shown = str(value) if value < 10**30 else f"a {len(str(value))}-digit number"
                    self._fail(f"field '{name}' of a {self.family} config must be at most 2**40; "
                               f"received {shown}")
                return value
        if default is ...:
            alt = f" (or {', '.join(repr(n) for n in names[1:])})" if len(names) > 1 else ""
            self._fail(f"a {self.family} config needs the field '{names[0]}'{alt}; it is missing")
        return default

    def bool(self, name: str, default: bool) -> bool:
        value = self.data.get(name, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            self._fail(f"field '{name}' of a {self.family} config must be true or false; "
                       f"received {_short(value)}")
        return value

    def head_dim(self, d_model: int, n_heads: int) -> int | None:
        """`head_dim` when the config sets it (None = d_model // n_heads)."""
        hd = self.int("head_dim", default=None, allow_none=True)
        error = None if hd is not None else divisibility_error("hidden_size", d_model, "num_attention_heads", n_heads)
        if error is not None:
            self._fail(f"{error}; the config sets no 'head_dim'")
        return hd

    def window_layers(self, n_layers: int) -> int | None:
        """Layers marked sliding in a `layer_types` list (newer configs), else None."""
        types = self.data.get("layer_types")
        if types is None:
            return None
        if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
            self._fail(f"field 'layer_types' of a {self.family} config must be a list of strings "
                       f"such as \"sliding_attention\"; received {_short(types)}")
        if not types:
            return None
        if len(types) != n_layers:
            self._fail(f"field 'layer_types' has {len(types)} entries but num_hidden_layers is "
                       f"{n_layers}")
        return sum(t == "sliding_attention" for t in types)

    def int_list(self, name: str) -> tuple[int, ...]:
        value = self.data.get(name)
        if value is None:
            return ()
        if (not isinstance(value, list)
                or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_FIELD
                           for v in value)):
            self._fail(f"field '{name}' of a {self.family} config must be a list of layer indices; "
                       f"received {_short(value)}")
        return tuple(value)


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _context(f: _Fields) -> int | None:
    return f.int("max_position_embeddings", "n_positions", default=None, allow_none=True)


def _layernorm_decoder(f: _Fields, c: int, h: int, hkv: int | None, *, layers: tuple[str, ...], d_ff: int,
                       bias: bool, ffn_bias: bool, tied: bool, **rest) -> ModelGeometry:
    """GPT-2, GPT-NeoX and Falcon: LayerNorm blocks with a plain (ungated) MLP; `layers`
    names the config's field for the layer count, `rest` the geometry's other fields."""
    return ModelGeometry(
        attention=AttentionGeometry(c, h, hkv, head_dim=f.head_dim(c, h), bias=bias),
        n_layers=f.int(*layers), vocab_size=f.int("vocab_size"), ffn=FeedForward(d_ff, gated=False, bias=ffn_bias),
        tied_embeddings=tied, norm="layernorm", **rest)


def _gpt2(f: _Fields) -> ModelGeometry:
    c = f.int("n_embd", "hidden_size")
    h = f.int("n_head", "num_attention_heads")
    n_pos = f.int("n_positions", "max_position_embeddings")
    d_ff = f.int("n_inner", default=None, allow_none=True) or 4 * c
    return _layernorm_decoder(f, c, h, None, layers=("n_layer", "num_hidden_layers"), d_ff=d_ff, bias=True,
                              ffn_bias=True, tied=f.bool("tie_word_embeddings", True), max_positions=n_pos,
                              context_length=n_pos)


def _bert(f: _Fields) -> ModelGeometry:
    c = f.int("hidden_size")
    h = f.int("num_attention_heads")
    n_pos = f.int("max_position_embeddings")
    return ModelGeometry(
        attention=AttentionGeometry(c, h, head_dim=f.head_dim(c, h), bias=True),
        n_layers=f.int("num_hidden_layers"),
        vocab_size=f.int("vocab_size"),
        ffn=FeedForward(f.int("intermediate_size"), gated=False, bias=True),
        lm_head=False,  # BertModel: the encoder with its pooler, no MLM head
        norm="layernorm",
        final_norm=False,  # post-norm: the norms sit inside the blocks
        max_positions=n_pos,
        token_types=f.int("type_vocab_size", default=2),
        embedding_norm=True,
        pooler=True,
        causal=False,
        context_length=n_pos,
        notes=("counted as BertModel with its pooler, without an MLM head",),
    )


def _llama_like(f: _Fields, *, qkv_bias: bool | None = None, o_bias: bool | None = None,
                tied: bool = False, norms_per_layer: int = 2, window: int | None = None,
                window_layers: int | None = None, qk_norm: bool = False, sinks: bool = False,
                moe: MixtureOfExperts | None = None, notes: tuple[str, ...] = ()) -> ModelGeometry:
    c = f.int("hidden_size")
    h = f.int("num_attention_heads")
    hkv = f.int("num_key_value_heads", default=h, allow_none=True) or h
    error = divisibility_error("num_attention_heads", h, "num_key_value_heads", hkv)
    if error is not None:
        f._fail(error)
    bias = f.bool("attention_bias", False) if qkv_bias is None else qkv_bias
    return ModelGeometry(
        attention=AttentionGeometry(c, h, hkv, head_dim=f.head_dim(c, h), bias=bias,
                                    o_bias=o_bias),
        n_layers=f.int("num_hidden_layers"),
        vocab_size=f.int("vocab_size"),
        ffn=FeedForward(f.int("intermediate_size"), gated=True, bias=f.bool("mlp_bias", False)),
        tied_embeddings=f.bool("tie_word_embeddings", tied),
        norms_per_layer=norms_per_layer,
        window=window,
        window_layers=window_layers,
        qk_norm=qk_norm,
        sinks=sinks,
        moe=moe,
        context_length=_context(f),
        notes=notes,
    )


def _llama(f: _Fields) -> ModelGeometry:
    return _llama_like(f)


def _mistral(f: _Fields) -> ModelGeometry:
    return _llama_like(f, window=f.int("sliding_window", default=None, allow_none=True))


def _qwen_window(f: _Fields) -> tuple[int | None, int | None]:
    """Qwen's sliding window: off unless use_sliding_window, then from max_window_layers on."""
    if not f.bool("use_sliding_window", False):
        return None, None
    window = f.int("sliding_window", default=None, allow_none=True)
    n_layers = f.int("num_hidden_layers")
    start = f.int("max_window_layers", default=0, minimum=0)
    window_layers = f.window_layers(n_layers)
    if window_layers is None:
        window_layers = max(0, n_layers - start)
    return window, window_layers


def _qwen2(f: _Fields) -> ModelGeometry:
    window, window_layers = _qwen_window(f)
    return _llama_like(f, qkv_bias=True, o_bias=False, window=window, window_layers=window_layers)


def _qwen3(f: _Fields, moe: MixtureOfExperts | None = None) -> ModelGeometry:
    window, window_layers = _qwen_window(f)
    return _llama_like(f, qk_norm=True, window=window, window_layers=window_layers, moe=moe)


def _qwen_moe(f: _Fields, shared: bool) -> MixtureOfExperts:
    return MixtureOfExperts(
        n_experts=f.int("num_experts"),
        top_k=f.int("num_experts_per_tok"),
        d_expert=f.int("moe_intermediate_size"),
        n_shared=1 if shared else 0,
        d_shared=f.int("shared_expert_intermediate_size") if shared else None,
        shared_gate=shared,
        layer_freq=f.int("decoder_sparse_step", default=1),
        freq_offset=1,  # transformers: (layer_idx + 1) % decoder_sparse_step == 0
        dense_layers=f.int_list("mlp_only_layers"),
    )


def _qwen2_moe(f: _Fields) -> ModelGeometry:
    window, window_layers = _qwen_window(f)
    bias = f.bool("qkv_bias", True)
    return _llama_like(f, qkv_bias=bias, o_bias=False, window=window, window_layers=window_layers,
                       moe=_qwen_moe(f, shared=True))


def _qwen3_moe(f: _Fields) -> ModelGeometry:
    return _qwen3(f, moe=_qwen_moe(f, shared=False))


def _mixtral(f: _Fields) -> ModelGeometry:
    moe = MixtureOfExperts(n_experts=f.int("num_local_experts"), top_k=f.int("num_experts_per_tok"),
                           d_expert=f.int("intermediate_size"))
    return _llama_like(f, window=f.int("sliding_window", default=None, allow_none=True), moe=moe)


def _phi3(f: _Fields) -> ModelGeometry:
    return _llama_like(f, window=f.int("sliding_window", default=None, allow_none=True),
                       notes=("qkv_proj and gate_up_proj are fused; counted as separate "
                              "projections, which have the same parameters",))


def _gemma(f: _Fields) -> ModelGeometry:
    f.int("head_dim")  # Gemma's head_dim is never hidden_size / heads: require it
    return _llama_like(f, tied=True)


def _gemma2(f: _Fields) -> ModelGeometry:
    f.int("head_dim")
    n_layers = f.int("num_hidden_layers")
    window = f.int("sliding_window", "sliding_window_size", default=4096, allow_none=True)
    # Layers 0, 2, 4, ... are local (sliding window), the others global.
    window_layers = f.window_layers(n_layers)
    if window_layers is None:
        window_layers = (n_layers + 1) // 2
    return _llama_like(f, tied=True, norms_per_layer=4, window=window,
                       window_layers=window_layers)


# transformers' Gemma3TextConfig defaults: the multimodal gemma3 configs (4B, 12B, 27B)
# write only what differs from them in text_config.
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "max_position_embeddings": 131_072, "sliding_window": 4096, "sliding_window_pattern": 6,
    "tie_word_embeddings": True,
}  # fmt: skip


def _gemma3_text(f: _Fields, notes: tuple[str, ...] = ()) -> ModelGeometry:
    f.int("head_dim")
    n_layers = f.int("num_hidden_layers")
    window = f.int("sliding_window", default=4096, allow_none=True)
    # Every `sliding_window_pattern`-th layer is global, the others local:
    # transformers' (i + 1) % pattern != 0, unless layer_types lists them.
    window_layers = f.window_layers(n_layers)
    if window_layers is None:
        pattern = f.int("sliding_window_pattern", default=6)
        window_layers = n_layers - n_layers // pattern  # closed form: n_layers may be 2**40
    return _llama_like(f, tied=True, norms_per_layer=4, window=window, window_layers=window_layers,
                       qk_norm=True, notes=notes)


def _gemma3(f: _Fields) -> ModelGeometry:
    text = f.data.get("text_config")
    if not isinstance(text, Mapping):
        f._fail(f"a gemma3 config needs a 'text_config' object (the language model); received "
                f"{_short(text)}")
    data = {**GEMMA3_TEXT_DEFAULTS, **text}
    if "tie_word_embeddings" in f.data and "tie_word_embeddings" not in text:
        data["tie_word_embeddings"] = f.data["tie_word_embeddings"]
    sub = _Fields(data, "gemma3 text_config", f.source)
    return _gemma3_text(sub, notes=(
        "the language model only (text_config, with transformers' Gemma3TextConfig defaults "
        "for the fields it leaves out); the vision tower and projector are not counted",))


def _gpt_neox(f: _Fields) -> ModelGeometry:
    c = f.int("hidden_size")
    h = f.int("num_attention_heads")
    return _layernorm_decoder(
        f, c, h, None, layers=("num_hidden_layers",), d_ff=f.int("intermediate_size"),
        bias=f.bool("attention_bias", True), ffn_bias=True, tied=f.bool("tie_word_embeddings", False),
        context_length=_context(f),
        notes=("query_key_value is fused: 3*C outputs; rotary on rotary_pct of each head (no parameters)",))


def _gpt_oss(f: _Fields) -> ModelGeometry:
    n_layers = f.int("num_hidden_layers")
    window = f.int("sliding_window", default=128, allow_none=True)
    # transformers' default layer_types: even layers sliding, odd layers full.
    window_layers = f.window_layers(n_layers)
    if window_layers is None:
        window_layers = (n_layers + 1) // 2
    moe = MixtureOfExperts(
        n_experts=f.int("num_local_experts"),
        top_k=f.int("num_experts_per_tok", "experts_per_token"),
        d_expert=f.int("intermediate_size"),
        expert_bias=True,  # gate_up_proj_bias and down_proj_bias
        router_bias=True,  # the router is a Linear with a bias
    )
    return _llama_like(f, qkv_bias=f.bool("attention_bias", True), window=window,
                       window_layers=window_layers, sinks=True, moe=moe,
                       notes=("one learned sink logit per head and layer (counted in attention; "
                              "it takes weight in the softmax and caches nothing)",))


def _falcon(f: _Fields) -> ModelGeometry:
    c = f.int("hidden_size")
    h = f.int("num_attention_heads", "n_head")
    new_arch = f.bool("new_decoder_architecture", False)
    if new_arch:
        hkv = f.int("num_kv_heads", "n_head_kv", default=h, allow_none=True) or h
        norms = f.int("num_ln_in_parallel_attn", default=2, allow_none=True) or 2
    elif f.bool("multi_query", True):
        hkv = 1  # HF Falcon: multi_query wins over num_kv_heads in the old architecture
        norms = 1 if f.bool("parallel_attn", True) else 2
    else:
        hkv = f.int("num_kv_heads", default=h, allow_none=True) or h
        norms = 1 if f.bool("parallel_attn", True) else 2
    error = divisibility_error("num_attention_heads", h, "num_kv_heads", hkv)
    if error is not None:
        f._fail(error)
    bias = f.bool("bias", False)
    d_ff = f.int("ffn_hidden_size", default=None, allow_none=True) or 4 * c
    return _layernorm_decoder(
        f, c, h, hkv, layers=("num_hidden_layers", "n_layer"), d_ff=d_ff, bias=bias, ffn_bias=bias,
        tied=f.bool("tie_word_embeddings", True), norms_per_layer=norms,
        context_length=f.int("max_position_embeddings", default=None, allow_none=True),
        notes=("query_key_value is fused: (H + 2*Hkv)*D outputs",))


def _deepseek(f: _Fields) -> ModelGeometry:
    c = f.int("hidden_size")
    h = f.int("num_attention_heads")
    n_layers = f.int("num_hidden_layers")
    attention = LatentGeometry(
        c, h,
        kv_rank=f.int("kv_lora_rank"),
        q_rank=f.int("q_lora_rank", default=None, allow_none=True),
        head_dim=f.int("qk_nope_head_dim"),
        rope_dim=f.int("qk_rope_head_dim", minimum=0),
        v_head_dim=f.int("v_head_dim"),
    )  # fmt: skip
    moe = None
    n_experts = f.int("n_routed_experts", default=None, allow_none=True)
    if n_experts:
        moe = MixtureOfExperts(
            n_experts=n_experts,
            top_k=f.int("num_experts_per_tok"),
            d_expert=f.int("moe_intermediate_size"),
            n_shared=f.int("n_shared_experts", default=0, allow_none=True, minimum=0) or 0,
            first_dense=f.int("first_k_dense_replace", default=0, minimum=0),
            layer_freq=f.int("moe_layer_freq", default=1),
            router_bias=f.data.get("topk_method") == "noaux_tc",
        )
    notes = ["num_key_value_heads is ignored: MLA caches the latent "
             "(kv_lora_rank + qk_rope_head_dim per token per layer)"]
    mtp = f.int("num_nextn_predict_layers", default=0, allow_none=True, minimum=0)
    if mtp:
        notes.append(f"the {mtp} multi-token-prediction layer(s) (num_nextn_predict_layers) are "
                     "not counted: transformers does not load them")
    return ModelGeometry(
        attention=attention,
        n_layers=n_layers,
        vocab_size=f.int("vocab_size"),
        ffn=FeedForward(f.int("intermediate_size")),
        moe=moe,
        tied_embeddings=f.bool("tie_word_embeddings", False),
        context_length=_context(f),
        notes=tuple(notes),
    )


READERS: dict[str, Callable[[_Fields], ModelGeometry]] = {
    "bert": _bert,
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
    "falcon": _falcon,
    "gemma": _gemma,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "gemma3_text": _gemma3_text,
    "gpt2": _gpt2,
    "gpt_neox": _gpt_neox,
    "gpt_oss": _gpt_oss,
    "llama": _llama,
    "mistral": _mistral,
    "mixtral": _mixtral,
    "phi3": _phi3,
    "qwen2": _qwen2,
    "qwen2_moe": _qwen2_moe,
    "qwen3": _qwen3,
    "qwen3_moe": _qwen3_moe,
}
_ALIASES = {"RefinedWebModel": "falcon", "RefinedWeb": "falcon"}
SUPPORTED = ", ".join(READERS)


def read_config(source, name: str | None = None) -> ModelGeometry:
    """A `ModelGeometry` from a config.json path, a model folder holding one, a dict, or the
    name of a preset (`"llama-3-8b"`, see `multihead.plan.presets`; a file or folder of that
    name wins).

    Raises ValueError naming the file and what is wrong: unreadable, larger than
    MAX_CONFIG_BYTES, not UTF-8, not JSON (or nested too deeply), not a model config, an
    unknown `model_type` (listing the supported families), a missing or bad field.
    """
    if isinstance(source, Mapping):
        data, label = source, name or "config"
    elif isinstance(source, (str, os.PathLike)):
        label = os.fspath(source)
        if not os.path.lexists(source):
            preset = find_preset(label) if isinstance(source, str) else None
            if preset is None:
                raise ValueError(f"cannot read {label}: no such file or folder, and no preset of that name"
                                 f"{did_you_mean(label)} (presets: {', '.join(PRESETS)}; `multihead plan "
                                 "--list-models` lists them)")
            return read_config(preset_config(preset.name), name=name or preset.name)
        if os.path.isdir(source):
            source = os.path.join(source, "config.json")
            if not os.path.isfile(source):
                raise ValueError(f"{label} is a folder without a config.json; give a Hugging Face "
                                 "model folder or the path of its config.json")
            label = os.fspath(source)
        _check_regular(source, label)
        data = _load_json(source, label)
    else:
        raise TypeError(f"read_config takes a path or a dict; received {type(source).__name__}")
    # ValueError, not TypeError, for the wrong JSON types below: the file is the bad value
    if not isinstance(data, Mapping):
        raise ValueError(f"{label} is not a model config: expected a JSON object, received "
                         f"a {type(data).__name__}")
    model_type = data.get("model_type")
    if model_type is None:
        keys = ", ".join(_short(k, 30) for k in list(data)[:6]) or "none"
        raise ValueError(f"{label} is not a model config: it has no 'model_type' (keys: {keys}); "
                         f"supported families: {SUPPORTED}")
    if not isinstance(model_type, str):
        raise ValueError(f"{label}: field 'model_type' must be a string such as \"llama\"; received "
                         f"{_short(model_type)}; supported: {SUPPORTED}")
    family = _ALIASES.get(model_type, model_type)
    if family not in READERS:
        raise ValueError(f"{label}: unknown model_type {_short(model_type)}; supported: {SUPPORTED}")
    try:
        model = READERS[family](_Fields(data, family, label))
    except (ValueError, TypeError) as err:
        # A geometry that rejects the combination of fields (e.g. top_k > n_experts).
        msg = str(err)
        raise ValueError(msg if msg.startswith(label) else f"{label}: {msg}") from None
    model_name = name or data.get("_name_or_path") or _stem(label) or family
    return _renamed(model, str(model_name)[:80], family)


def _check_regular(path, label: str) -> None:
    """Refuse a named pipe, socket or device before opening it: opening a pipe nobody
    writes to blocks forever, and a device is never a config. (A missing file is left to
    the reader, which names it.)"""
    import stat

    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode):
        kind = ("a named pipe" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
        raise ValueError(f"{label} is {kind}, not a regular file; give the path of a config.json "
                         "(or a model folder holding one)")


def _load_json(path, label: str):
    """At most MAX_CONFIG_BYTES of UTF-8 JSON; every failure a ValueError naming the file
    (and the field), through the library's one bounded reader."""
    from multihead.files import read_json

    return read_json(path, what="Hugging Face config.json", max_bytes=MAX_CONFIG_BYTES)


def _stem(label: str) -> str:
    base = os.path.basename(label)
    if base == "config.json":  # a model directory: use its name
        base = os.path.basename(os.path.dirname(os.path.abspath(label)))
    return base.removesuffix(".json")


def _renamed(model: ModelGeometry, name: str, family: str) -> ModelGeometry:
    from dataclasses import replace

    return replace(model, name=name, family=family)
