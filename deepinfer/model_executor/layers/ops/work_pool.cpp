// The CPU kernels' own thread pool: a call returns once every chunk of its work has run, whichever
// threads ran them, so a thread the OS has not scheduled (another process on its core) holds up
// nothing it has not started.
//
// OpenMP's fork/join (torch's at::parallel_for) waits at the end of every parallel region for each
// thread of the team to arrive, working or not. A decode step runs a few hundred such regions; with
// the cores shared, each one waits for the scheduler to run the descheduled thread: measured on 2
// cores with two busy loops beside the engine, batch-1 decode fell from ~28 tok/s on one thread to
// ~7 on two. Here the caller and up to T - 1 workers take chunks; nobody waits for a thread that
// took none.
//
//     work [0, n) in chunks of `grain` items, the chunks cut into T contiguous shares:
//         share 0 (the caller)   share 1 (worker 1)   ...   share T-1
//     each thread takes its own share's chunks front to back (a decode matmul's thread streams one
//     contiguous run of weight rows, as a static split does), then the chunks left in the others'
//     shares; the call ends when the chunks done equal the chunks.
//
// A share's cursor packs (job generation << 32 | next chunk): a worker that wakes after its job has
// ended fails the compare-and-swap and touches nothing of the next job. Idle workers spin a short
// while (DEEPINFER_POOL_SPIN_US, default 200) for the next call, then sleep on a condition variable.
// Under contention (the caller waiting on descheduled workers for over a quarter of its time) calls
// run on the caller alone for a while (see `account`). One caller at a time: a call made while the pool is busy (another thread's call, or a nested
// one) runs on its own thread. Which thread computes a chunk never changes its bits: every kernel
// here computes each output by one thread in a fixed order.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace deepinfer_pool {
namespace {

constexpr int kMaxThreads = 256;
using Fn = std::function<void(int64_t, int64_t)>;
using Clock = std::chrono::steady_clock;

struct alignas(64) Cursor {
  std::atomic<uint64_t> value{0};  // generation << 32 | next chunk
  std::atomic<int64_t> end{0};     // one past the share's last chunk
};

class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool();  // never destroyed: workers may outlive static destructors
    return *pool;
  }

  void set_threads(int n) { threads_.store(std::clamp(n, 0, kMaxThreads)); }  // 0: torch's count

  int threads() const {
    const int n = threads_.load();
    return n > 0 ? n : std::clamp(at::get_num_threads(), 1, kMaxThreads);
  }

  void run(int64_t n, int64_t grain, const Fn& fn) {
    if (n <= 0) return;
    grain = std::max<int64_t>(grain, 1);
    const int64_t chunks = (n + grain - 1) / grain;
    const int T = static_cast<int>(std::min<int64_t>(threads(), chunks));
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (T <= 1 || !busy.owns_lock() || chunks >= (int64_t{1} << 31) || solo_now()) {
      fn(0, n);
      return;
    }
    grow(T - 1);
    n_ = n;
    grain_ = grain;
    fn_ = &fn;
    done_.store(0);
    const uint64_t gen = (generation_.load() + 1) & 0xffffffffu;
    for (int t = 0; t < T; ++t) {
      cursors_[t].end.store(chunks * (t + 1) / T);
      cursors_[t].value.store(gen << 32 | static_cast<uint64_t>(chunks * t / T));
    }
    job_threads_.store(T);
    generation_.store(gen);  // publishes the job
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
    const auto start = Clock::now();
    work(0, T, gen);
    const auto own = Clock::now();
    wait_done(chunks);
    account(Clock::now() - start, Clock::now() - own);
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

 private:
  Pool() {
    const char* spin = std::getenv("DEEPINFER_POOL_SPIN_US");
    spin_us_ = spin ? std::max(0, std::atoi(spin)) : 200;
  }

  // Start workers 1 .. want (idempotent; workers are never stopped).
  void grow(int want) {
    while (static_cast<int>(workers_.size()) < want) {
      const int id = static_cast<int>(workers_.size()) + 1;
      workers_.emplace_back([this, id] { worker_loop(id); });
      workers_.back().detach();
    }
  }

  // Take chunks of job `gen`: own share first, then the others' in turn.
  void work(int self, int T, uint64_t gen) {
    for (int k = 0; k < T; ++k) {
      Cursor& c = cursors_[(self + k) % T];
      for (;;) {
        uint64_t cur = c.value.load();
        if (cur >> 32 != gen) return;  // the job has ended (or a newer one runs): stop
        const int64_t chunk = static_cast<int64_t>(cur & 0xffffffffu);
        if (chunk >= c.end.load()) break;
        if (!c.value.compare_exchange_weak(cur, cur + 1)) continue;
        const int64_t b = chunk * grain_;  // valid: the job cannot end before this chunk is done
        run_chunk(b, std::min(b + grain_, n_));
        done_.fetch_add(1);
      }
    }
  }

  // Contention: when the caller spends more than a quarter of a window of jobs waiting for chunks
  // that workers took and have not finished (a worker descheduled in the middle of one: the cores
  // are shared), the next kSoloJobs calls run on the caller alone, then threads are tried again. On
  // an idle machine the wait is at most about one chunk and this never triggers.
  static constexpr int kWindowJobs = 256, kSoloJobs = 4096;

  bool solo_now() {
    if (solo_left_ == 0) return false;
    --solo_left_;
    return true;
  }

  void account(Clock::duration total, Clock::duration waited) {
    window_total_ += total;
    window_waited_ += waited;
    if (++window_jobs_ < kWindowJobs) return;
    if (window_waited_ * 4 > window_total_) solo_left_ = kSoloJobs;
    window_jobs_ = 0;
    window_total_ = window_waited_ = Clock::duration::zero();
  }

  // One chunk; an exception is kept (the first one) for the caller to rethrow once the job is done.
  void run_chunk(int64_t b, int64_t e) {
    try {
      (*fn_)(b, e);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex_);
      if (!error_) error_ = std::current_exception();
    }
  }

  void wait_done(int64_t chunks) {
    for (int spins = 0; done_.load() < chunks; ++spins) {
      if (spins < 4096) _mm_pause();
      else std::this_thread::yield();
    }
  }

  void worker_loop(int id) {
    uint64_t seen = generation_.load();
    for (;;) {
      const uint64_t gen = next_generation(seen);
      seen = gen;
      if (id < job_threads_.load()) work(id, job_threads_.load(), gen);
    }
  }

  // Wait for a generation other than `seen`: spin for spin_us_, then sleep until woken.
  uint64_t next_generation(uint64_t seen) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
    for (int i = 0;; ++i) {
      const uint64_t g = generation_.load();
      if (g != seen) return g;
      _mm_pause();
      if ((i & 255) == 255 && std::chrono::steady_clock::now() >= until) break;
    }
    std::unique_lock<std::mutex> lock(mutex_);
    sleepers_.fetch_add(1);
    wake_.wait(lock, [&] { return generation_.load() != seen; });
    sleepers_.fetch_sub(1);
    return generation_.load();
  }

  std::atomic<int> threads_{0};  // 0: torch's thread count of the calling thread
  int solo_left_ = 0, window_jobs_ = 0;  // the contention window (caller-side, under busy_)
  Clock::duration window_total_{}, window_waited_{};
  int spin_us_ = 200;
  std::mutex busy_;
  std::vector<std::thread> workers_;
  Cursor cursors_[kMaxThreads];
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> job_threads_{0};
  std::atomic<int64_t> done_{0};
  int64_t n_ = 0, grain_ = 1;
  const Fn* fn_ = nullptr;
  std::mutex error_mutex_;
  std::exception_ptr error_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<int> sleepers_{0};
};

void set_pool_threads(int64_t n) { Pool::get().set_threads(static_cast<int>(n)); }

int64_t pool_threads() { return Pool::get().threads(); }

}  // namespace

// Run fn(begin, end) over [0, n) in chunks of at most `grain` items on the pool (see the top).
void parallel_for(int64_t n, int64_t grain, const Fn& fn) { Pool::get().run(n, grain, fn); }

// The threads a call may use now (for kernels that hand out their own tasks: one chunk per thread).
int64_t num_threads() { return Pool::get().threads(); }

}  // namespace deepinfer_pool

TORCH_LIBRARY_FRAGMENT(deepinfer_cpu, m) {
  m.def("set_pool_threads(int n) -> ()", deepinfer_pool::set_pool_threads);
  m.def("pool_threads() -> int", deepinfer_pool::pool_threads);
}
