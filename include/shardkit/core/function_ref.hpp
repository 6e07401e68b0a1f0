// A non-owning reference to a callable, without its type (C++26's std::function_ref, cut to
// what shardkit needs): a pointer to the callable and a pointer to a function that calls it.
//
// Why: code that takes a callable as a template parameter is compiled once per callable. Where
// that code is large and the call is not hot -- the thread pool's locking, OpenMP region and
// exception handling around every host loop; the config reader's catch clauses around each of
// its readers -- taking a FunctionRef lets it be compiled once, for one indirect call. Unlike
// std::function it never allocates and never copies the callable.
//
// It refers to a callable object (a lambda, a functor), which must outlive it: take a FunctionRef
// as a parameter, call it before returning, and never store it. A function, or a pointer to one,
// is held by value. Copies refer to the same object; a void signature drops the callable's
// result. Assigning a callable to a FunctionRef is refused (it would refer to a temporary), and
// so is a reference result bound to a value the callable returns (it would dangle).
#pragma once

#include <functional>
#include <memory>
#include <type_traits>
#include <utility>

namespace shardkit::detail {

template <class Signature>
class FunctionRef;

// A callable invocable as R(Args...) that a FunctionRef<R(Args...)> can be made from: not a
// FunctionRef (a copy of one refers to its callable, not to it), and, for a reference result,
// one that returns a reference rather than a value the result would outlive.
template <class F, class R, class... Args>
concept FunctionRefTarget =
    !std::is_same_v<std::remove_cvref_t<F>, FunctionRef<R(Args...)>> &&
    std::is_invocable_r_v<R, F&, Args...> &&
    (!std::is_reference_v<R> || std::is_reference_v<std::invoke_result_t<F&, Args...>>);

template <class R, class... Args>
class FunctionRef<R(Args...)> {
 public:
  template <FunctionRefTarget<R, Args...> F>
  FunctionRef(F&& f) noexcept {  // NOLINT(google-explicit-constructor): binds like a reference
    using Target = std::remove_reference_t<F>;
    if constexpr (std::is_function_v<std::remove_pointer_t<std::decay_t<F>>>) {
      // A function, or a pointer to one: held by value (a pointer argument is often a temporary).
      using Pointer = std::decay_t<F>;
      callee_.function = reinterpret_cast<void (*)()>(static_cast<Pointer>(f));
      call_ = [](Callee callee, Args... args) -> R {
        return invoke_as<R>(reinterpret_cast<Pointer>(callee.function),
                            std::forward<Args>(args)...);
      };
    } else {
      callee_.object = const_cast<void*>(static_cast<const void*>(std::addressof(f)));
      call_ = [](Callee callee, Args... args) -> R {
        return invoke_as<R>(*static_cast<Target*>(callee.object), std::forward<Args>(args)...);
      };
    }
  }
  // (Copies are fine: they refer to the same callable. Assigning a callable is not: in
  // `ref = [&] { ... };` the lambda dies at the semicolon.)
  template <FunctionRefTarget<R, Args...> F>
  FunctionRef& operator=(F&&) = delete;

  R operator()(Args... args) const { return call_(callee_, std::forward<Args>(args)...); }

 private:
  union Callee {
    void* object;
    void (*function)();
  };

  // Calls f and gives its result as R (nothing for void).
  template <class Result, class F, class... A>
  static Result invoke_as(F&& f, A&&... args) {
    if constexpr (std::is_void_v<Result>)
      std::invoke(std::forward<F>(f), std::forward<A>(args)...);
    else
      return std::invoke(std::forward<F>(f), std::forward<A>(args)...);
  }

  Callee callee_;
  R (*call_)(Callee, Args...);
};

}  // namespace shardkit::detail
