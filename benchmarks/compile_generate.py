"""Static-cache greedy `generate` with the forward compiled (`torch.compile(model.forward,
fullgraph=True)`, inductor), through `attn_implementation="multihead"` beside transformers'
own sdpa, compiled the same way (fp32, CPU, B = 1), and what the registry's decode step pays
for reading `config.output_attentions`.

    .venv/bin/python benchmarks/compile_generate.py                 # SmolLM2-135M, 64-token prompt, 32 new tokens
    .venv/bin/python benchmarks/compile_generate.py --quick         # a 2-layer random Llama: a smoke run
    .venv/bin/python benchmarks/compile_generate.py --model gemma3  # another model load_model knows

Two copies of the model, one per implementation, each with its forward compiled (the
compile of each graph, prefill and decode step, is timed on the first generate, untimed
after). Then --rounds rounds, each generating with every implementation in turn (the first
one alternating), the same prompt, `cache_implementation="static"`: per generate, the
prefill's time and the median decode step (each forward timed by hooks on the model, around
the compiled forward), by wall time and by the process's CPU time, with the load average
after each round. Reported: medians of each, the ratios multihead / sdpa paired per round
(median over rounds), and whether the two produced the same tokens. A loaded machine slows
both alike within a round, so the ratio is what to read; the absolute times are the load's.

Then the config read (`--read-calls`): the registry's decode-step call of the attention
function (q `(1, H, 1, D)`, k/v `(1, Hkv, S, D)`, nothing else, as a causal LM without
padding passes it), `--read-calls` calls per round, in turn with its `output_attentions`
read taken from the config's field (what the registry does outside torch.compile), through
`getattr` (what it does inside), and the field read without its compile check: microseconds
per call and per read alone (medians over rounds).

Writes a Markdown summary to stdout and JSON to benchmarks/results/compile_generate.json
(or --json), with the machine.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_info import finish, machine, write_json  # noqa: E402

IMPLS = ("sdpa", "multihead")


def load(model_name: str | None):
    """(model, prompt ids `(1, T)`) for `model_name`, or a 2-layer random Llama."""
    import multihead.interop.hf  # noqa: F401  (registers "multihead")

    if model_name is None:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
        torch.manual_seed(0)
        return LlamaForCausalLM(cfg).eval(), torch.randint(3, 1000, (1, 16))
    from multihead.interop.loaders import load_model

    loaded = load_model(model_name, fresh=True)  # its own copy: the benchmark changes its forward
    text = "In the beginning God created the heaven and the earth. And the earth was without form, and void; " * 4
    ids = torch.tensor([loaded.encode(text)])
    return loaded.model.eval(), ids


class StepTimer:
    """Times every forward of a model (hooks around its compiled forward): (queries, wall, CPU)."""

    def __init__(self, model):
        self.taken: list[tuple[int, float, float]] = []
        self._t = (0.0, 0.0)
        self._handles = [model.register_forward_pre_hook(self._pre, with_kwargs=True),
                         model.register_forward_hook(self._post, with_kwargs=True)]

    def _pre(self, _module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._queries = 0 if ids is None else ids.shape[1]
        self._t = (time.perf_counter(), time.process_time())

    def _post(self, _module, _args, _kwargs, _out):
        self.taken.append((self._queries, time.perf_counter() - self._t[0], time.process_time() - self._t[1]))

    def take(self) -> list[tuple[int, float, float]]:
        out, self.taken = self.taken, []
        return out


def generate(model, prompt, new_tokens: int):
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              cache_implementation="static", pad_token_id=0)


def compiled_generate(base, prompt, new_tokens: int, rounds: int) -> dict:
    """The generate comparison (module docstring): per implementation its own compiled copy."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)  # two models share code
    models, timers, compile_s, tokens = {}, {}, {}, {}
    for impl in IMPLS:
        m = copy.deepcopy(base)
        m.set_attn_implementation(impl)
        m.forward = torch.compile(m.forward, fullgraph=True)
        timers[impl] = StepTimer(m)
        t0 = time.perf_counter()
        tokens[impl] = generate(m, prompt, new_tokens)  # compiles the prefill's and the decode step's graphs
        compile_s[impl] = time.perf_counter() - t0
        timers[impl].take()
        models[impl] = m
    runs = {impl: {"prefill": [], "step": [], "prefill_cpu": [], "step_cpu": [], "generate": []} for impl in IMPLS}
    loads = []
    same = all(torch.equal(tokens["sdpa"], tokens[i]) for i in IMPLS)
    for r in range(rounds):
        for impl in (IMPLS if r % 2 == 0 else IMPLS[::-1]):
            t0 = time.perf_counter()
            out = generate(models[impl], prompt, new_tokens)
            total = time.perf_counter() - t0
            same = same and torch.equal(out, tokens["sdpa"] if impl != "sdpa" else tokens["multihead"])
            taken = timers[impl].take()
            prefill = [t for t in taken if t[0] > 1]
            steps = [t for t in taken if t[0] == 1]
            row = runs[impl]
            row["prefill"].append(prefill[0][1])
            row["prefill_cpu"].append(prefill[0][2])
            row["step"].append(statistics.median(t[1] for t in steps))
            row["step_cpu"].append(statistics.median(t[2] for t in steps))
            row["generate"].append(total)
        loads.append(os.getloadavg()[0])

    def ratio(key):
        return statistics.median(m / s for m, s in zip(runs["multihead"][key], runs["sdpa"][key]))

    return {"compile_and_first_generate_s": compile_s,
            "median_s": {impl: {k: statistics.median(v) for k, v in runs[impl].items()} for impl in IMPLS},
            "rounds": runs, "load_per_round": loads, "same_tokens": bool(same),
            "ratio": {k: ratio(k) for k in ("step", "step_cpu", "prefill", "prefill_cpu", "generate")}}


def config_read(calls: int, rounds: int) -> dict:
    """The registry's decode-step call with each way of reading `config.output_attentions`."""
    import transformers

    from multihead.interop.hf import registry

    current = registry._config_output_attentions

    def field_only(module):  # the field read as the registry does it, without the compile check
        config = getattr(module, "config", None)
        if config is None:
            return False
        direct = registry._FIELD_READS.get(type(config))
        if direct is None:
            direct = registry._FIELD_READS[type(config)] = registry._reads_the_field(type(config))
        if direct:
            return object.__getattribute__(config, "__dict__").get("_output_attentions", False)
        return getattr(config, "output_attentions", False)

    def by_getattr(module):  # what the registry reads inside torch.compile
        config = getattr(module, "config", None)
        return False if config is None else getattr(config, "output_attentions", False)

    class Layer(torch.nn.Module):
        is_causal = True

        def __init__(self, config):
            super().__init__()
            self.config = config

    layer = Layer(transformers.LlamaConfig())
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 9, 1, 64, generator=g), torch.randn(1, 3, 128, 64, generator=g),
               torch.randn(1, 3, 128, 64, generator=g))  # SmolLM2's heads, 128 keys
    ways = {"field (the registry)": current, "getattr": by_getattr, "field, no compile check": field_only}
    call_us = {w: [] for w in ways}
    read_us = {w: [] for w in ways}
    try:
        for _ in range(rounds):
            for w, fn in ways.items():
                registry._config_output_attentions = fn
                for _ in range(10):
                    registry.attention_forward(layer, q, k, v, None, scaling=0.125)
                t0 = time.perf_counter()
                for _ in range(calls):
                    registry.attention_forward(layer, q, k, v, None, scaling=0.125)
                call_us[w].append((time.perf_counter() - t0) / calls * 1e6)
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn(layer)
                read_us[w].append((time.perf_counter() - t0) / calls * 1e6)
    finally:
        registry._config_output_attentions = current
    # a round the process was preempted in reads tens of microseconds a call: the fastest round
    # is the cost itself (as timeit reads it), the median what a loaded machine gives
    return {"calls_per_round": calls, "rounds": rounds,
            "call_us": {w: statistics.median(v) for w, v in call_us.items()},
            "read_us": {w: statistics.median(v) for w, v in read_us.items()},
            "call_us_fastest": {w: min(v) for w, v in call_us.items()},
            "read_us_fastest": {w: min(v) for w, v in read_us.items()},
            "call_us_rounds": call_us, "read_us_rounds": read_us, "load_after": os.getloadavg()[0]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2", help="a model load_model knows (default smollm2)")
    p.add_argument("--quick", action="store_true", help="a 2-layer random Llama, few rounds: a smoke run")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens each generate adds (default 32)")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds of generates (default 7)")
    p.add_argument("--read-calls", type=int, default=300, help="attention calls per round of the config read")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: a shared machine)")
    p.add_argument("--read-only", action="store_true",
                   help="rerun the config read alone, into the existing JSON's config_read")
    p.add_argument("--json", default=None, help="where to write the JSON (default benchmarks/results/...)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    out = Path(a.json or Path(__file__).resolve().parent / "results" / "compile_generate.json")
    if a.read_only:
        import json

        report = json.loads(out.read_text())
        report["config_read"] = config_read(a.read_calls, 15)
        report["config_read"]["machine"] = machine()
        write_json(out, report)
        print(json.dumps({k: report["config_read"][k] for k in ("read_us", "read_us_fastest", "call_us_fastest")}))
        return report
    rounds, new_tokens = (2, 4) if a.quick else (a.rounds, a.new_tokens)
    model, prompt = load(None if a.quick else a.model)
    report = {"machine": machine(), "load_before": os.getloadavg()[0],
              "config": {"model": "random 2-layer llama" if a.quick else a.model, "prompt_tokens": prompt.shape[1],
                         "new_tokens": new_tokens, "rounds": rounds, "threads": a.threads,
                         "compile": "torch.compile(model.forward, fullgraph=True), inductor",
                         "cache": "static"}}
    import transformers

    report["machine"]["transformers"] = transformers.__version__
    report["generate"] = compiled_generate(model, prompt, new_tokens, rounds)
    report["config_read"] = config_read(a.read_calls if not a.quick else 50, 15 if not a.quick else 3)
    g, c = report["generate"], report["config_read"]
    print(f"## compiled static-cache generate, {report['config']['model']}, prompt {prompt.shape[1]}, "
          f"{new_tokens} new tokens, {rounds} rounds, {a.threads} thread(s), load {report['load_before']:.1f}\n")
    print("| | decode step (ms) | prefill (ms) | generate (s) | compile + first generate (s) |\n|---|---|---|---|---|")
    for impl in IMPLS:
        s = g["median_s"][impl]
        print(f"| {impl} | {s['step'] * 1e3:.2f} | {s['prefill'] * 1e3:.1f} | {s['generate']:.2f} | "
              f"{g['compile_and_first_generate_s'][impl]:.0f} |")
    r = g["ratio"]
    print(f"\nmultihead / sdpa: step {r['step']:.3f} (CPU {r['step_cpu']:.3f}), prefill {r['prefill']:.3f}, "
          f"generate {r['generate']:.3f}; same tokens: {g['same_tokens']}; load per round "
          f"{', '.join(f'{x:.1f}' for x in g['load_per_round'])}\n")
    print("| config read | attention call (us) | read alone (us) |\n|---|---|---|")
    for w in c["call_us"]:
        print(f"| {w} | {c['call_us'][w]:.2f} (fastest {c['call_us_fastest'][w]:.2f}) | {c['read_us'][w]:.3f} "
              f"(fastest {c['read_us_fastest'][w]:.3f}) |")
    if not a.quick or a.json:
        write_json(out, finish(report))
    return report


if __name__ == "__main__":
    main()
