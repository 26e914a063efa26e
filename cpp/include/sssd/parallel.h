// OpenMP helpers. Exceptions must not escape an OpenMP region (that calls
// std::terminate and kills the interpreter), so parallel loops capture the
// first exception and rethrow it on the calling thread after the region.
#pragma once

#include <atomic>
#include <cstddef>
#include <exception>
#include <mutex>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace sssd {

/// Threads to use: `requested` if > 0, else OpenMP's default (1 without OpenMP).
inline int resolve_threads(int requested) {
#ifdef _OPENMP
  return requested > 0 ? requested : omp_get_max_threads();
#else
  (void)requested;
  return 1;
#endif
}

/// Collects the first exception thrown inside a parallel region.
class ExceptionCapture {
 public:
  template <typename F>
  void run(F&& f) noexcept {
    if (failed_.load(std::memory_order_relaxed)) return;
    try {
      f();
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!error_) error_ = std::current_exception();
      failed_.store(true, std::memory_order_relaxed);
    }
  }
  void rethrow() const {
    if (error_) std::rethrow_exception(error_);
  }

 private:
  std::atomic<bool> failed_{false};
  std::mutex mu_;
  std::exception_ptr error_;
};

/// Runs body(i) for i in [0, n) on `threads` threads (dynamic schedule,
/// `chunk` iterations at a time), single-threaded when n < min_parallel.
/// The first exception thrown by any body is rethrown here.
template <typename Body>
void parallel_for(size_t n, int threads, Body&& body, size_t chunk = 1, size_t min_parallel = 2) {
  ExceptionCapture capture;
  const bool par = threads > 1 && n >= min_parallel;
#pragma omp parallel for schedule(dynamic, chunk) num_threads(threads) if (par)
  for (size_t i = 0; i < n; ++i) {
    capture.run([&] { body(i); });
  }
  capture.rethrow();
}

}  // namespace sssd
