// The decode graph's CPU worker (protocol in graph_worker.h).
//
// Waiting: a flag is polled with pause for spin_us (yielding every 64 pauses in case the core
// is shared), then with futex sleeps that stop() and reset() cut short: sleep_us while a step
// is active (the GPU is a layer away), doubling up to idle_sleep_us between steps (the host
// may be sampling, or idle). The thread asks for 1 us of timer slack so that a 20 us sleep
// stays about 20 us. Time spent waiting and computing is counted for the step report.
#include "graph_worker.h"

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <stdexcept>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define GRAPH_PAUSE() _mm_pause()
#else
#define GRAPH_PAUSE() ((void)0)
#endif

namespace ostinato {
namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Memory the GPU writes: atomic accesses through plain int32 storage (the GCC/Clang builtins:
// std::atomic_ref is C++20, and torch 2.11's extension builder compiles C++17).
int32_t load_acquire(int32_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void store_release(int32_t* p, int32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

// a is a later step than b (wrap-around safe).
bool newer_than(int32_t a, int32_t b) { return int32_t(uint32_t(a) - uint32_t(b)) > 0; }

// Single writer: a relaxed read-modify-write without a locked instruction.
template <class T>
void bump(std::atomic<T>& c, T d) {
  c.store(c.load(std::memory_order_relaxed) + d, std::memory_order_relaxed);
}

void check(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("graph_worker: " + what);
}

}  // namespace

GraphWorker::GraphWorker(ColdExperts& runner, const GraphShared& shared, std::vector<ColdArgs> layers,
                         int64_t num_experts, const GraphWorkerOptions& options)
    : runner_(runner), sh_(shared), layers_(std::move(layers)), E_(num_experts), opt_(options) {
  const GraphShared& s = sh_;
  check(s.L > 0 && s.K > 0 && s.D > 0 && s.T > 0, "L, K, D and T must be positive");
  check(s.post_flag && s.has_cold && s.done_flag && s.ids && s.weights && s.x && s.out, "null buffer");
  check(s.flag_stride >= 1, "flag_stride must be >= 1");
  check(int(s.x_dtype) == 0 || int(s.x_dtype) == 1, "x_dtype must be float32 or bfloat16");
  check(int64_t(layers_.size()) == s.L, "one ColdArgs per layer position is required");
  check(E_ > 0, "num_experts must be positive");
  int64_t maxE = 0, maxF = 0;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const ColdArgs& a = layers_[i];
    check(a.E >= 0, "layer " + std::to_string(i) + ": negative E");
    if (a.E == 0) continue;
    check(a.D == s.D && a.F > 0 && a.w13 && a.w2,
          "layer " + std::to_string(i) + ": host experts must have D = " + std::to_string(s.D));
    maxE = std::max(maxE, a.E);
    maxF = std::max(maxF, a.F);
  }
  for (auto& t : tables_) t.assign(size_t(s.L), std::vector<int32_t>(size_t(E_), -1));
  front_.assign(size_t(s.L), 0);
  pending_.assign(size_t(s.L), 0);
  pending_at_.assign(size_t(s.L), 0);
  tok_.assign(size_t(s.K * s.T), 0);
  eid_.assign(size_t(s.K * s.T), 0);
  wts_.assign(size_t(s.K * s.T), 0.f);
  seen_.assign(size_t(maxE), 0);
  staged_.assign(size_t(E_), 0);
  if (maxE > 0) runner_.reserve(s.K * s.T, s.T, maxE, s.D, maxF);  // the hot path then allocates nothing
}

GraphWorker::~GraphWorker() { stop(); }

void GraphWorker::set_compact(int64_t i, const int32_t* table, int32_t at_seq) {
  check(i >= 0 && i < sh_.L, "layer position " + std::to_string(i) + " is outside [0, L)");
  const int64_t Ec = layers_[size_t(i)].E;
  for (int64_t e = 0; e < E_; ++e)
    check(table[e] >= -1 && table[e] < Ec, "layer position " + std::to_string(i) + ": table[" + std::to_string(e) +
                                               "] = " + std::to_string(table[e]) + " is outside [-1, " +
                                               std::to_string(Ec) + ")");
  std::lock_guard<std::mutex> lock(table_mu_);
  if (!running_.load() && at_seq == 0) {  // no reader: the table takes effect now
    std::copy(table, table + E_, tables_[front_[i]][size_t(i)].begin());
    pending_[i] = 0;
    return;
  }
  std::copy(table, table + E_, tables_[front_[i] ^ 1][size_t(i)].begin());
  pending_[i] = 1;
  pending_at_[i] = at_seq;
  pending_any_.store(true, std::memory_order_release);
}

std::vector<int32_t> GraphWorker::active_table(int64_t i) const {
  check(i >= 0 && i < sh_.L, "layer position outside [0, L)");
  std::lock_guard<std::mutex> lock(table_mu_);
  return tables_[front_[i]][size_t(i)];
}

void GraphWorker::start(int32_t first_seq) {
  if (running_.load()) throw std::logic_error("graph_worker: start() while running");
  stop_.store(false);
  seen_reset_ = reset_gen_.load();
  running_.store(true);
  thread_ = std::thread([this, first_seq] { run(first_seq); });
}

void GraphWorker::stop() {
  if (!thread_.joinable()) return;
  stop_.store(true);
  wake_.fetch_add(1);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&wake_), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
  thread_.join();
  running_.store(false);
}

void GraphWorker::reset(int32_t seq) {
  if (!running_.load()) throw std::logic_error("graph_worker: reset() while stopped; use start(seq)");
  reset_seq_.store(seq, std::memory_order_relaxed);
  const uint32_t gen = reset_gen_.fetch_add(1, std::memory_order_acq_rel) + 1;
  wake_.fetch_add(1);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&wake_), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
  // The worker takes it at its next wait; at most one layer's compute away.
  for (uint32_t n = 1; reset_ack_.load(std::memory_order_acquire) != gen; ++n) {
    GRAPH_PAUSE();
    if ((n & 63) == 0) sched_yield();
  }
}

GraphWorkerStats GraphWorker::stats() const {
  constexpr auto r = std::memory_order_relaxed;
  GraphWorkerStats s;
  s.steps = c_.steps.load(r);
  s.layers_served = c_.layers_served.load(r);
  s.layers_skipped = c_.layers_skipped.load(r);
  s.cold_routes = c_.cold_routes.load(r);
  s.cold_experts = c_.cold_experts.load(r);
  s.staged_experts = c_.staged_experts.load(r);
  s.staged_routes = c_.staged_routes.load(r);
  s.bad_tokens = c_.bad_tokens.load(r);
  s.desync = c_.desync.load(r);
  s.bad_ids = c_.bad_ids.load(r);
  s.resyncs = c_.resyncs.load(r);
  s.errors = c_.errors.load(r);
  s.wait_ns = c_.wait_ns.load(r);
  s.idle_ns = c_.idle_ns.load(r);
  s.compute_ns = c_.compute_ns.load(r);
  s.last_seq = c_.last_seq.load(r);
  s.last_wait_ns = c_.last_wait_ns.load(r);
  s.last_compute_ns = c_.last_compute_ns.load(r);
  s.last_layers = c_.last_layers.load(r);
  s.last_routes = c_.last_routes.load(r);
  s.seq = c_.seq.load(r);
  s.layer = c_.layer.load(r);
  s.running = running_.load(r);
  return s;
}

std::string GraphWorker::last_error() const {
  std::lock_guard<std::mutex> lock(error_mu_);
  return last_error_;
}

void GraphWorker::sleep_for_us(int64_t us) {
  // Load the word before checking the flags: a stop()/reset() after the check bumps it, and
  // the futex then returns at once instead of missing the wake-up.
  const uint32_t w = wake_.load(std::memory_order_seq_cst);
  if (stop_.load() || reset_gen_.load() != seen_reset_) return;
  timespec ts{time_t(us / 1000000), long(us % 1000000) * 1000};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&wake_), FUTEX_WAIT_PRIVATE, w, &ts, nullptr, 0);
}

GraphWorker::Wake GraphWorker::wait_post(int64_t i, int32_t seq, bool between_steps, int32_t* newer) {
  int32_t* flag = sh_.post_flag + i * sh_.flag_stride;
  const int64_t t0 = now_ns();
  int64_t sleep_us = std::max<int64_t>(1, opt_.sleep_us);
  Wake result;
  for (uint32_t n = 1;; ++n) {
    if (stop_.load(std::memory_order_relaxed)) {
      result = Wake::kStop;
      break;
    }
    if (reset_gen_.load(std::memory_order_acquire) != seen_reset_) {
      result = Wake::kReset;
      break;
    }
    const int32_t v = load_acquire(flag);
    if (v == seq) {
      result = Wake::kReady;
      break;
    }
    if (newer_than(v, seq)) {
      *newer = v;
      result = Wake::kAhead;
      break;
    }
    GRAPH_PAUSE();
    if ((n & 63) != 0) continue;
    if (now_ns() - t0 < opt_.spin_us * 1000) {
      sched_yield();
      continue;
    }
    sleep_for_us(between_steps ? sleep_us : std::max<int64_t>(1, opt_.sleep_us));
    if (between_steps) sleep_us = std::min(std::max<int64_t>(1, opt_.idle_sleep_us), sleep_us * 2);
  }
  seen_ns_ = now_ns();
  const int64_t waited = seen_ns_ - t0;
  if (between_steps) {
    bump(c_.idle_ns, waited);
  } else {
    bump(c_.wait_ns, waited);
    step_wait_ns_ += waited;
  }
  return result;
}

void GraphWorker::begin_step(int32_t seq) {
  if (!pending_any_.load(std::memory_order_acquire)) return;
  std::lock_guard<std::mutex> lock(table_mu_);
  bool left = false;
  for (int64_t i = 0; i < sh_.L; ++i) {
    if (!pending_[i]) continue;
    if (pending_at_[i] == 0 || !newer_than(pending_at_[i], seq)) {
      front_[i] ^= 1;
      pending_[i] = 0;
    } else {
      left = true;
    }
  }
  pending_any_.store(left, std::memory_order_release);
}

void GraphWorker::serve(int64_t i, int32_t seq) {
  const int64_t K = sh_.K, D = sh_.D, T = sh_.T;
  const int32_t* table = tables_[front_[i]][size_t(i)].data();
  const int64_t n = sh_.tokens ? int64_t(load_acquire(const_cast<int32_t*>(sh_.tokens) + i * sh_.flag_stride)) : 1;
  const int32_t* ids = sh_.ids + i * T * K;
  const float* w = sh_.weights + i * T * K;
  float* out = sh_.out + i * T * D;
  int64_t R = 0, distinct = 0, staged = 0, staged_routes = 0;
  const bool tokens_ok = n >= 1 && n <= T;
  if (!tokens_ok) bump(c_.bad_tokens, int64_t(1));
  // the experts the GPU computes in this pass (layers/moe/staging.py), posted before post_flag[i]
  const uint8_t* gpu_side = (tokens_ok && n > 1 && sh_.staged) ? sh_.staged + i * E_ : nullptr;
  for (int64_t t = 0; tokens_ok && t < n; ++t) {
    for (int64_t k = 0; k < K; ++k) {  // token-major, top-k order, as the synchronous path gathers them
      const int32_t e = ids[t * K + k];
      if (e < 0 || e >= E_) {
        bump(c_.bad_ids, int64_t(1));
        continue;
      }
      const int32_t c = table[e];
      if (c < 0) continue;
      if (gpu_side && gpu_side[e]) {
        ++staged_routes;
        if (!staged_[size_t(e)]) {
          staged_[size_t(e)] = 1;
          ++staged;
        }
        continue;
      }
      tok_[R] = int32_t(t);
      eid_[R] = c;
      wts_[R] = w[t * K + k];
      ++R;
      if (!seen_[size_t(c)]) {
        seen_[size_t(c)] = 1;
        ++distinct;
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) seen_[size_t(eid_[r])] = 0;
  if (staged) std::fill(staged_.begin(), staged_.end(), uint8_t(0));
  if (R == 0) {
    if (tokens_ok && !staged) bump(c_.desync, int64_t(1));
    std::memset(out, 0, size_t((tokens_ok ? n : T) * D) * sizeof(float));
  } else {
    ColdArgs a = layers_[size_t(i)];
    const size_t elem = sh_.x_dtype == DType::kBFloat16 ? 2 : 4;
    a.x = static_cast<const char*>(sh_.x) + size_t(i * T * D) * elem;
    a.x_dtype = sh_.x_dtype;
    a.T = n;
    a.x_stride = D;
    a.token_idx = tok_.data();
    a.expert_ids = eid_.data();
    a.weights = wts_.data();
    a.R = R;
    a.out = out;
    a.out_stride = D;
    try {
      cold_experts_forward(a, runner_);
    } catch (const std::exception& ex) {  // never leave the GPU waiting
      bump(c_.errors, int64_t(1));
      {
        std::lock_guard<std::mutex> lock(error_mu_);
        last_error_ = ex.what();
      }
      std::memset(out, 0, size_t(n * D) * sizeof(float));
    }
  }
  store_release(sh_.done_flag + i * sh_.flag_stride, seq);
  const int64_t spent = now_ns() - seen_ns_;
  bump(c_.compute_ns, spent);
  bump(c_.layers_served, int64_t(1));
  bump(c_.cold_routes, R);
  bump(c_.cold_experts, distinct);
  bump(c_.staged_experts, staged);
  bump(c_.staged_routes, staged_routes);
  step_compute_ns_ += spent;
  step_routes_ += R;
  ++step_layers_;
}

void GraphWorker::finish_step(int32_t seq) {
  constexpr auto r = std::memory_order_relaxed;
  bump(c_.steps, int64_t(1));
  c_.last_seq.store(seq, r);
  c_.last_wait_ns.store(step_wait_ns_, r);
  c_.last_compute_ns.store(step_compute_ns_, r);
  c_.last_layers.store(step_layers_, r);
  c_.last_routes.store(step_routes_, r);
  step_wait_ns_ = step_compute_ns_ = step_layers_ = step_routes_ = 0;
}

void GraphWorker::run(int32_t first_seq) {
  if (opt_.cpu >= 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(opt_.cpu, &set);
    pthread_setaffinity_np(pthread_self(), sizeof(set), &set);  // best effort
  }
  prctl(PR_SET_TIMERSLACK, 1000UL);  // ns
  int32_t seq = first_seq;
  int64_t i = 0;
  step_wait_ns_ = step_compute_ns_ = step_layers_ = step_routes_ = 0;
  for (;;) {
    c_.seq.store(seq, std::memory_order_relaxed);
    c_.layer.store(i, std::memory_order_relaxed);
    int32_t newer = 0;
    const Wake w = wait_post(i, seq, i == 0, &newer);
    if (w == Wake::kStop) return;
    if (w == Wake::kReset) {  // the step in progress is abandoned
      seen_reset_ = reset_gen_.load(std::memory_order_acquire);
      seq = reset_seq_.load(std::memory_order_relaxed);
      i = 0;
      step_wait_ns_ = step_compute_ns_ = step_layers_ = step_routes_ = 0;
      c_.seq.store(seq, std::memory_order_relaxed);
      c_.layer.store(0, std::memory_order_relaxed);
      reset_ack_.store(seen_reset_, std::memory_order_release);
      continue;
    }
    bool ahead = w == Wake::kAhead;
    if (w == Wake::kReady) {
      if (i == 0) begin_step(seq);
      const int32_t hc = load_acquire(sh_.has_cold + i * sh_.flag_stride);
      if (hc == 0) {
        bump(c_.layers_skipped, int64_t(1));
      } else if (hc != 1 && newer_than(hc, seq)) {
        ahead = true;  // has_cold of a later step: the GPU is past this one (see the header)
        newer = hc;
      } else {
        serve(i, seq);
      }
    }
    if (!ahead) {
      if (++i == sh_.L) {
        finish_step(seq);
        ++seq;
        i = 0;
      }
      continue;
    }
    // The GPU began step `newer`: the rest of this step needed no CPU.
    bump(c_.resyncs, int64_t(1));
    if (i > 0) finish_step(seq);
    seq = newer;
    i = 0;
  }
}

}  // namespace ostinato
