// Glue helpers for the binding: borrow numpy arrays as spans (with the exact
// dtype, 1-D, C-contiguous; no silent conversion copies) and hand C++
// vectors to numpy without a copy (the array owns the vector via a capsule).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "sssd/types.h"

namespace sssd::py_util {

namespace py = pybind11;

/// Borrows `arr` as a span of T. Throws TypeError naming `what` unless it is
/// a 1-D C-contiguous array of exactly dtype T. Call with the GIL held; the
/// caller keeps `arr` alive while the span is used.
template <typename T>
std::span<const T> borrow(const py::array& arr, const char* what) {
  if (!arr.dtype().is(py::dtype::of<T>())) {
    throw py::type_error(std::string(what) + ": expected a numpy array of dtype " +
                         std::string(py::str(py::dtype::of<T>())) + ", got " +
                         std::string(py::str(arr.dtype())));
  }
  if (arr.ndim() != 1) {
    throw py::type_error(std::string(what) + ": expected a 1-D array, got " +
                         std::to_string(arr.ndim()) + " dimensions");
  }
  if (!(arr.flags() & py::array::c_style)) {
    throw py::type_error(std::string(what) + ": array must be C-contiguous");
  }
  return {static_cast<const T*>(arr.data()), size_t(arr.shape(0))};
}

/// Token ids from any 1-D integer numpy array: borrowed when it already is
/// C-contiguous uint32, otherwise converted once with range checks (ids are
/// in [0, kMaxTokenId]; the first bad one raises ValueError naming `what`
/// and its index). Construct with the GIL held; span() stays valid while
/// this object and the array live.
class Tokens {
 public:
  Tokens(const py::array& arr, const char* what) {
    if (arr.ndim() != 1) {
      throw py::type_error(std::string(what) + ": expected a 1-D array of token ids, got " +
                           std::to_string(arr.ndim()) + " dimensions");
    }
    const char kind = arr.dtype().kind();
    if (kind != 'i' && kind != 'u') {
      throw py::type_error(std::string(what) + ": token ids must be integers, got dtype " +
                           std::string(py::str(arr.dtype())));
    }
    if (arr.dtype().is(py::dtype::of<token_t>()) && (arr.flags() & py::array::c_style)) {
      view_ = {static_cast<const token_t*>(arr.data()), size_t(arr.shape(0))};
      return;
    }
    if (kind == 'u') {
      convert(py::array_t<uint64_t, py::array::c_style | py::array::forcecast>(arr), what);
    } else {
      convert(py::array_t<int64_t, py::array::c_style | py::array::forcecast>(arr), what);
    }
  }
  std::span<const token_t> span() const { return view_; }

 private:
  template <typename T>
  void convert(const py::array_t<T, py::array::c_style | py::array::forcecast>& a, const char* what) {
    const T* p = a.data();
    const size_t n = size_t(a.shape(0));
    owned_.resize(n);
    for (size_t i = 0; i < n; ++i) {
      if constexpr (std::is_signed_v<T>) {
        if (p[i] < 0) {
          throw py::value_error(std::string(what) + "[" + std::to_string(i) + "] = " +
                                std::to_string(p[i]) + " is negative; token ids are >= 0");
        }
      }
      if (uint64_t(p[i]) > uint64_t(kMaxTokenId)) {
        throw py::value_error(std::string(what) + "[" + std::to_string(i) + "] = " +
                              std::to_string(p[i]) + " exceeds the largest token id " +
                              std::to_string(kMaxTokenId) + " (" + std::to_string(kSeparator) +
                              " is reserved as the document separator)");
      }
      owned_[i] = token_t(p[i]);
    }
    view_ = owned_;
  }
  std::vector<token_t> owned_;
  std::span<const token_t> view_;
};

/// Request ids (uint64) from a 1-D integer array: borrowed when it is
/// C-contiguous uint64, else converted once (negative ids raise ValueError).
class RequestIds {
 public:
  explicit RequestIds(const py::array& arr) {
    const char kind = arr.dtype().kind();
    if (arr.ndim() != 1 || (kind != 'i' && kind != 'u')) {
      throw py::type_error("request ids must be a 1-D array of integers");
    }
    if (arr.dtype().is(py::dtype::of<uint64_t>()) && (arr.flags() & py::array::c_style)) {
      view_ = {static_cast<const uint64_t*>(arr.data()), size_t(arr.shape(0))};
      return;
    }
    py::array_t<int64_t, py::array::c_style | py::array::forcecast> a(arr);
    owned_.resize(size_t(a.shape(0)));
    for (size_t i = 0; i < owned_.size(); ++i) {
      if (a.data()[i] < 0) {
        throw py::value_error("request ids must be >= 0, got " + std::to_string(a.data()[i]));
      }
      owned_[i] = uint64_t(a.data()[i]);
    }
    view_ = owned_;
  }
  std::span<const uint64_t> span() const { return view_; }

 private:
  std::vector<uint64_t> owned_;
  std::span<const uint64_t> view_;
};

/// Moves `v` into a new 1-D numpy array without copying its data.
template <typename T>
py::array_t<T> to_numpy(std::vector<T>&& v) {
  auto* owner = new std::vector<T>(std::move(v));
  py::capsule free_when_done(owner, [](void* p) { delete static_cast<std::vector<T>*>(p); });
  return py::array_t<T>({owner->size()}, {sizeof(T)}, owner->data(), free_when_done);
}

/// A read-only 1-D view of `size` elements at `data`, kept valid by `base`.
template <typename T>
py::array_t<T> view(const T* data, size_t size, py::handle base) {
  py::array_t<T> a({size}, {sizeof(T)}, data, base);
  py::detail::array_proxy(a.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  return a;
}

}  // namespace sssd::py_util
