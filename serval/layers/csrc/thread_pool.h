// The CPU kernels' own worker threads for their hot loops (the block linears, attention and the row ops between
// them: norms, RoPE, activations, argmax), in place of OpenMP's. One pool for all of a step's calls: while the
// linears ran here and the row ops on OpenMP, each of the two pools' waiting workers held the core the other's
// needed, and a 1B model's decode step of 8 rows took 1.6x as long (benchmarks/README.md, 2026-12-03).
//
// A one-row decode step of a 1B model makes about 100 parallel calls of 30-300 microseconds each, with a little
// serial work between them. libgomp's workers spin GOMP_SPINCOUNT times and then sleep; a sleeping worker's wake-up
// costs tens of microseconds on a VM. The spin that a busy neighbor needs (1000, platform_info.py) left the 1B's
// one stream 10% slower alone than a long one, and a long one was 5.6x slower beside the neighbor
// (benchmarks/README.md, "One stream, paired"). These threads choose by what they measure:
// - Work is claimed in chunks, one at a time, by whichever thread is free: the caller starts at once, and a worker
//   that is asleep or has no core leaves its chunks to the others instead of holding the call up.
// - Alone, a waiting worker spins, yielding its core to any other task that wants it (sched_yield), for up to
//   kSpinAlone: the next call usually comes within it.
// - Contended, it spins kSpinContended and sleeps on a futex. Contended means that a thread of these calls spent
//   more than kContendedShare of the last kWindow waiting for a core (its run delay, /proc/thread-self/schedstat): a
//   neighbor, a CPU quota, or more threads than cores. It holds for kContendedFor after the last such window.
// Every chunk runs the same code on the same data whichever thread takes it, so results keep their bits.
#pragma once

#include <ATen/Parallel.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace serval {
namespace pool_detail {

constexpr int64_t kMicrosecond = 1000;
constexpr int64_t kSpinAlone = 2000 * kMicrosecond;
constexpr int64_t kSpinContended = 5 * kMicrosecond;
constexpr int64_t kWindow = 10000 * kMicrosecond;
constexpr double kContendedShare = 0.1;
constexpr int64_t kContendedFor = 1000000 * kMicrosecond;
constexpr int kPausesPerCheck = 64;  // between looks at the clock (and yields): a few microseconds
constexpr int64_t kChunksPerThread = 4;

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

inline void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}

inline void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

// This thread's time spent runnable without a core, in nanoseconds (-1 where the kernel does not say).
inline int64_t run_delay_ns() {
  thread_local int fd = open("/proc/thread-self/schedstat", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  char text[96];
  const ssize_t n = pread(fd, text, sizeof(text) - 1, 0);
  if (n <= 0) return -1;
  text[n] = 0;
  char* end = nullptr;
  std::strtoll(text, &end, 10);  // time on a core
  return std::strtoll(end, nullptr, 10);
}

using ChunkFn = void (*)(const void* context, int64_t begin, int64_t end);

// One call's work: [begin, end) in chunks of `chunk`. Fields are atomics (sequentially consistent): a worker reads
// them before it claims a chunk, and trusts what it read only if the claim succeeds (see Pool::work).
struct Job {
  std::atomic<ChunkFn> fn{nullptr};
  std::atomic<const void*> context{nullptr};
  std::atomic<int64_t> begin{0}, end{0}, chunk{1}, chunks{0}, workers{0}, done{0};
};

class Pool {
 public:
  const pid_t pid = getpid();

  // Runs f over [begin, end) on the caller and up to `workers` workers, in `chunk`-sized pieces. False (nothing run)
  // where another call holds the pool: the caller then runs f itself.
  bool run(int64_t begin, int64_t end, int64_t chunk, int64_t workers, ChunkFn fn, const void* context) {
    std::unique_lock<std::mutex> lock(submit_, std::try_to_lock);
    if (!lock.owns_lock()) return false;
    while (static_cast<int64_t>(started_) < workers) start_worker();
    note_run_delay();
    const uint32_t gen = generation_ + 1;
    generation_ = gen;
    Job& job = jobs_[gen & 1];
    job.fn = fn;
    job.context = context;
    job.begin = begin;
    job.end = end;
    job.chunk = chunk;
    job.chunks = (end - begin + chunk - 1) / chunk;
    job.workers = workers;
    job.done = 0;
    claim_ = static_cast<uint64_t>(gen) << 32;
    posted_ = gen;
    if (sleepers_ > 0) futex_wake_all(&posted_);
    work(gen);
    wait_done(gen, job);
    if (failed_) {
      failed_ = false;
      std::exception_ptr error = error_;
      error_ = nullptr;
      std::rethrow_exception(error);
    }
    return true;
  }

  static thread_local bool in_pool_call;

 private:
  void start_worker() {
    const int index = started_++;
    std::thread([this, index, seen = generation_] { loop(index, seen); }).detach();
  }

  bool contended() const { return now_ns() < contended_until_.load(std::memory_order_relaxed); }

  // Called by every thread of these calls now and then: its share of the last window spent waiting for a core.
  void note_run_delay() {
    thread_local int64_t window_start = 0, delay_at_start = 0;
    const int64_t now = now_ns();
    if (now - window_start < kWindow) return;
    const int64_t delay = run_delay_ns();
    if (delay < 0) return;
    if (window_start > 0 && static_cast<double>(delay - delay_at_start) > kContendedShare * (now - window_start))
      contended_until_.store(now + kContendedFor, std::memory_order_relaxed);
    window_start = now;
    delay_at_start = delay;
  }

  void loop(int index, uint32_t seen) {
    in_pool_call = true;  // a kernel that a chunk calls runs its own loops inline
    for (;;) {
      seen = wait_posted(seen);
      if (index < jobs_[seen & 1].workers) work(seen);
      note_run_delay();
    }
  }

  // Claims and runs chunks of job `gen` until none is left or a later job is posted. A claim is a compare-exchange
  // of (generation, next chunk): it succeeds only while `gen` is the posted job, so the fields read before it (which
  // are rewritten only for job gen + 2, after gen + 1 was posted) were job gen's.
  void work(uint32_t gen) {
    Job& job = jobs_[gen & 1];
    for (;;) {
      uint64_t claim = claim_;
      if (static_cast<uint32_t>(claim >> 32) != gen) return;
      const int64_t index = static_cast<int64_t>(claim & 0xFFFFFFFFu), chunks = job.chunks;
      if (index >= chunks) return;
      const ChunkFn fn = job.fn;
      const void* context = job.context;
      const int64_t first = job.begin + index * job.chunk, last = std::min<int64_t>(job.end, first + job.chunk);
      if (!claim_.compare_exchange_weak(claim, claim + 1)) continue;
      try {
        fn(context, first, last);
      } catch (...) {
        if (!failing_.exchange(true)) {
          error_ = std::current_exception();
          failed_ = true;
        }
      }
      if (job.done.fetch_add(1) + 1 == chunks) {
        finished_ = gen;
        if (caller_sleeping_) futex_wake_all(&finished_);
      }
    }
  }

  // Spins (alone: yielding to any other task on this core) until `done` holds, or sleeps on `word` after `spin`.
  template <typename Done>
  void wait(std::atomic<uint32_t>& word, uint32_t sleeping_value, std::atomic<int>& sleeping, Done done) {
    const bool alone = !contended();
    const int64_t start = now_ns(), spin = alone ? kSpinAlone : kSpinContended;
    for (;;) {
      for (int i = 0; i < kPausesPerCheck; ++i) {
        if (done()) return;
        cpu_relax();
      }
      if (now_ns() - start > spin) break;
      if (alone) sched_yield();
    }
    ++sleeping;
    while (!done()) futex_wait(&word, sleeping_value);
    --sleeping;
  }

  uint32_t wait_posted(uint32_t seen) {
    wait(posted_, seen, sleepers_, [&] { return posted_.load() != seen; });
    return posted_;
  }

  void wait_done(uint32_t gen, Job& job) {
    const uint32_t before = finished_;
    wait(finished_, before, caller_sleeping_, [&] { return job.done.load() == job.chunks.load(); });
    failing_ = false;
  }

  std::mutex submit_;
  uint32_t generation_ = 0;  // the caller's, under submit_
  Job jobs_[2];
  std::atomic<uint64_t> claim_{0};     // (generation << 32) | the next chunk to claim
  std::atomic<uint32_t> posted_{0};    // the last job's generation: workers wait on it
  std::atomic<uint32_t> finished_{0};  // the last finished job's generation: the caller waits on it
  std::atomic<int> sleepers_{0}, caller_sleeping_{0};
  std::atomic<int64_t> contended_until_{0};
  std::atomic<int> started_{0};
  std::atomic<bool> failing_{false}, failed_{false};
  std::exception_ptr error_;
};

inline thread_local bool Pool::in_pool_call = false;

// The process's pool, made on first use and again in a forked child (which has none of its parent's threads; the
// parent's pool is left as it is, never freed).
inline Pool& pool() {
  static std::atomic<Pool*> current{nullptr};
  static std::mutex making;
  Pool* p = current.load();
  if (p != nullptr && p->pid == getpid()) return *p;
  std::lock_guard<std::mutex> lock(making);
  p = current.load();
  if (p == nullptr || p->pid != getpid()) {
    p = new Pool();
    current = p;
  }
  return *p;
}

}  // namespace pool_detail

// f(b, e) over [begin, end) in pieces of `chunk` (the last shorter), on the caller and the workers that
// torch.set_num_threads allows, each piece claimed by whichever thread is free. f may be called more than once per
// thread; a call nested in another (or inside an OpenMP region) runs f(begin, end) inline.
template <typename F>
void parallel_chunks(int64_t begin, int64_t end, int64_t chunk, const F& f) {
  using pool_detail::Pool;
  const int64_t threads = at::get_num_threads();
  if (end <= begin) return;
  if (end - begin <= chunk || threads <= 1 || Pool::in_pool_call || at::in_parallel_region()) return f(begin, end);
  const pool_detail::ChunkFn call = [](const void* context, int64_t b, int64_t e) {
    (*static_cast<const F*>(context))(b, e);
  };
  Pool::in_pool_call = true;
  struct Reset {
    ~Reset() { Pool::in_pool_call = false; }
  } reset;
  if (!pool_detail::pool().run(begin, end, chunk, threads - 1, call, &f)) f(begin, end);
}

// at::parallel_for's contract (pieces at least `grain` long), in about kChunksPerThread pieces per thread: few
// enough that each is a long run of memory, enough that a thread that starts late leaves work to the others.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t pieces = at::get_num_threads() * pool_detail::kChunksPerThread;
  parallel_chunks(begin, end, std::max<int64_t>(grain, (end - begin + pieces - 1) / pieces), f);
}

}  // namespace serval
