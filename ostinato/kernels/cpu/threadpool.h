// A resident pool of pinned worker threads with spin-then-sleep waiting, running jobs made
// of phases of independent tasks; the thread that waits for a job works on it too.
//
// Why not OpenMP or a condition variable: a decode step hands the pool one small job per
// MoE layer (about 0.1 ms of work), so a wake-up must cost microseconds. Idle workers spin
// on a generation counter for `spin_us` after each job and only then sleep on a futex.
//
// Why the waiter helps: a spinning waiter next to one pinned worker per core oversubscribes
// the machine, and a preempted worker then stalls a whole phase for a scheduler tick
// (measured: 1 token x 1 expert took 10 ms instead of 1 ms on 2 cores). So the pool holds
// one worker fewer than the cores it may use, and wait() takes tasks like a worker. Phases
// end on completion counters rather than a fixed-party barrier, so a helper that arrives
// late (or never, for a job that finished first) changes nothing, and every spin loop
// yields the core now and then in case a peer was preempted.
//
// One submitter at a time: launch() then wait(), then the next launch().
#pragma once

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define OSTINATO_PAUSE() _mm_pause()
#else
#define OSTINATO_PAUSE() ((void)0)
#endif

namespace ostinato {

inline void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, nullptr,
          nullptr, 0);
}

inline void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
          nullptr, 0);
}

// Spins until pred() holds, yielding every 64 pauses (a preempted peer may need this core).
template <class Pred>
inline void spin_until(Pred pred) {
  for (uint32_t i = 1; !pred(); ++i) {
    OSTINATO_PAUSE();
    if ((i & 63) == 0) sched_yield();
  }
}

// A job: up to kMaxPhases phases of independent tasks; phase k+1 starts once every task of
// phase k has finished. run() is called by every worker and by the waiter.
class PhasedJob {
 public:
  static constexpr int kMaxPhases = 4;
  virtual ~PhasedJob() = default;
  virtual void task(int phase, int64_t i) = 0;
  // Called once by the thread that finishes the last task of the last phase, after every task's
  // writes are visible to it.
  virtual void finished_hook() {}

  // Before launch: the number of tasks of each phase.
  void reset(const std::vector<int64_t>& counts) {
    phases_ = static_cast<int>(counts.size());
    start_ns_ = now_ns();
    for (int k = 0; k < phases_; ++k) {
      n_[k] = counts[k];
      next_[k].v.store(0, std::memory_order_relaxed);
      done_[k].v.store(0, std::memory_order_relaxed);
    }
  }

  void run() {
    for (int k = 0; k < phases_; ++k) {
      const int64_t n = n_[k];
      for (int64_t i; (i = next_[k].v.fetch_add(1, std::memory_order_relaxed)) < n;) {
        task(k, i);
        if (done_[k].v.fetch_add(1, std::memory_order_acq_rel) == n - 1) {
          end_ns_[k] = now_ns();  // the thread finishing the phase stamps it
          if (k == phases_ - 1) finished_hook();
        }
      }
      spin_until([&] { return done_[k].v.load(std::memory_order_acquire) >= n; });
    }
  }

  // Nanoseconds from reset() to the end of each phase (valid once finished()).
  int64_t phase_end_ns(int k) const { return end_ns_[k] - start_ns_; }
  int64_t start_ns() const { return start_ns_; }  // the now_ns() of reset()

  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  bool finished() const {
    return phases_ == 0 || done_[phases_ - 1].v.load(std::memory_order_acquire) >= n_[phases_ - 1];
  }

 private:
  struct alignas(64) Counter {
    std::atomic<int64_t> v{0};
  };
  int phases_ = 0;
  int64_t n_[kMaxPhases] = {};
  int64_t start_ns_ = 0, end_ns_[kMaxPhases] = {};
  Counter next_[kMaxPhases], done_[kMaxPhases];
};

class ThreadPool {
 public:
  // cpus: one logical CPU per worker to pin it to; -1 leaves that worker unpinned.
  ThreadPool(const std::vector<int>& cpus, int64_t spin_us) : spin_us_(spin_us) {
    n_ = cpus.empty() ? 1 : static_cast<int>(cpus.size());
    for (int t = 0; t < n_; ++t) {
      int cpu = cpus.empty() ? -1 : cpus[t];
      threads_.emplace_back([this, cpu] { worker(cpu); });
    }
  }

  // The owner waits for its last job first; workers still leaving it are drained here.
  ~ThreadPool() {
    drain();
    stop_.store(true);
    gen_.fetch_add(1);
    futex_wake_all(&gen_);
    for (auto& th : threads_) th.join();
  }

  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_; }
  int64_t spin_us() const { return spin_us_.load(std::memory_order_relaxed); }
  void set_spin_us(int64_t us) { spin_us_.store(us, std::memory_order_relaxed); }

  // Returns once no worker is inside a job any more (one woken late may still be leaving
  // the last one); call before resetting or rewriting the state of the next job.
  void drain() {
    spin_until([&] { return running_.load(std::memory_order_acquire) == 0; });
  }

  // Hands `job` (already reset, after drain()) to the workers and returns at once.
  void launch(PhasedJob* job) {
    job_ = job;
    running_.store(static_cast<uint32_t>(n_), std::memory_order_relaxed);
    gen_.fetch_add(1, std::memory_order_seq_cst);  // publishes job_ and the job's counters
    if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake_all(&gen_);
  }

  // Works on the launched job until it is complete (its results are then visible).
  void wait() {
    if (job_ != nullptr) job_->run();
  }

  bool finished() const { return job_ == nullptr || job_->finished(); }

 private:
  void worker(int cpu) {
    if (cpu >= 0) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(cpu, &set);
      pthread_setaffinity_np(pthread_self(), sizeof(set), &set);  // best effort
    }
    using clock = std::chrono::steady_clock;
    uint32_t seen = 0;
    for (;;) {
      auto start = clock::now();
      for (uint32_t i = 1; gen_.load(std::memory_order_acquire) == seen; ++i) {
        OSTINATO_PAUSE();
        if ((i & 63) != 0) continue;
        sched_yield();
        if (std::chrono::duration_cast<std::chrono::microseconds>(clock::now() - start).count() <
            spin_us())
          continue;
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        futex_wait(&gen_, seen);
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        start = clock::now();
      }
      seen = gen_.load(std::memory_order_acquire);
      if (stop_.load()) return;
      job_->run();
      running_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  int n_ = 0;
  std::atomic<int64_t> spin_us_;
  std::vector<std::thread> threads_;
  PhasedJob* job_ = nullptr;
  std::atomic<bool> stop_{false};
  alignas(64) std::atomic<uint32_t> gen_{0};
  alignas(64) std::atomic<uint32_t> sleepers_{0};
  alignas(64) std::atomic<uint32_t> running_{0};
};

}  // namespace ostinato
