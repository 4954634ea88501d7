// gguf.h — a validating, read-only GGUF reader over an mmapped file.
//
// Opening a file parses the header, every metadata value and every tensor
// info, and checks all of it against the file's size before anything else
// touches the data: bad magic or version, truncation anywhere, unknown value
// or tensor types, misaligned or out-of-bounds tensor data all raise
// dfl::Error with a one-line message that names the file and the problem.
// Tensor data is never copied: `GGUFTensor::data` points into the mapping.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "util/error.h"
#include "util/mapped_file.h"

namespace dfl {

enum class GGUFType : uint32_t {
  U8 = 0, I8 = 1, U16 = 2, I16 = 3, U32 = 4, I32 = 5, F32 = 6, BOOL = 7, STRING = 8,
  ARRAY = 9, U64 = 10, I64 = 11, F64 = 12,
};

struct GGUFValue {
  GGUFType type = GGUFType::U8;
  // Scalars (integers widened; bool stored in i).
  int64_t i = 0;
  uint64_t u = 0;
  double f = 0.0;
  std::string s;
  // Arrays: element type and count; numeric elements point into the mapping,
  // string elements are decoded into `strs`.
  GGUFType arr_type = GGUFType::U8;
  uint64_t arr_n = 0;
  const uint8_t* arr_data = nullptr;
  std::vector<std::string> strs;
};

struct GGUFTensor {
  std::string name;
  int n_dims = 0;
  int64_t ne[4] = {1, 1, 1, 1};
  uint32_t type = 0;
  uint64_t offset = 0;
  uint64_t nbytes = 0;
  const uint8_t* data = nullptr;
  int64_t nelements() const { return ne[0] * ne[1] * ne[2] * ne[3]; }
};

class GGUFFile {
 public:
  explicit GGUFFile(const std::string& path);
  ~GGUFFile() = default;
  GGUFFile(const GGUFFile&) = delete;
  GGUFFile& operator=(const GGUFFile&) = delete;

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  uint64_t file_size() const { return size_; }
  const std::map<std::string, GGUFValue>& kv() const { return kv_; }
  const std::vector<GGUFTensor>& tensors() const { return tensors_; }

  const GGUFValue* find(const std::string& key) const;
  const GGUFTensor* find_tensor(const std::string& name) const;

  // Typed getters: a missing required key or a value of the wrong type is an
  // error naming the key; optional ones return `def` when absent.
  uint32_t get_u32(const std::string& key) const;
  uint32_t get_u32(const std::string& key, uint32_t def) const;
  float get_f32(const std::string& key) const;
  float get_f32(const std::string& key, float def) const;
  std::string get_str(const std::string& key) const;
  std::vector<int64_t> get_int_array(const std::string& key) const;  // empty if absent

 private:
  std::string path_;
  MappedFile file_;  // declared before the views into it
  const uint8_t* map_ = nullptr;
  uint64_t size_ = 0;
  uint32_t version_ = 0;
  std::map<std::string, GGUFValue> kv_;
  std::vector<GGUFTensor> tensors_;
  std::map<std::string, size_t> tensor_index_;
};

}  // namespace dfl
