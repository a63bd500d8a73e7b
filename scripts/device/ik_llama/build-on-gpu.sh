#!/usr/bin/env bash
# On the GPU machine: build ik_llama.cpp (source: $IK_SRC, default .ik-kit/ik-src.tar.xz, the
# vendor/ik_llama.cpp tree of PyPI's ik-llama-cpp-python 0.1.5 sdist, trimmed: README.md beside this script) for sm_90 and pack ik-kit.tar.xz into $OUT
# (in 15 MB parts) and into $W. Resumable: the build folder is $W/b (default W=/tmp/ikb); if a call runs
# out of time (BUILD_S, default 480 s), run the same command again on the still-warm machine.
# Env: W (work dir), BUILD_S (build timeout), JOBS (default nproc), TARGETS (default below).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
W=${W:-/tmp/ikb}; mkdir -p $W; S=$W/ik_llama.cpp; B=$W/b; OUT=${OUT:-$W/out}; mkdir -p $OUT
TARGETS=${TARGETS:-llama-server llama-bench llama-sweep-bench llama-quantize}
IK_SRC=${IK_SRC:-.ik-kit/ik-src.tar.xz}
[[ -d $S ]] || tar xJf "$IK_SRC" -C $W || { echo "no ik_llama.cpp source at $IK_SRC"; exit 1; }
# the sdist lacks common/cmake/build-info-gen-cpp.cmake, the script of the rule that writes common/build-info.cpp
G=$S/common/cmake/build-info-gen-cpp.cmake
if [[ ! -f $G ]]; then
  mkdir -p "$(dirname "$G")"
  printf '%s\n' 'include(${CMAKE_CURRENT_SOURCE_DIR}/cmake/build-info.cmake)  # BUILD_NUMBER, _COMMIT, _COMPILER, _TARGET' \
    'configure_file(${CMAKE_CURRENT_SOURCE_DIR}/common/build-info.cpp.in ${CMAKE_CURRENT_SOURCE_DIR}/common/build-info.cpp)' > "$G"
fi
nproc; which cmake nvcc ninja gcc; cmake --version | head -1; nvcc --version | tail -1
common=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON
  -DGGML_AVX512_BF16=ON -DGGML_AVX512_VNNI=ON
  # its GGML_AVX512 adds only -mavx512f -mavx512bw, and iqk's AVX-512 paths (flash attention's tanh) need DQ and VL
  '-DCMAKE_C_FLAGS=-mavx512dq -mavx512vl -mavx512cd' '-DCMAKE_CXX_FLAGS=-mavx512dq -mavx512vl -mavx512cd' -DGGML_CCACHE=OFF -DGGML_NCCL=OFF -DGGML_CUDA_FA_ALL_QUANTS=OFF
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON
  -DLLAMA_BUILD_COMMIT=pypi-ik-llama-cpp-python-0.1.5
  # CMake < ~3.26 does not know nvcc's C++20 flag (ik_llama.cpp compiles CUDA as C++20): tell it
  -DCMAKE_CUDA20_STANDARD_COMPILE_OPTION=-std=c++20 -DCMAKE_CUDA20_EXTENSION_COMPILE_OPTION=-std=c++20
  -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON '-DCMAKE_INSTALL_RPATH=$ORIGIN/lib;$ORIGIN;/usr/local/cuda/targets/x86_64-linux/lib;/usr/local/nvidia/lib64')
if [[ ! -f $B/build.ninja ]]; then
  [[ -x /usr/local/cuda/bin/nvcc ]] && common+=(-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc)
  if ! cmake -S $S -B $B "${common[@]}" > $OUT/configure.log 2>&1; then
    # cuBLAS not in the toolkit: take it from an installed nvidia-cublas wheel (cu12 or cu13 layout) or CUBLAS_DIR
    L=$(ls ${CUBLAS_DIR:-/nonexistent}/lib/libcublas.so.1[23] 2>/dev/null | head -1)
    [[ -n $L ]] || L=$(python3 -c "import sys,glob; print(next(iter(sorted(f for d in sys.path for f in glob.glob(d+'/nvidia/*/lib/libcublas.so.1[23]'))),''))" 2>/dev/null)
    [[ -n $L ]] || { tail -30 $OUT/configure.log; echo "no cuBLAS found"; exit 1; }
    CB=$(dirname $(dirname $L)); echo "retry with cublas from $CB"; ls $CB $CB/lib
    extra=(-DCUDA_cublas_LIBRARY=$L -DCUDA_cublasLt_LIBRARY=$(ls $CB/lib/libcublasLt.so.1[23] | head -1) -DCMAKE_CUDA_FLAGS="-I$CB/include")
    # libcuda.so to link against: toolkit stub, else the driver, else a generated stub (soname libcuda.so.1)
    if ! ls /usr/local/cuda/lib64/stubs/libcuda.so >/dev/null 2>&1; then
      D=$(ls /usr/local/nvidia/lib64/libcuda.so.1 /usr/lib/x86_64-linux-gnu/libcuda.so.1 2>/dev/null | head -1)
      if [[ -z $D ]]; then
        mkdir -p $W/stubs; H=/usr/local/cuda/include/cuda.h
        { grep -oE "CUDAAPI[[:space:]]+cu[A-Za-z0-9_]+[[:space:]]*\(" $H | sed -E 's/CUDAAPI[[:space:]]+//; s/[[:space:]]*\(//'
          grep -oE "^[[:space:]]*#[[:space:]]*define[[:space:]]+cu[A-Za-z0-9_]+[[:space:]]+cu[A-Za-z0-9_]+" $H | awk '{print $NF}'; } | sort -u \
          | awk '{print "int " $1 "(void){return 999;}"}' > $W/stubs/stub.c
        gcc -shared -fPIC -o $W/stubs/libcuda.so -Wl,-soname,libcuda.so.1 $W/stubs/stub.c; D=$W/stubs/libcuda.so
        ln -sf libcuda.so $W/stubs/libcuda.so.1  # the name libggml.so asks for, when the programs link
      fi
      extra+=(-DCUDA_cuda_driver_LIBRARY=$D)
    fi
    # the programs link against libggml.so, whose cuBLAS and driver the linker must find too
    extra+=("-DCMAKE_EXE_LINKER_FLAGS=-Wl,-rpath-link,$CB/lib -Wl,-rpath-link,$(dirname ${D:-/usr/local/cuda/lib64/stubs/libcuda.so})")
    rm -rf $B; cmake -S $S -B $B "${common[@]}" "${extra[@]}" >> $OUT/configure.log 2>&1 \
      || { tail -30 $OUT/configure.log; exit 1; }
  fi
fi
t0=$SECONDS
timeout ${BUILD_S:-480} cmake --build $B -j${JOBS:-$(nproc)} --target $TARGETS > $OUT/build.log 2>&1
rc=$?; echo "build rc $rc in $((SECONDS - t0)) s"; tail -3 $OUT/build.log
(( rc == 0 )) || { echo "not finished (rc $rc): run again to resume"; exit 1; }
K=$W/ik-kit-dir; rm -rf $K; mkdir -p $K/lib
for t in $TARGETS; do cp $B/bin/$t $K/; done
find $B -name "*.so*" \( -type f -o -type l \) -not -path "*/CMakeFiles/*" -exec cp -P {} $K/lib/ \;
strip --strip-unneeded $K/llama-* $K/lib/*.so* 2>/dev/null
ls -la $K $K/lib; for b in $K/llama-*; do echo "== ldd $b"; ldd $b | grep -v "=> /lib\|linux-vdso\|ld-linux"; done
$K/llama-server --version 2>&1 | tail -3
tar cf - -C $W ik-kit-dir | xz -T0 -6 > $W/ik-kit.tar.xz && ls -la $W/ik-kit.tar.xz && split -b 15M -d $W/ik-kit.tar.xz $OUT/ik-kit.tar.xz.part
sha256sum $W/ik-kit.tar.xz | tee $OUT/ik-kit.sha256
