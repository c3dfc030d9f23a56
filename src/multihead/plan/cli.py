"""Account for and recommend an attention geometry.

  multihead plan --params 7B --context 32k --accelerator h100-80gb --batch-size 16
  multihead plan --model llama-3-8b --context 8k --accelerator a100-80gb
  multihead plan --model path/to/config.json (or path/to/model-folder)
  multihead plan --compare llama-3-8b mistral-7b-v0.1 gemma-2-9b --json
  multihead plan --list-models

With --params, recommend a variant (MHA, GQA, MQA, MLA), head geometry, init scales and
the check to run, with a ranked table of alternatives. With --model or --compare, the
exact accounting of Hugging Face config.json files (or of the presets shipped with
multihead, named as --list-models lists them): parameters, KV cache (window- and
MLA-aware), attention FLOPs and, with an accelerator, what fits and the decode estimate.
Sizes are written as people write them: 125M, 1.3B, 70B; 32k, 128K; 80GB, 80GiB.
"""

from __future__ import annotations

import argparse
import json

from multihead.cli_args import add_context, add_json, add_model, renamed

DESCRIPTION = __doc__  # the --help text: this module's docstring is short enough to be it

# dest -> flag of the geometry one may fix when recommending
SIZE_FLAGS = {"d_model": "--d-model", "layers": "--n-layers", "n_heads": "--n-heads", "n_kv_heads": "--n-kv-heads",
              "head_dim": "--head-dim", "kv_rank": "--kv-rank", "variant": "--variant"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    mode = parser.add_argument_group("what to plan (one of)")
    mode.add_argument("--params", metavar="SIZE",
                      help="recommend a geometry for this many parameters (125M, 1.3B, 7B, 70B)")
    # a model here is its config (no weights are read): --model as every command names a model
    add_model(mode, None,
              help="account for a model: a Hugging Face config.json, a model folder holding one, or a "
                   "preset (llama-3-8b, qwen2.5-7b, mixtral-8x7b, minilm, ...: see --list-models)")
    mode.add_argument("--compare", metavar="NAME|PATH", nargs="+",
                      help="account for several models (config files, folders or presets) side by side")
    mode.add_argument("--list-models", action="store_true",
                      help="list the preset models (public config.json files shipped with multihead)")
    mode.add_argument("--list-accelerators", action="store_true",
                      help="list the accelerator presets")

    use = parser.add_argument_group("how it is used")
    add_context(use, "context length (32k, 128K, 4096); default 8k when recommending, "
                     "the model's max positions for a config")
    use.add_argument("--batch-size", metavar="N", default="1", dest="batch", help="sequences decoded at once "
                     "(default 1)")
    # an accelerator to plan for, by name; --device elsewhere is where torch runs (auto/cpu/cuda)
    use.add_argument("--accelerator", metavar="NAME",
                     help="accelerator preset (default h100-80gb when recommending); "
                          "see --list-accelerators")
    use.add_argument("--n-accelerators", metavar="N",
                     help="number of such accelerators (tensor parallel); default 1 for a config, "
                          "and when recommending the fewest that hold the weights in half "
                          "their memory")
    use.add_argument("--memory", metavar="SIZE", help="accelerator memory, e.g. 48GiB (overrides "
                     "the preset's)")
    use.add_argument("--bandwidth", metavar="BW", help="accelerator memory bandwidth, e.g. 960GB/s "
                     "(overrides the preset's)")
    use.add_argument("--priority", default="inference", metavar="{inference,training}",
                     help="what the geometry is optimised for (default inference)")
    use.add_argument("--dtype", default="bf16",
                     help="KV cache dtype: fp32, bf16, fp16, fp8, int8, int4 (default bf16)")
    use.add_argument("--weights-dtype", default=None, metavar="DTYPE",
                     help="weights dtype (default: the same as --dtype)")

    shape = parser.add_argument_group("fix part of the geometry (when recommending)")
    shape.add_argument("--d-model", metavar="N", help="model width")
    shape.add_argument("--n-layers", metavar="N", dest="layers", help="number of layers (default: fill --params)")
    shape.add_argument("--n-heads", metavar="N", help="query heads")
    shape.add_argument("--n-kv-heads", metavar="N", help="key/value heads")
    shape.add_argument("--head-dim", metavar="N", help="head dim")
    shape.add_argument("--variant", metavar="{mha,gqa,mqa,mla}", help="attention variant")
    shape.add_argument("--kv-rank", metavar="N", help="MLA latent rank")
    shape.add_argument("--vocab", metavar="N", default="32000", help="vocabulary (default 32000)")

    add_json(parser, help="machine-readable output (schema in docs/plan.md)")
    where_torch_runs = "--device is where torch runs, in lab; plan names an accelerator preset"
    for old, new, note in (("--device", "--accelerator", where_torch_runs),
                           ("--devices", "--n-accelerators", ""),
                           ("--list-devices", "--list-accelerators", ""),
                           ("--config", "--model", ""),
                           ("--list-configs", "--list-models", "")):
        renamed(parser, old, new, note)


def _usage(msg: str):
    from multihead.errors import UsageError

    return UsageError(msg)


def _int(flag: str, text: str | None) -> int | None:
    if text is None:
        return None
    try:
        value = int(str(text).replace("_", "").replace(",", ""))
    except ValueError:
        raise _usage(f"{flag} must be a whole number; received {text!r}") from None
    if value <= 0:
        raise _usage(f"{flag} must be positive; received {value}")
    return value


def _device(args, required: bool):
    """The preset named by --accelerator, adjusted by --memory/--bandwidth, or a custom one."""
    from dataclasses import replace

    from multihead.plan import devices, units

    memory = units.parse_bytes(args.memory) if args.memory else None
    bandwidth = units.parse_bandwidth(args.bandwidth) if args.bandwidth else None
    if args.accelerator is None:
        if memory and bandwidth:
            return devices.custom_device(memory, bandwidth)
        if memory or bandwidth:
            raise _usage("a custom accelerator needs both --memory and --bandwidth (e.g. --memory "
                         f"48GiB --bandwidth 960GB/s); received --memory {args.memory} "
                         f"--bandwidth {args.bandwidth}, or name an --accelerator")
        return devices.DEVICES["h100-80gb"] if required else None
    dev = devices.get_device(args.accelerator)
    if memory or bandwidth:
        dev = replace(dev, memory=memory or dev.memory, bandwidth=bandwidth or dev.bandwidth,
                      name=f"{dev.name}*")
    return dev


def main(args) -> int:
    try:
        return _main(args)
    except (ValueError, TypeError) as err:
        # plan raises ValueError/TypeError for bad input, naming what was received and
        # what is valid; at the command line that is a one-line usage error.
        raise _usage(str(err)) from None


def _main(args) -> int:
    from multihead.plan import devices, report, units
    from multihead.plan.recommend import Request, recommend

    if args.list_accelerators:
        return _list_devices(devices, args.json)
    if args.list_models:
        return _list_configs(args.json)
    modes = [flag for flag, m in (("--params", "params"), ("--model", "model"), ("--compare", "compare"))
             if getattr(args, m)]
    if len(modes) != 1:
        given = ", ".join(modes) or "none"
        raise _usage(f"give exactly one of --params SIZE (e.g. 7B), --model FILE|PRESET or --compare "
                     f"FILE|PRESET ... (presets: --list-models); received {given}")
    if args.priority not in ("inference", "training"):
        raise _usage(f"--priority must be inference or training; received {args.priority!r}")
    dtype = units.dtype_name(args.dtype)
    weights_dtype = units.dtype_name(args.weights_dtype) if args.weights_dtype else dtype
    batch = _int("--batch-size", args.batch)
    n_devices = _int("--n-accelerators", args.n_accelerators)
    context = units.parse_tokens(args.context) if args.context else None

    if args.params:
        variant = args.variant.lower() if args.variant else None
        req = Request(
            params=units.parse_count(args.params),
            context=context or 8192,
            batch=batch,
            device=_device(args, required=True),
            n_devices=n_devices,
            priority=args.priority,
            dtype=dtype,
            weights_dtype=weights_dtype,
            d_model=_int("--d-model", args.d_model),
            n_layers=_int("--n-layers", args.layers),
            n_heads=_int("--n-heads", args.n_heads),
            n_kv_heads=_int("--n-kv-heads", args.n_kv_heads),
            head_dim=_int("--head-dim", args.head_dim),
            variant=variant,
            kv_rank=_int("--kv-rank", args.kv_rank),
            vocab_size=_int("--vocab", args.vocab),
        )
        rec = recommend(req)
        out = (json.dumps(report.recommendation_dict(rec), indent=2) if args.json
               else report.recommendation_text(rec))
        print(out)
        return 0

    fixed = [flag for dest, flag in SIZE_FLAGS.items() if getattr(args, dest) is not None]
    if fixed:
        raise _usage(f"{', '.join(fixed)} apply when recommending (--params), not to a config; "
                     "edit the config instead")
    from multihead.plan.configs import read_config

    paths = [args.model] if args.model else args.compare
    device = _device(args, required=False)
    accounts = [report.account(read_config(p), context, batch, dtype, device, weights_dtype,
                               n_devices or 1) for p in paths]
    if args.json:
        print(json.dumps(report.account_json(accounts), indent=2))
    else:
        print(report.account_text(accounts))
        if args.model:  # what converting it would save (multihead.convert)
            from multihead.plan.conversions import conversions_text

            print(conversions_text(read_config(args.model), dtype))
    return 0


def _list_configs(as_json: bool) -> int:
    from multihead.plan.configs import read_config
    from multihead.plan.geometry import param_counts
    from multihead.plan.presets import PRESETS
    from multihead.plan.units import fmt_count, table

    models = {name: read_config(p.config, name=name) for name, p in PRESETS.items()}
    if as_json:
        print(json.dumps({"schema": "multihead.plan.presets/1", "presets": [
            {"name": name, "repo": PRESETS[name].repo, "family": m.family, "attention": m.attention.label,
             "params": param_counts(m).total, "context": m.context_length}
            for name, m in models.items()]}, indent=2))
        return 0
    rows = [[name, m.family, m.attention.label, fmt_count(param_counts(m).total),
             f"{m.context_length:,}" if m.context_length else "-", PRESETS[name].repo]
            for name, m in models.items()]
    print(table(["preset", "family", "attention", "params", "positions", "from"], rows, right={3, 4}))
    print("use: multihead plan --model NAME (or --compare NAME NAME ...); a file or folder of that name wins")
    return 0


def _list_devices(devices, as_json: bool) -> int:
    from multihead.plan.units import fmt_bytes, table

    if as_json:
        print(json.dumps({"schema": "multihead.plan.devices/1", "devices": [
            {"name": d.name, "memory_bytes": d.memory, "bandwidth_bytes_per_s": d.bandwidth,
             "note": d.note} for d in devices.DEVICES.values()]}, indent=2))
        return 0
    rows = [[d.name, fmt_bytes(d.memory), f"{d.bandwidth / 1e9:,.0f} GB/s", d.note]
            for d in devices.DEVICES.values()]
    print(table(["accelerator", "memory", "bandwidth", "what"], rows, right={1, 2}))
    return 0
