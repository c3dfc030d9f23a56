"""The edge graph of the circuits tools, and its names (as Hanna et al.'s EAP-IG code names them).

Senders: the input, every head's output and every MLP's output; receivers: every head's
q/k/v inputs, every MLP's input and the logits; an edge exists when the sender runs
before the receiver reads. Gemma 2/3's post-attention norm makes a head's output its
share of the normed sum. An attention-only model (`mlp=False`) has no MLP senders or receivers.

Details: docs/heads-circuits-auto.md, "The edge graph's senders, receivers and names".
"""

from __future__ import annotations

import numbers
import re
from dataclasses import dataclass
from functools import cached_property

Node = str | tuple
Edge = tuple


@dataclass(frozen=True)
class Graph:
    """The edge graph of a model of `n_layers` layers, `n_heads` query and `n_kv_heads` KV heads each,
    and an MLP in each layer unless `mlp=False` (an attention-only model)."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    mlp: bool = True

    @property
    def per_layer(self) -> int:
        """Receivers per layer: H queries, Hkv keys, Hkv values, and one MLP where there is one."""
        return self.n_heads + 2 * self.n_kv_heads + self.mlp

    @cached_property
    def senders(self) -> list[Node]:
        out: list[Node] = ["input"]
        for layer in range(self.n_layers):
            out += [(layer, h) for h in range(self.n_heads)] + ([("mlp", layer)] if self.mlp else [])
        return out

    @cached_property
    def receivers(self) -> list[Node]:
        out: list[Node] = []
        for layer in range(self.n_layers):
            out += [(layer, h, "q") for h in range(self.n_heads)]
            out += [(layer, g, "k") for g in range(self.n_kv_heads)]
            out += [(layer, g, "v") for g in range(self.n_kv_heads)]
            if self.mlp:
                out.append(("mlp", layer))
        return out + ["logits"]

    def first_sender(self, layer: int) -> int:
        """The index of layer `layer`'s first head among the senders (= the senders before it)."""
        return 1 + layer * (self.n_heads + self.mlp)

    @cached_property
    def prefix(self) -> list[int]:
        """Per receiver (in `receivers` order), how many senders (a prefix) it reads."""
        out = []
        for layer in range(self.n_layers):
            out += [self.first_sender(layer)] * (self.n_heads + 2 * self.n_kv_heads)
            if self.mlp:
                out.append(self.first_sender(layer) + self.n_heads)
        return out + [len(self.senders)]

    @cached_property
    def sender_index(self) -> dict:
        return {s: i for i, s in enumerate(self.senders)}

    @cached_property
    def receiver_index(self) -> dict:
        return {r: i for i, r in enumerate(self.receivers)}

    @cached_property
    def edges(self) -> list[Edge]:
        """Every edge, receiver by receiver (in `receivers` order), senders in their order."""
        return [(self.senders[s], r) for r, n in zip(self.receivers, self.prefix) for s in range(n)]

    @cached_property
    def edge_index(self) -> dict:
        """edge -> (receiver index, sender index)."""
        return {(self.senders[s], r): (i, s) for i, (r, n) in enumerate(zip(self.receivers, self.prefix))
                for s in range(n)}

    def __len__(self) -> int:
        return sum(self.prefix)


def node_name(node: Node) -> str:
    """`input`, `a3.h2`, `m3`, `a3.h2<q>`, `a3.g1<k>`, `a3.g1<v>`, `logits`."""
    if node in ("input", "logits"):
        return node
    if len(node) == 2 and node[0] == "mlp":
        return f"m{node[1]}"
    if len(node) == 2:
        return f"a{node[0]}.h{node[1]}"
    layer, i, via = node
    return f"a{layer}.h{i}<q>" if via == "q" else f"a{layer}.g{i}<{via}>"


def edge_name(edge: Edge) -> str:
    """`"{sender}->{receiver}"`: `a0.h1->a2.h0<q>`, `input->logits`."""
    return f"{node_name(edge[0])}->{node_name(edge[1])}"


_NODE = re.compile(r"^(?:(input|logits)|m(\d+)|a(\d+)\.h(\d+)(?:<(q)>)?|a(\d+)\.g(\d+)<([kv])>)$", re.ASCII)


def parse_node(name: str) -> Node:
    """The node a name stands for (`"a3.g1<k>"` -> `(3, 1, "k")`); ValueError naming the forms."""
    m = _NODE.match(name.strip())
    if m is None:
        raise ValueError(f"{name!r} is not a node name; valid: input, a{{l}}.h{{h}}, m{{l}}, a{{l}}.h{{h}}<q>, "
                         "a{l}.g{g}<k>, a{l}.g{g}<v>, logits")
    word, mlp, al, ah, q, gl, gg, via = m.groups()
    if word:
        return word
    if mlp is not None:
        return ("mlp", int(mlp))
    if al is not None:
        return (int(al), int(ah), "q") if q else (int(al), int(ah))
    return (int(gl), int(gg), via)


def parse_edge(edge) -> Edge:
    """An edge from `(sender, receiver)` (nodes or names) or a `"sender->receiver"` name."""
    if isinstance(edge, str):
        if "->" not in edge:
            raise ValueError(f"{edge!r} is not an edge name; an edge is 'sender->receiver', e.g. 'a0.h1->a2.h0<q>'")
        s, r = edge.split("->", 1)
        return parse_node(s), parse_node(r)
    if isinstance(edge, tuple) and len(edge) == 2:
        return tuple(parse_node(n) if isinstance(n, str) else _node_tuple(n) for n in edge)
    raise TypeError(f"an edge is a (sender, receiver) pair or a 'sender->receiver' name; received "
                    f"{type(edge).__name__} {edge!r:.80}")


def _node_tuple(n):
    """A node given as a tuple (or list): `("mlp", l)`, `(l, h)` or `(l, i, "q" | "k" | "v")`, its indices ints
    (a float or a bool is refused, not rounded); TypeError naming the forms."""
    t = tuple(n) if isinstance(n, list) else n
    forms = "'input', 'logits', ('mlp', layer), (layer, head) or (layer, head, 'q' | 'k' | 'v') with int indices"
    if not isinstance(t, tuple) or len(t) not in (2, 3):
        raise TypeError(f"a node is {forms}; received {type(n).__name__} {n!r:.80}")
    # the positions that hold a word, and the words valid there
    words = {0: ("mlp",)} if len(t) == 2 and t[0] == "mlp" else {2: ("q", "k", "v")} if len(t) == 3 else {}
    out = []
    for i, x in enumerate(t):
        if i in words:
            if not isinstance(x, str) or x not in words[i]:
                raise TypeError(f"a node is {forms}; received {n!r:.80}")
            out.append(x)
        elif isinstance(x, bool) or not isinstance(x, numbers.Integral):
            raise TypeError(f"a node is {forms}; received {n!r:.80} (index {x!r} is {type(x).__name__})")
        else:
            out.append(int(x))
    return tuple(out)
