// Cold experts on the CPU: CPU feature detection, planning a call, and running its phases
// on the resident pool (see kernels.h for the phases and experts.h for the contract).
//
// Planning runs on the submitting thread and costs O(R + E + T + S log S): routes are
// counting-sorted by expert (stable, so duplicates keep their order), each active expert is
// sent to the AMX tiles or to the vector kernels, and the task lists of the phases are
// written. The bf16 paths' tasks never depend on the number of threads; the quantized
// experts' tasks grow with fewer threads, but no output element's arithmetic depends on a
// task's extent (kernels.h). So no output bit depends on the number of threads.
// After a warm-up call of the largest size (or reserve()), planning allocates nothing.
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>

#include "experts.h"
#include "kernels.h"
#include "threadpool.h"

namespace ostinato {
namespace {

uint64_t read_xcr0() {
  uint32_t eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (uint64_t(edx) << 32) | eax;
}

CpuFeatures detect() {
  CpuFeatures f;
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = c & (1u << 27), fma = c & (1u << 12);
  if (!osxsave || !fma || __get_cpuid_max(0, nullptr) < 7) return f;
  const uint64_t xcr0 = read_xcr0();
  __cpuid_count(7, 0, a, b, c, d);
  const bool avx512 = (b & (1u << 16)) && (b & (1u << 17)) && (b & (1u << 30)) &&
                      (b & (1u << 31)) && (b & (1u << 8));  // F, DQ, BW, VL, BMI2
  const bool amx_cpu = (d & (1u << 22)) && (d & (1u << 24));  // AMX-BF16, AMX-TILE
  const bool amx_int8_cpu = (d & (1u << 25)) && (d & (1u << 24));  // AMX-INT8, AMX-TILE
  f.avx512 = avx512 && (xcr0 & 0xe6) == 0xe6;  // SSE, AVX, opmask, ZMM state enabled
  if (!f.avx512) return f;
  unsigned a1, b1, c1, d1;
  __cpuid_count(7, 1, a1, b1, c1, d1);
  f.avx512_bf16 = a1 & (1u << 5);
  f.avx512_vnni = c & (1u << 11);
  if ((amx_cpu || amx_int8_cpu) && (xcr0 & (3ull << 17)) == (3ull << 17)) {
    // Linux hands out the 8 KiB tile state only on request (once per process).
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    const bool tiles = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
    f.amx = tiles && amx_cpu && f.avx512_bf16;
    f.amx_int8 = tiles && amx_int8_cpu && f.avx512_vnni;
  }
  return f;
}

template <class T>
class AlignedBuffer {
 public:
  ~AlignedBuffer() { std::free(ptr_); }
  T* ensure(size_t n) {
    if (n > cap_) {
      std::free(ptr_);
      size_t bytes = (n * sizeof(T) + 63) / 64 * 64;
      ptr_ = static_cast<T*>(std::aligned_alloc(64, bytes));
      if (!ptr_) throw std::bad_alloc();
      cap_ = n;
    }
    return ptr_;
  }

 private:
  T* ptr_ = nullptr;
  size_t cap_ = 0;
};

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx512Bf16: return "avx512_bf16";
    case Isa::kAmx: return "amx";
    default: return "auto";
  }
}

Isa best_isa(const CpuFeatures& f) {
  return f.amx ? Isa::kAmx : f.avx512_bf16 ? Isa::kAvx512Bf16 : Isa::kAvx512;
}

void check(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("cold_experts: " + what);
}

bool is_block_qtype(QType qt) { return int(qt) >= 1 && int(qt) <= 5; }

void validate_quant(const ColdArgs& a) {
  check(is_block_qtype(a.qt13) && is_block_qtype(a.qt2), "qt13 and qt2 must both be block formats");
  if (!cpu_features().avx512_vnni)
    throw std::runtime_error("cold_experts: quantized experts need AVX512_VNNI, which this CPU lacks");
  check(a.D % qtype_block_values(a.qt13) == 0, "D = " + std::to_string(a.D) + " is not a whole number of qt13 blocks");
  check(a.F % qtype_block_values(a.qt2) == 0, "F = " + std::to_string(a.F) + " is not a whole number of qt2 blocks");
}

void validate(const ColdArgs& a) {
  const CpuFeatures& f = cpu_features();
  if (!f.avx512) throw std::runtime_error("cold_experts: this CPU lacks AVX-512 (F, BW, VL)");
  check(a.E > 0 && a.D > 0 && a.F > 0, "E, D and F must be positive");
  check(a.T >= 0 && a.R >= 0, "T and R must be >= 0");
  check(int(a.w_dtype) == 0 || int(a.w_dtype) == 1, "w_dtype must be float32 or bfloat16");
  check(int(a.x_dtype) == 0 || int(a.x_dtype) == 1, "x_dtype must be float32 or bfloat16");
  check(int(a.isa) >= 0 && int(a.isa) <= 3, "unknown isa");
  check(a.down_mode >= 0 && a.down_mode <= 2, "down_mode must be 0, 1 or 2");
  check(int(a.act) == 0 || int(a.act) == 1, "act must be 0 (silu) or 1 (clamped_swiglu)");
  check(a.act != Act::kClampedSwiglu || a.act_limit > 0, "clamped_swiglu needs act_limit > 0");
  check((a.b13 == nullptr) == (a.b2 == nullptr), "b13 and b2 must both be set or both be null");
  if (a.qt13 != QType::kNone || a.qt2 != QType::kNone) validate_quant(a);
  if (a.isa != Isa::kAuto && int(a.isa) > int(best_isa(f)))
    throw std::invalid_argument(std::string("cold_experts: this CPU does not support isa '") +
                                isa_name(a.isa) + "' (best: " + isa_name(best_isa(f)) + ")");
  check(a.T == 0 || (a.out && a.out_stride >= a.D), "out must be non-null with out_stride >= D");
  if (a.R == 0) return;
  check(a.w13 && a.w2 && a.x && a.token_idx && a.expert_ids && a.weights, "null pointer");
  check(a.x_stride >= a.D, "x_stride must be >= D");
  for (int64_t r = 0; r < a.R; ++r) {
    if (a.token_idx[r] < 0 || a.token_idx[r] >= a.T)
      throw std::invalid_argument("cold_experts: token_idx[" + std::to_string(r) + "] = " +
                                  std::to_string(a.token_idx[r]) + " is outside [0, T)");
    if (a.expert_ids[r] < 0 || a.expert_ids[r] >= a.E)
      throw std::invalid_argument("cold_experts: expert_ids[" + std::to_string(r) + "] = " +
                                  std::to_string(a.expert_ids[r]) + " is outside [0, E)");
  }
}

}  // namespace

int64_t qtype_block_values(QType qt) {
  switch (qt) {
    case QType::kQ8_0:
    case QType::kMXFP4: return 32;
    case QType::kQ4_K:
    case QType::kQ5_K:
    case QType::kQ6_K: return 256;
    default: return 0;
  }
}

int64_t qtype_block_bytes(QType qt) {
  switch (qt) {
    case QType::kQ8_0: return 34;
    case QType::kQ4_K: return 144;
    case QType::kQ5_K: return 176;
    case QType::kQ6_K: return 210;
    case QType::kMXFP4: return 17;
    default: return 0;
  }
}

int64_t qtype_row_bytes(QType qt, int64_t n) {
  const int64_t k = qtype_block_values(qt);
  return k ? n / k * qtype_block_bytes(qt) : 0;
}

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

struct ColdExperts::Impl final : PhasedJob {
  Impl(const std::vector<int>& cpus, int64_t spin_us) : pool(cpus, spin_us) {}

  void plan_call(const ColdArgs& args);
  void task(int phase, int64_t i) override;
  void finished_hook() override { announce(plan.a); }
  static void announce(const ColdArgs& a) {
    if (a.notify != nullptr) __atomic_store_n(a.notify, a.notify_value, __ATOMIC_RELEASE);
  }

  ThreadPool pool;
  Plan plan;
  AlignedBuffer<float> h, u, xconv, y;
  AlignedBuffer<uint16_t> xpack, hhi;
  AlignedBuffer<uint8_t> xact, hact, xpk, hpk;
  std::vector<int32_t> counts, slots_by_size, chunk_rows, chunks_left;
  std::vector<uint8_t> token_used;
  std::atomic<int64_t> ups_done{0};  // merged quantized phase: gate/up tasks finished,
  int64_t up_end_ns = 0;             // and when the last one did
  std::vector<int64_t> phase_sizes;
  // job phase -> 0 prepare, 1 gate/up, 2 down, 3 reduce, 4 gate/up then down (Plan::merged)
  int phases[PhasedJob::kMaxPhases] = {};
  bool pending = false, launched = false;
  ColdStats stats;
};

void ColdExperts::Impl::plan_call(const ColdArgs& args) {
  Plan& p = plan;
  p.a = args;
  const ColdArgs& a = p.a;
  const Isa avail = best_isa(cpu_features());
  p.isa = a.isa == Isa::kAuto ? avail : a.isa;
  const bool bf16_w = a.w_dtype == DType::kBFloat16, bf16_x = a.x_dtype == DType::kBFloat16;
  p.kind = !bf16_w ? VecKind::kF32
                   : (bf16_x && p.isa >= Isa::kAvx512Bf16 ? VecKind::kDpBf16 : VecKind::kSplit);
  p.D32 = round_up(a.D, 32);
  p.F32 = round_up(a.F, 32);
  p.quant = a.qt13 != QType::kNone;
  if (p.quant) {
    p.rb13 = qtype_row_bytes(a.qt13, a.D);
    p.rb2 = qtype_row_bytes(a.qt2, a.F);
    p.xl = qact_layout(a.qt13, a.D);
    p.hl = qact_layout(a.qt2, a.F);
  }

  // Counting sort of the routes by expert.
  counts.assign(size_t(a.E) + 1, 0);
  for (int64_t r = 0; r < a.R; ++r) ++counts[a.expert_ids[r] + 1];
  p.exp_id.clear();
  p.start.clear();
  for (int64_t e = 0; e < a.E; ++e) {
    if (counts[e + 1] > 0) {
      p.exp_id.push_back(int32_t(e));
      p.start.push_back(counts[e]);
    }
    counts[e + 1] += counts[e];
  }
  p.start.push_back(int32_t(a.R));
  p.order.resize(size_t(a.R));
  for (int64_t r = 0; r < a.R; ++r) p.order[counts[a.expert_ids[r]]++] = int32_t(r);
  const int32_t S = int32_t(p.exp_id.size());

  // AMX for experts with enough routes; packed buffers laid out slot after slot. Quantized
  // experts go to the tiles as bf16 rows decoded per task (kernels_amx.cpp), where allowed.
  const int64_t amx_min = p.quant ? a.amx_quant_min_tokens : a.amx_min_tokens;
  const bool amx_ok = p.isa == Isa::kAmx && (p.quant ? amx_min > 0 : bf16_w) && bf16_x && a.D % 32 == 0 &&
                      a.F % 32 == 0;
  p.amx.assign(size_t(S), 0);
  p.xpack_off.assign(size_t(S), 0);
  p.hpack_off.assign(size_t(S), 0);
  int64_t xpack_len = 0, hpack_len = 0, amx_slots = 0;
  bool any_vec = false;
  for (int32_t s = 0; s < S; ++s) {
    const int64_t n = p.start[s + 1] - p.start[s];
    p.amx[s] = amx_ok && n >= std::max<int64_t>(1, amx_min);
    if (!p.amx[s]) {
      any_vec = true;
      continue;
    }
    ++amx_slots;
    const int64_t padded = round_up(n, 16);
    p.xpack_off[s] = xpack_len;
    p.hpack_off[s] = hpack_len;
    xpack_len += padded * a.D;
    hpack_len += padded * a.F;
  }
  const bool convert = any_vec && (p.quant || p.kind == VecKind::kSplit ||
                                   (p.kind == VecKind::kF32 && a.x_dtype == DType::kBFloat16));
  p.h = any_vec ? h.ensure(size_t(a.R * p.F32)) : nullptr;
  p.u = any_vec ? u.ensure(size_t(a.R * p.F32)) : nullptr;
  p.xconv = convert && !p.quant ? xconv.ensure(size_t(a.T * p.D32)) : nullptr;
  p.xact = p.quant ? xact.ensure(size_t(a.T * p.xl.stride)) : nullptr;
  p.hact = p.quant ? hact.ensure(size_t(a.R * p.hl.stride)) : nullptr;
  p.xpack = amx_slots ? xpack.ensure(size_t(xpack_len)) : nullptr;
  p.hhi = amx_slots ? hhi.ensure(size_t(hpack_len)) : nullptr;

  // Quantized experts on the AMX int8 tiles (kernels_amx8.cpp): the slots with enough routes not on
  // the bf16 tiles, for each projection of a format the tiles take; their activations' packs.
  const bool i8_ok = p.quant && a.amx_int8_min_tokens > 0 && cpu_features().amx_int8 &&
                     (a.isa == Isa::kAuto || a.isa == Isa::kAmx);
  const bool i8_13 = i8_ok && (a.qt13 == QType::kQ4_K || a.qt13 == QType::kMXFP4);
  const bool i8_2 = i8_ok && (a.qt2 == QType::kQ4_K || a.qt2 == QType::kQ6_K || a.qt2 == QType::kMXFP4);
  p.i8_13.assign(size_t(S), 0);
  p.i8_2.assign(size_t(S), 0);
  p.xpk_off.assign(size_t(S), 0);
  p.hpk_off.assign(size_t(S), 0);
  int64_t xpk_len = 0, hpk_len = 0, i8_slots = 0;
  for (int32_t s = 0; s < S; ++s) {
    const int64_t n = p.start[s + 1] - p.start[s], groups = (n + kI8Routes - 1) / kI8Routes;
    if (p.amx[s] || n < a.amx_int8_min_tokens || !(i8_13 || i8_2)) continue;
    ++i8_slots;
    p.i8_13[s] = i8_13;
    p.i8_2[s] = i8_2;
    p.xpk_off[s] = xpk_len;
    p.hpk_off[s] = hpk_len;
    xpk_len += i8_13 ? groups * i8_group_bytes(a.D) : 0;
    hpk_len += i8_2 ? groups * i8_group_bytes(a.F) : 0;
  }
  p.xpk = xpk_len ? xpk.ensure(size_t(xpk_len)) : nullptr;
  p.hpk = hpk_len ? hpk.ensure(size_t(hpk_len)) : nullptr;
  p.xtok_start.clear();
  if (xpk_len) {  // token -> its routes in i8_13 slots, which phase 0 packs with its x
    p.xtok_start.assign(size_t(a.T) + 1, 0);
    for (int32_t s = 0; s < S; ++s)
      if (p.i8_13[s])
        for (int32_t q = p.start[s]; q < p.start[s + 1]; ++q) ++p.xtok_start[p.route_token(q) + 1];
    for (int64_t t = 0; t < a.T; ++t) p.xtok_start[t + 1] += p.xtok_start[t];
    p.xtok_slot.resize(size_t(p.xtok_start[a.T]));
    p.xtok_idx.resize(size_t(p.xtok_start[a.T]));
    counts.assign(p.xtok_start.begin(), p.xtok_start.end());
    for (int32_t s = 0; s < S; ++s)
      if (p.i8_13[s])
        for (int32_t q = p.start[s]; q < p.start[s + 1]; ++q) {
          const int32_t k = counts[p.route_token(q)]++;
          p.xtok_slot[k] = s;
          p.xtok_idx[k] = q - p.start[s];
        }
  }

  // Phase 0: convert the x rows the vector slots read; pack x for the AMX slots.
  p.t0.clear();
  if (convert) {
    token_used.assign(size_t(a.T), 0);
    for (int32_t s = 0; s < S; ++s)
      if (!p.amx[s])
        for (int32_t q = p.start[s]; q < p.start[s + 1]; ++q) token_used[p.route_token(q)] = 1;
    for (int64_t t = 0; t < a.T; ++t)
      if (token_used[t]) p.t0.push_back({0, 0, t, 0});
  }
  for (int32_t s = 0; s < S; ++s)
    if (p.amx[s])
      for (int64_t b = 0; b < (p.start[s + 1] - p.start[s] + 15) / 16; ++b)
        p.t0.push_back({1, s, b, 0});

  // then submit() runs the x tasks (all of them quantizing x: no slot packs x for AMX)
  p.prepare_inline = p.quant && a.T <= kQuantInlineTokens && amx_slots == 0;

  // Phase 1: (slot, f block) tasks, the busiest experts first so the tail is short.
  slots_by_size.resize(size_t(S));
  for (int32_t s = 0; s < S; ++s) slots_by_size[s] = s;
  std::sort(slots_by_size.begin(), slots_by_size.end(), [&](int32_t x, int32_t y) {
    const int32_t nx = p.start[x + 1] - p.start[x], ny = p.start[y + 1] - p.start[y];
    return nx != ny ? nx > ny : x < y;  // std::sort: no temporary buffer, unlike stable_sort
  });
  // Quantized experts: guided task sizes (kernels.h). A task takes a (kQuantGuide x threads)-th
  // of the phase's rows not yet handed out, in multiples of kQRowsUnit within [lo, hi]; a
  // slot's last task takes a remainder below lo along.
  const int64_t guide = kQuantGuide * (pool.size() + 1);  // the waiter helps
  // A slot on the int8 tiles takes its rows in aligned groups of 16.
  const auto guided = [&](std::vector<Plan::Task>& tasks, int32_t s, int64_t rows, int64_t& left, int64_t lo,
                          int64_t hi, bool tiles) {
    for (int64_t r = 0; r < rows;) {
      int64_t n = std::clamp(round_up(left / guide, tiles ? 16 : kQRowsUnit), lo, hi);
      if (rows - r - n < lo) n = rows - r;
      tasks.push_back({s, 0, r, r + n});
      r += n;
      left -= n;
    }
  };
  p.t1.clear();
  int64_t left = (S - amx_slots) * a.F;
  for (int32_t s : slots_by_size) {
    if (p.quant && !p.amx[s]) {
      guided(p.t1, s, a.F, left, kUpRowsQuantMin, kUpRowsQuantMax, p.i8_13[s]);
      continue;
    }
    const int64_t step = p.amx[s] ? kUpRowsAmx : kUpRowsVec;
    for (int64_t f = 0; f < a.F; f += step)
      p.t1.push_back({s, p.amx[s], f, std::min(a.F, f + step)});
  }

  // Phase 2 (and 3): direct while h is small, else scatter through y. Quantized experts
  // always scatter: a direct task's 16 rows of an expert are too short a stream for their
  // row kernels (measured 1.7x slower down projections on one token).
  p.scatter = a.down_mode == 0 ? a.R * p.F32 * int64_t(sizeof(float)) > kDirectMaxHBytes || p.quant
                                : a.down_mode == 2;
  p.t2.clear();
  if (p.scatter) {
    p.y = y.ensure(size_t(a.R * a.D));
    p.tok_start.assign(size_t(a.T) + 1, 0);
    for (int64_t r = 0; r < a.R; ++r) ++p.tok_start[a.token_idx[r] + 1];
    for (int64_t t = 0; t < a.T; ++t) p.tok_start[t + 1] += p.tok_start[t];
    counts.assign(p.tok_start.begin(), p.tok_start.end());
    p.tok_pos.resize(size_t(a.R));
    for (int64_t q = 0; q < a.R; ++q) p.tok_pos[counts[p.route_token(q)]++] = int32_t(q);
    left = (S - amx_slots) * a.D;
    for (int32_t s : slots_by_size) {
      if (p.quant && !p.amx[s]) {
        guided(p.t2, s, a.D, left, kDownRowsQuantMin, kDownRowsQuantMax, p.i8_2[s]);
        continue;
      }
      for (int64_t d = 0; d < a.D; d += kDownRowsScatter)
        p.t2.push_back({s, p.amx[s], d, std::min(a.D, d + kDownRowsScatter)});
    }
    p.n2 = int64_t(p.t2.size());
  } else {
    p.n2 = (a.D + kDownRows - 1) / kDownRows;
  }
  p.merged = p.quant && p.scatter;
  if (p.quant) {  // the chunks of h: rows computed, and per slot those not yet quantized
    p.chunks = a.F / 32;
    chunk_rows.assign(size_t(S * p.chunks), 0);
    chunks_left.assign(size_t(S), int32_t(p.chunks));
    p.chunk_rows = chunk_rows.data();
    p.chunks_left = chunks_left.data();
  }

  stats.experts = S;
  stats.amx_experts = amx_slots;
  stats.int8_experts = i8_slots;
  stats.routes = a.R;
  stats.scatter = p.scatter;
  stats.quant = p.quant;
  stats.isa = amx_slots ? Isa::kAmx
              : p.kind == VecKind::kDpBf16 ? Isa::kAvx512Bf16 : Isa::kAvx512;
}

void ColdExperts::Impl::task(int phase, int64_t i) {
  const Plan& p = plan;
  const ColdArgs& a = p.a;
  switch (phases[phase]) {
    case 0: {
      const Plan::Task& t = p.t0[i];
      if (t.kind_or_slot == 0 && p.quant)
        quant_prepare_x(p, t.lo);
      else if (t.kind_or_slot == 0)
        vec_convert_x(p, t.lo);
      else
        amx_pack_x(p, t.i, t.lo);
      break;
    }
    case 1: {
      const Plan::Task& t = p.t1[i];
      if (t.i)
        amx_gate_up(p, t.kind_or_slot, t.lo);
      else if (p.quant)
        quant_gate_up(p, t.kind_or_slot, t.lo, t.hi);
      else
        vec_gate_up(p, t.kind_or_slot, t.lo, t.hi);
      break;
    }
    case 2: {
      if (p.scatter) {
        const Plan::Task& t = p.t2[i];
        if (!t.i) {
          if (p.quant)
            quant_down(p, t.kind_or_slot, t.lo, t.hi);
          else
            vec_down(p, t.kind_or_slot, t.lo, t.hi);
          break;
        }
        amx_down_rows(p, t.kind_or_slot, t.lo, t.hi);
        break;
      }
      const int64_t d0 = i * kDownRows, d1 = std::min(a.D, d0 + kDownRows);
      for (int64_t t = 0; t < a.T; ++t)
        std::memset(a.out + t * a.out_stride + d0, 0, size_t(d1 - d0) * sizeof(float));
      const int32_t S = int32_t(p.exp_id.size());
      for (int32_t s = 0; s < S; ++s) {  // ascending expert: the sum order
        if (!p.amx[s]) {
          if (p.quant)
            quant_down(p, s, d0, d1);
          else
            vec_down(p, s, d0, d1);
          continue;
        }
        const uint16_t* next = nullptr;  // the next AMX slot's rows, prefetched meanwhile
        if (s + 1 < S && p.amx[s + 1] && !p.quant)
          next = static_cast<const uint16_t*>(a.w2) + (int64_t(p.exp_id[s + 1]) * a.D + d0) * a.F;
        amx_down(p, s, d0, next);
      }
      break;
    }
    case 3:
      reduce_token(p, i);
      break;
    case 4: {  // quantized gate/up tasks, then the down tasks, each once its slot's h is whole
      const int64_t n1 = int64_t(p.t1.size());
      if (i < n1) {
        const Plan::Task& t = p.t1[i];
        if (t.i)
          amx_gate_up(p, t.kind_or_slot, t.lo);
        else
          quant_gate_up(p, t.kind_or_slot, t.lo, t.hi);
        if (ups_done.fetch_add(1, std::memory_order_relaxed) == n1 - 1) up_end_ns = PhasedJob::now_ns();
        break;
      }
      const Plan::Task& t = p.t2[i - n1];
      const int32_t* left = &p.chunks_left[t.kind_or_slot];
      spin_until([&] { return __atomic_load_n(left, __ATOMIC_ACQUIRE) == 0; });
      if (t.i)
        amx_down_rows(p, t.kind_or_slot, t.lo, t.hi);
      else
        quant_down(p, t.kind_or_slot, t.lo, t.hi);
    }
  }
}

ColdExperts::ColdExperts(const std::vector<int>& cpus, int64_t spin_us)
    : impl_(std::make_unique<Impl>(cpus, spin_us)) {}

ColdExperts::~ColdExperts() { wait(); }

void ColdExperts::submit(const ColdArgs& args) {
  Impl& m = *impl_;
  if (m.pending) throw std::logic_error("cold_experts: submit() before wait() of the previous call");
  validate(args);
  m.pool.drain();
  m.plan_call(args);
  Plan& p = m.plan;
  if (p.prepare_inline) {  // a few x rows: quantized here, before the pool starts (kernels.h)
    for (const Plan::Task& t : p.t0) quant_prepare_x(p, t.lo);
    p.t0.clear();
  }
  m.pending = true;
  m.launched = args.R > 0;
  if (!m.launched) {
    for (int64_t t = 0; t < args.T; ++t)
      std::memset(args.out + t * args.out_stride, 0, size_t(args.D) * sizeof(float));
    Impl::announce(args);
    return;
  }
  const int64_t n1 = int64_t(p.t1.size());
  const int64_t sizes[5] = {int64_t(p.t0.size()), p.merged ? 0 : n1, p.merged ? 0 : p.n2, p.scatter ? p.a.T : 0,
                            p.merged ? n1 + p.n2 : 0};
  m.phase_sizes.clear();
  for (int k : {0, 1, 2, 4, 3}) {  // job order
    if (sizes[k] == 0) continue;
    m.phases[m.phase_sizes.size()] = k;
    m.phase_sizes.push_back(sizes[k]);
  }
  m.ups_done.store(0, std::memory_order_relaxed);
  m.reset(m.phase_sizes);
  m.pool.launch(&m);
}

void ColdExperts::wait() {
  Impl& m = *impl_;
  if (!m.pending) return;
  if (m.launched) m.pool.wait();
  m.pending = m.launched = false;
}

bool ColdExperts::ready() const { return !impl_->launched || impl_->pool.finished(); }

void ColdExperts::reserve(int64_t routes, int64_t tokens, int64_t E, int64_t D, int64_t F, bool int8_tiles) {
  Impl& m = *impl_;
  if (m.pending) throw std::logic_error("cold_experts: reserve() while a call is pending");
  m.pool.drain();
  const int64_t D32 = round_up(D, 32), F32 = round_up(F, 32);
  const int64_t padded = routes + 16 * std::min(E, routes);  // AMX pads each expert to 16
  m.h.ensure(size_t(routes * F32));
  m.u.ensure(size_t(routes * F32));
  m.xconv.ensure(size_t(tokens * D32));
  m.xpack.ensure(size_t(padded * D));
  m.hhi.ensure(size_t(padded * F));
  m.y.ensure(size_t(routes * D));
  m.xact.ensure(size_t(tokens * qact_max_stride(D)));  // quantized experts, any format
  m.hact.ensure(size_t(routes * qact_max_stride(F)));
  for (auto* v : {&m.plan.i8_13, &m.plan.i8_2}) v->reserve(size_t(std::min(E, routes)));
  for (auto* v : {&m.plan.xpk_off, &m.plan.hpk_off}) v->reserve(size_t(std::min(E, routes)));
  if (int8_tiles) {  // quantized experts on the int8 tiles: at most padded / 16 groups of routes
    m.xpk.ensure(size_t(padded / kI8Routes * i8_group_bytes(D)));
    m.hpk.ensure(size_t(padded / kI8Routes * i8_group_bytes(F)));
    m.plan.xtok_start.reserve(size_t(tokens + 1));
    m.plan.xtok_slot.reserve(size_t(routes));
    m.plan.xtok_idx.reserve(size_t(routes));
  }
  m.plan.tok_pos.reserve(size_t(routes));
  m.plan.tok_start.reserve(size_t(tokens + 1));
  const int64_t down_rows = std::min(kDownRowsScatter, kDownRowsQuantMin);
  m.plan.t2.reserve(size_t(std::min<int64_t>(routes, 1024) * ((D + down_rows - 1) / down_rows)));
  m.plan.order.reserve(size_t(routes));
  m.plan.t0.reserve(size_t(tokens + padded / 16));
  const int64_t up_rows = std::min(kUpRowsVec, kUpRowsQuantMin);
  m.plan.t1.reserve(size_t(std::min<int64_t>(routes, 1024) * ((F + up_rows - 1) / up_rows)));
  m.token_used.reserve(size_t(tokens));
  m.chunks_left.reserve(size_t(std::min(E, routes)));  // quantized experts' h chunks
  m.chunk_rows.reserve(size_t(std::min(E, routes) * ((F + 31) / 32)));
}

namespace {

// The bandwidth probe: 1 MiB tasks, each summing its bytes (the sums keep the reads alive).
struct ReadJob final : PhasedJob {
  static constexpr int64_t kChunk = 1 << 20;
  const char* data = nullptr;
  int64_t bytes = 0;
  std::vector<double> sums;
  void task(int, int64_t i) override {
    const int64_t lo = i * kChunk;
    sums[size_t(i)] = read_sum(data + lo, std::min(kChunk, bytes - lo));
  }
};

}  // namespace

double ColdExperts::read_seconds(const void* data, int64_t bytes) {
  Impl& m = *impl_;
  if (m.pending) throw std::logic_error("cold_experts: read_seconds() while a call is pending");
  if (!cpu_features().avx512) throw std::runtime_error("cold_experts: this CPU lacks AVX-512 (F, BW, VL)");
  if (bytes <= 0) return 0.0;
  ReadJob job;
  job.data = static_cast<const char*>(data);
  job.bytes = bytes;
  const int64_t n = (bytes + ReadJob::kChunk - 1) / ReadJob::kChunk;
  job.sums.assign(size_t(n), 0.0);
  m.pool.drain();
  const int64_t t0 = PhasedJob::now_ns();
  job.reset({n});
  m.pool.launch(&job);
  m.pool.wait();
  const double seconds = double(PhasedJob::now_ns() - t0) / 1e9;
  m.pool.drain();  // the job lives on this stack
  return seconds;
}

int ColdExperts::num_threads() const { return impl_->pool.size(); }
void ColdExperts::set_spin_us(int64_t spin_us) { impl_->pool.set_spin_us(spin_us); }
ColdStats ColdExperts::last_stats() const {
  const Impl& m = *impl_;
  ColdStats s = m.stats;
  if (m.stats.routes > 0 && !m.pending)
    for (size_t j = 0; j < m.phase_sizes.size(); ++j) {
      if (m.phases[j] == 4) s.phase_end_us[1] = double(m.up_end_ns - m.start_ns()) / 1e3;  // then 2: the phase's end
      s.phase_end_us[m.phases[j] == 4 ? 2 : m.phases[j]] = double(m.phase_end_ns(int(j))) / 1e3;
    }
  return s;
}

void cold_experts_forward(const ColdArgs& args, ColdExperts& runner) {
  runner.submit(args);
  runner.wait();
}

}  // namespace ostinato
