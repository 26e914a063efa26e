#include "sssd/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "sssd/check.h"

namespace sssd {

Bytes Bytes::map_file(const std::string& path, bool random_access) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a
  // writer. It changes nothing for a regular file, the only kind accepted.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  SSSD_CHECK(fd >= 0, "cannot open ", path, ": ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw Error(detail::concat("cannot stat ", path, ": ", std::strerror(err)));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    const char* kind = S_ISFIFO(st.st_mode)  ? "a FIFO"
                       : S_ISDIR(st.st_mode) ? "a directory"
                       : S_ISCHR(st.st_mode) ? "a character device"
                       : S_ISBLK(st.st_mode) ? "a block device"
                       : S_ISSOCK(st.st_mode) ? "a socket"
                                              : "a special file";
    throw Error(detail::concat("cannot open ", path, ": it is ", kind, ", not a regular file"));
  }
  Bytes b;
  b.size_ = size_t(st.st_size);
  if (b.size_ > 0) {
    void* p = ::mmap(nullptr, b.size_, PROT_READ, MAP_SHARED, fd, 0);
    const int err = errno;
    ::close(fd);
    SSSD_CHECK(p != MAP_FAILED, "cannot mmap ", path, ": ", std::strerror(err));
    if (random_access) ::madvise(p, b.size_, MADV_RANDOM);
    b.data_ = static_cast<const uint8_t*>(p);
    b.mapped_ = true;
  } else {
    ::close(fd);
  }
  return b;
}

void Bytes::advise(int advice) const {
  if (mapped_ && data_) ::madvise(const_cast<uint8_t*>(data_), size_, advice);
}

Bytes Bytes::own(std::vector<uint8_t> buffer) {
  Bytes b;
  b.owned_ = std::move(buffer);
  b.data_ = b.owned_.data();
  b.size_ = b.owned_.size();
  return b;
}

Bytes::Bytes(Bytes&& other) noexcept { *this = std::move(other); }

Bytes& Bytes::operator=(Bytes&& other) noexcept {
  if (this != &other) {
    release();
    mapped_ = other.mapped_;
    size_ = other.size_;
    owned_ = std::move(other.owned_);
    data_ = mapped_ ? other.data_ : owned_.data();
    other.data_ = nullptr;
    other.size_ = 0;
    other.mapped_ = false;
  }
  return *this;
}

Bytes::~Bytes() { release(); }

void Bytes::release() noexcept {
  if (mapped_ && data_) ::munmap(const_cast<uint8_t*>(data_), size_);
  data_ = nullptr;
  size_ = 0;
  mapped_ = false;
  owned_.clear();
}

}  // namespace sssd
