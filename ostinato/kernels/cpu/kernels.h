// Internal: the plan of one call and the ISA-specific task functions that execute it.
//
// Legend: T tokens, R routes, D hidden, F expert FFN, P positions of the routes sorted by
// expert (p -> route order[p]), s an active expert's slot (ascending expert id).
//
// A call runs in up to four phases; a phase starts when the previous one has finished:
//   0  prepare activations: convert x rows to fp32 (vector path) / pack them into AMX tiles;
//   1  gate/up: h[p, f] = act(w13[e][f] . x[t] + b13[e][f], w13[e][F+f] . x[t] + b13[e][F+f]),
//      tasks (s, f-block) (act and the biases as the call says: experts.h);
//   2  down, "direct" (few routes, h fits in L2): one task per d-block covering every
//      expert, out[t, d] = fma(weight, w2[e][d] . h[p] + b2[e][d], out[t, d]) over s ascending;
//      down, "scatter" (many routes): tasks (s, d-block) write y[p, d] = w2[e][d] . h[p] + b2[e][d];
//   3  (scatter only) one task per token: out[t, d] = fma(weight, y[p, d], out[t, d]) over
//      its positions p ascending, i.e. the same expert order and operations as direct, so
//      both modes give the same bits.
// Every output element has exactly one writer and a fixed order of operations.
//
// Quantized experts run the same phases on the VNNI kernels of kernels_quant.cpp: phase 0
// quantizes each x row into an activation record (below) arranged for qt13 (on the submitting
// thread when the call has few tokens), the gate/up tasks quantize each 32-chunk of bf16(h)
// into a record arranged for qt2 once its rows are all computed (whichever task completes a
// chunk), and the row kernels read the weight blocks in place. In scatter mode phases 1 and 2
// are one job phase: the down tasks follow the gate/up tasks, and one of slot s waits only for
// slot s's h (Plan::chunks_left), not for every expert's, so the gate/up tail overlaps the
// first down tasks instead of idling at a barrier.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "experts.h"

namespace ostinato {

// How the vector (non-AMX) path reads operands.
enum class VecKind : int32_t {
  kDpBf16 = 0,  // bf16 w13 . bf16 x with VDPBF16PS; w2 widened, h split layout
  kSplit = 1,  // bf16 weights widened by shift/mask; x and h in split fp32 layout
  kF32 = 2,  // fp32 weights; x and h fp32 in natural layout
};

// "Split" layout of an fp32 vector used against bf16 weights: each chunk of 32 elements
// stores its even elements then its odd ones, so that one 512-bit load of 32 bf16 weights
// widens into (even, odd) fp32 halves with one shift and one mask. Length padded to 32.
inline int64_t split_index(int64_t k) { return (k & ~int64_t(31)) + ((k & 1) << 4) + ((k & 31) >> 1); }
inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

inline float bf16_to_f32(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16_rne(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// One quantized activation vector of n values, as the row kernels of one QType read it, in
// a record of `stride` bytes:
//   q    int8 [pad]     the values in the format's arrangement (pad = n rounded up to 128;
//                       positions past n are 0)
//   aux  fp32 [...]     at aux_off: block scales, laid out as that format's kernel loads them
//   corr int32 [pad/4]  at corr_off: -offset * (sum of the 4 q of each dot lane), the start
//                       value of the formats whose weights are stored with an offset
struct QActLayout {
  int64_t n = 0, aux_off = 0, corr_off = 0, stride = 0;
};
QActLayout qact_layout(QType qt, int64_t n);
int64_t qact_max_stride(int64_t n);  // the largest stride over the formats

struct QActView {
  int8_t* q;
  float* aux;
  int32_t* corr;
};
inline QActView qact_view(uint8_t* base, const QActLayout& l, int64_t i) {
  uint8_t* r = base + i * l.stride;
  return {reinterpret_cast<int8_t*>(r), reinterpret_cast<float*>(r + l.aux_off),
          reinterpret_cast<int32_t*>(r + l.corr_off)};
}

struct Plan {
  ColdArgs a;
  Isa isa = Isa::kAvx512;
  VecKind kind = VecKind::kSplit;
  int64_t D32 = 0, F32 = 0;  // D, F rounded up to 32 (row strides of xconv and h)

  // Routes sorted by expert: slot s covers positions [start[s], start[s+1]).
  std::vector<int32_t> order;  // [R] route index of position p
  std::vector<int32_t> exp_id;  // [S] expert id of slot s, ascending
  std::vector<int32_t> start;  // [S+1]
  std::vector<uint8_t> amx;  // [S] slot computed on AMX tiles
  std::vector<int64_t> xpack_off;  // [S] AMX: offset of the slot's packed x (uint16 units)
  std::vector<int64_t> hpack_off;  // [S] AMX: offset of the slot's packed h (uint16 units)
  std::vector<int32_t> tok_start;  // [T+1] scatter: token t owns tok_pos[tok_start[t]..]
  std::vector<int32_t> tok_pos;  // [R] positions grouped by token, ascending within a token

  // Workspace (owned by the runner).
  bool scatter = false;  // down-projection mode (see above)
  float* h = nullptr;  // [R, F32] by position p (vector slots); gate values until the activation
  float* u = nullptr;  // [R, F32] up values, read by the gate/up task's epilogue
  float* y = nullptr;  // [R, D] by position p (scatter mode)
  float* xconv = nullptr;  // [T, D32] converted x (kSplit, or kF32 from bf16 x)
  uint16_t* xpack = nullptr;  // AMX B tiles of x
  uint16_t* hhi = nullptr;  // AMX B tiles of bf16(h)

  // Quantized experts.
  bool quant = false;
  int64_t rb13 = 0, rb2 = 0;  // bytes of a w13 row (D values) and of a w2 row (F values)
  QActLayout xl, hl;  // records of x (qt13, D) and of h (qt2, F)
  uint8_t* xact = nullptr;  // [T, xl.stride]
  uint8_t* hact = nullptr;  // [R, hl.stride] by position p
  bool prepare_inline = false;  // x rows quantized by submit() (then no phase 0)
  bool merged = false;  // scatter: gate/up and down tasks in one job phase
  int64_t chunks = 0;  // F / 32: the 32-chunks of h of a slot
  // Counters shared by the tasks (GCC's __atomic builtins), zeroed by the plan:
  int32_t* chunk_rows = nullptr;  // [S * chunks] gate/up rows computed of each chunk of each slot
  int32_t* chunks_left = nullptr;  // [S] chunks of the slot's h not yet quantized

  // Quantized experts on the AMX int8 tiles (kernels_amx8.cpp, ColdArgs::amx_int8_min_tokens):
  // whether slot s's gate/up (i8_13) and down (i8_2) projections run there, and its activations
  // packed for them (i8_pack below) at byte offsets xpk_off / hpk_off of xpk (x) and hpk (h).
  std::vector<uint8_t> i8_13, i8_2;  // [S]
  std::vector<int64_t> xpk_off, hpk_off;  // [S]
  uint8_t* xpk = nullptr;
  uint8_t* hpk = nullptr;
  // Token t's routes in i8_13 slots, (slot, index in the slot) for k in [xtok_start[t], xtok_start[t + 1]):
  // where quant_prepare_x packs its x as well.
  std::vector<int32_t> xtok_start, xtok_slot, xtok_idx;

  // Task lists: phase 0 (kind 0: convert token t; kind 1: pack slot s token-block b),
  // phase 1 (slot, AMX or not, first f row, end f row), phase 2 scatter (slot, AMX or not,
  // first d row, end d row); direct phase 2 has ceil(D / kDownRows) tasks, phase 3 T.
  struct Task {
    int32_t kind_or_slot;
    int32_t i;
    int64_t lo, hi;
  };
  std::vector<Task> t0, t1, t2;
  int64_t n2 = 0;

  int32_t route_token(int64_t p) const { return a.token_idx[order[p]]; }
  float route_weight(int64_t p) const { return a.weights[order[p]]; }
};

// LDTILECFG's 64-byte operand (palette 1): rows and bytes per row of each tile register, for the
// AMX paths (kernels_amx.cpp, kernels_amx8.cpp).
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

constexpr int64_t kUpRowsVec = 32;  // f rows per vector gate/up task (one 32-chunk of h)
// Quantized experts: guided task sizes, each task about a (kQuantGuide x threads)-th of its
// phase's rows not yet handed out (within these bounds, in multiples of kQRowsUnit): long row
// streams first, for the hardware prefetcher, and short tasks last, so that the threads finish
// together (the waiter, which joins last, or a thread slowed by its neighbours, leaves a short
// tail). No output bit depends on the task sizes: each row's dot products are computed whole
// by one kernel call of kQRowsUnit rows (or of the rows one pass of several routes takes, a
// divisor of it), and each 32-chunk of h once.
constexpr int64_t kQuantGuide = 2;
constexpr int64_t kQRowsUnit = 4;  // rows of one kernel call for one route (kernels_quant.cpp)
constexpr int64_t kUpRowsQuantMin = 16, kUpRowsQuantMax = 256;
constexpr int64_t kDownRowsQuantMin = 64, kDownRowsQuantMax = 512;
// Calls with at most this many tokens quantize x on the submitting thread: a phase of its own
// costs a barrier for about a microsecond of work per token.
constexpr int64_t kQuantInlineTokens = 4;
constexpr int64_t kUpRowsAmx = 32;  // f rows per AMX gate/up task (one K block of h)
constexpr int64_t kDownRows = 16;  // d rows per direct down task (one AMX tile of rows)
constexpr int64_t kDownRowsScatter = 128;  // d rows per scatter down task (8 AMX tiles)
constexpr int64_t kDirectMaxHBytes = 192 << 10;  // direct down while all of h fits in L2

// The AMX int8 tiles' activations: a slot's routes in groups of 16 (kI8Routes), each group
// i8_group_bytes(K) bytes: the routes' int8 values, 16 rows of K in natural order (the A operand of
// TDPBSUD, a row per route), then 4 x 16 fp32 per 32-chunk c of the K values: the routes' scale d, and
// d times the sum of the chunk's 32 q, of its first 16 and of its last 16. Written by the quantization
// of x (phase 0) and of h (the gate/up epilogue) beside the row kernels' records, from the same int8
// values.
constexpr int64_t kI8Routes = 16;
inline int64_t i8_group_bytes(int64_t K) { return kI8Routes * K + K / 32 * 256; }

// Vector path (AVX-512), kernels_avx512.cpp.
void vec_convert_x(const Plan& p, int64_t t);
void vec_gate_up(const Plan& p, int32_t s, int64_t f0, int64_t f1);
void vec_down(const Plan& p, int32_t s, int64_t d0, int64_t d1);  // direct or scatter
void reduce_token(const Plan& p, int64_t t);  // phase 3

// Quantized experts, kernels_quant.cpp (every slot; D, F multiples of the block sizes; row
// ranges multiples of kQRowsUnit).
void quant_prepare_x(const Plan& p, int64_t t);
void quant_gate_up(const Plan& p, int32_t s, int64_t f0, int64_t f1);  // quantizes the h chunks it completes
void quant_down(const Plan& p, int32_t s, int64_t d0, int64_t d1);  // direct or scatter
double read_sum(const void* data, int64_t bytes);  // the bandwidth probe's task (AVX-512)

// AMX int8 tiles, kernels_amx8.cpp: rows [lo, hi) of slot s's gate and up (into h and u, as
// quant_gate_up's row kernels; the caller runs the chunks' epilogue) or of its down projection
// (into y, or out in direct mode, as quant_down). lo, hi multiples of 16.
void amx8_gate_up(const Plan& p, int32_t s, int64_t f0, int64_t f1);
void amx8_down(const Plan& p, int32_t s, int64_t d0, int64_t d1);

// AMX path, kernels_amx.cpp (requires D % 32 == 0, F % 32 == 0, bf16 x, and bf16 or
// quantized weights).
void amx_pack_x(const Plan& p, int32_t s, int64_t block);
void amx_gate_up(const Plan& p, int32_t s, int64_t f0);  // quantized: marks its chunk of h done
// 16 rows from d0, direct or scatter; next_rows (or null): the 16 w2 rows computed next,
// prefetched into L2 meanwhile.
void amx_down(const Plan& p, int32_t s, int64_t d0, const uint16_t* next_rows);
void amx_down_rows(const Plan& p, int32_t s, int64_t d0, int64_t d1);  // scatter: rows [d0, d1), 16 at a time
// The AMX path's decoding of quantized rows (dequant.h, with Q4_K and Q5_K by table), for the
// tests: uint8 w[rows, row bytes] -> bf16 out[rows, n]. Requires AVX-512BW.
void dequant_rows_bf16_avx512(QType qt, const uint8_t* w, int64_t rows, int64_t n, uint16_t* out);

}  // namespace ostinato
