// gguf_api.cpp — a GGUF file's metadata for the Python side (tokenizer, chat template, model listing), read by
// the same validating reader the model loader uses, so there is one GGUF parser in the project.
#include "dflash27b_dev.h"  // the public ABI and the tool entry points

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "api/last_error.h"
#include "gguf/gguf.h"

namespace {

using dfl::GGUFType;

// A JSON string: quotes, backslashes and control characters escaped; bytes that are not UTF-8 become U+FFFD
// (what Python's decode("utf-8", "replace") gives for each bad byte).
void put_string(std::string& o, const std::string& s) {
  o += '"';
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  for (size_t i = 0; i < n;) {
    const unsigned char c = p[i];
    if (c < 0x80) {
      if (c == '"' || c == '\\') o += '\\', o += (char)c;
      else if (c < 0x20) {
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\u%04x", c);
        o += buf;
      } else {
        o += (char)c;
      }
      ++i;
      continue;
    }
    // a well-formed multi-byte sequence (no overlongs, no surrogates, <= U+10FFFF) is copied whole
    int len = c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
    bool ok = len > 0 && i + len <= n;
    for (int k = 1; ok && k < len; ++k) ok = (p[i + k] & 0xC0) == 0x80;
    if (ok && len == 3) ok = !(c == 0xE0 && p[i + 1] < 0xA0) && !(c == 0xED && p[i + 1] >= 0xA0);
    if (ok && len == 4) ok = !(c == 0xF0 && p[i + 1] < 0x90) && !(c == 0xF4 && p[i + 1] >= 0x90);
    if (ok) {
      o.append(s, i, (size_t)len);
      i += (size_t)len;
    } else {
      o += "\xEF\xBF\xBD";
      ++i;
    }
  }
  o += '"';
}

// Floats as the shortest decimal that reads back the same value; NaN / infinities as Python's json spells them.
void put_float(std::string& o, double v, bool f32) {
  if (std::isnan(v)) { o += "NaN"; return; }
  if (std::isinf(v)) { o += v > 0 ? "Infinity" : "-Infinity"; return; }
  char buf[40];
  for (int prec = f32 ? 6 : 15; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, v);
    if (f32 ? (float)std::strtod(buf, nullptr) == (float)v : std::strtod(buf, nullptr) == v) break;
  }
  o += buf;
  if (!std::strpbrk(buf, ".eEn")) o += ".0";  // stays a float when read back
}

void put_element(std::string& o, GGUFType t, const uint8_t* p) {
  auto rd = [&](auto v) { std::memcpy(&v, p, sizeof v); return v; };
  switch (t) {
    case GGUFType::U8: o += std::to_string(rd(uint8_t{})); break;
    case GGUFType::I8: o += std::to_string(rd(int8_t{})); break;
    case GGUFType::U16: o += std::to_string(rd(uint16_t{})); break;
    case GGUFType::I16: o += std::to_string(rd(int16_t{})); break;
    case GGUFType::U32: o += std::to_string(rd(uint32_t{})); break;
    case GGUFType::I32: o += std::to_string(rd(int32_t{})); break;
    case GGUFType::U64: o += std::to_string(rd(uint64_t{})); break;
    case GGUFType::I64: o += std::to_string(rd(int64_t{})); break;
    case GGUFType::F32: put_float(o, rd(float{}), true); break;
    case GGUFType::F64: put_float(o, rd(double{}), false); break;
    case GGUFType::BOOL: o += rd(uint8_t{}) ? "true" : "false"; break;
    default: dfl::fail("internal: GGUF array element type %u", (unsigned)t);
  }
}

size_t element_size(GGUFType t) {
  switch (t) {
    case GGUFType::U8: case GGUFType::I8: case GGUFType::BOOL: return 1;
    case GGUFType::U16: case GGUFType::I16: return 2;
    case GGUFType::U32: case GGUFType::I32: case GGUFType::F32: return 4;
    default: return 8;
  }
}

void put_value(std::string& o, const dfl::GGUFValue& v) {
  switch (v.type) {
    case GGUFType::STRING: put_string(o, v.s); return;
    case GGUFType::BOOL: o += v.i ? "true" : "false"; return;
    case GGUFType::F32: put_float(o, v.f, true); return;
    case GGUFType::F64: put_float(o, v.f, false); return;
    case GGUFType::U8: case GGUFType::U16: case GGUFType::U32: case GGUFType::U64: o += std::to_string(v.u); return;
    case GGUFType::I8: case GGUFType::I16: case GGUFType::I32: case GGUFType::I64: o += std::to_string(v.i); return;
    case GGUFType::ARRAY: {
      o += '[';
      if (v.arr_type == GGUFType::STRING) {
        for (size_t k = 0; k < v.strs.size(); ++k) {
          if (k) o += ',';
          put_string(o, v.strs[k]);
        }
      } else {
        const size_t es = element_size(v.arr_type);
        for (uint64_t k = 0; k < v.arr_n; ++k) {
          if (k) o += ',';
          put_element(o, v.arr_type, v.arr_data + k * es);
        }
      }
      o += ']';
      return;
    }
  }
  dfl::fail("internal: GGUF value type %u", (unsigned)v.type);
}

}  // namespace

#pragma GCC visibility push(default)
extern "C" {

char* dfl_gguf_metadata_json(const char* path) {
  char* out = nullptr;
  dfl::api_guard([&] {
    if (!path) dfl::fail("path is NULL");
    const dfl::GGUFFile f(path);
    std::string o = "{";
    bool first = true;
    for (const auto& [key, value] : f.kv()) {
      if (!first) o += ',';
      first = false;
      put_string(o, key);
      o += ':';
      put_value(o, value);
    }
    o += '}';
    out = static_cast<char*>(std::malloc(o.size() + 1));
    if (!out) throw std::bad_alloc();
    std::memcpy(out, o.c_str(), o.size() + 1);
  });
  return out;
}

void dfl_string_free(char* s) { std::free(s); }

}  // extern "C"
#pragma GCC visibility pop
