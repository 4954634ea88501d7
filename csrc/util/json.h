// json.h — a small strict JSON parser (RFC 8259) for the files the core reads
// (safetensors headers, drafter config.json).
//
// Strict: exactly one value plus surrounding whitespace; no comments, no
// trailing commas, no NaN/Infinity, no leading zeros, no raw control
// characters or invalid UTF-8 in strings, no duplicate object keys.  Escapes
// (\uXXXX with surrogate pairs included) are decoded to UTF-8.  Nesting depth
// and input size are bounded.  Every failure is a dfl::Error
// "<label>: malformed JSON at byte N: <problem>", N counted from `base_offset`.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "util/error.h"

namespace dfl {

struct JsonLimits {
  size_t max_bytes = size_t(100) << 20;  // input size
  int max_depth = 64;                    // nested arrays/objects
};

class JsonValue {
 public:
  enum class Kind { Null, Bool, Number, String, Array, Object };

  Kind kind = Kind::Null;
  bool b = false;
  double num = 0.0;
  // Numbers written as integers (no fraction or exponent) that fit in int64
  // keep their exact value here; `is_int` says so.
  bool is_int = false;
  int64_t i = 0;
  std::string str;
  std::vector<JsonValue> arr;
  std::vector<std::pair<std::string, JsonValue>> obj;  // in file order, keys unique

  bool is_null() const { return kind == Kind::Null; }
  bool is_bool() const { return kind == Kind::Bool; }
  bool is_number() const { return kind == Kind::Number; }
  bool is_string() const { return kind == Kind::String; }
  bool is_array() const { return kind == Kind::Array; }
  bool is_object() const { return kind == Kind::Object; }
  // Object member or nullptr (also nullptr when this is not an object).
  const JsonValue* find(const std::string& key) const;
};

const char* json_kind_name(JsonValue::Kind k);  // "null", "boolean", "number", ...

JsonValue parse_json(const char* text, size_t n, const std::string& label, size_t base_offset = 0,
                     const JsonLimits& limits = JsonLimits());
// Reads a whole file (at most limits.max_bytes) and parses it; errors name the path.
JsonValue parse_json_file(const std::string& path, const JsonLimits& limits = JsonLimits());

}  // namespace dfl
