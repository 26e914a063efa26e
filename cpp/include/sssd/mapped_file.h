// Read-only memory maps of datastore files, and an owned-buffer stand-in so
// that an in-memory datastore and an mmap'd one share one code path.
//
// Maps are MAP_SHARED and read-only: many processes that open the same
// datastore share one copy in the page cache, and opening costs the same
// whatever the file size (nothing is read until a query touches it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace sssd {

class Bytes {
 public:
  Bytes() = default;
  /// Maps `path` read-only. Throws sssd::Error (with the path and errno text)
  /// if it cannot be opened or mapped, or is not a regular file (a FIFO, a
  /// device or a directory is refused without blocking on it).
  /// `random_access` sets MADV_RANDOM.
  static Bytes map_file(const std::string& path, bool random_access);
  /// Takes ownership of an in-memory buffer.
  static Bytes own(std::vector<uint8_t> buffer);

  Bytes(Bytes&& other) noexcept;
  Bytes& operator=(Bytes&& other) noexcept;
  Bytes(const Bytes&) = delete;
  Bytes& operator=(const Bytes&) = delete;
  ~Bytes();

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  bool mapped() const { return mapped_; }
  /// madvise() hint for a mapped file (MADV_SEQUENTIAL, MADV_RANDOM, ...);
  /// a no-op for owned buffers. Failures are ignored (it is a hint).
  void advise(int advice) const;

  // Residency of a mapped file's pages (no-ops on owned buffers, which are
  // always resident).
  /// Reads every page in (MADV_POPULATE_READ where the kernel has it, else
  /// one touch per page). The kernel may still reclaim them later.
  void populate() const;
  /// Pins the pages in memory (mlock) until the map is released. Throws
  /// sssd::Error naming errno and the RLIMIT_MEMLOCK fix if it cannot.
  void lock(const std::string& what) const;
  /// Asks the kernel to reclaim the pages now (MADV_PAGEOUT; locked pages
  /// stay), as memory pressure would. Returns false if the kernel cannot.
  bool page_out() const;
  /// Bytes of the map now in memory (mincore).
  size_t resident_bytes() const;

 private:
  void release() noexcept;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  bool mapped_ = false;
  bool random_ = false;  // mapped with MADV_RANDOM
  std::vector<uint8_t> owned_;
};

}  // namespace sssd
