// Glue helpers for the binding: borrow numpy arrays as spans (with the exact
// dtype, 1-D, C-contiguous; no silent conversion copies) and hand C++
// vectors to numpy without a copy (the array owns the vector via a capsule).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <span>
#include <string>
#include <utility>
#include <vector>

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
