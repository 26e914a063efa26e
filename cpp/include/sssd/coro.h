// Coroutines that interleave memory-bound searches.
//
// A datastore query is a chain of dependent cache misses (suffix-array
// entry, then the text it points at, then the next probe). One query at a
// time leaves the CPU waiting on each miss; a batch of queries written as
// coroutines can instead prefetch, suspend, and let the next query issue its
// own miss, so several misses are in flight at once ("interleaving with
// coroutines", Jonathan et al., VLDB 2018). The code reads like the plain
// search; `co_await Prefetch{addr}` marks where a miss is expected.
//
// Task<T> is a lazy coroutine; a Task can co_await another (symmetric
// transfer). run() drives one task to completion; run_interleaved() drives
// several round-robin. A Prefetch suspends the innermost running coroutine;
// the driver records it in a per-task slot and resumes it on its next turn.
#pragma once

#include <coroutine>
#include <exception>
#include <span>
#include <utility>
#include <vector>

namespace sssd {

namespace detail {
// Where the driver wants the suspended coroutine recorded (set per resume).
inline thread_local std::coroutine_handle<>* resume_slot = nullptr;
}  // namespace detail

/// Prefetches `addr` and lets other interleaved tasks run before continuing.
struct Prefetch {
  const void* addr;
  bool await_ready() const noexcept { return detail::resume_slot == nullptr; }  // plain run: no suspension
  void await_suspend(std::coroutine_handle<> h) const noexcept {
    __builtin_prefetch(addr);
    *detail::resume_slot = h;
  }
  void await_resume() const noexcept {}
};

template <typename T>
class Task {
 public:
  struct promise_type {
    T value{};
    std::exception_ptr error;
    std::coroutine_handle<> continuation;

    Task get_return_object() { return Task(std::coroutine_handle<promise_type>::from_promise(*this)); }
    std::suspend_always initial_suspend() noexcept { return {}; }
    struct Final {
      bool await_ready() noexcept { return false; }
      std::coroutine_handle<> await_suspend(std::coroutine_handle<promise_type> h) noexcept {
        auto c = h.promise().continuation;
        return c ? c : std::noop_coroutine();
      }
      void await_resume() noexcept {}
    };
    Final final_suspend() noexcept { return {}; }
    void return_value(T v) { value = std::move(v); }
    void unhandled_exception() { error = std::current_exception(); }
  };

  Task() = default;
  explicit Task(std::coroutine_handle<promise_type> h) : h_(h) {}
  Task(Task&& o) noexcept : h_(std::exchange(o.h_, {})) {}
  Task& operator=(Task&& o) noexcept {
    if (this != &o) {
      if (h_) h_.destroy();
      h_ = std::exchange(o.h_, {});
    }
    return *this;
  }
  Task(const Task&) = delete;
  Task& operator=(const Task&) = delete;
  ~Task() {
    if (h_) h_.destroy();
  }

  // Awaited from another coroutine: start this one, resume the awaiter when done.
  bool await_ready() const noexcept { return false; }
  std::coroutine_handle<> await_suspend(std::coroutine_handle<> awaiter) noexcept {
    h_.promise().continuation = awaiter;
    return h_;
  }
  T await_resume() { return result(); }

  bool done() const { return !h_ || h_.done(); }
  std::coroutine_handle<> handle() const { return h_; }
  T result() {
    if (h_.promise().error) std::rethrow_exception(h_.promise().error);
    return std::move(h_.promise().value);
  }

 private:
  std::coroutine_handle<promise_type> h_;
};

/// Runs a task to completion without suspending (prefetches become no-ops).
template <typename T>
T run(Task<T>& task) {
  std::coroutine_handle<>* saved = std::exchange(detail::resume_slot, nullptr);
  task.handle().resume();
  detail::resume_slot = saved;
  return task.result();
}

/// Runs tasks round-robin until all are done. Exceptions stay in each task
/// (read them with result()).
template <typename T>
void run_interleaved(std::span<Task<T>> tasks) {
  std::vector<std::coroutine_handle<>> next(tasks.size());
  for (size_t i = 0; i < tasks.size(); ++i) next[i] = tasks[i].handle();
  std::coroutine_handle<>* saved = detail::resume_slot;
  size_t live = tasks.size();
  while (live > 0) {
    live = 0;
    for (size_t i = 0; i < tasks.size(); ++i) {
      if (tasks[i].done()) continue;
      detail::resume_slot = &next[i];
      next[i].resume();
      live += !tasks[i].done();
    }
  }
  detail::resume_slot = saved;
}

}  // namespace sssd
