"""The attention kernels, one home per formula (issue 20, "The house": being moved here in
small steps). `multihead.functional` stays the public face: `scaled_dot_product_attention`,
`attend` and the backend registry are imported from there.

- `registry`: `Backend`, `register_backend`, `available_backends`, `resolve_backend`
  ("auto", at call time) and `get_backend` (what a backend cannot do, with the backends
  that can).
- `math`: the explicit paths ("math", "chunked") and the weights pass.
- `validation`: the checks of q, k, v, masks, scale, score mods and weight heads.
- `common`: what every engine shares (accumulation dtype, index tensors, the MQA split,
  the causal triangle, the log-sum-exp merge of partial attentions).
"""
