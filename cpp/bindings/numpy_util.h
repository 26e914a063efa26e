// Glue helpers for the binding: borrow numpy arrays as spans (with the exact
// dtype, 1-D, C-contiguous; no silent conversion copies) and hand C++
// vectors to numpy without a copy (the array owns the vector via a capsule).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "sssd/types.h"

namespace sssd::py_util {

namespace py = pybind11;

inline bool is_aligned(const py::array& arr) {
  return (arr.flags() & py::detail::npy_api::NPY_ARRAY_ALIGNED_) != 0;
}

/// A 1-D C-contiguous numpy array of dtype T (or an equivalent one: 'q' and
/// 'l' are both int64) as a span. Borrowed without a copy when the data is
/// aligned for T; a misaligned array (np.frombuffer at an odd offset) is
/// copied once, since reading T in place there is undefined behaviour.
/// Holds a reference to the array, so the span stays valid while this
/// object lives, even for a temporary array converted from a list.
/// Construct and destroy with the GIL held.
template <typename T>
class Borrowed {
 public:
  Borrowed(const py::array& arr, const char* what) : keep_(arr) {
    if (!arr.dtype().equal(py::dtype::of<T>())) {
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
    const size_t n = size_t(arr.shape(0));
    if (is_aligned(arr)) {
      view_ = {static_cast<const T*>(arr.data()), n};
    } else {
      owned_.resize(n);
      if (n) std::memcpy(owned_.data(), arr.data(), n * sizeof(T));
      view_ = owned_;
      copied_ = true;
    }
  }
  Borrowed(Borrowed&& o) noexcept
      : keep_(std::move(o.keep_)), owned_(std::move(o.owned_)), view_(o.view_), copied_(o.copied_) {
    if (copied_) view_ = owned_;
  }
  Borrowed(const Borrowed&) = delete;
  Borrowed& operator=(const Borrowed&) = delete;
  Borrowed& operator=(Borrowed&&) = delete;

  std::span<const T> span() const { return view_; }
  operator std::span<const T>() const { return view_; }
  size_t size() const { return view_.size(); }
  bool empty() const { return view_.empty(); }
  const T* data() const { return view_.data(); }
  const T& operator[](size_t i) const { return view_[i]; }
  const T& front() const { return view_.front(); }
  const T& back() const { return view_.back(); }
  auto begin() const { return view_.begin(); }
  auto end() const { return view_.end(); }

 private:
  py::array keep_;
  std::vector<T> owned_;
  std::span<const T> view_;
  bool copied_ = false;
};

/// Borrows `arr` (see Borrowed). Throws TypeError naming `what` unless it is
/// a 1-D C-contiguous array of dtype T.
template <typename T>
Borrowed<T> borrow(const py::array& arr, const char* what) {
  return Borrowed<T>(arr, what);
}

/// Element i of a C-contiguous array of T, read bytewise (any alignment).
template <typename T>
T load(const py::array& a, size_t i) {
  T v;
  std::memcpy(&v, static_cast<const char*>(a.data()) + i * sizeof(T), sizeof(T));
  return v;
}

/// Token ids from any 1-D integer numpy array: borrowed when it already is
/// aligned C-contiguous uint32, otherwise converted once with range checks
/// (ids are in [0, kMaxTokenId]; the first bad one raises ValueError naming
/// `what` and its index). Holds a reference to the array: span() stays
/// valid while this object lives. Construct and destroy with the GIL held.
class Tokens {
 public:
  Tokens(const py::array& arr, const char* what) : keep_(arr) {
    if (arr.ndim() != 1) {
      throw py::type_error(std::string(what) + ": expected a 1-D array of token ids, got " +
                           std::to_string(arr.ndim()) + " dimensions");
    }
    const char kind = arr.dtype().kind();
    if (kind != 'i' && kind != 'u') {
      throw py::type_error(std::string(what) + ": token ids must be integers, got dtype " +
                           std::string(py::str(arr.dtype())));
    }
    if (arr.dtype().equal(py::dtype::of<token_t>()) && (arr.flags() & py::array::c_style) && is_aligned(arr)) {
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
  // `a` may still be misaligned (no conversion was needed): read bytewise.
  template <typename T>
  void convert(const py::array_t<T, py::array::c_style | py::array::forcecast>& a, const char* what) {
    const size_t n = size_t(a.shape(0));
    owned_.resize(n);
    for (size_t i = 0; i < n; ++i) {
      const T v = load<T>(a, i);
      if constexpr (std::is_signed_v<T>) {
        if (v < 0) {
          throw py::value_error(std::string(what) + "[" + std::to_string(i) + "] = " +
                                std::to_string(v) + " is negative; token ids are >= 0");
        }
      }
      if (uint64_t(v) > uint64_t(kMaxTokenId)) {
        throw py::value_error(std::string(what) + "[" + std::to_string(i) + "] = " +
                              std::to_string(v) + " exceeds the largest token id " +
                              std::to_string(kMaxTokenId) + " (" + std::to_string(kSeparator) +
                              " is reserved as the document separator)");
      }
      owned_[i] = token_t(v);
    }
    view_ = owned_;
  }
  py::array keep_;
  std::vector<token_t> owned_;
  std::span<const token_t> view_;
};

/// Request ids are the integers in [0, 2^64): one rule for every entry
/// point, scalar or array. Message of the ValueError for one that is not.
inline std::string bad_request_id(const std::string& value) {
  return "request ids must be >= 0 and < 2^64, got " + value;
}

/// A scalar request id: any Python int (or object with __index__, such as a
/// numpy integer; not a bool). TypeError for other types, ValueError for one
/// outside [0, 2^64).
inline uint64_t request_id(py::handle obj) {
  if (PyBool_Check(obj.ptr())) throw py::type_error("request id must be an int, got bool");
  PyObject* index = PyNumber_Index(obj.ptr());
  if (!index) {
    PyErr_Clear();
    throw py::type_error("request id must be an int, got " + std::string(py::str(py::type::handle_of(obj).attr("__name__"))));
  }
  py::int_ value = py::reinterpret_steal<py::int_>(index);
  if (PyObject_RichCompareBool(value.ptr(), py::int_(0).ptr(), Py_LT) == 1) {
    throw py::value_error(bad_request_id(std::string(py::str(value))));
  }
  const unsigned long long v = PyLong_AsUnsignedLongLong(value.ptr());
  if (v == (unsigned long long)-1 && PyErr_Occurred()) {
    PyErr_Clear();
    throw py::value_error(bad_request_id(std::string(py::str(value))));
  }
  return uint64_t(v);
}

/// Request ids from a 1-D integer array (see request_id): borrowed when it is
/// aligned C-contiguous uint64, else converted once (any unsigned dtype
/// exactly; signed ones refuse negative ids with ValueError). Holds a
/// reference to the array; construct and destroy with the GIL held.
class RequestIds {
 public:
  explicit RequestIds(const py::array& arr) : keep_(arr) {
    const char kind = arr.dtype().kind();
    if (arr.ndim() != 1 || (kind != 'i' && kind != 'u')) {
      throw py::type_error("request ids must be a 1-D array of integers");
    }
    if (arr.dtype().equal(py::dtype::of<uint64_t>()) && (arr.flags() & py::array::c_style) && is_aligned(arr)) {
      view_ = {static_cast<const uint64_t*>(arr.data()), size_t(arr.shape(0))};
      return;
    }
    if (kind == 'u') {
      const py::array_t<uint64_t, py::array::c_style | py::array::forcecast> a(arr);
      owned_.resize(size_t(a.shape(0)));
      for (size_t i = 0; i < owned_.size(); ++i) owned_[i] = load<uint64_t>(a, i);
    } else {
      const py::array_t<int64_t, py::array::c_style | py::array::forcecast> a(arr);
      owned_.resize(size_t(a.shape(0)));
      for (size_t i = 0; i < owned_.size(); ++i) {
        const int64_t v = load<int64_t>(a, i);
        if (v < 0) throw py::value_error(bad_request_id(std::to_string(v)));
        owned_[i] = uint64_t(v);
      }
    }
    view_ = owned_;
  }
  std::span<const uint64_t> span() const { return view_; }

 private:
  py::array keep_;
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
