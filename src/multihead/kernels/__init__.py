"""The attention kernels, one file per backend and one home per formula.
`multihead.functional` stays the public face: `scaled_dot_product_attention`,
`attend`, `attention_weights` and the backend registry are imported from there.

- `registry`: `Backend`, `register_backend`, `available_backends`, `resolve_backend`
  ("auto", at call time) and `get_backend` (what a backend cannot do, with the backends
  that can).
- `backends`: the built-in backends registered in their listed order ("math", "sdpa",
  "chunked", "tiles", "flex"); flex's module is imported on its first call only.
- `sdpa`: torch's fused kernel ("sdpa"), bottom-right causal, GQA without copies, weights
  from the weights pass, exact second derivatives.
- `planner`: the tiles of the score matrix a mask keeps (empty / full / partial), causal
  squares, per-block masks.
- `fused_tiles`: the block-sparse engine on torch's fused kernel (`sdpa` with a predicate
  or an additive mod), pieces merged by log-sum-exp on the CPU.
- `explicit_tiles`: the online-softmax tile engine ("tiles": any score mod, dropout) with
  its FlashAttention-2 backward.
- `flex`: the opt-in "flex" backend, torch's compiled flex_attention with cached block
  masks.
- `math`: the explicit paths ("math", "chunked") and the weights pass.
- `validation`: the checks of q, k, v, masks, scale, score mods and weight heads.
- `common`: what every engine shares (accumulation dtype, index tensors, the MQA split,
  the causal triangle, the masked softmax and a block's softmax with its log-sum-exp, the
  log-sum-exp a backward reads, the log-sum-exp merge of partial attentions, whole or
  running (ring attention), softcap).
"""
