// The names of an enum's values, one table per enum, read both ways: value -> name for messages
// and files, name -> value for options and configs (with an error that lists the names).
//
//   inline constexpr EnumName<Stage> kStageNames[] = {{Stage::ddp, "ddp"}, {Stage::oss, "oss"}};
//   name_of(Stage::oss, kStageNames)                        // "oss"
//   parse_name("oss", kStageNames, "ZeRO stage", "ddp, oss (ZeRO-1)")
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

#include "shardkit/core/error.hpp"

namespace shardkit {

template <class E>
struct EnumName {
  E value;
  std::string_view name;
};

// The name of `value` ("?" for a value the table lacks).
template <class E, std::size_t N>
constexpr std::string_view name_of(E value, const EnumName<E> (&names)[N]) {
  for (const auto& entry : names)
    if (entry.value == value) return entry.name;
  return "?";
}

// The value named `name`, if the table has it.
template <class E, std::size_t N>
constexpr std::optional<E> find_name(std::string_view name, const EnumName<E> (&names)[N]) {
  for (const auto& entry : names)
    if (entry.name == name) return entry.value;
  return std::nullopt;
}

// "a, b or c": the table's names, for messages.
template <class E, std::size_t N>
std::string names_list(const EnumName<E> (&names)[N]) {
  std::string out;
  for (std::size_t i = 0; i < N; ++i)
    out.append(i == 0 ? "" : i + 1 == N ? " or " : ", ").append(names[i].name);
  return out;
}

// The value named `name`, or InvalidArgument naming the thing (`what`), the value and the
// names to use (`hint`, or the table's names when empty).
template <class E, std::size_t N>
E parse_name(std::string_view name, const EnumName<E> (&names)[N], std::string_view what,
             std::string_view hint = {}) {
  if (const auto value = find_name(name, names)) return *value;
  fail<InvalidArgument>("unknown ", what, " '", name, "'; use ",
                        hint.empty() ? names_list(names) : std::string(hint));
}

}  // namespace shardkit
