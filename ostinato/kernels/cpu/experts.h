// Cold experts of one MoE layer on the CPU: public C++ interface.
//
// Legend: T tokens, R routes, E experts, D hidden size, F expert FFN size.
//
//   out[t, :] = sum over routes r with token_idx[r] == t, in ascending expert order, of
//               weights[r] * (w2[e] @ act(w13[e][:F] @ x[t] + b13[e][:F], w13[e][F:] @ x[t] + b13[e][F:])
//                             + b2[e])
//
// with e = expert_ids[r]; act(g, u) = silu(g) * u unless the call names another (Act); the
// biases are optional (absent: zero). Rows of out[:T] without a route are zero. Intermediates
// are fp32.
// The result depends only on the inputs and the chosen ISA path, never on the number of
// threads or on scheduling: every output element is produced by one task in a fixed order.
//
// Quantized experts (qt13 / qt2 set, kernels_quant.cpp) keep their GGUF block formats: a row
// of n values is n / K blocks, K = qtype_block_values(qt), blocks along the input dimension.
// Each activation entering a quantized projection (x for gate/up, h for down) is quantized
// per 32 consecutive values to int8 (quantize_activations below) and multiplied with the
// weights' integers exactly (VNNI); the block scales then combine the sums in fp32.
//
// A later native polling worker (the decode CUDA graph's CPU side) calls
// cold_experts_forward() directly, without Python.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

namespace ostinato {

enum class DType : int32_t { kFloat32 = 0, kBFloat16 = 1 };

// GGUF block formats of quantized expert weights (kNone: the weights are w_dtype floats).
//   kQ8_0   32 values in 34 bytes    kQ4_K  256 in 144    kQ5_K  256 in 176
//   kQ6_K  256 values in 210 bytes   kMXFP4  32 in 17
enum class QType : int32_t { kNone = 0, kQ8_0 = 1, kQ4_K = 2, kQ5_K = 3, kQ6_K = 4, kMXFP4 = 5 };

int64_t qtype_block_values(QType qt);  // 0 for kNone
int64_t qtype_block_bytes(QType qt);
int64_t qtype_row_bytes(QType qt, int64_t n);  // n a multiple of the block values

// The activation between the projections (vecmath.h act512):
//   kSilu           h = silu(g) * u
//   kClampedSwiglu  h = (u' + 1) * g' * sigmoid(alpha * g'), g' = min(g, limit),
//                   u' = clamp(u, -limit, limit)  (gpt-oss)
enum class Act : int32_t { kSilu = 0, kClampedSwiglu = 1 };

// Instruction-set paths, in increasing order. kAuto picks the best the CPU supports.
//   kAvx512:     weights widened to fp32 (AVX-512F/BW), fp32 FMA.
//   kAvx512Bf16: as kAvx512, but bf16 x bf16 gate/up products with VDPBF16PS.
//   kAmx:        as kAvx512Bf16, plus AMX tiles for experts with >= amx_min_tokens routes.
enum class Isa : int32_t { kAuto = 0, kAvx512 = 1, kAvx512Bf16 = 2, kAmx = 3 };

struct CpuFeatures {
  bool avx512 = false;       // AVX-512 F+BW+VL usable (CPU and OS)
  bool avx512_bf16 = false;  // AVX512_BF16
  bool amx = false;          // AMX-TILE + AMX-BF16, and the OS granted XTILEDATA
  bool avx512_vnni = false;  // AVX512_VNNI (with AVX-512 F/BW/VL/DQ): the quantized experts
  bool amx_int8 = false;     // AMX-TILE + AMX-INT8 (with AVX512_VNNI), and the OS granted XTILEDATA
};

// Detected once (cpuid, xgetbv, arch_prctl for AMX).
const CpuFeatures& cpu_features();

struct ColdArgs {
  // Expert weights of one layer, row-major: w13[E, 2F, D] (gate rows then up rows), w2[E, D, F].
  const void* w13 = nullptr;
  const void* w2 = nullptr;
  DType w_dtype = DType::kBFloat16;
  int64_t E = 0, D = 0, F = 0;
  // Quantized experts: both set (they may differ), w_dtype then unused; w13 is uint8
  // [E, 2F, qtype_row_bytes(qt13, D)], w2 uint8 [E, D, qtype_row_bytes(qt2, F)]. Needs AVX512_VNNI.
  QType qt13 = QType::kNone, qt2 = QType::kNone;
  // The experts' activation, and their optional fp32 biases b13[E, 2F] (gate then up) and
  // b2[E, D]: both null or both set, for float and quantized weights alike.
  Act act = Act::kSilu;
  float act_alpha = 1.0f, act_limit = 0.0f;
  const float* b13 = nullptr;
  const float* b2 = nullptr;
  // Activations x[T, D], row stride x_stride (elements).
  const void* x = nullptr;
  DType x_dtype = DType::kBFloat16;
  int64_t T = 0, x_stride = 0;
  // Routes.
  const int32_t* token_idx = nullptr;  // [R], in [0, T)
  const int32_t* expert_ids = nullptr;  // [R], in [0, E)
  const float* weights = nullptr;  // [R]
  int64_t R = 0;
  // Output out[T, D] fp32, row stride out_stride (elements); rows [0, T) are overwritten.
  float* out = nullptr;
  int64_t out_stride = 0;
  // Path: the highest allowed ISA (throws if the CPU lacks an explicitly requested one), and
  // the fewest routes of one expert that send that expert to the AMX tiles.
  Isa isa = Isa::kAuto;
  int64_t amx_min_tokens = 4;
  // Quantized experts on the AMX tiles: their rows decoded to bf16 once per call (dequant.h),
  // for experts with at least this many routes; 0 (the default): never, the row kernels take
  // every route. The rows' decoding costs the time of several routes, so the break-even is
  // measured (scripts/bench_cpu_quant.py --amx-quant) before a caller turns it on.
  int64_t amx_quant_min_tokens = 0;
  // Quantized experts on the AMX int8 tiles (kernels_amx8.cpp; Q4_K gate/up, Q4_K and Q6_K down),
  // for experts with at least this many routes; 0: never. The tiles multiply the same integers as
  // the row kernels (the weights' and the per-32 quantized activations'), into the same int32
  // sums of each scale's sub-block; only the fp32 combination of those sums runs in another order.
  // A projection of another format stays on the row kernels. Needs cpu_features().amx_int8.
  int64_t amx_int8_min_tokens = 0;
  // Down projection: 0 picks by size, 1 "direct", 2 "scatter" (kernels.h); same bits.
  int32_t down_mode = 0;
  // Software prefetch of the weight rows computed next (a tuning switch; same results), and, for
  // the quantized row kernels, how far ahead of each row stream they prefetch every line (and
  // start the hardware prefetcher on the stream's next page: kernels_quant.cpp prefetch_rows).
  bool prefetch = true;
  int64_t prefetch_bytes = 1024;
  // Where to announce the call's end (null: nowhere): the worker that finishes it stores
  // notify_value into *notify with release semantics once out is complete, before wait() is
  // called, so that a GPU stream spinning on that word (page-locked, device-mapped) can read out
  // while the host goes on (layers/moe/hybrid.py's deferred combine). wait() is still required.
  int32_t* notify = nullptr;
  int32_t notify_value = 0;
};

// What the last submit() did (for tests and benchmarks).
struct ColdStats {
  Isa isa = Isa::kAuto;  // the path actually used
  int64_t experts = 0;  // distinct experts with cold routes
  int64_t amx_experts = 0;  // of which computed on AMX tiles
  int64_t int8_experts = 0;  // of which a projection ran on the AMX int8 tiles (amx_int8_min_tokens)
  int64_t routes = 0;
  bool scatter = false;  // the down projection went through the per-route buffer
  bool quant = false;  // quantized experts (the VNNI kernels)
  // Microseconds from the pool's start to the end of phase k (0 prepare, 1 gate/up, 2 down,
  // 3 reduce; -1 if the call had no such phase, as 0 when submit() quantized x itself).
  // Quantized scatter calls overlap 1 and 2: 1 is when the last gate/up task ended. Complete
  // once the call was waited for.
  double phase_end_us[4] = {-1, -1, -1, -1};
};

// A resident pinned thread pool plus the workspace of one call. Not thread-safe: one
// submitter; submit() requires the previous call to have been waited for.
class ColdExperts {
 public:
  // cpus: the logical CPU each worker is pinned to (-1: unpinned); one worker per entry.
  // spin_us: how long idle workers and wait() spin before sleeping on a futex.
  ColdExperts(const std::vector<int>& cpus, int64_t spin_us);
  ~ColdExperts();
  ColdExperts(const ColdExperts&) = delete;
  ColdExperts& operator=(const ColdExperts&) = delete;

  // Validates (std::invalid_argument), plans, and hands the work to the pool; returns at
  // once. Every buffer in args must stay valid and unchanged until wait() returns.
  void submit(const ColdArgs& args);
  void wait();
  bool ready() const;  // the last submitted call has finished (wait() still required)

  // Pre-sizes the workspace so that calls up to these sizes allocate nothing (int8_tiles: calls with
  // quantized experts on the AMX int8 tiles too).
  void reserve(int64_t routes, int64_t tokens, int64_t E, int64_t D, int64_t F, bool int8_tiles = false);
  int num_threads() const;
  void set_spin_us(int64_t spin_us);
  ColdStats last_stats() const;
  // The bandwidth probe of the benchmarks: reads `bytes` from data on the pool's threads
  // (and the caller's, as wait() does), in 1 MiB tasks; returns the seconds it took.
  double read_seconds(const void* data, int64_t bytes);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// Synchronous: submit(args) then wait().
void cold_experts_forward(const ColdArgs& args, ColdExperts& runner);

// The activation quantization of the quantized experts, per block of 32 values (n a multiple
// of 32): amax = max |v|, d = amax / 127, q = round-half-even(v * (127 / amax)) with one fp32
// division and one fp32 product; a block with amax < 2^-96 (zeros) has d = 0, q = 0.
// v ~ d * q. Requires AVX-512 (cpu_features().avx512).
void quantize_activations(const float* v, int64_t n, int8_t* q, float* d);

}  // namespace ostinato
