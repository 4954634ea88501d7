// safetensors.h — a validating, read-only .safetensors reader over an mmapped file.
//
// Layout: u64 little-endian header length N, N bytes of JSON
// {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}},
// then the data region; offsets are relative to the data region's start.
// Opening a file checks all of it before anything touches the data: header
// length past the end or over 100 MB, malformed JSON, unknown fields, dtypes
// other than BF16/F16/F32 (named in the error), shape x dtype size different
// from end - begin, offsets reversed / past the data region / overlapping,
// duplicate names.  Every failure is a one-line dfl::Error naming the file.
// Tensor data is never copied: `STTensor::data` points into the mapping (at
// 8 + N + begin, which need not be aligned: read it with memcpy).
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "quant/blocks.h"
#include "util/error.h"
#include "util/mapped_file.h"

namespace dfl {

struct STTensor {
  std::string name;
  DType dtype = DType::F32;  // F32, F16 or BF16
  std::vector<int64_t> shape;  // outermost first (row-major), as in the header
  uint64_t begin = 0, end = 0;  // relative to the data region
  const uint8_t* data = nullptr;
  uint64_t nbytes() const { return end - begin; }
  int64_t numel() const;
  std::string shape_str() const;  // "[4096, 5120]"
};

const char* st_dtype_name(DType t);  // "BF16", "F16", "F32"

class SafetensorsFile {
 public:
  static constexpr uint64_t kMaxHeaderBytes = 100000000;  // the format's own limit

  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile() = default;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  uint64_t file_size() const { return size_; }
  uint64_t data_offset() const { return data_off_; }  // 8 + header length
  const std::vector<STTensor>& tensors() const { return tensors_; }  // header order
  const std::map<std::string, std::string>& metadata() const { return meta_; }
  const STTensor* find(const std::string& name) const;

 private:
  std::string path_;
  MappedFile file_;  // declared before the views into it
  const uint8_t* map_ = nullptr;
  uint64_t size_ = 0;
  uint64_t data_off_ = 0;
  std::vector<STTensor> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> meta_;
};

}  // namespace dfl
