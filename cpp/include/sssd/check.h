// Error reporting for the SSSD core.
//
// Every check in the core is always on (never `assert`): a bad input or a
// corrupt file raises a C++ exception that the binding turns into a Python
// exception. Three kinds, mapped by pybind11's default translator:
//   std::invalid_argument -> ValueError   (bad argument values)
//   std::out_of_range     -> IndexError   (unknown ids, indices)
//   sssd::Error           -> sssd.SSSDError (corrupt files, I/O, internal)
//   sssd::CorruptFile     -> sssd._core.CorruptDatastoreError, both a
//                            sssd.SSSDError and a ValueError (a file whose
//                            structure is inconsistent)
//   sssd::UnknownRequest  -> KeyError       (a request id that is not open)
#pragma once

#include <cstdint>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>

namespace sssd {

/// Failure that is not the caller's argument: I/O, corrupt data, internal state.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A file whose contents are inconsistent (bad structure, not bad I/O).
class CorruptFile : public Error {
 public:
  using Error::Error;
};

/// A request id that is not open (KeyError in Python).
class UnknownRequest : public std::out_of_range {
 public:
  using std::out_of_range::out_of_range;
};

namespace detail {
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace sssd

/// Throw ExcType(message...) unless cond holds. Always compiled in.
#define SSSD_CHECK_AS(ExcType, cond, ...)                                \
  do {                                                                   \
    if (!(cond)) throw ExcType(::sssd::detail::concat(__VA_ARGS__));     \
  } while (0)

/// Argument checks: raise ValueError in Python.
#define SSSD_CHECK_ARG(cond, ...) SSSD_CHECK_AS(std::invalid_argument, cond, __VA_ARGS__)
/// Data / file / state checks: raise sssd.SSSDError in Python.
#define SSSD_CHECK(cond, ...) SSSD_CHECK_AS(::sssd::Error, cond, __VA_ARGS__)

namespace sssd {

/// Checks CSR offsets of `rows` rows over `total` items (row b's are [offsets[b], offsets[b + 1])):
/// rows + 1 entries, from 0 to total, non-decreasing. Throws std::invalid_argument saying which fails.
inline void check_offsets(std::span<const int64_t> offsets, size_t rows, size_t total) {
  SSSD_CHECK_ARG(offsets.size() == rows + 1, "offsets must have ", rows + 1, " entries, got ", offsets.size());
  SSSD_CHECK_ARG(offsets.front() == 0 && uint64_t(offsets.back()) == total,
                 "offsets must start at 0 and end at the number of tokens");
  for (size_t b = 0; b < rows; ++b) SSSD_CHECK_ARG(offsets[b] <= offsets[b + 1], "offsets must be non-decreasing");
}

}  // namespace sssd
