"""`multihead lab kv`: what do GQA, MQA and MLA cost and save?

At one geometry (default d_model 512, 8 heads of 64, a cache of N = 2048 tokens), for
MHA, GQA at several groupings, MQA and MLA at a few latent ranks, it measures on the
real modules and caches:

parameters, KV-cache bytes (each asserted equal to `multihead.plan`) and decode time per
token, MLA timed absorbed and naive. Nothing is trained: results.json and kv.png.

Details: docs/lab.md, "What `lab kv` measures".
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from multihead.checks import check_divisible, check_kv_heads, variant_name
from multihead.lab.configs import KVConfig
from multihead.lab.devices import seed_everything
from multihead.lab.plots import draw_plots, pyplot, save_figure
from multihead.lab.results import start_run, write_json_atomic
from multihead.lab.training import StepCallback

__all__ = ["KVConfig", "run_kv"]


def _variants(cfg: KVConfig):
    """(name, kind, module factory, plan geometry) for every variant."""
    from multihead import Attention, LatentAttention, plan

    out = []
    for hkv in cfg.kv_heads:
        check_kv_heads(cfg.n_heads, hkv, n_kv_heads_name="kv_heads")
        kind = variant_name(cfg.n_heads, hkv)
        name = kind if kind != "GQA" else f"GQA-{hkv}"
        out.append((name, kind, hkv, None,
                    lambda hkv=hkv: Attention(cfg.d_model, cfg.n_heads, hkv, bias=cfg.bias, causal=True),
                    plan.AttentionGeometry(cfg.d_model, cfg.n_heads, hkv, bias=cfg.bias)))
    for r in cfg.mla_ranks:
        out.append((f"MLA-{r}", "MLA", None, r,
                    lambda r=r: LatentAttention(cfg.d_model, cfg.n_heads, r, rope_dim=cfg.mla_rope_dim,
                                                causal=True, bias=cfg.bias),
                    plan.LatentGeometry(cfg.d_model, cfg.n_heads, r, rope_dim=cfg.mla_rope_dim, bias=cfg.bias)))
    return out


def run_kv(cfg: KVConfig | None = None, out_dir: str | Path = "lab-kv", *, seed: int = 0, device: str = "auto",
           callback: StepCallback | None = None, progress: bool = True) -> dict:
    """Measure every variant; write results.json and kv.png to `out_dir`; return the results."""
    from multihead import plan

    cfg = cfg or KVConfig()
    check_divisible("d_model", cfg.d_model, "n_heads", cfg.n_heads)
    dev, out, res, t0 = start_run("kv", cfg, out_dir, seed, device)
    rows: list[dict] = []
    res["results"] = {"rows": rows}
    variants = _variants(cfg)
    try:
        for i, (name, kind, hkv, rank, make, geom) in enumerate(variants, 1):
            seed_everything(seed)
            module = make().to(dev).eval()
            params = sum(p.numel() for p in module.parameters())
            row = {"name": name, "kind": kind, "n_kv_heads": hkv, "kv_rank": rank,
                   "rope_dim": cfg.mla_rope_dim if kind == "MLA" else None,
                   "params": params, "params_plan": plan.attention_params(geom)}
            for dtype, dname in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
                cache = module.new_cache(cfg.batch, cfg.context, dtype=dtype, device=dev)
                row[f"cache_bytes_{dname}"] = cache.nbytes
                row[f"cache_bytes_{dname}_plan"] = plan.kv_cache_bytes(geom, cfg.context, cfg.batch, dname)
                del cache
            row["cache_values_per_token"] = geom.kv_elements_per_token
            row["cache_bytes_per_token_bf16"] = plan.kv_cache_bytes(geom, 1, 1, "bf16")
            if kind == "MLA":
                row["decompressed_cache_bytes_bf16_plan"] = plan.kv_cache_bytes(
                    geom, cfg.context, cfg.batch, "bf16", decompressed=True)
            _check_agree(row)
            row["decode_us_per_token"], row["decode_us_spread"] = _decode_time(module, cfg, dev, absorb=None)
            if kind == "MLA":
                row["decode_naive_us_per_token"], _ = _decode_time(module, cfg, dev, absorb=False)
            rows.append(row)
            if progress:
                import sys

                print(f"kv [{i}/{len(variants)}] {name:<8} params {params:>9,}  cache {row['cache_bytes_fp32']:>11,} B "
                      f"(fp32)  decode {row['decode_us_per_token']:8.1f} us/token", file=sys.stderr, flush=True)
            if callback is not None:
                callback("kv", i, 0.0)
    except KeyboardInterrupt:
        res["interrupted"] = True
    mha = next((r for r in rows if r["kind"] == "MHA"), rows[0] if rows else None)
    for r in rows:
        r["cache_vs_mha"] = r["cache_bytes_fp32"] / mha["cache_bytes_fp32"]
        r["params_vs_mha"] = r["params"] / mha["params"]
        r["decode_vs_mha"] = r["decode_us_per_token"] / mha["decode_us_per_token"]
    res["results"]["plan_agrees"] = all(r["plan_agrees"] for r in rows)
    res["results"]["table"] = _table(cfg, rows)
    threads = torch.get_num_threads() if dev.type == "cpu" else None
    res["results"]["decode_threads"] = threads
    res["results"]["summary"] = _summary(cfg, rows, threads)
    res["elapsed_s"] = time.perf_counter() - t0
    write_json_atomic(out / "results.json", res)  # the numbers first: a plot that fails cannot lose them
    if rows:
        draw_plots(res, [lambda: _plot(cfg, rows, out / "kv.png", res["device"])])
        write_json_atomic(out / "results.json", res)
    return res


def _check_agree(row: dict) -> None:
    pairs = [("params", "params_plan"), ("cache_bytes_fp32", "cache_bytes_fp32_plan"),
             ("cache_bytes_bf16", "cache_bytes_bf16_plan")]
    bad = [f"{a} {row[a]:,} != plan {row[b]:,}" for a, b in pairs if row[a] != row[b]]
    row["plan_agrees"] = not bad
    if bad:
        raise AssertionError(f"{row['name']}: the module and multihead.plan disagree: " + "; ".join(bad))


@torch.no_grad()
def _decode_time(module, cfg: KVConfig, dev, absorb: bool | None) -> tuple[float, float]:
    """Median and (max - min) / 2 microseconds of a one-token step over ~N cached tokens."""
    steps = cfg.warmup_steps + cfg.decode_steps
    prefill = max(1, cfg.context - steps)
    kw = {} if absorb is None else {"absorb": absorb}
    cache = module.new_cache(cfg.batch, prefill + steps, device=dev)
    x = torch.randn(cfg.batch, prefill, cfg.d_model, device=dev)
    module(x, cache=cache, **({} if absorb is None else {"absorb": False}))
    tok = torch.randn(cfg.batch, 1, cfg.d_model, device=dev)
    times = []
    for i in range(steps):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        module(tok, cache=cache, **kw)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if i >= cfg.warmup_steps:
            times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times), (max(times) - min(times)) / 2


def _fmt_bytes(n: float) -> str:
    from multihead.plan.units import fmt_bytes

    return fmt_bytes(n)


def _table(cfg: KVConfig, rows: list[dict]) -> str:
    head = (f"{'variant':<8}  {'KV heads':>8}  {'params':>10}  {'cache fp32':>10}  {'cache bf16':>10}  "
            f"{'B/token bf16':>12}  {'vs MHA':>6}  {'decode us/tok':>13}")
    lines = [f"d_model {cfg.d_model}, {cfg.n_heads} heads, N = {cfg.context}, batch {cfg.batch}"
             + (f", MLA rope_dim {cfg.mla_rope_dim}" if cfg.mla_ranks else ""), head, "-" * len(head)]
    for r in rows:
        kvh = str(r["n_kv_heads"]) if r["kind"] != "MLA" else f"R={r['kv_rank']}"
        dec = f"{r['decode_us_per_token']:.0f}"
        if "decode_naive_us_per_token" in r:
            dec += f" ({r['decode_naive_us_per_token']:.0f} naive)"
        lines.append(f"{r['name']:<8}  {kvh:>8}  {r['params']:>10,}  {_fmt_bytes(r['cache_bytes_fp32']):>10}  "
                     f"{_fmt_bytes(r['cache_bytes_bf16']):>10}  {r['cache_bytes_per_token_bf16']:>12,}  "
                     f"{r['cache_vs_mha']:>6.3f}  {dec:>13}")
    return "\n".join(lines)


def _summary(cfg: KVConfig, rows: list[dict], threads: int | None = None) -> str:
    if not rows:
        return "No variant was measured."
    agree = all(r["plan_agrees"] for r in rows)
    mha = next((r for r in rows if r["kind"] == "MHA"), None)
    parts = [("Parameter counts and cache bytes of every module equal multihead.plan's formulas."
              if agree else "Some modules disagree with multihead.plan (see plan_agrees).")]
    if mha is not None:
        smallest = min(rows, key=lambda r: r["cache_bytes_fp32"])
        fastest = min(rows, key=lambda r: r["decode_us_per_token"])
        parts.append(f"The smallest cache is {smallest['name']}'s, {smallest['cache_vs_mha']:.3f} of MHA's "
                     f"({_fmt_bytes(smallest['cache_bytes_bf16'])} against {_fmt_bytes(mha['cache_bytes_bf16'])} "
                     f"in bf16 at N = {cfg.context}).")
        parts.append(f"The fastest decode step on this machine is {fastest['name']}'s, "
                     f"{fastest['decode_us_per_token']:.0f} us/token against MHA's {mha['decode_us_per_token']:.0f}.")
        mla = [r for r in rows if r["kind"] == "MLA" and "decode_naive_us_per_token" in r]
        for r in mla:
            parts.append(f"{r['name']}: the absorbed step is "
                         f"{_times(r['decode_us_per_token'], r['decode_naive_us_per_token'])} "
                         "than decompressing K/V each step.")
    if threads is not None:
        parts.append(f"Decode times are medians on {threads} CPU thread{'s' * (threads != 1)}"
                     + (" (the kv default: one thread is steadier on a shared machine; --threads N to change)"
                        if threads == 1 else "") + ".")
    return " ".join(parts)


def _times(t: float, other: float) -> str:
    """'1.2x faster' / '1.2x slower': t against other, the ratio always >= 1, so the word
    carries the direction (t = 1.2 * other is '1.2x slower', never '0.8x slower')."""
    if t <= other:
        return f"{other / t:.1f}x faster"
    return f"{t / other:.1f}x slower"


def _plot(cfg: KVConfig, rows: list[dict], path: Path, device: str) -> str:
    plt = pyplot()
    names = [r["name"] for r in rows]
    colours = {"MHA": "#4c72b0", "GQA": "#55a868", "MQA": "#c44e52", "MLA": "#8172b2"}
    c = [colours[r["kind"]] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    panels = [
        # exact counts: at small widths GQA and MLA differ by a few hundred (49,152 vs 50,208)
        ("parameters (attention block)", [r["params"] for r in rows], "parameters", "{:,.0f}"),
        (f"KV cache at N = {cfg.context} (bf16)", [r["cache_bytes_bf16"] / 2**20 for r in rows], "MiB", "{:.2f}"),
        ("decode time per token", [r["decode_us_per_token"] for r in rows], "microseconds", "{:.0f}"),
    ]
    y = list(range(len(rows)))
    naive = [(i, r["decode_naive_us_per_token"]) for i, r in enumerate(rows) if "decode_naive_us_per_token" in r]
    for k, (ax, (title, vals, unit, fmt)) in enumerate(zip(axes, panels)):
        log = k == 2 and bool(naive)  # the naive MLA step can be 10-100x slower: a log axis keeps both readable
        ax.barh(y, vals, color=c)
        ax.set_yticks(y, names)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(unit + (" (log scale)" if log else ""))
        ax.grid(axis="y", visible=False)
        top = max(vals + [v for _, v in naive]) if log else max(vals)
        for yi, v in zip(y, vals):
            ax.text(v * 1.08 if log else v + top * 0.01, yi, fmt.format(v), va="center", fontsize=8)
        if log:
            ax.set_xscale("log")
            ax.set_xlim(min(vals) / 2, top * 4)
        else:
            ax.set_xlim(0, top * 1.22)
        if k == 0:  # ticks in k/M (the bar labels carry the exact counts), no "1e6" offset
            ax.xaxis.set_major_formatter(plt.FuncFormatter(
                lambda v, _: "0" if v == 0 else f"{v / 1e6:g}M" if v >= 1e6 else f"{v / 1e3:g}k"))
    if naive:
        axes[2].scatter([v for _, v in naive], [i for i, _ in naive], marker="|", s=250, color="black", zorder=3,
                        label="MLA naive (decompress K/V)")
        for i, v in naive:
            axes[2].text(v * 1.08, i, f"{v:.0f}", va="center", fontsize=8)
        axes[2].legend(frameon=False, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    fig.suptitle(f"MHA vs GQA vs MQA vs MLA at d_model {cfg.d_model}, {cfg.n_heads} heads "
                 f"(batch {cfg.batch}, float32 decode on {device})", fontsize=11)
    fig.tight_layout()
    return save_figure(fig, path)
