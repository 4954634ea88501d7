// safetensors.cpp — header parsing and validation (util/json.h does the JSON).
#include "safetensors/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "util/json.h"

namespace dfl {

int64_t STTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string STTensor::shape_str() const {
  std::string s = "[";
  for (size_t k = 0; k < shape.size(); ++k) {
    if (k) s += ", ";
    s += std::to_string(shape[k]);
  }
  return s + "]";
}

const char* st_dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    default: return "?";
  }
}

namespace {

bool parse_dtype(const std::string& s, DType& t, uint64_t& size) {
  if (s == "F32") { t = DType::F32; size = 4; return true; }
  if (s == "F16") { t = DType::F16; size = 2; return true; }
  if (s == "BF16") { t = DType::BF16; size = 2; return true; }
  return false;
}

// Reads a non-negative JSON integer (offsets, dims); `what` names it in errors.
uint64_t get_uint(const JsonValue& v, const std::string& path, const std::string& tname, const char* what) {
  if (!v.is_number() || !v.is_int || v.i < 0)
    fail("%s: tensor '%s' has an invalid %s (expected a non-negative integer)", path.c_str(), tname.c_str(), what);
  return (uint64_t)v.i;
}

}  // namespace

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path), file_(path), map_(file_.data()), size_(file_.size()) {
  {
    if (size_ < 8)
      fail("%s: truncated safetensors file: %llu bytes, too short for the 8-byte header length", path.c_str(),
           (unsigned long long)size_);

    uint64_t hlen = 0;
    for (int k = 7; k >= 0; --k) hlen = (hlen << 8) | map_[k];  // little-endian whatever the host
    if (hlen > kMaxHeaderBytes)
      fail("%s: safetensors header length %llu is absurd (limit %llu bytes): not a safetensors file or corrupt",
           path.c_str(), (unsigned long long)hlen, (unsigned long long)kMaxHeaderBytes);
    if (hlen > size_ - 8)
      fail("%s: truncated safetensors file: header length %llu runs past the end of the file (%llu bytes)",
           path.c_str(), (unsigned long long)hlen, (unsigned long long)size_);
    if (hlen < 2) fail("%s: safetensors header of %llu bytes is too short", path.c_str(), (unsigned long long)hlen);
    data_off_ = 8 + hlen;
    const uint64_t data_size = size_ - data_off_;

    JsonLimits lim;
    lim.max_bytes = kMaxHeaderBytes;
    lim.max_depth = 8;
    JsonValue h = parse_json((const char*)map_ + 8, (size_t)hlen, path + ": safetensors header", 8, lim);
    if (!h.is_object())
      fail("%s: safetensors header is a JSON %s, expected an object", path.c_str(), json_kind_name(h.kind));

    tensors_.reserve(h.obj.size());
    for (auto& kv : h.obj) {
      const std::string& name = kv.first;
      const JsonValue& e = kv.second;
      if (name == "__metadata__") {
        if (!e.is_object()) fail("%s: __metadata__ is a JSON %s, expected an object", path.c_str(), json_kind_name(e.kind));
        for (auto& mv : e.obj) {
          if (!mv.second.is_string())
            fail("%s: __metadata__ value '%s' is a JSON %s, expected a string", path.c_str(), mv.first.c_str(),
                 json_kind_name(mv.second.kind));
          meta_[mv.first] = mv.second.str;
        }
        continue;
      }
      if (name.empty()) fail("%s: a tensor has an empty name", path.c_str());
      if (!e.is_object())
        fail("%s: tensor '%s' entry is a JSON %s, expected an object", path.c_str(), name.c_str(), json_kind_name(e.kind));
      // The JSON parser already refuses duplicate keys; keep the check local too.
      if (index_.count(name)) fail("%s: duplicate tensor name '%s'", path.c_str(), name.c_str());
      const JsonValue *jd = nullptr, *js = nullptr, *jo = nullptr;
      for (auto& f : e.obj) {
        if (f.first == "dtype") jd = &f.second;
        else if (f.first == "shape") js = &f.second;
        else if (f.first == "data_offsets") jo = &f.second;
        else fail("%s: tensor '%s' has an unknown field '%s'", path.c_str(), name.c_str(), f.first.c_str());
      }
      if (!jd || !js || !jo)
        fail("%s: tensor '%s' lacks '%s'", path.c_str(), name.c_str(), !jd ? "dtype" : !js ? "shape" : "data_offsets");
      STTensor t;
      t.name = name;
      if (!jd->is_string()) fail("%s: tensor '%s' dtype is not a string", path.c_str(), name.c_str());
      uint64_t esize = 0;
      if (!parse_dtype(jd->str, t.dtype, esize))
        fail("%s: tensor '%s' has unsupported dtype '%s' (supported: BF16, F16, F32)", path.c_str(), name.c_str(),
             jd->str.c_str());
      if (!js->is_array()) fail("%s: tensor '%s' shape is not an array", path.c_str(), name.c_str());
      if (js->arr.size() > 8)
        fail("%s: tensor '%s' has %zu dimensions (at most 8)", path.c_str(), name.c_str(), js->arr.size());
      // Product of dims * element size, checked against overflow (cap at 2^62).
      unsigned __int128 bytes = esize;
      for (const JsonValue& d : js->arr) {
        uint64_t dim = get_uint(d, path, name, "dimension");
        if (dim > (uint64_t(1) << 40)) fail("%s: tensor '%s' has an absurd dimension %llu", path.c_str(), name.c_str(), (unsigned long long)dim);
        t.shape.push_back((int64_t)dim);
        bytes *= dim;
        if (bytes > ((unsigned __int128)1 << 62))
          fail("%s: tensor '%s' shape %s is absurdly large", path.c_str(), name.c_str(), t.shape_str().c_str());
      }
      if (!jo->is_array() || jo->arr.size() != 2)
        fail("%s: tensor '%s' data_offsets is not a [begin, end] pair", path.c_str(), name.c_str());
      t.begin = get_uint(jo->arr[0], path, name, "data offset");
      t.end = get_uint(jo->arr[1], path, name, "data offset");
      if (t.end < t.begin)
        fail("%s: tensor '%s' data_offsets [%llu, %llu] are reversed", path.c_str(), name.c_str(),
             (unsigned long long)t.begin, (unsigned long long)t.end);
      if ((unsigned __int128)(t.end - t.begin) != bytes)
        fail("%s: tensor '%s' shape %s of %s needs %llu bytes but data_offsets [%llu, %llu] span %llu",
             path.c_str(), name.c_str(), t.shape_str().c_str(), jd->str.c_str(), (unsigned long long)bytes,
             (unsigned long long)t.begin, (unsigned long long)t.end, (unsigned long long)(t.end - t.begin));
      if (t.end > data_size)
        fail("%s: truncated safetensors file: tensor '%s' data [%llu, %llu) lies beyond the end of the data region (%llu bytes)",
             path.c_str(), name.c_str(), (unsigned long long)t.begin, (unsigned long long)t.end,
             (unsigned long long)data_size);
      t.data = map_ + data_off_ + t.begin;
      index_[name] = tensors_.size();
      tensors_.push_back(std::move(t));
    }

    // Overlap: sort the ranges; each must start at or after the previous one's end.
    std::vector<size_t> order(tensors_.size());
    for (size_t k = 0; k < order.size(); ++k) order[k] = k;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      const STTensor &x = tensors_[a], &y = tensors_[b];
      return x.begin != y.begin ? x.begin < y.begin : x.end < y.end;
    });
    const STTensor* prev = nullptr;  // the non-empty tensor reaching furthest so far
    for (size_t k = 0; k < order.size(); ++k) {
      const STTensor& b = tensors_[order[k]];
      if (b.begin == b.end) continue;  // an empty tensor occupies no bytes
      if (prev && b.begin < prev->end)
        fail("%s: tensors '%s' [%llu, %llu) and '%s' [%llu, %llu) overlap", path.c_str(), prev->name.c_str(),
             (unsigned long long)prev->begin, (unsigned long long)prev->end, b.name.c_str(),
             (unsigned long long)b.begin, (unsigned long long)b.end);
      if (!prev || b.end > prev->end) prev = &b;
    }
  }
}

const STTensor* SafetensorsFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

}  // namespace dfl
