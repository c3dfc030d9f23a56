"""The tasks `multihead heads` measures heads with.

Decoders: IOI pairs (Wang et al., 2022) and repeated random tokens (Olsson et al.,
2022); sentence encoders: verse-half retrieval on the bundled King James Bible
(InfoNCE, van den Oord et al., 2018); causal LMs: next-token loss on the verses.

Details: docs/heads.md, "The tasks: IOI, induction, verse retrieval".
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import Tensor

from multihead.checks import is_int
from multihead.corpus import load_corpus
from multihead.heads.metrics import AtPositions
from multihead.tokens import pieces, prefix

TEMPERATURE = 0.05
POOL = 32  # candidates per retrieval
MAX_COUNT = 100_000  # pairs or sequences: beyond it a task would not finish being drawn


def kjv_verses(n: int, start: int = 0, min_words: int = 8, path: str | None = None, stride: int = 1) -> list[str]:
    """n verses (lines of >= min_words words): every `stride`-th from the `start`-th on, of the
    bundled KJV or a UTF-8 file (a stride spreads them over the book: neighbouring verses,
    a genealogy's, are too alike to tell apart)."""
    text, _ = load_corpus(path)  # refuses a device or pipe (/dev/zero would be read forever)
    out = []
    lines = [line.strip() for line in text.splitlines() if len(line.split()) >= min_words]
    stride = max(1, min(stride, len(lines) // max(1, n)))  # a short corpus: as spread as it allows
    for line in lines[start::stride]:
        out.append(line)
        if len(out) == n:
            break
    if len(out) < 2:
        raise ValueError(f"the corpus has {len(out)} lines of {min_words}+ words from line {start}; need at least 2")
    return out


def halves(verses: list[str]) -> tuple[list[str], list[str]]:
    a, b = [], []
    for v in verses:
        w = v.split()
        a.append(" ".join(w[:len(w) // 2]))
        b.append(" ".join(w[len(w) // 2:]))
    return a, b


def embed(model, tokenizer, texts: list[str], max_length: int = 64) -> Tensor:
    """Mean-pooled, L2-normalized last hidden states `(N, C)` (sentence-transformers' recipe)."""
    enc = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    out = model(**enc, output_hidden_states=True)
    # a model with an LM head returns logits first: the embedding is its last hidden state
    h = getattr(out, "last_hidden_state", None)
    h = out.hidden_states[-1] if h is None else h  # (N, T, C)
    keep = enc["attention_mask"].unsqueeze(-1).to(h.dtype)
    return F.normalize((h * keep).sum(1) / keep.sum(1).clamp_min(1), dim=-1)


def contrastive_loss(model, tokenizer, verses: list[str]) -> Tensor:
    """InfoNCE of first halves against the batch's second halves (temperature 0.05)."""
    a, b = halves(verses)
    sim = embed(model, tokenizer, a) @ embed(model, tokenizer, b).T / TEMPERATURE  # (N, N)
    return F.cross_entropy(sim, torch.arange(len(verses)))


def retrieval_accuracy(model, tokenizer, verses: list[str], pool: int = POOL) -> float:
    """Top-1 accuracy of finding each first half's second half among the `pool` second halves
    of its group (the verses taken `pool` at a time; a last short group is left out)."""
    a, b = halves(verses)
    pool = min(pool, len(verses))
    hits = []
    with torch.no_grad():
        ea, eb = embed(model, tokenizer, a), embed(model, tokenizer, b)
    for s in range(0, len(verses) - pool + 1, pool):
        sim = ea[s:s + pool] @ eb[s:s + pool].T
        hits.append(sim.argmax(1) == torch.arange(pool))
    return torch.cat(hits).float().mean().item()


def logits(model, out) -> Tensor:
    """A run's logits; a base model's: last hidden states @ input embeddings^T."""
    if isinstance(out, Tensor):
        return out
    lg = getattr(out, "logits", None)
    if isinstance(lg, Tensor):
        return lg
    h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return h @ model.get_input_embeddings().weight.T


def next_token_loss(logits_: Tensor, ids: Tensor) -> Tensor:
    return F.cross_entropy(logits_[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


# ------------------------------------------------------------------ tasks for decoders

# Wang et al. (2022), "Interpretability in the wild": the IOI templates (their BABA set; an
# ABBA prompt is the same text with the first two names swapped). {A} is the indirect
# object, {B} the subject, who is named twice.
IOI_TEMPLATES = (
    "Then,{B} and{A} went to the{PLACE}.{B} gave a{OBJECT} to",
    "Then,{B} and{A} had a lot of fun at the{PLACE}.{B} gave a{OBJECT} to",
    "When{B} and{A} got a{OBJECT} at the{PLACE},{B} decided to give it to",
    "When{B} and{A} went to the{PLACE},{B} gave the{OBJECT} to",
    "After{B} and{A} went to the{PLACE},{B} gave a{OBJECT} to",
    "While{B} and{A} were working at the{PLACE},{B} gave a{OBJECT} to",
    "Friends{B} and{A} found a{OBJECT} at the{PLACE}.{B} gave it to",
    "The{PLACE}{B} and{A} went to had a{OBJECT}.{B} gave it to",
)
IOI_PLACES = (" store", " garden", " restaurant", " school", " hospital", " office", " house", " station")
IOI_OBJECTS = (" ring", " kiss", " bone", " basketball", " computer", " necklace", " drink", " snack")
# Common English first names; `ioi` keeps those that are one token, with their leading space,
# for the tokenizer at hand (SmolLM2's keeps 70 of these 80).
IOI_NAMES = (
    "Mary", "John", "Tom", "James", "Dan", "Sid", "Martin", "Amy", "Anna", "Laura", "Lisa", "Sarah", "Michael",
    "David", "Robert", "Paul", "Mark", "George", "Kevin", "Jason", "Ryan", "Eric", "Peter", "Adam", "Alex",
    "Ben", "Sam", "Max", "Jack", "Joe", "Bob", "Steve", "Frank", "Scott", "Andrew", "Richard", "Thomas", "William",
    "Daniel", "Matthew", "Emily", "Emma", "Kate", "Jane", "Rachel", "Rose", "Grace", "Alice", "Ruth", "Helen",
    "Linda", "Susan", "Karen", "Nancy", "Julia", "Claire", "Lucy", "Sophie", "Nina", "Eva", "Carl", "Henry",
    "Louis", "Victor", "Simon", "Tony", "Fred", "Harry", "Ian", "Luke", "Dean", "Jeff", "Neil", "Roy", "Ray",
    "Karl", "Leo", "Hugo", "Oscar", "Ted",
)


def _tokenizer_of(tokenizer):
    """A Hugging Face tokenizer, from itself or from something that holds one (a LoadedModel)."""
    tok = getattr(tokenizer, "tokenizer", tokenizer)
    if not callable(tok) or not hasattr(tok, "convert_ids_to_tokens"):
        raise TypeError(f"tokenizer must be a Hugging Face tokenizer, or a loaded model that holds one (its "
                        f".tokenizer); received {type(tokenizer).__name__}")
    return tok


def _check_count(name: str, value, low: int) -> None:
    if not is_int(value):
        raise TypeError(f"{name} must be an int; received {type(value).__name__}")
    if not low <= value <= MAX_COUNT:
        shown = value if len(str(value)) <= 20 else f"{str(value)[:12]}... ({len(str(value))} digits)"
        raise ValueError(f"{name} must be between {low} and {MAX_COUNT:,}; received {shown}")


def _check_seed(seed) -> int | None:
    if seed is not None and not is_int(seed):
        raise TypeError(f"seed must be an int, or None for a fresh draw; received {type(seed).__name__}")
    return None if seed is None else operator.index(seed)


def single_token_names(tokenizer, names=IOI_NAMES) -> list[tuple[str, int]]:
    """(name, id) for the names that are one token of `tokenizer` with a leading space
    (" Mary"): the piece a model writes after a word. Unknown pieces ([UNK]) are left out."""
    tok = _tokenizer_of(tokenizer)
    unk = getattr(tok, "unk_token_id", None)
    out = []
    for name in names:
        ids = pieces(tok, " " + name)
        if len(ids) == 1 and ids[0] != unk and tok.decode(ids).strip() == name:
            out.append((name, ids[0]))
    return out


def _pad(rows: list[list[int]], pad: int) -> tuple[Tensor, Tensor]:
    """Right-padded ids `(N, T)` and their attention mask: a causal model's real positions
    never see the padding, so their logits are those of the unpadded text."""
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
    return ids, mask


def _refuse_unknown(tok, text: str, ids: list[int]) -> None:
    """A prompt the tokenizer reads partly as its unknown token is not the task: refused."""
    unk = getattr(tok, "unk_token_id", None)
    if unk is not None and unk in ids:
        unknown = sum(i == unk for i in ids)
        raise ValueError(f"this tokenizer reads {unknown} of the {len(ids)} tokens of the IOI prompt {text!r} as "
                         f"its unknown token {getattr(tok, 'unk_token', unk)!r}; IOI needs a tokenizer that knows "
                         "ordinary English words (a language model's own)")


@dataclass(frozen=True, eq=False)
class IOITask:
    """Indirect-object identification pairs (Wang et al., 2022), ready for `patch_scan`:

        table = heads.patch_scan(model, task.clean, task.corrupted, task.metric)

    clean, corrupted, reference: `{"input_ids", "attention_mask"}` `(N, T)`, right-padded
        (a pair's clean and corrupted have the same tokens but one), each prompt as the
        tokenizer reads it by default: after its BOS where it puts one (Gemma's `<bos>`). `reference` is Wang
        et al.'s "ABC" distribution (three different names, same templates): the inputs a
        mean ablation averages over.
    answer, wrong: `(N,)` the indirect object's and the subject's name tokens (" Mary").
    position: `(N,)` each prompt's last real token, where the metric is read.
    """

    clean: dict
    corrupted: dict
    reference: dict
    answer: Tensor
    wrong: Tensor
    position: Tensor
    texts: tuple[str, ...]
    corrupted_texts: tuple[str, ...]
    reference_texts: tuple[str, ...]
    orders: tuple[str, ...]  # "ABBA" or "BABA", per pair

    def __len__(self) -> int:
        return len(self.texts)

    def logit_diff(self, logits: Tensor) -> Tensor:
        """Per pair `(N,)`: logit(IO) - logit(S) at the last real token."""
        if not isinstance(logits, Tensor) or logits.dim() != 3 or logits.shape[0] != len(self):
            shape = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
            raise ValueError(f"the IOI metric reads logits (N={len(self)}, T, vocab) of this task's {len(self)} "
                             f"prompts; received {shape}")
        rows = torch.arange(len(self), device=logits.device)
        return self._diff_at_last(logits[rows, self.position.to(logits.device)])

    def _diff_at_last(self, last: Tensor) -> Tensor:
        """`(N,)` logit(IO) - logit(S) from `(N, vocab)` logits at each prompt's last real token."""
        rows = torch.arange(len(self), device=last.device)
        return last[rows, self.answer.to(last.device)] - last[rows, self.wrong.to(last.device)]

    def _mean_diff_at_last(self, last: Tensor) -> Tensor:
        return self._diff_at_last(last).mean()

    @cached_property
    def metric(self) -> AtPositions:
        """logit(IO) - logit(S) at the last token, averaged over the pairs: a scalar of the
        `(N, T, vocab)` logits. It reads one position per prompt (an `AtPositions`), so the
        scans compute the model's head there only."""
        return AtPositions(self._mean_diff_at_last, self.position, name="the IOI metric")


def ioi(n: int, seed: int = 0, *, tokenizer, templates=IOI_TEMPLATES, names=IOI_NAMES) -> IOITask:
    """`n` IOI prompt pairs in the style of Wang et al. (2022).

    Each pair draws a template, a place, an object and two names (one token each for
    `tokenizer`, with a leading space); half the pairs are ABBA ("When Mary and John ...,
    John gave a drink to"), half BABA ("When John and Mary ..., John ..."). The answer is
    the indirect object (Mary), the wrong answer the subject (John). The corrupted prompt
    has the subject's second occurrence replaced by the indirect object ("..., Mary gave a
    drink to": the same number of tokens, and now John is the answer), so the metric
    logit(IO) - logit(S) is positive on clean prompts and negative on corrupted ones for a
    model that does the task. The reference prompts name a third person there instead
    ("ABC": no name repeats), for mean ablation. Every prompt starts with the special
    tokens the tokenizer puts before a text (Gemma's `<bos>`; none for SmolLM2), as the
    model was trained; a prompt the tokenizer reads partly as its unknown token is refused.

    Args:
        n: number of pairs (1 to 100,000).
        seed: the draw (the same seed gives the same pairs; None: a fresh one).
        tokenizer: a Hugging Face tokenizer, or a loaded model holding one (`.tokenizer`).
        templates: texts with {A} (the indirect object), {B} (the subject, twice), {PLACE}
            and {OBJECT}; each placeholder stands where a space-led word goes.
        names: candidate names; those that are not one token are skipped.
    """
    import random

    _check_count("n (the number of pairs)", n, 1)
    seed = _check_seed(seed)
    tok = _tokenizer_of(tokenizer)
    start = prefix(tok)  # the tokenizer's own BOS, if it adds one: the model was trained with it
    pool = single_token_names(tok, names)
    if len(pool) < 3:
        raise ValueError(f"IOI needs at least 3 names that are one token of this tokenizer (with a leading space); "
                         f"{len(pool)} of the {len(names)} candidates are: {[p for p, _ in pool]}")
    bad = [t for t in templates if t.count("{B}") != 2 or t.count("{A}") != 1]
    if not templates or bad:
        raise ValueError(f"each IOI template names {{A}} once and {{B}} twice; received {bad or list(templates)!r}")
    rng = random.Random(seed)
    rows: dict[str, list] = {k: [] for k in ("clean", "corrupted", "reference", "io", "s", "texts", "ctexts",
                                              "rtexts", "orders")}
    for i in range(n):
        order = "ABBA" if i % 2 == 0 else "BABA"
        for _ in range(100):  # a draw whose texts tokenize apart at the names (nearly always the first)
            template = rng.choice(templates)
            place, obj = rng.choice(IOI_PLACES), rng.choice(IOI_OBJECTS)
            (a, a_id), (b, b_id), (c, _) = rng.sample(pool, 3)
            x, y = (a, b) if order == "ABBA" else (b, a)  # the first two names; the template reads BABA
            parts = template.replace("{PLACE}", place).replace("{OBJECT}", obj).split("{B}", 1)
            head, tail = parts[0], parts[1]
            base = head + "{X}" + tail.replace("{A}", "{Y}", 1).replace("{B}", "{Z}", 1)

            def fill(x, y, z, base=base):
                return base.replace("{X}", " " + x).replace("{Y}", " " + y).replace("{Z}", " " + z)
            texts = (fill(x, y, b), fill(x, y, a), fill(x, y, c))
            ids = [start + pieces(tok, t) for t in texts]
            differ = [k for k in range(len(ids[0])) if len(ids[1]) == len(ids[0]) and ids[0][k] != ids[1][k]]
            if (len({len(x) for x in ids}) == 1 and len(differ) == 1 and ids[0][differ[0]] == b_id
                    and ids[1][differ[0]] == a_id):
                break
        else:
            raise ValueError("could not draw IOI prompts whose clean and corrupted texts differ in one token for "
                             "this tokenizer (names merge with their neighbours)")
        _refuse_unknown(tok, texts[0], ids[0])
        for key, value in zip(("clean", "corrupted", "reference"), ids):
            rows[key].append(value)
        rows["io"].append(a_id)
        rows["s"].append(b_id)
        rows["texts"].append(texts[0])
        rows["ctexts"].append(texts[1])
        rows["rtexts"].append(texts[2])
        rows["orders"].append(order)
    pad = next((p for p in (getattr(tok, "pad_token_id", None), getattr(tok, "eos_token_id", None)) if p is not None),
               0)
    inputs = {}
    for key in ("clean", "corrupted", "reference"):
        ids, mask = _pad(rows[key], pad)
        inputs[key] = {"input_ids": ids, "attention_mask": mask}
    position = inputs["clean"]["attention_mask"].sum(1) - 1
    return IOITask(inputs["clean"], inputs["corrupted"], inputs["reference"], torch.tensor(rows["io"]),
                   torch.tensor(rows["s"]), position, tuple(rows["texts"]), tuple(rows["ctexts"]),
                   tuple(rows["rtexts"]), tuple(rows["orders"]))


@dataclass(frozen=True, eq=False)
class InductionTask:
    """Repeated random tokens (Olsson et al., 2022), ready for `patch_scan`:

    clean: `(N, 2L)` (after a BOS column where there is one, `(N, 2L + 1)`): L random
        tokens, then the same L again. An induction head at a repeated token attends to
        the token after that token's first occurrence and copies it.
    corrupted: the same second half after a different random first half: nothing to
        copy, so the second half is as hard as fresh text.
    reference: fresh random tokens `(N, 2L)` with no repeat, for mean ablation.
    metric(logits): the loss (mean next-token cross-entropy, nats) on the repeated half:
        the predictions of its tokens 2..L from their predecessors in it, which are the
        same in clean and corrupted. Lower is better.
    """

    clean: Tensor
    corrupted: Tensor
    reference: Tensor
    length: int
    offset: int  # the BOS columns before the first half (the tokenizer's own, or `bos`): 0 or 1

    def __len__(self) -> int:
        return self.clean.shape[0]

    def _loss(self, logits: Tensor, start: int) -> Tensor:
        if not isinstance(logits, Tensor) or logits.dim() != 3 or logits.shape[:2] != self.clean.shape:
            shape = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
            raise ValueError(f"the induction metric reads logits {tuple(self.clean.shape)} + (vocab,) of this "
                             f"task's sequences; received {shape}")
        a = start + self.offset
        b = a + self.length - 1
        pred = logits[:, a:b].float()  # (N, L - 1, vocab): positions that predict tokens a+1 .. b
        target = self.clean[:, a + 1:b + 1].to(logits.device)  # the same tokens in clean and corrupted
        return F.cross_entropy(pred.flatten(0, 1), target.flatten())

    def metric(self, logits: Tensor) -> Tensor:
        """The mean next-token loss on the repeated (second) half, in nats."""
        return self._loss(logits, self.length)

    def first_half_loss(self, logits: Tensor) -> Tensor:
        """The same loss on the first half of the clean sequences (nothing to copy yet)."""
        return self._loss(logits, 0)


def induction(n: int, length: int, seed: int | None = 0, *, vocab, bos: int | None | str = "auto") -> InductionTask:
    """`n` sequences of `length` random tokens repeated once (Olsson et al., 2022).

    Args:
        n: number of sequences (1 to 100,000).
        length: L, tokens per half (2 to 100,000).
        seed: the draw (None: a fresh one).
        vocab: where tokens are drawn from, uniformly: an int V (ids 0..V-1), a 1-D tensor
            or list of allowed ids (integers >= 0), or a Hugging Face tokenizer / loaded
            model (its ordinary tokens: no special or bracketed ones such as <|im_start|>).
        bos: a token id put before every sequence, None for none, or "auto" (the default):
            the special tokens a tokenizer `vocab` puts before every text (Gemma's <bos>;
            none for SmolLM2), none for ids.
    """
    _check_count("n", n, 1)
    _check_count("length", length, 2)
    seed = _check_seed(seed)
    pool, tok = _induction_pool(vocab)
    start = _induction_prefix(bos, tok, vocab)
    g = torch.Generator()
    g.manual_seed(seed) if seed is not None else g.seed()

    def draw(rows: int, cols: int) -> Tensor:
        return pool[torch.randint(pool.numel(), (rows, cols), generator=g)]
    first, other, ref = draw(n, length), draw(n, length), draw(n, 2 * length)
    clean = torch.cat([first, first], 1)  # (N, 2L)
    corrupted = torch.cat([other, first], 1)
    if start:
        cols = torch.tensor([start], dtype=torch.long).expand(n, len(start))
        clean, corrupted, ref = (torch.cat([cols, x], 1) for x in (clean, corrupted, ref))
    return InductionTask(clean, corrupted, ref, length, len(start))


def _induction_pool(vocab) -> tuple[Tensor, object]:
    """(the ids to draw from, the tokenizer or None), refusing ids that are not token ids."""
    import re

    if isinstance(vocab, bool):
        raise TypeError("vocab must be an int, a list or tensor of ids, or a tokenizer; received bool")
    if is_int(vocab):
        if vocab < 2:
            raise ValueError(f"vocab must be >= 2 tokens; received {vocab}")
        return torch.arange(operator.index(vocab)), None
    if type(vocab).__module__ == "numpy":  # an array of ids: its items as Python numbers
        vocab = vocab.ravel().tolist()
    if isinstance(vocab, (list, tuple, range, set, frozenset, Tensor)):
        items = vocab.flatten().tolist() if isinstance(vocab, Tensor) else list(vocab)
        bad = next((x for x in items if not is_int(x)), None)
        if bad is not None or (isinstance(vocab, Tensor) and (vocab.is_floating_point() or vocab.is_complex()
                                                               or vocab.dtype == torch.bool)):
            raise TypeError(f"vocab's ids must be integers; received {bad!r} ({type(bad).__name__})"
                            if bad is not None else f"vocab's ids must be integers; received a {vocab.dtype} tensor")
        if any(x < 0 for x in items):
            raise ValueError(f"vocab's ids must be >= 0; received {min(items)}")
        pool = torch.tensor([operator.index(x) for x in items], dtype=torch.long).unique()
    else:
        tok = _tokenizer_of(vocab)
        special = set(getattr(tok, "all_special_ids", ()))
        bracketed = re.compile(r"^(\[.*\]|<.*>|<\|.*\|>)$")
        pool = torch.tensor(sorted(i for t, i in tok.get_vocab().items() if i not in special
                                   and not bracketed.match(t)))
        if pool.numel() >= 2:
            return pool, tok
    if pool.numel() < 2:
        raise ValueError(f"vocab must offer at least 2 token ids; received {pool.numel()}")
    return pool, None


def _induction_prefix(bos, tok, vocab) -> list[int]:
    """The ids before every sequence: the tokenizer's own for "auto", else `bos` checked."""
    if isinstance(bos, str) and bos == "auto":
        return prefix(tok) if tok is not None else []
    if bos is None:
        return []
    if not is_int(bos):
        raise TypeError(f"bos must be a token id (an int), None or 'auto'; received {bos!r}")
    bos = operator.index(bos)
    size = operator.index(vocab) if is_int(vocab) else len(tok) if tok is not None else None
    if bos < 0 or (size is not None and bos >= size):
        valid = f"0 to {size - 1}" if size is not None else ">= 0"
        raise ValueError(f"bos must be a token id ({valid}); received {bos}")
    return [bos]
