// The CPU half of the decode CUDA graph: a native thread that polls the flags the captured
// graph publishes in page-locked host memory, computes each layer's cold routes on the
// ColdExperts pool (cold_experts_forward, the kernel of the synchronous path, so the bits are
// the same), and answers with a done flag. No Python, no GIL and no allocation on its path.
//
// Legend: L MoE layers in execution order (position i), T the most tokens a step posts, n the
// tokens of one step (1 for decode, up to T for a short prefill pass captured as a graph), K
// top-k, D hidden, E routed experts of a layer, Ec cold experts in a layer's host stack; seq the
// step counter (decode steps and captured passes share it).
//
// Shared memory, allocated once by Python (flags: int32 at [i * flag_stride], each on its own
// 64-byte line):
//   post_flag[i]  GPU -> CPU  seq once layer i's routing and activations are published
//   has_cold[i]   GPU -> CPU  0: no cold route, the GPU will not wait; else seq (1 accepted)
//   done_flag[i]  CPU -> GPU  seq once out[i] holds the cold routes' weighted sum
//   tokens[i]     GPU -> CPU  n, the tokens posted (null buffer: always 1)
//   ids[L, T, K] int32 (layer-local expert ids), weights[L, T, K] fp32, x[L, T, D] bf16 or fp32
//   out[L, T, D] fp32; rows [0, n) of a layer are read and written
//
// Protocol, per step seq and layer i = 0..L-1:
//   GPU: write ids[i], weights[i], x[i] (n rows), tokens[i], has_cold[i]; release fence at system scope; store
//        post_flag[i] = seq; run the GPU branch; if has_cold[i] != 0, spin (acquire, system
//        scope) until done_flag[i] == seq, then read out[i].
//   CPU: spin until post_flag[i] >= seq (acquire); if has_cold[i] == 0, go on to i + 1;
//        else map the n tokens' ids through the layer's compact table (less the staged experts), compute, write rows
//        [0, n) of out[i] (a row without a cold route is zero; all zeros when no route is cold: tables out of sync are counted, never a deadlock), and store
//        done_flag[i] = seq (release). After layer L-1, seq + 1.
// The worker may lag: the GPU does not wait at layers without cold routes, so it can post a
// later step before the worker saw a layer. A flag (post_flag, or has_cold when it carries
// seq) newer than the expected step means every layer left in the current step needed no
// CPU, so the worker moves to that step at layer 0 (counted as a resync). Writing seq rather
// than 1 into has_cold closes the one remaining window: a worker a whole step behind that
// reads has_cold of the next step right before its post.
//
// Staged experts (staged[L, E], when shared): in a captured prefill pass (n > 1) the GPU copies some of
// a layer's cold experts into flex slots of its pool and computes their routes itself; it marks them
// (1) in staged[i] before post_flag[i] (layers/moe/staging.py decides which). The worker leaves their
// routes out. A layer whose cold routes were all staged is answered with zeros. Decode steps (n = 1)
// stage nothing: the worker reads staged[i] only for n > 1.
//
// Compact tables (cold expert -> index in the host stack, -1 = hot) are double-buffered per
// layer. set_compact() copies into the back buffer under a mutex and marks it pending for a
// step (at_seq, or 0: the next step the worker begins). The worker begins step s when it sees
// post_flag[0] >= s and then, before reading anything of layer 0, swaps in every pending
// table due at s. It never reads a back buffer and the caller never writes a front one, so
// the hot path takes no lock unless a switch is pending. The GPU's device table must switch
// at the same step (its update stream-ordered before that step's replay).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "experts.h"

namespace ostinato {

// Addresses of the shared buffers (host pointers of page-locked, device-mapped memory).
struct GraphShared {
  int32_t* post_flag = nullptr;
  int32_t* has_cold = nullptr;
  int32_t* done_flag = nullptr;
  const int32_t* tokens = nullptr;  // n per layer, on the flags' stride (null: one token a step)
  int64_t flag_stride = 16;  // int32 elements between two layers' flags (64 bytes)
  const int32_t* ids = nullptr;  // [L, T, K]
  const float* weights = nullptr;  // [L, T, K]
  const void* x = nullptr;  // [L, T, D]
  DType x_dtype = DType::kBFloat16;
  float* out = nullptr;  // [L, T, D]
  const uint8_t* staged = nullptr;  // [L, E]: the experts a captured pass computes on the GPU (null: none)
  int64_t L = 0, K = 0, D = 0, T = 1;
};

struct GraphWorkerOptions {
  int cpu = -1;  // logical CPU to pin the worker to (-1: unpinned)
  int64_t spin_us = 2000;  // pure spinning (pause) on a flag before sleeping
  int64_t sleep_us = 20;  // sleep after the spin budget while a step is active
  int64_t idle_sleep_us = 1000;  // longest sleep between steps (backoff doubles up to it)
};

// Counters; totals since construction, "last_*" of the last finished step. Read while the
// worker runs, fields may come from adjacent steps; exact after stop().
struct GraphWorkerStats {
  int64_t steps = 0;  // steps finished (all layers seen, or left by a resync)
  int64_t layers_served = 0;  // layers with has_cold != 0 answered
  int64_t layers_skipped = 0;  // layers with has_cold == 0
  int64_t cold_routes = 0;
  int64_t cold_experts = 0;  // distinct cold experts of each served layer, summed
  int64_t staged_experts = 0;  // cold experts left to the GPU by the staging rule, summed over layers
  int64_t staged_routes = 0;  // and their routes
  int64_t bad_tokens = 0;  // tokens[i] outside [1, T] (zeros sent for all T rows)
  int64_t desync = 0;  // has_cold != 0 but the compact table left no cold route (zeros sent)
  int64_t bad_ids = 0;  // routed ids outside [0, E) (ignored)
  int64_t resyncs = 0;  // moved to a newer step the GPU had already begun
  int64_t errors = 0;  // compute threw (zeros sent; last_error() says why)
  int64_t wait_ns = 0;  // spinning for posts of layers 1..L-1: the CPU waiting for the GPU
  int64_t idle_ns = 0;  // spinning for layer 0's post: between steps
  int64_t compute_ns = 0;  // from seeing a served layer's post to storing its done flag
  int32_t last_seq = 0;
  int64_t last_wait_ns = 0, last_compute_ns = 0, last_layers = 0, last_routes = 0;
  int32_t seq = 0;  // the step the worker expects now
  int64_t layer = 0;  // and the layer position it waits for
  bool running = false;
};

class GraphWorker {
 public:
  // layers[i]: the host experts of position i (ColdArgs as CpuExperts fills them; E = Ec,
  // may be 0 for a layer without cold experts). num_experts: E, the compact tables' length.
  // The ColdArgs are copied (a later CpuExperts.set_isa() does not reach the worker). The
  // runner is shared: while a step is in flight the worker is its only submitter.
  GraphWorker(ColdExperts& runner, const GraphShared& shared, std::vector<ColdArgs> layers,
              int64_t num_experts, const GraphWorkerOptions& options);
  ~GraphWorker();
  GraphWorker(const GraphWorker&) = delete;
  GraphWorker& operator=(const GraphWorker&) = delete;

  // Copies table[E] (values -1 or [0, Ec)) as layer i's table from step at_seq (0: the next
  // step the worker begins). A second call before the switch replaces the pending table.
  void set_compact(int64_t i, const int32_t* table, int32_t at_seq);
  // Starts the thread expecting step first_seq at layer 0 (std::logic_error if running).
  void start(int32_t first_seq);
  // Stops and joins; prompt whether or not the GPU ever posts (a layer in compute finishes).
  void stop();
  // Abandons the current step and expects step seq at layer 0 (e.g. after a prefill, which
  // may have used the pool meanwhile); returns once the worker took it. Stopped: sets the
  // step that start() would otherwise be told.
  void reset(int32_t seq);
  bool running() const { return running_.load(); }
  GraphWorkerStats stats() const;
  std::string last_error() const;
  // Layer i's table in effect now (for tests): E entries.
  std::vector<int32_t> active_table(int64_t i) const;

 private:
  enum class Wake { kReady, kAhead, kReset, kStop };
  void run(int32_t first_seq);
  Wake wait_post(int64_t i, int32_t seq, bool between_steps, int32_t* newer);
  void sleep_for_us(int64_t us);
  void begin_step(int32_t seq);
  void serve(int64_t i, int32_t seq);
  void finish_step(int32_t seq);

  ColdExperts& runner_;
  GraphShared sh_;
  std::vector<ColdArgs> layers_;
  int64_t E_;
  GraphWorkerOptions opt_;
  std::thread thread_;

  // Compact tables: tables_[i][b] for buffer b; front_[i] is the one the worker reads.
  std::vector<std::vector<int32_t>> tables_[2];
  std::vector<uint8_t> front_, pending_;
  std::vector<int32_t> pending_at_;
  mutable std::mutex table_mu_;
  alignas(64) std::atomic<bool> pending_any_{false};

  alignas(64) std::atomic<bool> stop_{false};
  std::atomic<uint32_t> reset_gen_{0}, reset_ack_{0};
  std::atomic<int32_t> reset_seq_{0};
  std::atomic<uint32_t> wake_{0};  // futex word: stop and reset cut sleeps short
  std::atomic<bool> running_{false};
  uint32_t seen_reset_ = 0;  // worker-only from here on
  int64_t seen_ns_ = 0;  // when the last post was seen

  // Worker-only scratch, sized once.
  std::vector<int32_t> tok_, eid_;
  std::vector<float> wts_;
  std::vector<uint8_t> seen_;  // per cold expert of a layer: counted in this layer's distinct ones
  std::vector<uint8_t> staged_;  // per expert id: counted among this layer's staged experts
  int64_t step_wait_ns_ = 0, step_compute_ns_ = 0, step_layers_ = 0, step_routes_ = 0;

  struct Counters {
    std::atomic<int64_t> steps{0}, layers_served{0}, layers_skipped{0}, cold_routes{0}, cold_experts{0},
        staged_experts{0}, staged_routes{0}, bad_tokens{0}, desync{0}, bad_ids{0}, resyncs{0}, errors{0}, wait_ns{0}, idle_ns{0}, compute_ns{0};
    std::atomic<int32_t> last_seq{0}, seq{0};
    std::atomic<int64_t> last_wait_ns{0}, last_compute_ns{0}, last_layers{0}, last_routes{0},
        layer{0};
  };
  alignas(64) Counters c_;
  mutable std::mutex error_mu_;
  std::string last_error_;
};

}  // namespace ostinato
