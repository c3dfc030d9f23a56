"""Text to token ids the way a model's tokenizer does it, for every tool that builds inputs.

A model is trained on its tokenizer's output, special tokens included: Gemma's tokenizer
puts `<bos>` before every text and the model needs it (without it IOI reads upside
down), SmolLM2's puts nothing. So a task or a tool never tokenizes with
`add_special_tokens=False` alone: it asks `prefix(tokenizer)` for the ids the tokenizer
puts before a text and starts every sequence with them, windows cut from a long token
stream included. `next_token` is the one reading of "the token a model writes after this
text" (an --answer or --wrong) that `heads scan` and `heads path` share. A leaf on the lowest
floor (it imports nothing of multihead's), so the loaders, the tools and lab all read it.
"""

from __future__ import annotations

__all__ = ["check_ids_fit", "next_token", "pieces", "prefix", "windows"]

_PROBE = "a"  # any ordinary text: what the tokenizer adds around it is what it adds around every text


def pieces(tokenizer, text: str) -> list[int]:
    """The ids of `text` alone, no special tokens: a piece to place inside a sequence."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def prefix(tokenizer) -> list[int]:
    """The ids `tokenizer` puts before every text by default (Gemma's `<bos>`; none for
    SmolLM2 or GPT-2), read from the tokenizer itself rather than from `bos_token_id`,
    which many tokenizers define without adding it."""
    if not callable(tokenizer) or not hasattr(tokenizer, "convert_ids_to_tokens"):
        raise TypeError(f"prefix reads a Hugging Face tokenizer; received {type(tokenizer).__name__}")
    full = list(tokenizer(_PROBE)["input_ids"])
    body = pieces(tokenizer, _PROBE)
    for k in range(len(full) - len(body) + 1):
        if full[k:k + len(body)] == body:
            return full[:k]
    return []


def next_token(model, flag: str, text: str, token: str) -> tuple[int, str]:
    """The id and piece of `token` as the model would write it right after `text`: after a
    text that ends in a letter or digit, a BPE tokenizer's space-led piece (" Mary", not
    "Mary", which is another token). `model` is a Hugging Face tokenizer, a loaded model
    holding one (`.tokenizer`), or a lab model (`.encode`, a character vocabulary: the token
    as written). ValueError naming `flag` unless that is exactly one token the tokenizer
    knows (not its unknown token)."""
    if not isinstance(token, str):
        raise TypeError(f"{flag} must be a str, the token the text should continue with; received {token!r} "
                        f"({type(token).__name__})")
    if not token.strip():
        raise ValueError(f"{flag} is empty; give the token the text should continue with, e.g. {flag} Mary")
    tokenizer = getattr(model, "tokenizer", model)
    if not hasattr(tokenizer, "convert_ids_to_tokens"):  # a lab model: no pieces, no spaces to lead them
        ids = model.encode(token)
        if len(ids) != 1:
            raise ValueError(f"{flag} {token!r} is {len(ids)} tokens for this model; give one token")
        return ids[0], token
    piece = " " + token if text[-1:].isalnum() and not token[:1].isspace() else token
    base, full = pieces(tokenizer, text), pieces(tokenizer, text + piece)
    new = full[len(base):] if full[:len(base)] == base else pieces(tokenizer, piece)
    shown = tokenizer.convert_ids_to_tokens(new)
    if len(new) != 1:
        raise ValueError(f"{flag} {token!r} is {len(new)} tokens after the text ({piece!r} -> {shown}) for this "
                         "model's tokenizer; give one token")
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is not None and new[0] == unk and token.strip() != getattr(tokenizer, "unk_token", None):
        raise ValueError(f"{flag} {token!r} is not in this model's vocabulary (it would be read as "
                         f"{tokenizer.unk_token}); give a token it has")
    return new[0], shown[0]


def check_ids_fit(model, inputs, what: str = "the inputs") -> None:
    """ValueError when a token id of `inputs` (ids, or a dict holding "input_ids") is outside
    the model's embedding table (a folder whose tokenizer belongs to another model): the
    forward would fail deep inside with an index error."""
    get = getattr(model, "get_input_embeddings", None)
    table = get() if callable(get) else None
    rows = getattr(table, "num_embeddings", None)
    ids = inputs.get("input_ids") if hasattr(inputs, "get") else inputs
    if not rows or ids is None or not hasattr(ids, "numel") or not ids.numel():
        return
    top = int(ids.max())
    if top >= rows:
        raise ValueError(f"{what} hold token id {top}, and the model's vocabulary has {rows} ids (0-{rows - 1}): "
                         "the folder's tokenizer does not belong to this model")


def windows(start: list[int], body, offsets, n: int):
    """`(len(offsets), n)` token ids cut from a long token stream `body` (a 1-D tensor of its
    pieces): each row the tokenizer's prefix `start` (its BOS, if any) then
    `body[o : o + n - len(start)]`, so a window read mid-stream begins as every text does
    for the model. With no prefix it is the plain cut."""
    import torch

    k = n - len(start)
    head = torch.tensor(start, dtype=torch.long)
    return torch.stack([torch.cat([head, body[int(o):int(o) + k]]) for o in offsets])
