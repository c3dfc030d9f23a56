"""The attention kernels, one home per formula (issue 20, "The house": being moved here in
small steps). `multihead.functional` stays the public face: `scaled_dot_product_attention`,
`attend` and the backend registry are imported from there.

- `common`: what every engine shares (accumulation dtype, index tensors, the MQA split,
  the causal triangle, the log-sum-exp merge of partial attentions).
"""
