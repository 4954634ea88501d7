// gguf.cpp — GGUF parsing with bounds checks on every read.
//
// A Cursor walks the header; every read first checks that the bytes exist, so
// a truncated file fails with the offset where it ended instead of reading past
// the mapping.  After the header, each tensor's data range is checked against
// the file size and the alignment rule.
#include "gguf/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "quant/quant.h"

namespace dfl {

namespace {

struct Cursor {
  const uint8_t* base;
  uint64_t size;
  uint64_t pos = 0;
  const std::string& path;

  void need(uint64_t n, const char* what) {
    if (n > size || pos > size - n)
      fail("%s: truncated GGUF file: it ends at byte %llu while reading %s", path.c_str(),
           (unsigned long long)size, what);
  }
  template <class T>
  T read(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, base + pos, sizeof(T));
    pos += sizeof(T);
    return v;
  }
  std::string read_str(const char* what) {
    uint64_t n = read<uint64_t>(what);
    need(n, what);
    std::string s((const char*)base + pos, n);
    pos += n;
    return s;
  }
};

size_t scalar_size(GGUFType t) {
  switch (t) {
    case GGUFType::U8: case GGUFType::I8: case GGUFType::BOOL: return 1;
    case GGUFType::U16: case GGUFType::I16: return 2;
    case GGUFType::U32: case GGUFType::I32: case GGUFType::F32: return 4;
    case GGUFType::U64: case GGUFType::I64: case GGUFType::F64: return 8;
    default: return 0;
  }
}

void read_scalar(Cursor& c, GGUFType t, GGUFValue& v, const char* what) {
  switch (t) {
    case GGUFType::U8: v.u = c.read<uint8_t>(what); v.i = (int64_t)v.u; break;
    case GGUFType::I8: v.i = c.read<int8_t>(what); v.u = (uint64_t)v.i; break;
    case GGUFType::U16: v.u = c.read<uint16_t>(what); v.i = (int64_t)v.u; break;
    case GGUFType::I16: v.i = c.read<int16_t>(what); v.u = (uint64_t)v.i; break;
    case GGUFType::U32: v.u = c.read<uint32_t>(what); v.i = (int64_t)v.u; break;
    case GGUFType::I32: v.i = c.read<int32_t>(what); v.u = (uint64_t)v.i; break;
    case GGUFType::U64: v.u = c.read<uint64_t>(what); v.i = (int64_t)v.u; break;
    case GGUFType::I64: v.i = c.read<int64_t>(what); v.u = (uint64_t)v.i; break;
    case GGUFType::F32: v.f = c.read<float>(what); break;
    case GGUFType::F64: v.f = c.read<double>(what); break;
    case GGUFType::BOOL: v.i = c.read<uint8_t>(what) != 0; v.u = (uint64_t)v.i; break;
    case GGUFType::STRING: v.s = c.read_str(what); break;
    default: break;
  }
}

// Names of ggml types this engine does not implement, for error messages.
const char* other_type_name(uint32_t t) {
  static const char* names[] = {"F32", "F16", "Q4_0", "Q4_1", "Q4_2", "Q4_3", "Q5_0", "Q5_1", "Q8_0", "Q8_1",
                                "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS",
                                "IQ1_S", "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS", "I8", "I16", "I32", "I64", "F64",
                                "IQ1_M", "BF16"};
  return t < sizeof(names) / sizeof(names[0]) ? names[t] : "unknown";
}

const char* type_name(GGUFType t) {
  static const char* names[] = {"u8", "i8", "u16", "i16", "u32", "i32", "f32",
                                "bool", "string", "array", "u64", "i64", "f64"};
  return (uint32_t)t <= 12 ? names[(uint32_t)t] : "?";
}

}  // namespace

GGUFFile::GGUFFile(const std::string& path) : path_(path), file_(path), map_(file_.data()), size_(file_.size()) {
  {
    if (size_ < 4) fail("%s: not a GGUF file: only %llu bytes", path.c_str(), (unsigned long long)size_);

    Cursor c{map_, size_, 0, path_};
    if (std::memcmp(map_, "GGUF", 4) != 0)
      fail("%s: not a GGUF file (magic bytes %02x %02x %02x %02x, expected 'GGUF')", path.c_str(),
           map_[0], map_[1], map_[2], map_[3]);
    c.pos = 4;
    version_ = c.read<uint32_t>("the version");
    if ((version_ & 0xffff) == 0 && version_ != 0)
      fail("%s: GGUF file is big-endian (version field %08x); only little-endian files are supported",
           path.c_str(), version_);
    if (version_ < 2 || version_ > 3)
      fail("%s: unsupported GGUF version %u (supported: 2, 3)", path.c_str(), version_);
    int64_t n_tensors = c.read<int64_t>("the tensor count");
    int64_t n_kv = c.read<int64_t>("the metadata count");
    // Every KV needs >= 13 bytes and every tensor info >= 28: bounds the counts
    // by the file size before allocating anything.
    if (n_tensors < 0 || (uint64_t)n_tensors > size_ / 28)
      fail("%s: truncated GGUF file or corrupt header: %lld tensors cannot fit in %llu bytes",
           path.c_str(), (long long)n_tensors, (unsigned long long)size_);
    if (n_kv < 0 || (uint64_t)n_kv > size_ / 13)
      fail("%s: truncated GGUF file or corrupt header: %lld metadata entries cannot fit in %llu bytes",
           path.c_str(), (long long)n_kv, (unsigned long long)size_);

    for (int64_t k = 0; k < n_kv; ++k) {
      std::string key = c.read_str("a metadata key");
      if (key.empty()) fail("%s: metadata entry %lld has an empty key", path.c_str(), (long long)k);
      if (kv_.count(key)) fail("%s: duplicate metadata key '%s'", path.c_str(), key.c_str());
      GGUFValue v;
      uint32_t t = c.read<uint32_t>("a metadata value type");
      if (t > 12) fail("%s: metadata key '%s' has unknown value type %u", path.c_str(), key.c_str(), t);
      v.type = (GGUFType)t;
      if (v.type == GGUFType::ARRAY) {
        uint32_t at = c.read<uint32_t>("an array element type");
        if (at > 12 || at == (uint32_t)GGUFType::ARRAY)
          fail("%s: metadata key '%s' is an array of unsupported element type %u", path.c_str(),
               key.c_str(), at);
        v.arr_type = (GGUFType)at;
        v.arr_n = c.read<uint64_t>("an array length");
        if (v.arr_type == GGUFType::STRING) {
          if (v.arr_n > (size_ - c.pos) / 8)
            fail("%s: truncated GGUF file: array '%s' claims %llu strings", path.c_str(), key.c_str(),
                 (unsigned long long)v.arr_n);
          v.strs.reserve(v.arr_n);
          for (uint64_t j = 0; j < v.arr_n; ++j) v.strs.push_back(c.read_str(key.c_str()));
        } else {
          size_t es = scalar_size(v.arr_type);
          if (v.arr_n > (size_ - c.pos) / es)
            fail("%s: truncated GGUF file: array '%s' of %llu elements runs past the end", path.c_str(),
                 key.c_str(), (unsigned long long)v.arr_n);
          v.arr_data = map_ + c.pos;
          c.pos += v.arr_n * es;
        }
      } else {
        read_scalar(c, v.type, v, key.c_str());
      }
      kv_.emplace(std::move(key), std::move(v));
    }

    uint64_t alignment = 32;
    if (const GGUFValue* a = find("general.alignment")) {
      if (a->type != GGUFType::U32 || a->u == 0 || (a->u & (a->u - 1)) != 0)
        fail("%s: general.alignment must be a power-of-two u32", path.c_str());
      alignment = a->u;
    }

    tensors_.resize((size_t)n_tensors);
    for (int64_t k = 0; k < n_tensors; ++k) {
      GGUFTensor& t = tensors_[k];
      t.name = c.read_str("a tensor name");
      t.n_dims = (int)c.read<uint32_t>("a tensor's dimension count");
      if (t.n_dims < 1 || t.n_dims > 4)
        fail("%s: tensor '%s' has %d dimensions (1..4 allowed)", path.c_str(), t.name.c_str(), t.n_dims);
      for (int d = 0; d < t.n_dims; ++d) {
        t.ne[d] = c.read<int64_t>("a tensor shape");
        if (t.ne[d] < 0 || t.ne[d] > (int64_t(1) << 40))
          fail("%s: tensor '%s' has invalid dimension %lld", path.c_str(), t.name.c_str(), (long long)t.ne[d]);
      }
      t.type = c.read<uint32_t>("a tensor type");
      t.offset = c.read<uint64_t>("a tensor offset");
      const TypeTraits* tt = type_traits(t.type);
      if (!tt)
        fail("%s: tensor '%s' has unsupported tensor type %u (%s); supported: F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K",
             path.c_str(), t.name.c_str(), t.type, other_type_name(t.type));
      if (t.ne[0] % tt->block_elems != 0)
        fail("%s: tensor '%s' row length %lld is not a multiple of the %s block size %d", path.c_str(),
             t.name.c_str(), (long long)t.ne[0], tt->name, tt->block_elems);
      if (tensor_index_.count(t.name)) fail("%s: duplicate tensor name '%s'", path.c_str(), t.name.c_str());
      tensor_index_[t.name] = (size_t)k;
      long double nb = (long double)(t.ne[0] / tt->block_elems) * tt->block_bytes * t.ne[1] * t.ne[2] * t.ne[3];
      if (nb > (long double)size_)
        fail("%s: tensor '%s' (%lld x %lld x %lld x %lld %s) is larger than the file", path.c_str(),
             t.name.c_str(), (long long)t.ne[0], (long long)t.ne[1], (long long)t.ne[2], (long long)t.ne[3], tt->name);
      t.nbytes = (uint64_t)(t.ne[0] / tt->block_elems) * tt->block_bytes * t.ne[1] * t.ne[2] * t.ne[3];
      if (t.offset % alignment != 0)
        fail("%s: tensor '%s' data offset %llu is not aligned to %llu", path.c_str(), t.name.c_str(),
             (unsigned long long)t.offset, (unsigned long long)alignment);
    }
    // The data section holds the tensors in table order, each starting where the one before ends, padded to
    // the alignment: the rule llama.cpp's reader enforces and every writer (gguf-py, llama.cpp) follows.  A
    // tensor elsewhere (overlapping another, or a gap where a type change shrank the one before) is damage,
    // and would read another tensor's bytes as weights.
    uint64_t expected = 0;
    uint64_t data_start = (c.pos + alignment - 1) / alignment * alignment;
    for (GGUFTensor& t : tensors_) {
      if (t.offset != expected)
        fail("%s: tensor '%s' data starts at offset %llu of the data section, but the tensors before it end at "
             "%llu (GGUF stores them one after another in table order): the file is damaged",
             path.c_str(), t.name.c_str(), (unsigned long long)t.offset, (unsigned long long)expected);
      expected = (t.offset + t.nbytes + alignment - 1) / alignment * alignment;
      if (data_start > size_ || t.offset > size_ - data_start || t.nbytes > size_ - data_start - t.offset)
        fail("%s: tensor '%s' data [%llu, %llu) lies beyond the end of the file (%llu bytes): the file is truncated",
             path.c_str(), t.name.c_str(), (unsigned long long)(data_start + t.offset),
             (unsigned long long)(data_start + t.offset + t.nbytes), (unsigned long long)size_);
      t.data = map_ + data_start + t.offset;
    }
  }
}

const GGUFValue* GGUFFile::find(const std::string& key) const {
  auto it = kv_.find(key);
  return it == kv_.end() ? nullptr : &it->second;
}

const GGUFTensor* GGUFFile::find_tensor(const std::string& name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

static bool is_int(GGUFType t) {
  return t == GGUFType::U8 || t == GGUFType::I8 || t == GGUFType::U16 || t == GGUFType::I16 ||
         t == GGUFType::U32 || t == GGUFType::I32 || t == GGUFType::U64 || t == GGUFType::I64;
}

uint32_t GGUFFile::get_u32(const std::string& key) const {
  const GGUFValue* v = find(key);
  if (!v) fail("%s: missing metadata key '%s'", path_.c_str(), key.c_str());
  if (!is_int(v->type) || v->i < 0 || v->u > 0xffffffffu)
    fail("%s: metadata key '%s' should be an unsigned integer, found %s", path_.c_str(), key.c_str(),
         type_name(v->type));
  return (uint32_t)v->u;
}

uint32_t GGUFFile::get_u32(const std::string& key, uint32_t def) const {
  return find(key) ? get_u32(key) : def;
}

float GGUFFile::get_f32(const std::string& key) const {
  const GGUFValue* v = find(key);
  if (!v) fail("%s: missing metadata key '%s'", path_.c_str(), key.c_str());
  if (v->type == GGUFType::F32 || v->type == GGUFType::F64) return (float)v->f;
  if (is_int(v->type)) return (float)v->i;
  fail("%s: metadata key '%s' should be a number, found %s", path_.c_str(), key.c_str(), type_name(v->type));
}

float GGUFFile::get_f32(const std::string& key, float def) const { return find(key) ? get_f32(key) : def; }

std::string GGUFFile::get_str(const std::string& key) const {
  const GGUFValue* v = find(key);
  if (!v) fail("%s: missing metadata key '%s'", path_.c_str(), key.c_str());
  if (v->type != GGUFType::STRING)
    fail("%s: metadata key '%s' should be a string, found %s", path_.c_str(), key.c_str(), type_name(v->type));
  return v->s;
}

std::vector<int64_t> GGUFFile::get_int_array(const std::string& key) const {
  std::vector<int64_t> out;
  const GGUFValue* v = find(key);
  if (!v) return out;
  if (v->type != GGUFType::ARRAY || (!is_int(v->arr_type) && v->arr_type != GGUFType::BOOL))
    fail("%s: metadata key '%s' should be an integer array", path_.c_str(), key.c_str());
  size_t es = scalar_size(v->arr_type);
  for (uint64_t j = 0; j < v->arr_n; ++j) {
    Cursor c{v->arr_data + j * es, es, 0, path_};
    GGUFValue e;
    read_scalar(c, v->arr_type, e, key.c_str());
    out.push_back(e.i);
  }
  return out;
}

}  // namespace dfl
