// detail::FunctionRef: calls the very object it was made from (never a copy), or a function by
// value, with the signature's arguments and result; refuses the forms that would dangle; lets the
// object's exceptions through, and binds to a temporary where a parameter takes it -- how
// ThreadPool::parallel_for and the SwAV config reader use it.
#include <doctest/doctest.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include <shardkit/core/function_ref.hpp>

using shardkit::detail::FunctionRef;

namespace {

struct CountingFunctor {
  int calls = 0;
  int operator()(int x) { return x + ++calls; }
};

int square(int x) { return x * x; }

// A parameter of FunctionRef type, as in the library: the argument may be a temporary.
int call_twice(FunctionRef<int(int)> f, int x) { return f(x) + f(x); }

}  // namespace

TEST_CASE("FunctionRef calls the object it refers to, not a copy of it") {
  CountingFunctor functor;
  FunctionRef<int(int)> ref = functor;
  CHECK(ref(10) == 11);
  CHECK(ref(10) == 12);
  CHECK(functor.calls == 2);               // the functor's own state moved
  const FunctionRef<int(int)> copy = ref;  // a copy refers to the same object
  CHECK(copy(0) == 3);
  CHECK(functor.calls == 3);

  auto counter = [n = 0]() mutable { return ++n; };
  FunctionRef<int()> next = counter;
  CHECK(next() == 1);
  CHECK(next() == 2);
  CHECK(counter() == 3);
}

TEST_CASE("FunctionRef passes the signature's arguments and returns its result") {
  std::string text = "a";
  auto append = [](std::string& s, const std::string& tail) -> std::string& { return s += tail; };
  FunctionRef<std::string&(std::string&, const std::string&)> ref = append;
  CHECK(&ref(text, "b") == &text);  // by reference, both ways
  CHECK(text == "ab");

  auto take = [](std::unique_ptr<int> p) { return *p * 2; };  // a move-only argument
  FunctionRef<int(std::unique_ptr<int>)> taking = take;
  CHECK(taking(std::make_unique<int>(21)) == 42);

  const auto twice = [](int x) { return 2 * x; };  // a const callable
  FunctionRef<int(int)> by_const = twice;
  CHECK(by_const(7) == 14);
}

TEST_CASE("FunctionRef holds a function, or a pointer to one, by value") {
  FunctionRef<int(int)> by_name = square;
  FunctionRef<long(int)> by_pointer = &square;  // a temporary pointer, copied in
  CHECK(by_name(7) == 49);
  CHECK(by_pointer(8) == 64L);  // the result converted to the signature's
  int (*pointer)(int) = &square;
  FunctionRef<int(int)> from_variable = pointer;
  pointer = nullptr;  // the FunctionRef kept the pointer's value
  CHECK(from_variable(9) == 81);
}

TEST_CASE("FunctionRef refuses what would leave it referring to a dead object") {
  using Ref = FunctionRef<int(int)>;
  // Copies use the copy constructor, never the converting one (which would refer to the copied
  // FunctionRef instead of its callable).
  static_assert(!shardkit::detail::FunctionRefTarget<Ref&, int, int>);
  static_assert(!shardkit::detail::FunctionRefTarget<const Ref&, int, int>);
  static_assert(!shardkit::detail::FunctionRefTarget<Ref&&, int, int>);
  // `ref = [] { ... };` would refer to a lambda dead at the semicolon; a FunctionRef is assigned
  // only from another.
  auto add_one = [](int x) { return x + 1; };
  static_assert(!std::is_assignable_v<Ref&, decltype(add_one)>);
  static_assert(!std::is_assignable_v<Ref&, decltype(add_one)&>);
  static_assert(std::is_assignable_v<Ref&, const Ref&>);
  static_assert(std::is_assignable_v<Ref&, Ref&>);
  static_assert(std::is_assignable_v<Ref&, Ref&&>);
  // A reference result bound to a returned value would dangle; to a returned reference it is fine.
  auto by_value = [] { return 1; };
  static int stored = 2;
  auto by_reference = []() -> const int& { return stored; };
  static_assert(!std::is_constructible_v<FunctionRef<const int&()>, decltype(by_value)&>);
  static_assert(std::is_constructible_v<FunctionRef<const int&()>, decltype(by_reference)&>);
  FunctionRef<const int&()> ref = by_reference;
  CHECK(&ref() == &stored);
}

TEST_CASE("FunctionRef with a void signature calls the object and drops its result") {
  int seen = 0;
  auto record = [&](int x) {
    seen = x;
    return x * 2;
  };
  FunctionRef<void(int)> ref = record;
  ref(5);
  CHECK(seen == 5);
}

TEST_CASE("FunctionRef lets the object's exception through to the caller") {
  auto failing = [](int x) -> int { throw std::runtime_error("failed at " + std::to_string(x)); };
  FunctionRef<int(int)> ref = failing;
  CHECK_THROWS_WITH_AS(ref(3), "failed at 3", std::runtime_error);
}

TEST_CASE("FunctionRef binds to a temporary for the length of a call that takes it") {
  int calls = 0;
  CHECK(call_twice(
            [&](int x) {
              ++calls;
              return x + calls;
            },
            1) == 2 + 3);
  CHECK(calls == 2);
}
