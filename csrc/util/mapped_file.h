// mapped_file.h — a whole file mapped read-only, owned for its lifetime.
//
// The model readers (GGUF, safetensors) parse in place from the mapping and
// hand out pointers into it; weights are never copied.  Opening failures are
// dfl::Error naming the file.  The descriptor is closed right after mmap (the
// mapping keeps the file alive).
#pragma once
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>

#include "util/error.h"

namespace dfl {

class MappedFile {
 public:
  explicit MappedFile(const std::string& path) {
    // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer (forever); it is refused below
    // as not a regular file, and the flag changes nothing for one that is
    int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) fail("%s: cannot open: %s", path.c_str(), std::strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      fail("%s: not a regular file", path.c_str());
    }
    size_ = (uint64_t)st.st_size;
    if (size_ > 0) {
      void* m = mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
      int err = errno;
      ::close(fd);
      if (m == MAP_FAILED) fail("%s: mmap failed: %s", path.c_str(), std::strerror(err));
      data_ = (const uint8_t*)m;
    } else {
      ::close(fd);
    }
  }
  ~MappedFile() {
    if (data_) munmap((void*)data_, size_);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

}  // namespace dfl
