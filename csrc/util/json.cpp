// json.cpp — recursive-descent JSON parser with byte offsets in every error.
#include "util/json.h"

#include <charconv>
#include <cstring>
#include <fstream>
#include <unordered_set>

#include <sys/stat.h>

namespace dfl {

const JsonValue* JsonValue::find(const std::string& key) const {
  if (kind != Kind::Object) return nullptr;
  for (const auto& kv : obj)
    if (kv.first == key) return &kv.second;
  return nullptr;
}

const char* json_kind_name(JsonValue::Kind k) {
  switch (k) {
    case JsonValue::Kind::Null: return "null";
    case JsonValue::Kind::Bool: return "boolean";
    case JsonValue::Kind::Number: return "number";
    case JsonValue::Kind::String: return "string";
    case JsonValue::Kind::Array: return "array";
    case JsonValue::Kind::Object: return "object";
  }
  return "?";
}

namespace {

struct Parser {
  const char* p;
  size_t n;
  size_t pos = 0;
  const std::string& label;
  size_t base;
  int max_depth;

  [[noreturn]] void err(const char* what, size_t at) const {
    fail("%s: malformed JSON at byte %zu: %s", label.c_str(), base + at, what);
  }
  [[noreturn]] void err(const char* what) const { err(what, pos); }

  void ws() {
    while (pos < n && (p[pos] == ' ' || p[pos] == '\t' || p[pos] == '\n' || p[pos] == '\r')) ++pos;
  }
  bool at_end() const { return pos >= n; }
  char peek() const { return p[pos]; }

  void literal(const char* word) {
    size_t len = std::strlen(word);
    if (n - pos < len || std::memcmp(p + pos, word, len) != 0) err("invalid literal");
    pos += len;
  }

  JsonValue value(int depth) {
    ws();
    if (at_end()) err("unexpected end of input, expected a value");
    JsonValue v;
    char c = peek();
    switch (c) {
      case '{': object(v, depth + 1); break;
      case '[': array(v, depth + 1); break;
      case '"': v.kind = JsonValue::Kind::String; v.str = string(); break;
      case 't': literal("true"); v.kind = JsonValue::Kind::Bool; v.b = true; break;
      case 'f': literal("false"); v.kind = JsonValue::Kind::Bool; v.b = false; break;
      case 'n': literal("null"); v.kind = JsonValue::Kind::Null; break;
      default:
        if (c == '-' || (c >= '0' && c <= '9')) number(v);
        else err("unexpected character, expected a value");
    }
    return v;
  }

  void object(JsonValue& v, int depth) {
    if (depth > max_depth) err("nesting deeper than the limit");
    v.kind = JsonValue::Kind::Object;
    ++pos;  // '{'
    std::unordered_set<std::string> seen;
    ws();
    if (!at_end() && peek() == '}') { ++pos; return; }
    for (;;) {
      ws();
      if (at_end()) err("unexpected end of input inside an object");
      if (peek() != '"') err("expected a string key");
      size_t key_at = pos;
      std::string key = string();
      if (!seen.insert(key).second) {
        std::string m = "duplicate key '" + key + "'";
        err(m.c_str(), key_at);
      }
      ws();
      if (at_end() || peek() != ':') err("expected ':' after an object key");
      ++pos;
      JsonValue member = value(depth);
      v.obj.emplace_back(std::move(key), std::move(member));
      ws();
      if (at_end()) err("unexpected end of input inside an object");
      if (peek() == ',') { ++pos; continue; }
      if (peek() == '}') { ++pos; return; }
      err("expected ',' or '}' in an object");
    }
  }

  void array(JsonValue& v, int depth) {
    if (depth > max_depth) err("nesting deeper than the limit");
    v.kind = JsonValue::Kind::Array;
    ++pos;  // '['
    ws();
    if (!at_end() && peek() == ']') { ++pos; return; }
    for (;;) {
      v.arr.push_back(value(depth));
      ws();
      if (at_end()) err("unexpected end of input inside an array");
      if (peek() == ',') { ++pos; continue; }
      if (peek() == ']') { ++pos; return; }
      err("expected ',' or ']' in an array");
    }
  }

  static void put_utf8(std::string& s, uint32_t cp) {
    if (cp < 0x80) {
      s += (char)cp;
    } else if (cp < 0x800) {
      s += (char)(0xC0 | (cp >> 6));
      s += (char)(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      s += (char)(0xE0 | (cp >> 12));
      s += (char)(0x80 | ((cp >> 6) & 0x3F));
      s += (char)(0x80 | (cp & 0x3F));
    } else {
      s += (char)(0xF0 | (cp >> 18));
      s += (char)(0x80 | ((cp >> 12) & 0x3F));
      s += (char)(0x80 | ((cp >> 6) & 0x3F));
      s += (char)(0x80 | (cp & 0x3F));
    }
  }

  uint32_t hex4() {
    if (n - pos < 4) err("unexpected end of input in a \\u escape");
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) {
      char c = p[pos + k];
      v <<= 4;
      if (c >= '0' && c <= '9') v |= (uint32_t)(c - '0');
      else if (c >= 'a' && c <= 'f') v |= (uint32_t)(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') v |= (uint32_t)(c - 'A' + 10);
      else err("invalid hex digit in a \\u escape", pos + k);
    }
    pos += 4;
    return v;
  }

  // Validates one raw UTF-8 sequence starting at pos (first byte >= 0x80) and appends it.
  void utf8_seq(std::string& s) {
    const unsigned char* u = (const unsigned char*)p;
    unsigned char c0 = u[pos];
    int len;
    uint32_t cp, min;
    if (c0 >= 0xC2 && c0 <= 0xDF) { len = 2; cp = c0 & 0x1F; min = 0x80; }
    else if (c0 >= 0xE0 && c0 <= 0xEF) { len = 3; cp = c0 & 0x0F; min = 0x800; }
    else if (c0 >= 0xF0 && c0 <= 0xF4) { len = 4; cp = c0 & 0x07; min = 0x10000; }
    else err("invalid UTF-8 in a string");
    if (n - pos < (size_t)len) err("truncated UTF-8 sequence in a string");
    for (int k = 1; k < len; ++k) {
      unsigned char ck = u[pos + k];
      if ((ck & 0xC0) != 0x80) err("invalid UTF-8 in a string", pos + k);
      cp = (cp << 6) | (ck & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) err("invalid UTF-8 in a string");
    s.append(p + pos, (size_t)len);
    pos += (size_t)len;
  }

  std::string string() {
    ++pos;  // opening quote
    std::string s;
    for (;;) {
      if (at_end()) err("unterminated string");
      unsigned char c = (unsigned char)p[pos];
      if (c == '"') { ++pos; return s; }
      if (c < 0x20) err("raw control character in a string");
      if (c >= 0x80) { utf8_seq(s); continue; }
      if (c != '\\') { s += (char)c; ++pos; continue; }
      ++pos;
      if (at_end()) err("unterminated escape in a string");
      char e = p[pos++];
      switch (e) {
        case '"': s += '"'; break;
        case '\\': s += '\\'; break;
        case '/': s += '/'; break;
        case 'b': s += '\b'; break;
        case 'f': s += '\f'; break;
        case 'n': s += '\n'; break;
        case 'r': s += '\r'; break;
        case 't': s += '\t'; break;
        case 'u': {
          size_t at = pos - 2;
          uint32_t cp = hex4();
          if (cp >= 0xDC00 && cp <= 0xDFFF) err("unpaired low surrogate in a \\u escape", at);
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (n - pos < 2 || p[pos] != '\\' || p[pos + 1] != 'u')
              err("high surrogate not followed by a low surrogate", at);
            pos += 2;
            uint32_t lo = hex4();
            if (lo < 0xDC00 || lo > 0xDFFF) err("high surrogate not followed by a low surrogate", at);
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          }
          put_utf8(s, cp);
          break;
        }
        default: err("invalid escape character in a string", pos - 1);
      }
    }
  }

  static bool digit(char c) { return c >= '0' && c <= '9'; }

  void number(JsonValue& v) {
    size_t start = pos;
    bool integer = true;
    if (p[pos] == '-') ++pos;
    if (at_end() || !digit(peek())) err("expected a digit");
    if (peek() == '0') {
      ++pos;
      if (!at_end() && digit(peek())) err("leading zero in a number");
    } else {
      while (!at_end() && digit(peek())) ++pos;
    }
    if (!at_end() && peek() == '.') {
      integer = false;
      ++pos;
      if (at_end() || !digit(peek())) err("expected a digit after the decimal point");
      while (!at_end() && digit(peek())) ++pos;
    }
    if (!at_end() && (peek() == 'e' || peek() == 'E')) {
      integer = false;
      ++pos;
      if (!at_end() && (peek() == '+' || peek() == '-')) ++pos;
      if (at_end() || !digit(peek())) err("expected a digit in the exponent");
      while (!at_end() && digit(peek())) ++pos;
    }
    v.kind = JsonValue::Kind::Number;
    auto r = std::from_chars(p + start, p + pos, v.num);
    if (r.ec == std::errc::result_out_of_range) err("number out of range", start);
    if (r.ec != std::errc() || r.ptr != p + pos) err("invalid number", start);
    if (integer) {
      int64_t iv = 0;
      auto ri = std::from_chars(p + start, p + pos, iv);
      if (ri.ec == std::errc() && ri.ptr == p + pos) {
        v.is_int = true;
        v.i = iv;
      }
    }
  }
};

}  // namespace

JsonValue parse_json(const char* text, size_t n, const std::string& label, size_t base_offset,
                     const JsonLimits& limits) {
  if (n > limits.max_bytes)
    fail("%s: JSON text of %zu bytes exceeds the %zu-byte limit", label.c_str(), n, limits.max_bytes);
  Parser ps{text, n, 0, label, base_offset, limits.max_depth};
  JsonValue v = ps.value(0);
  ps.ws();
  if (!ps.at_end()) ps.err("unexpected data after the JSON value");
  return v;
}

JsonValue parse_json_file(const std::string& path, const JsonLimits& limits) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) fail("%s: cannot open: no such file", path.c_str());
  if (!S_ISREG(st.st_mode)) fail("%s: not a regular file", path.c_str());
  std::ifstream f(path, std::ios::binary);
  if (!f) fail("%s: cannot open", path.c_str());
  f.seekg(0, std::ios::end);
  std::streamoff sz = f.tellg();
  if (sz < 0) fail("%s: cannot read", path.c_str());
  if ((uint64_t)sz > limits.max_bytes)
    fail("%s: file of %lld bytes exceeds the %zu-byte JSON limit", path.c_str(), (long long)sz, limits.max_bytes);
  std::string buf((size_t)sz, '\0');
  f.seekg(0);
  if (sz > 0 && !f.read(&buf[0], sz)) fail("%s: cannot read", path.c_str());
  return parse_json(buf.data(), buf.size(), path, 0, limits);
}

}  // namespace dfl
