#!/usr/bin/env bash
# FlashInfer for the GPU test bed (docs/gpu.md, "FlashInfer in the test bed"). The stack the test bed carries has no
# FlashInfer, the GPU machine's image has none and no network, and SGLang's FlashInfer backend (our custom-mask
# verify path) needs it; FlashInfer also has no float32 kernels, so its runs are bf16.
#
#   bash bench/gpu_flashinfer.sh pack      # here, from the repository root: gpu/fi1 (5 MB, beside gpu/s2) and
#       # gpu/fi2 (~10 MB, in the paired call), git-ignored (the calls: bench/gpu_calls.py): flashinfer-python 0.7.2
#       # with its attention modules compiled
#       # here for sm_90a (bench/gpu_flashinfer_aot.py; loaded as is there), without the sources of the kernel
#       # families SGLang's attention never builds (MoE, GEMM, comm, ...). About 6 minutes the first time.
#   bash bench/gpu_flashinfer.sh install   # there, in every call that carries a piece: stages it in $STAGE; once
#       # all pieces are staged, unpacks the package into $SITE, a folder of its own: only the FlashInfer steps put
#       # it on PYTHONPATH (SGLang uses FlashInfer wherever it imports, so the Triton runs stay as they were)
#
# Environment: FI_WHL (the wheel cache, filled here when empty), FI_AOT (compiled modules kept between packs),
# SITE (default /root/site-flashinfer), STAGE (default /root/stage/fi), FIRST_MB and REST_MB (the pieces' sizes).
set -euo pipefail
VERSION=0.7.2
FIRST_MB=${FIRST_MB:-5}  # the first piece's size (beside gpu/s2 in a call); the others up to REST_MB each
REST_MB=${REST_MB:-32}
cmd=${1:-}

case "$cmd" in
pack)
    REPO=$(git rev-parse --show-toplevel)
    FI_WHL=${FI_WHL:-$HOME/.cache/gpu_sglang_wheels}
    FI_AOT=${FI_AOT:-$HOME/.cache/treespec-flashinfer-aot/$VERSION}
    WHEEL=$FI_WHL/flashinfer_python-$VERSION-py3-none-any.whl
    mkdir -p "$FI_WHL" "$FI_AOT"
    [ -f "$WHEEL" ] || python3 -m pip download -q --no-deps -d "$FI_WHL" "flashinfer-python==$VERSION"
    T=$(mktemp -d)
    trap 'rm -rf "$T"' EXIT
    unzip -q "$WHEEL" -d "$T/pkg"
    # FlashInfer imports these at start; the GPU image has nvidia-ml-py, einops, tabulate and cuda-bindings, the
    # test bed's stack apache-tvm-ffi: here they go to a folder of their own, for the build only
    python3 -m pip install -q --no-deps --target "$T/deps" nvidia-ml-py einops tabulate "apache-tvm-ffi==0.1.11" \
        cuda-bindings cuda-pathfinder
    # the toolkit: CUDA_HOME, else the folder of the nvcc a wrapper on PATH runs (as on this machine) or nvcc's own
    NVCC=$(readlink -f "$(command -v nvcc)")
    [ "$(head -c 2 "$NVCC")" = "#!" ] && NVCC=$(grep -oE '/[^ "]*/bin/nvcc' "$NVCC" | head -1)
    CUDA=${CUDA_HOME:-$(dirname "$(dirname "$NVCC")")}
    export CUDA_HOME=$CUDA
    # FlashInfer links its modules with -lcuda, the driver's library, which this machine (no GPU) lacks: a stand-in
    # with the driver's soname and every entry point cuda.h declares (empty: only the link reads it; a module that
    # calls the driver records libcuda.so.1, the GPU machine's driver; the four here need libcudart.so.13 only)
    mkdir -p "$T/stubs"
    echo '#include <cuda.h>' | gcc -E -I"$CUDA/include" - | grep -oE '\bcu[A-Z][A-Za-z0-9_]*[[:space:]]*\(' \
        | tr -d '( \t' | sort -u | sed 's/.*/void &(void) {}/' > "$T/stubs/cuda_stub.c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$T/stubs/libcuda.so" "$T/stubs/cuda_stub.c"
    # FA3 includes CUTLASS's utilities, which include cuRAND's device header: not in this toolkit, in its wheel
    ls "$FI_WHL"/nvidia_curand-*.whl > /dev/null 2>&1 || python3 -m pip download -q --no-deps -d "$FI_WHL" nvidia-curand
    unzip -q -o "$(ls "$FI_WHL"/nvidia_curand-*.whl | head -1)" 'nvidia/cu13/include/*' -d "$T/curand"
    # the build folder is kept between packs: ninja rebuilds only what changed
    FLASHINFER_WORKSPACE_BASE="$FI_AOT/../ws" FLASHINFER_EXTRA_LDFLAGS="-L$T/stubs" \
        FLASHINFER_EXTRA_CUDAFLAGS="-I$T/curand/nvidia/cu13/include" PYTHONPATH="$T/pkg:$T/deps" \
        python3 "$REPO/bench/gpu_flashinfer_aot.py" "$FI_AOT"
    mkdir -p "$T/pkg/flashinfer/data/aot" && cp -r "$FI_AOT"/. "$T/pkg/flashinfer/data/aot/"
    # the kernel families' sources SGLang's attention backend never compiles (kept: include/, cutlass, cccl, spdlog
    # and csrc's own files, so a module missing from data/aot still compiles there)
    find "$T/pkg/flashinfer/data/csrc" -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +
    rm -rf "$T/pkg/flashinfer/data/cutlass/examples"
    find "$T/pkg" -name __pycache__ -type d -prune -exec rm -rf {} +
    tar -C "$T/pkg" -cf - flashinfer "flashinfer_python-$VERSION.dist-info" | xz -T0 -6 > "$T/fi.tar.xz"
    # a call carries the checkout (35 MB) and at most 64 MiB in all: the pieces ride beside gpu/s2 (20 MB) and in
    # the paired call (gpu/tools alone), so FlashInfer costs no call of its own (bench/gpu_calls.py checks the sizes)
    rm -rf "$REPO"/gpu/fi[0-9]*
    head -c $((FIRST_MB * 1000000)) "$T/fi.tar.xz" > "$T/fi.tar.xz.part00"
    tail -c +$((FIRST_MB * 1000000 + 1)) "$T/fi.tar.xz" | split -b $((REST_MB * 1000000)) -d -a 2 \
        --numeric-suffixes=1 - "$T/fi.tar.xz.part"
    n=0
    for p in "$T"/fi.tar.xz.part*; do
        [ -s "$p" ] || continue
        n=$((n + 1)) && mkdir -p "$REPO/gpu/fi$n" && mv "$p" "$REPO/gpu/fi$n/"
    done
    sha256sum "$T/fi.tar.xz" | cut -d' ' -f1 > "$REPO/gpu/fi1/fi.tar.xz.sha256"
    echo "$n" > "$REPO/gpu/fi1/pieces"
    grep -qx '/gpu/' "$REPO/.git/info/exclude" || echo '/gpu/' >> "$REPO/.git/info/exclude"
    du -sh "$REPO"/gpu/fi*
    ;;
install)
    SITE=${SITE:-/root/site-flashinfer}
    STAGE=${STAGE:-/root/stage/fi}
    mkdir -p "$STAGE"
    for d in gpu/fi*; do [ -d "$d" ] && cp "$d"/* "$STAGE"/ && echo "FLASHINFER: staged $d"; done
    if [ -f "$SITE/flashinfer/.treespec-installed" ]; then echo "FLASHINFER: already installed"; exit 0; fi
    n=$(cat "$STAGE/pieces" 2>/dev/null || echo "?")
    have=$(ls "$STAGE"/fi.tar.xz.part* 2>/dev/null | wc -l)
    if [ "$n" = "?" ] || [ "$have" -lt "$n" ]; then
        echo "FLASHINFER: waiting for the pieces: $have of $n staged"
        exit 2
    fi
    cat "$STAGE"/fi.tar.xz.part* > "$STAGE/fi.tar.xz"
    [ "$(sha256sum "$STAGE/fi.tar.xz" | cut -d' ' -f1)" = "$(cat "$STAGE/fi.tar.xz.sha256")" ] \
        || { echo "FLASHINFER: the pieces do not make the packed archive (sha256)"; exit 1; }
    mkdir -p "$SITE" && tar -C "$SITE" -xJf "$STAGE/fi.tar.xz" && rm "$STAGE/fi.tar.xz"
    # marked installed only once it imports (with the test bed's site on PYTHONPATH: tvm-ffi is there)
    PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" python3 -c \
        "import flashinfer, os; print('FLASHINFER: installed', flashinfer.__version__, 'with',
len(os.listdir(os.path.join(os.path.dirname(flashinfer.__file__), 'data', 'aot'))), 'modules compiled ahead')"
    touch "$SITE/flashinfer/.treespec-installed"
    ;;
*)
    echo "usage: bash bench/gpu_flashinfer.sh pack|install" >&2
    exit 2
    ;;
esac
